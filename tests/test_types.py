"""mypy over src/mlxd with pyproject.toml's [tool.mypy] settings, strict for every module.

The modules still short of that have their error count in tests/mypy_baseline.json, which
may only go down: a file's count growing fails, and so does a count left higher than the
file's errors (lower it: ``python tests/test_types.py`` rewrites the baseline). A file not
in the baseline, a new one included, must have no error, and the packages the front ends
are made of may never enter it. mypy keeps its incremental cache in pytest's cache folder,
so a run after a small change checks only what changed.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import mypy.api
import pytest

ROOT = Path(__file__).resolve().parents[1]
BASELINE = Path(__file__).with_name("mypy_baseline.json")
# held at zero errors: no baseline entry may name a file under these
STRICT = (
    "src/mlxd/core/",
    "src/mlxd/config.py",
    "src/mlxd/store/",
    "src/mlxd/enginecore/",
    "src/mlxd/frontend/",
    "src/mlxd/api/",
)
ERROR = re.compile(r"^(src/mlxd/[^:]+\.py):\d+(?::\d+)?: error: ")


def run_mypy(cache_dir: Path, *files: str) -> tuple[int, str]:
    """mypy's exit status and report, run from the repository root (its configuration's
    ``files`` are relative to it, and so are the paths it reports)."""
    cwd = Path.cwd()
    os.chdir(ROOT)
    try:
        stdout, stderr, status = mypy.api.run(
            [
                "--config-file",
                str(ROOT / "pyproject.toml"),
                "--cache-dir",
                str(cache_dir),
                "--no-pretty",
                "--no-color-output",
                "--show-error-codes",
                "--hide-error-context",
                *files,
            ]
        )
    finally:
        os.chdir(cwd)
    assert status in (0, 1), f"mypy did not run (exit {status}):\n{stderr}{stdout}"
    return status, stdout


def errors_per_file(report: str) -> tuple[Counter[str], list[str]]:
    counts: Counter[str] = Counter()
    lines = []
    for line in report.splitlines():
        m = ERROR.match(line)
        if m:
            counts[m.group(1)] += 1
            lines.append(line)
    return counts, lines


def read_baseline() -> dict[str, int]:
    return json.loads(BASELINE.read_text())


@pytest.fixture(scope="module")
def cache_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pytest's cache folder, kept between runs; a fresh one when that cache is off."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("mypy") if cache is not None else tmp_path_factory.mktemp("mypy")


@pytest.fixture(scope="module")
def mypy_run(cache_dir: Path) -> tuple[Counter[str], list[str]]:
    return errors_per_file(run_mypy(cache_dir)[1])


def test_no_file_has_more_type_errors_than_its_baseline(mypy_run) -> None:
    counts, lines = mypy_run
    baseline = read_baseline()
    grown = sorted(f for f, n in counts.items() if n > baseline.get(f, 0))
    new = [line for line in lines if line.split(":", 1)[0] in grown]
    assert not grown, (
        "type errors beyond tests/mypy_baseline.json ("
        + ", ".join(f"{f}: {counts[f]} > {baseline.get(f, 0)}" for f in grown)
        + "):\n"
        + "\n".join(new)
    )


def test_baseline_is_no_higher_than_the_errors_left(mypy_run) -> None:
    counts, _ = mypy_run
    stale = {f: (n, counts.get(f, 0)) for f, n in read_baseline().items() if counts.get(f, 0) < n}
    assert not stale, (
        "fewer type errors than tests/mypy_baseline.json allows; lower it (python "
        "tests/test_types.py rewrites it): "
        + ", ".join(f"{f}: {now} < {n}" for f, (n, now) in sorted(stale.items()))
    )


def test_the_front_end_packages_have_no_baseline() -> None:
    exempt = [f for f in read_baseline() if f.startswith(STRICT)]
    assert not exempt, f"these must have no type error at all: {exempt}"


def test_a_type_error_is_reported(tmp_path: Path, cache_dir: Path) -> None:
    """The check sees errors: a file with one, checked with the same configuration."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x: int) -> str:\n    return x\n")
    status, report = run_mypy(cache_dir, str(bad))
    assert status == 1 and "[return-value]" in report, report


if __name__ == "__main__":  # rewrite the baseline from a fresh run
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        found, _ = errors_per_file(run_mypy(Path(d))[1])
    BASELINE.write_text(json.dumps(dict(sorted(found.items())), indent=1) + "\n")
    print(f"{BASELINE}: {sum(found.values())} errors in {len(found)} files", file=sys.stderr)
