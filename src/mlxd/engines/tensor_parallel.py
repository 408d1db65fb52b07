"""One text model split over the ranks of an ``mx.distributed`` group: tensor parallel
(``engine.tensor_parallel``) or pipeline parallel (``engine.pipeline_parallel``).

Tensor parallel: mlx-lm shards a model's linear layers with ``model.shard(group)``; every
forward pass then all-reduces inside the model. Pipeline parallel: mlx-lm's
``PipelineMixin.pipeline(group)`` (``model.model.pipeline``, in the classes that offer it)
keeps a run of consecutive layers on each rank, rank 0 the last ones; a forward pass
receives the hidden state from the rank before, runs its layers, sends it on, and ends with
an ``all_gather`` that gives every rank the last layer's output. Either way every rank must
run the same forward passes at the same time with the same batch. Rank 0 is the ordinary
engine core: it schedules, samples, and runs grammars and penalties. Followers hold the
other shards (or layers) and replay what rank 0 did to its mlx-lm batch, as a stream of
commands:

* ``("load", eid, name, path, options)``: load this model's shard or layers (the
  :class:`LLMEngine` options rank 0 used);
* ``("new", eid)``: a fresh batch (after a load, or after a fault reset the batch);
* ``("insert", eid, prompts, max_tokens, all_tokens)``, ``("remove", eid, uids)``:
  batch mutations, in rank 0's order (uids are assigned in insertion order, so they agree);
* ``("next", eid)``: one batch step (prefill chunk + decode), with the model's
  collectives in it;
* ``("check", eid)``: once, before the first step: every rank says whether it holds its
  shard (one collective; see :func:`check_loaded`);
* ``("close", eid)``: the model was unloaded (or its load failed on rank 0).

Only rank 0's sampler counts: after each step its next tokens are broadcast (one small
``all_sum``, rank 0's tokens plus zeros), so a follower feeds the same tokens into the next
step whatever its own (plain greedy) sampler chose. That is why followers need no samplers,
seeds, penalties or grammars, and why a seeded or grammar-constrained request gives the
same text as on one device.

The prefix cache is off in this mode (a cached prefix is a rank-local KV shard that
followers would have to mirror). Other kinds of model (embedding, reranker, vision) are
not sharded: they run on rank 0 alone, and the followers never hear of them.

This module holds the process's group (MLX's is process-wide too) and the publisher that
rank 0's engine core installs; engines read them through :func:`group` and :func:`publish`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

log = logging.getLogger(__name__)

Mode = Literal["tensor", "pipeline"]
_state: dict[str, Any] = {"group": None, "publish": None, "mode": "tensor"}
_ids = itertools.count(1)


class GroupStepFailed(BaseException):  # noqa: N818 - named for what happened
    """A step of a split model failed on rank 0. The followers may be blocked in (or past)
    that step's collectives: the group is out of step and only a restart of every rank
    mends it. A ``BaseException`` so that it passes the worker's per-engine recovery and
    ends the device thread, which ends the process (the supervisor restarts the group)."""


def setup(group: Any, publish: Callable[[tuple], None] | None, mode: Mode = "tensor") -> None:
    """Install this process's rank group, how it splits models (and, on rank 0, the command
    publisher)."""
    _state["group"] = group
    _state["publish"] = publish
    _state["mode"] = mode


def mode() -> Mode:
    """How this process's group splits a model: "tensor" or "pipeline"."""
    return _state["mode"]


def mode_name() -> str:
    """For messages: "tensor-parallel" or "pipeline-parallel"."""
    return f"{_state['mode']}-parallel"


def group() -> Any:
    """The rank group when this process is part of a tensor- or pipeline-parallel core."""
    return _state["group"]


def active() -> bool:
    g = _state["group"]
    return g is not None and g.size() > 1


def leads() -> bool:
    """Rank 0: the one that publishes what it does."""
    return _state["publish"] is not None


def new_engine_id() -> int:
    return next(_ids)


def publish(cmd: tuple) -> None:
    fn = _state["publish"]
    if fn is not None:
        fn(cmd)


@contextlib.contextmanager
def loading(eid: int) -> Iterator[None]:
    """Around rank 0's load: if it fails, the followers (told to load first) drop theirs."""
    try:
        yield
    except BaseException:
        if eid:
            publish(("close", eid))
        raise


def check_loaded(eid: int, name: str) -> None:
    """Rank 0, on the device thread (in step order), once a model is loaded: did every rank
    load it? One ``all_sum`` of "I have it" flags; the followers answer it at ``check``. A
    model some follower lacks is a failed load here, not a group stuck in its first step."""
    from mlxd.core.errors import ModelLoadError

    g = _state["group"]
    publish(("check", eid))
    have = _count_loaded(True, g)
    if have < g.size():
        publish(("close", eid))
        raise ModelLoadError(
            f"model '{name}' loaded on {have} of {g.size()} {mode_name()} "
            "ranks (see the other ranks' logs)"
        )


def _count_loaded(mine: bool, g: Any) -> int:
    with mx.stream(mx.default_stream(mx.default_device())):
        n = mx.distributed.all_sum(mx.array([int(mine)], dtype=mx.int32), group=g)
        return int(n.item())


# Sizes mlx-lm's ``shard`` splits evenly over the ranks without checking that they divide:
# 3 heads over 2 ranks would load and answer, wrongly.
SPLIT_SIZES = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def shard(model: Any, name: str, config: dict) -> None:
    """Split ``model`` over the group as the mode says (lazy weights: only this rank's
    slices, or layers, are ever read)."""
    from mlxd.core.errors import ModelLoadError

    g = _state["group"]
    if _state["mode"] == "pipeline":
        pipeline(model, name, g)
        return
    if not hasattr(model, "shard"):
        raise ModelLoadError(
            f"model '{name}' ({type(model).__module__}) has no tensor-parallel sharding in "
            "mlx-lm; serve it with engine.tensor_parallel: 1"
        )
    for key in SPLIT_SIZES:
        v = config.get(key, (config.get("text_config") or {}).get(key))
        if isinstance(v, int) and v % g.size():
            raise ModelLoadError(
                f"model '{name}' cannot be sharded over {g.size()} ranks: "
                f"its {key} ({v}) does not divide by {g.size()}"
            )
    try:
        model.shard(g)
    except Exception as exc:  # noqa: BLE001 - e.g. heads that do not divide by the ranks
        raise ModelLoadError(
            f"model '{name}' cannot be sharded over {g.size()} ranks: {exc}"
        ) from exc


def pipeline(model: Any, name: str, g: Any) -> None:
    """Keep this rank's run of layers (mlx-lm's even split, rank 0 the last layers). A model
    whose mlx-lm class has no pipelining (mlx-lm's own test: ``model.model.pipeline``) or
    fewer layers than ranks is a load error naming the cause, before any step."""
    from mlxd.core.errors import ModelLoadError

    inner = getattr(model, "model", None)
    if not hasattr(inner, "pipeline"):
        raise ModelLoadError(
            f"model '{name}' ({type(model).__module__}) has no pipeline parallelism in "
            "mlx-lm (its class lacks PipelineMixin, which Qwen2/2.5, Qwen3-MoE, "
            "DeepSeek-V2/V3 and GLM-4-MoE have); serve it with engine.pipeline_parallel: 1, "
            "or engine.tensor_parallel"
        )
    layers = len(getattr(inner, "layers", []))
    if layers < g.size():
        raise ModelLoadError(
            f"model '{name}' cannot be pipelined over {g.size()} ranks: it has {layers} layers"
        )
    try:
        inner.pipeline(g)
    except Exception as exc:  # noqa: BLE001 - mlx-lm's ValueError for a split it refuses
        raise ModelLoadError(
            f"model '{name}' cannot be pipelined over {g.size()} ranks: {exc}"
        ) from exc


def share_tokens(gen: Any) -> None:
    """After a batch step on any rank: make the tokens the next step feeds in rank 0's.

    mlx-lm samples the next tokens at the end of a step (lazily) and feeds them to the
    following one; every rank replaces them with rank 0's by one ``all_sum`` (rank 0 adds
    its tokens, the others zeros). The same number of collectives on every rank, since
    every rank holds the same batch."""
    g = _state["group"]
    batch = gen._generation_batch
    tokens = batch._next_tokens
    if g is None or not len(batch) or tokens is None:
        return
    with mx.stream(gen.stream):
        # int32: a type every backend sums (NCCL has no unsigned 32-bit sum everywhere)
        mine = tokens.astype(mx.int32) if g.rank() == 0 else mx.zeros(tokens.shape, mx.int32)
        batch._next_tokens = mx.distributed.all_sum(mine, group=g).astype(tokens.dtype)
        # Queued now, so that it runs before anything of the next step on every rank (a
        # stream runs what it is given in order). Left lazy, each rank would run it where
        # its own next graph needs it: pipelined, rank 0's receive of the hidden state does
        # not depend on the tokens and would run first, while the first layers' rank sums
        # the tokens first (it embeds them): each waits for the other forever.
        mx.async_eval(batch._next_tokens)


class ReplicatedBatch:
    """Rank 0's mlx-lm batch: every mutation and step is published to the followers before
    it is made here (in order, from the device thread), and every step shares its tokens."""

    def __init__(self, gen: Any, eid: int) -> None:
        self._gen = gen
        self._eid = eid
        publish(("new", eid))

    def insert(
        self,
        prompts: list[list[int]],
        max_tokens: list[int] | None = None,
        caches: list | None = None,
        all_tokens: list[list[int]] | None = None,
        **kw: Any,
    ) -> list[int]:
        if caches is not None and any(c is not None for c in caches):
            raise RuntimeError(f"a cached prefix cannot join a {mode_name()} batch")
        publish(("insert", self._eid, prompts, max_tokens, all_tokens))
        return self._gen.insert(prompts, max_tokens=max_tokens, all_tokens=all_tokens, **kw)

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict:
        publish(("remove", self._eid, list(uids)))
        return self._gen.remove(uids, return_prompt_caches=False)

    def next(self) -> Any:
        publish(("next", self._eid))
        try:
            out = self._gen.next()
            share_tokens(self._gen)
        except Exception as exc:
            raise GroupStepFailed(f"a {mode_name()} step failed: {exc}") from exc
        return out

    def close(self) -> None:
        self._gen.close()

    def __getattr__(self, name: str) -> Any:  # _generation_batch, prompt_cache_nbytes...
        return getattr(self._gen, name)


class Replayer:
    """A follower's side: the same engines, driven by rank 0's commands.

    ``load_engine`` builds an engine as rank 0 did (``LLMEngine``): given by the follower,
    so this module never imports the engine that imports it.
    """

    def __init__(self, load_engine: Callable[..., Any]) -> None:
        self.load_engine = load_engine
        self.engines: dict[int, Any] = {}
        self.gens: dict[int, Any] = {}
        self.failed: set[int] = set()  # loads that failed here (check tells rank 0)

    def apply(self, cmd: list) -> None:
        op, eid = cmd[0], cmd[1]
        if op == "load":
            self._load(eid, cmd[2], cmd[3], cmd[4])
            return
        if op == "check":
            _count_loaded(eid not in self.failed, _state["group"])
            return
        if eid in self.failed:
            if op == "close":
                self.failed.discard(eid)
            return
        if op == "new":
            old = self.gens.pop(eid, None)
            if old is not None:
                old.close()
            self.gens[eid] = self.engines[eid].raw_generator()
        elif op == "insert":
            _, _, prompts, max_tokens, all_tokens = cmd
            try:
                self.gens[eid].insert(prompts, max_tokens=max_tokens, all_tokens=all_tokens)
            except ValueError:  # rank 0's insert refused the same input before any change
                pass
        elif op == "remove":
            self.gens[eid].remove(cmd[2])
        elif op == "next":
            gen = self.gens[eid]
            gen.next()
            share_tokens(gen)
        elif op == "close":
            gen = self.gens.pop(eid, None)
            if gen is not None:
                gen.close()
            engine = self.engines.pop(eid, None)
            if engine is not None:
                engine.close()
        else:
            raise ValueError(f"unknown {mode_name()} command {op!r}")

    def _load(self, eid: int, name: str, path: str, options: dict) -> None:
        from mlxd.engines.options import TextEngineOptions

        try:
            self.engines[eid] = self.load_engine(name, Path(path), TextEngineOptions(**options))
        except Exception:  # noqa: BLE001 - rank 0 learns it at "check", or failed too
            log.exception("follower could not load '%s'", name)
            self.failed.add(eid)
