"""Step trace for diagnosis (benchmarks/h200_gap.sh trace): put this folder first on
PYTHONPATH and set STEP_TRACE=PREFIX; every process that runs an mlx-lm BatchGenerator (the
engine alone, mlxd's engine core) appends one JSON line per step (``_next`` call) to
PREFIX.<who>-<pid>.jsonl (who: core, engine or proc): [start, duration ms, decode rows
before, prompt-batch rows, queued rows, prompt tokens processed, decode rows after, the CPU
the call ended on]. ``summary.py`` beside it sums them up.

Knobs for A/B runs, never used by mlxd itself:
STEP_TRACE_LOAD_ON_DEVICE=1 builds chat models on the device thread (the loader thread only
waits for it), so their weights are made on the stream that runs them;
STEP_TRACE_KEEP_SWITCH=1 leaves Python's GIL switch interval at its default;
STEP_TRACE_PREFILL_CLEARS=1 makes mlxd's prefill clear MLX's buffer cache after every
chunk again, as mlx-lm's does (engines/serving_batch.py keeps it);
STEP_TRACE_NO_CLEAR=1 turns ``mx.clear_cache()`` into nothing in that process (for the
engine alone: what mlx-lm's per-chunk clearing costs it);
STEP_TRACE_PIN=N pins the thread that steps the batch (and only that thread) to CPU N;
STEP_TRACE_REQS=1 also logs each request of mlxd's engine core (PREFIX.req.<pid>.jsonl).
"""

import builtins
import ctypes
import json
import os
import sys
import time

_out = os.environ.get("STEP_TRACE")
if _out:
    _orig = builtins.__import__
    _state: dict = {"traced": False, "registry": False, "f": None}
    try:
        _getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        _getcpu = lambda: -1  # noqa: E731

    def _trace(cls) -> None:
        """Wraps ``cls._next``: mlx-lm's BatchGenerator, and mlxd's ServingBatchGenerator,
        whose own ``_next`` (a prompt's last token in its last prefill chunk) a patch of the
        base never sees. A step is written once: the outermost ``_next`` of a call writes
        it (the subclass's calls the base's when its prompt-end path is off)."""
        orig = cls.__dict__["_next"]

        def _next(self):
            if _state.get("depth"):
                return orig(self)
            if _state["f"] is None:
                argv0 = sys.argv[0] if sys.argv else ""
                who = (
                    "core" if "enginecore" in argv0 else "engine" if argv0 == "-c" else "proc"
                )  # mlxd's engine core, serve_compare's engine alone
                _state["f"] = open(
                    f"{_out}.{who}-{os.getpid()}.jsonl",
                    "w",  # noqa: SIM115
                    buffering=1,
                )
                pin = os.environ.get("STEP_TRACE_PIN")
                if pin:
                    os.sched_setaffinity(0, {int(pin)})  # 0: the calling thread
            gb, pb = len(self._generation_batch), len(self._prompt_batch)
            up, pt0 = len(self._unprocessed_sequences), self._counters.prompt_tokens
            t0 = time.perf_counter()
            _state["depth"] = 1
            try:
                res = orig(self)
            finally:
                _state["depth"] = 0
            ms = (time.perf_counter() - t0) * 1000
            _state["f"].write(
                json.dumps(
                    [
                        round(t0, 5),
                        round(ms, 3),
                        gb,
                        pb,
                        up,
                        self._counters.prompt_tokens - pt0,
                        len(self._generation_batch),
                        _getcpu(),
                    ]
                )
                + "\n"
            )
            return res

        cls._next = _next

    def _hook(name, *args, **kwargs):
        module = _orig(name, *args, **kwargs)
        if not _state["traced"]:
            g = sys.modules.get("mlx_lm.generate")
            if g is not None and hasattr(g, "BatchGenerator"):
                _state["traced"] = True
                _trace(g.BatchGenerator)
        if "serving_traced" not in _state:
            sb = sys.modules.get("mlxd.engines.serving_batch")
            if sb is not None and hasattr(sb, "ServingBatchGenerator"):
                _state["serving_traced"] = True
                _trace(sb.ServingBatchGenerator)
        if os.environ.get("STEP_TRACE_PREFILL_CLEARS") == "1" and "clears" not in _state:
            sb = sys.modules.get("mlxd.engines.serving_batch")
            if sb is not None and hasattr(sb, "CACHE_KEEP_BYTES"):
                _state["clears"] = True
                sb.CACHE_KEEP_BYTES = -1
        if os.environ.get("STEP_TRACE_NO_CLEAR") == "1" and "no_clear" not in _state:
            core = sys.modules.get("mlx.core")
            if core is not None and hasattr(core, "clear_cache"):
                _state["no_clear"] = True
                core.clear_cache = lambda: None
        if os.environ.get("STEP_TRACE_LOAD_ON_DEVICE") == "1":
            w = sys.modules.get("mlxd.runtime.worker")
            if "worker_patched" not in _state and w is not None and hasattr(w, "DeviceWorker"):
                _state["worker_patched"] = True
                init = w.DeviceWorker.__init__

                def __init__(self, *args, **kwargs):
                    init(self, *args, **kwargs)
                    _state["worker"] = self

                w.DeviceWorker.__init__ = __init__
            r = sys.modules.get("mlxd.engines.registry")
            if not _state["registry"] and r is not None and hasattr(r, "create_engine"):
                _state["registry"] = True
                create = r.create_engine

                def create_engine(kind, *args, **kwargs):
                    if kind != "chat" or "worker" not in _state:
                        return create(kind, *args, **kwargs)
                    sys.stderr.write("step_trace: building the chat model on the device thread\n")
                    return _state["worker"].call(lambda: create(kind, *args, **kwargs)).result()

                r.create_engine = create_engine
        if os.environ.get("STEP_TRACE_REQS") == "1":
            _trace_requests()
        return module

    def _req_log(row: list) -> None:
        f = _state.get("rf")
        if f is None:
            f = _state["rf"] = open(f"{_out}.req.{os.getpid()}.jsonl", "w", buffering=1)  # noqa: SIM115
        f.write(json.dumps(row) + "\n")

    def _trace_requests() -> None:
        """STEP_TRACE_REQS=1: per request, when the engine core handed it to the device
        thread (``arr``), when the device thread queued it (``t_added``), when it went to
        mlx-lm (one ``admit`` line per group) and when its first token came out."""
        w = sys.modules.get("mlxd.runtime.worker")
        if "req_w" not in _state and w is not None and hasattr(w, "DeviceWorker"):
            _state["req_w"] = True
            submit = w.DeviceWorker.submit

            def _submit(self, engine, seq):
                seq._tr_arr = time.monotonic()
                return submit(self, engine, seq)

            w.DeviceWorker.submit = _submit
        llm = sys.modules.get("mlxd.engines.llm")
        if "req_llm" not in _state and llm is not None and hasattr(llm, "LLMEngine"):
            _state["req_llm"] = True
            admit = llm.LLMEngine._admit

            def _admit(self):
                before = list(self._pending)
                running = self.num_running
                res = admit(self)
                left = {id(s) for s in self._pending}
                took = [s for s in before if id(s) not in left]
                if took:
                    _req_log(
                        [
                            "admit",
                            round(time.monotonic(), 5),
                            running,
                            len(self._pending),
                            [
                                [id(s), round(getattr(s, "_tr_arr", 0.0), 5), round(s.t_added, 5)]
                                for s in took
                            ],
                        ]
                    )
                return res

            llm.LLMEngine._admit = _admit
        dec = sys.modules.get("mlxd.engines.decode")
        if "req_dec" not in _state and dec is not None and hasattr(dec, "DecodeEngine"):
            _state["req_dec"] = True
            emit = dec.DecodeEngine._emit

            def _emit(self, seq, token, finish, logprobs):
                out = emit(self, seq, token, finish, logprobs)
                if seq.generated == 1 and token is not None:
                    _req_log(["first", round(time.monotonic(), 5), id(seq)])
                return out

            dec.DecodeEngine._emit = _emit

    builtins.__import__ = _hook
    if os.environ.get("STEP_TRACE_KEEP_SWITCH") == "1":
        sys.setswitchinterval = lambda interval: None
