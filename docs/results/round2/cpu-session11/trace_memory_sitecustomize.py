"""Scratch: per LLMEngine._step: duration, MLX cache/active memory, clear_cache calls, prefix entries."""
import builtins, json, os, sys, time
_out = os.environ.get("MEM_TRACE")
if _out:
    _orig = builtins.__import__
    _s = {"done": False, "f": None, "clears": 0, "mx": False}
    def _w(rec):
        if _s["f"] is None:
            _s["f"] = open(f"{_out}.{os.getpid()}.jsonl", "w", buffering=1)
        _s["f"].write(json.dumps(rec) + "\n")
    def _hook(name, *a, **k):
        m = _orig(name, *a, **k)
        core = sys.modules.get("mlx.core")
        if not _s["mx"] and core is not None and hasattr(core, "clear_cache"):
            _s["mx"] = True
            cc = core.clear_cache
            def clear_cache():
                _s["clears"] += 1
                _w(["clear", round(time.perf_counter(), 4), core.get_cache_memory()])
                return cc()
            core.clear_cache = clear_cache
        if not _s["done"]:
            llm = sys.modules.get("mlxd.engines.llm")
            if llm is not None and hasattr(llm, "LLMEngine"):
                _s["done"] = True
                st = llm.LLMEngine._step
                def _step(self):
                    t0 = time.perf_counter(); r = st(self)
                    _w(["step", round(t0, 4), round((time.perf_counter() - t0) * 1000, 2), self.num_running,
                        core.get_cache_memory() >> 20, core.get_active_memory() >> 20, len(self.prefix_cache), _s["clears"]])
                    return r
                llm.LLMEngine._step = _step
        return m
    builtins.__import__ = _hook
