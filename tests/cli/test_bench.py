"""`mlxd bench` as a user runs it: real servers on free ports, the JSON it writes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, wait_until

SMALL = ["--concurrency", "1,2", "--pairs", "2", "--max-tokens", "8", "--prompt-tokens", "16"]


def _bench(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", "bench", *args],
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _check_side(side: dict, pairs: int, requests: int) -> None:
    tps = side["output_tps"]
    assert len(tps["per_pass"]) == pairs
    assert tps["min"] <= tps["median"] <= tps["max"]
    assert side["errors"] == 0, side["error_samples"]
    assert side["requests"] == requests
    assert side["output_tokens"] > 0
    assert side["ttft_s"]["p50"] <= side["ttft_s"]["p95"]
    gaps = side["inter_token_s"]
    assert gaps["p50"] <= gaps["p95"] <= gaps["max"]


def _check_common(data: dict, command_has: str) -> None:
    assert data["complete"] is True
    assert data["command"].startswith("mlxd bench ") and command_has in data["command"]
    assert data["mlxd_version"]
    assert {"platform", "machine", "cpu_count", "python", "mlx", "mlx_default_device"} <= set(
        data["machine"]
    )
    assert len(data["machine"]["load_average_end"]) == 3
    assert data["machine"]["mlx_default_device"]  # MLX answered in a child process
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", data["date"])
    assert "git_commit" in data
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        assert len(lv["pairs"]) == 2


def test_bench_without_a_peer_measures_mlxd_alone(tmp_path, tiny_llama):
    out = tmp_path / "out.json"
    r = _bench(str(tiny_llama), "--peer", "none", *SMALL, "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    _check_common(data, "--peer none")
    assert data["peer"] is None
    for lv in data["levels"]:
        c = lv["concurrency"]
        assert list(lv["sides"]) == ["mlxd"]
        _check_side(lv["sides"]["mlxd"], pairs=2, requests=2 * c * 2)
        assert lv["ratio"] is None
    # the table on stdout, one row per level
    assert r.stdout.splitlines()[0].startswith("| C | side |")
    assert len([x for x in r.stdout.splitlines() if x.startswith("| 1 | mlxd")]) == 1


def test_bench_sends_the_key_an_mlxd_with_api_keys_asks_for(tmp_path, tiny_llama):
    out = tmp_path / "out.json"
    r = _bench(
        str(tiny_llama),
        "--peer",
        "none",
        *SMALL,
        "--json",
        str(out),
        MLXD_API_KEYS="bench:sk-bench-0123",
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    for lv in data["levels"]:
        _check_side(lv["sides"]["mlxd"], pairs=2, requests=2 * lv["concurrency"] * 2)
    assert data["machine"]["mlx_devices"]  # /health's full answer: the key was accepted
    assert "sk-bench-0123" not in out.read_text()
    # a key the server refuses: every request fails, and the bench stops saying so
    r = _bench(
        str(tiny_llama),
        "--peer",
        "none",
        *SMALL,
        MLXD_API_KEYS="bench:sk-bench-0123",
        MLXD_API_KEY="sk-wrong",
    )
    assert r.returncode == 1, r.stderr
    assert "mlxd: mlxd (http://127.0.0.1:" in r.stderr and "HTTP 401" in r.stderr


def test_bench_against_a_running_server_interleaves_the_pairs(tmp_path, tiny_llama, start_server):
    peer = start_server(tiny_llama)
    before = sum(c["requests_total"] for c in peer.health()["engine_cores"])
    out = tmp_path / "out.json"
    r = _bench(str(tiny_llama), "--peer", peer.url, *SMALL, "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    _check_common(data, peer.url)
    assert data["peer"]["kind"] == "url" and data["peer"]["url"] == peer.url
    for lv in data["levels"]:
        c = lv["concurrency"]
        assert list(lv["sides"]) == ["mlxd", "peer"]
        for side in lv["sides"].values():
            _check_side(side, pairs=2, requests=2 * c * 2)
        # each pair's order the reverse of the one before
        assert [p["order"] for p in lv["pairs"]] == [["mlxd", "peer"], ["peer", "mlxd"]]
        ratio = lv["ratio"]
        assert len(ratio["per_pair"]) == 2
        assert ratio["min"] <= ratio["median"] <= ratio["max"]
        for p, x in zip(lv["pairs"], ratio["per_pair"], strict=True):
            assert x == p["ratio"] == p["mlxd"]["output_tps"] / p["peer"]["output_tps"]
    # the peer's requests really went to the peer: warm-up (1 + 2) and the pairs (4 + 8)
    after = sum(c["requests_total"] for c in peer.health()["engine_cores"])
    assert after - before == 15


def test_bench_starts_mlx_lm_server_on_the_same_directory(tmp_path, tiny_llama):
    out = tmp_path / "out.json"
    # on Linux with the BLAS mlxd loads preloaded into mlx_lm's server too
    blas = ["--peer-blas"] if sys.platform == "linux" else []
    r = _bench(str(tiny_llama), "--peer", "mlx_lm", *blas, *SMALL, "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    _check_common(data, "--peer mlx_lm")
    assert data["peer"]["kind"] == "mlx_lm"
    if blas:
        assert Path(data["peer"]["ld_preload"]).is_file()
    assert str(tiny_llama) in data["peer"]["command"]
    for lv in data["levels"]:
        assert list(lv["sides"]) == ["mlxd", "mlx_lm"]
        assert lv["ratio"]["of"] == "mlxd/mlx_lm output tok/s"
        for side in lv["sides"].values():
            _check_side(side, pairs=2, requests=2 * lv["concurrency"] * 2)


def test_bench_against_the_engine_alone_on_the_same_directory(tmp_path, tiny_llama):
    out = tmp_path / "out.json"
    small = ["--concurrency", "1,2", "--pairs", "2", "--max-tokens", "4", "--prompt-tokens", "16"]
    r = _bench(str(tiny_llama), "--peer", "engine", *small, "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    _check_common(data, "--peer engine")
    peer = data["peer"]
    assert peer["kind"] == "engine" and str(tiny_llama) in peer["command"]
    # the engine core's settings: its MLX environment, its BLAS, models.dtype's choice
    assert peer["env"] == {"MLX_CUDA_USE_CUDNN_SDPA": "0"}
    assert peer["blas"] and peer["backend"] in ("cpu", "cuda", "metal")
    assert (peer["backend"] == "cpu") == ("cpu" in data["machine"]["mlx_default_device"])
    assert peer["dtype"] == ("float32" if peer["backend"] == "cpu" else "native")
    for lv in data["levels"]:
        c = lv["concurrency"]
        assert list(lv["sides"]) == ["mlxd", "engine"]
        mlxd, engine = lv["sides"]["mlxd"], lv["sides"]["engine"]
        for side in (mlxd, engine):
            _check_side(side, pairs=2, requests=2 * c * 2)
        # the same prompts through the same template, greedy: the same tokens both sides
        assert engine["prompt_tokens_mean"] == mlxd["prompt_tokens_mean"]
        assert engine["finished_by_length"] == mlxd["finished_by_length"]
        assert lv["ratio"]["of"] == "mlxd/engine output tok/s"
        assert [p["order"] for p in lv["pairs"]] == [["mlxd", "engine"], ["engine", "mlxd"]]
        for p, x in zip(lv["pairs"], lv["ratio"]["per_pair"], strict=True):
            assert p["engine"]["output_tokens"] == p["mlxd"]["output_tokens"]
            assert x == p["ratio"] == p["mlxd"]["output_tps"] / p["engine"]["output_tps"]
    assert "| 1 | engine |" in r.stdout


def test_bench_refuses_bad_options_before_starting_anything(tmp_path, tiny_llama):
    for args, says in (
        (["--concurrency", "0,2"], "--concurrency takes positive integers"),
        (["--concurrency", "a"], "--concurrency takes positive integers"),
        (["--peer", "vllm"], "--peer takes mlx_lm, engine, none or an http(s) URL"),
    ):
        r = _bench(str(tiny_llama), *args, "--json", str(tmp_path / "out.json"), timeout=60)
        assert r.returncode == 2, r.stderr
        assert says in r.stderr and "Traceback" not in r.stderr
        assert "starting mlxd" not in r.stderr
        assert not (tmp_path / "out.json").exists()


def test_bench_a_model_that_cannot_start_says_so(tmp_path):
    r = _bench(str(tmp_path / "nothing-here"), "--peer", "none", *SMALL, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"mlxd: no model directory at {tmp_path / 'nothing-here'}"
    # a store name mlxd cannot pull (offline): mlxd exits, and the bench says so
    r = _bench("acme/no-such-model", "--peer", "none", *SMALL)
    assert r.returncode == 1, r.stderr
    assert "mlxd: mlxd did not start" in r.stderr  # then the last lines of its log
    assert "Traceback" not in r.stderr.split("the last lines of its log")[0]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie until its parent reaps it: gone for our purpose
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z"


def test_bench_against_a_url_nothing_answers_says_so_before_starting_mlxd(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    r = _bench(str(tmp_path), "--peer", url, *SMALL, timeout=180)
    assert r.returncode == 1, r.stderr
    assert f"mlxd: peer {url}: {url} not ready after 30 s" in r.stderr
    assert "starting mlxd" not in r.stderr


@pytest.mark.parametrize("peer", ["mlx_lm", "engine"])
def test_ctrl_c_stops_both_sides(tmp_path, tiny_llama, peer):
    p = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "bench", str(tiny_llama), "--peer", peer]
        + ["--concurrency", "1", "--pairs", "100000", "--max-tokens", "8", "--prompt-tokens", "16"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    seen: list[str] = []
    try:
        assert p.stderr is not None
        for line in p.stderr:
            seen.append(line)
            m = re.search(r"ready (?:at \S+ )?\(pid (\d+)\)", line)
            if m:
                pids.append(int(m.group(1)))
            if "pair 1/" in line:
                break
        assert len(pids) == 2, "".join(seen)
        p.send_signal(signal.SIGINT)
        rest = p.communicate(timeout=180)[1]
        assert p.returncode == 130, rest
        assert "mlxd: interrupted" in rest
        assert wait_until(lambda: all(_gone(pid) for pid in pids), timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
