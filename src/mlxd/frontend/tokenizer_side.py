"""mlx-lm's tokenizer side in a front end, without MLX.

A front end templates, tokenizes, parses tool calls and detokenizes with mlx-lm's own code
(``mlx_lm.tokenizer_utils``, ``mlx_lm.tool_parsers``, ``mlx_lm.chat_templates``), none of
which imports MLX. mlx-lm's package ``__init__`` does: it imports its generation and
conversion entry points, and with them MLX and its model code (~7 MB of every front end's
memory, measured with memory_soak.py), although the engine core owns everything MLX
(docs/architecture.md). So a front-end process registers the package without running that
``__init__``: its submodules import as usual (Python finds them through the package's
``__path__``); only the names the ``__init__`` binds (``mlx_lm.load``, ``mlx_lm.generate``,
...) are missing, and no front end calls them. A process that needs them (an engine core,
the test suite) has imported mlx-lm already or never calls this.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def register_without_init() -> bool:
    """Make ``import mlx_lm.<submodule>`` skip mlx-lm's package ``__init__`` in this
    process; False when mlx-lm is imported already (or not installed)."""
    if "mlx_lm" in sys.modules:
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.submodule_search_locations is None:
        return False
    package = importlib.util.module_from_spec(spec)
    # the one setting mlx-lm's __init__ makes for its tokenizer code: no advisory warnings
    # from transformers (which has no PyTorch here) on every tokenizer load
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    sys.modules["mlx_lm"] = package
    try:
        version = importlib.import_module("mlx_lm._version").__version__
        setattr(package, "__version__", version)  # noqa: B010 - a module made here, typed bare
    except (ImportError, AttributeError):  # a layout without _version: only informative
        pass
    return True
