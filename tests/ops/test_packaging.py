"""Packaging: ``python -m build`` gives an sdist and a wheel that install and serve in a
fresh virtualenv, and the Homebrew formula's resources cover what the wheel requires on
macOS.

The build runs once per session (about 20-40 s: an isolated build fetches setuptools). The
fresh venv gets the wheel with ``--no-deps``; its dependencies come from the running
environment's site-packages through a ``.pth`` line (a path in a .pth is not itself scanned
for .pth files, so the editable mlxd of the running environment stays out of sight).
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from email.parser import Parser
from pathlib import Path

import httpx
import pytest
import tomllib
from conftest import free_port
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from mlxd import __version__

ROOT = Path(__file__).resolve().parents[2]
HOMEBREW = ROOT / "packaging" / "homebrew"
DARWIN_ARM64 = {
    "sys_platform": "darwin",
    "platform_system": "Darwin",
    "platform_machine": "arm64",
    "os_name": "posix",
    "python_version": "3.12",
    "python_full_version": "3.12.8",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "platform_release": "24.0.0",
    "platform_version": "",
    "implementation_version": "3.12.8",
    "extra": "",
}
SHA256 = re.compile(r"^[0-9a-f]{64}$")


# --------------------------------------------------------------------------------------- #
# The Homebrew formula (fast: reads files only)
# --------------------------------------------------------------------------------------- #


def formula_resources(text: str) -> dict[str, dict[str, str]]:
    """``resource "name" do url ...; sha256 ... end`` blocks: name -> {url, sha256, ...}."""
    out = {}
    for m in re.finditer(r'^  resource "([^"]+)" do\n(.*?)^  end\n', text, re.M | re.S):
        body = m.group(2)
        url = re.search(r'^\s+url "([^"]+)"(, using: :nounzip)?$', body, re.M)
        sha = re.search(r'^\s+sha256 "([^"]+)"$', body, re.M)
        assert url and sha, f"resource {m.group(1)} lacks url or sha256:\n{body}"
        out[m.group(1)] = {
            "url": url.group(1),
            "sha256": sha.group(1),
            "nounzip": bool(url.group(2)),
        }
    return out


def version_in_url(url: str) -> str:
    name = url.rsplit("/", 1)[-1]
    if name.endswith(".whl"):
        return name.split("-")[1]
    return re.sub(r"\.(tar\.gz|zip)$", "", name).rsplit("-", 1)[1]


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (HOMEBREW / "requirements-macos.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    return pins


def darwin_requirements(requires: list[str]) -> set[str]:
    """Names of the requirements that apply on macOS arm64 without extras."""
    out = set()
    for spec in requires:
        req = Requirement(spec)
        if req.marker is None or Marker(str(req.marker)).evaluate(DARWIN_ARM64):
            out.add(canonicalize_name(req.name))
    return out


def pyproject_dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


@pytest.fixture(scope="module")
def formula() -> str:
    return (HOMEBREW / "mlxd.rb").read_text()


def test_formula_is_a_python_virtualenv_formula(formula):
    assert re.search(r"^class Mlxd < Formula$", formula, re.M)
    assert "include Language::Python::Virtualenv" in formula
    assert re.search(
        r'^  url "https://files\.pythonhosted\.org/\S+/mlxd-[\d.]+\.tar\.gz"$', formula, re.M
    )
    assert SHA256.match(re.search(r'^  sha256 "([^"]+)"$', formula, re.M).group(1))
    assert re.search(r'^  depends_on "python@3\.\d+"$', formula, re.M)
    assert "depends_on arch: :arm64" in formula
    assert "venv.pip_install_and_link buildpath" in formula
    # every block opened (class, def, ... do [|x|]) is closed by an `end` at its indent
    opened = [
        m.group(1)
        for m in re.finditer(r"^( *)(?:class |def |\S.* do(?: \|[^|]*\|)?$)", formula, re.M)
    ]
    closed = [m.group(1) for m in re.finditer(r"^( *)end$", formula, re.M)]
    assert sorted(opened) == sorted(closed)


def test_formula_resources_are_the_lock_with_pypi_urls_and_hashes(formula):
    res = formula_resources(formula)
    pins = lock_pins()
    assert set(res) == set(pins)
    for name, r in res.items():
        assert r["url"].startswith("https://files.pythonhosted.org/packages/"), name
        assert SHA256.match(r["sha256"]), name
        assert version_in_url(r["url"]) == pins[name], name
        # sdists, except the binary-only MLX wheels and pure-Python packages that publish no
        # sdist for the pinned version (certifi's post releases): installed by pip as they are
        assert r["url"].endswith(".whl") == r["nounzip"], name
        if r["url"].endswith(".whl") and not r["url"].endswith("-py3-none-any.whl"):
            assert name in {"mlx", "mlx-metal"} and "macosx" in r["url"], name
            assert r["url"].endswith("_arm64.whl"), name


def test_formula_resources_cover_what_mlxd_requires_on_macos(formula):
    res = set(formula_resources(formula))
    needed = darwin_requirements(pyproject_dependencies())
    assert {"mlx", "mlx-lm", "fastapi"} <= needed  # the darwin marker on mlx evaluated
    assert needed <= res, needed - res
    # MLX's Metal kernels come in through mlx's own darwin-only requirement
    assert "mlx-metal" in res
    # the Linux extras do not leak into a macOS formula
    assert not {"mkl", "mlx-cpu", "intel-openmp", "tbb"} & res


def test_formula_is_what_the_generator_renders_from_the_lock(formula, monkeypatch):
    """No hand edits: scripts/gen_formula.py's template, given the lock's pins and the
    formula's own URLs and hashes (fetching them needs the index), gives the same text."""
    spec = importlib.util.spec_from_file_location(
        "gen_formula", ROOT / "scripts" / "gen_formula.py"
    )
    gen = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gen_formula", gen)  # dataclasses look it up there
    spec.loader.exec_module(gen)
    pins = dict(gen.read_lock(HOMEBREW / "requirements-macos.lock"))
    arts = [
        gen.Artifact(name, pins[name], r["url"], r["sha256"])
        for name, r in formula_resources(formula).items()
    ]
    sha = re.search(r'^  sha256 "([^"]+)"$', formula, re.M).group(1)
    assert gen.render(gen.project(), sha, arts) == formula


# --------------------------------------------------------------------------------------- #
# Build, install, serve (slow)
# --------------------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    p = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (sdist,) = out.glob("mlxd-*.tar.gz")
    (wheel,) = out.glob("mlxd-*.whl")
    return {"sdist": sdist, "wheel": wheel}


def _modules() -> set[str]:
    """Every module, and every file the web UI serves (package data)."""
    src = ROOT / "src"
    return {f.relative_to(src).as_posix() for f in (src / "mlxd").rglob("*.py")} | {
        f.relative_to(src).as_posix()
        for f in (src / "mlxd" / "ui" / "static").rglob("*")
        if f.is_file()
    }


def test_sdist_and_wheel_carry_every_module(dists):
    with tarfile.open(dists["sdist"]) as tf:
        top = tf.getnames()[0].split("/")[0]
        sdist = {
            n.removeprefix(f"{top}/src/") for n in tf.getnames() if n.startswith(f"{top}/src/")
        }
        names = set(tf.getnames())
    assert _modules() <= sdist, _modules() - sdist
    assert {f"{top}/pyproject.toml", f"{top}/README.md"} <= names
    with zipfile.ZipFile(dists["wheel"]) as zf:
        wheel = set(zf.namelist())
        meta = next(n for n in wheel if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(zf.read(meta).decode())
        entry = next(n for n in wheel if n.endswith(".dist-info/entry_points.txt"))
        assert "mlxd = mlxd.cli.main:main" in zf.read(entry).decode()
    assert _modules() <= wheel, _modules() - wheel
    # the wheel's own Requires-Dist, evaluated for macOS: the formula covers it
    needed = darwin_requirements(metadata.get_all("Requires-Dist") or [])
    res = set(formula_resources((HOMEBREW / "mlxd.rb").read_text()))
    assert "mlx" in needed and needed <= res, needed - res


@pytest.fixture(scope="module")
def wheel_venv(dists, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("wheelvenv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            str(dists["wheel"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert p.returncode == 0, p.stderr
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    Path(site.stdout.strip(), "_mlxd_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return venv


def _clean_env() -> dict:
    """No PYTHONPATH: a source tree on it (src/, with its egg-info) would stand in for the
    installed wheel."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _env(tmp_path: Path) -> dict:
    env = _clean_env()
    env.update(MLXD_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    return env


def test_installed_wheel_runs_the_cli_from_its_own_files(dists, wheel_venv, tmp_path):
    env = _env(tmp_path)
    mlxd = wheel_venv / "bin" / "mlxd"
    p = subprocess.run([str(mlxd), "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "serve" in p.stdout and "doctor" in p.stdout
    # one version: mlxd.__version__ is the wheel's, and what both CLI spellings print
    version = str(parse_wheel_filename(dists["wheel"].name)[1])
    assert version == __version__
    for args in (["version"], ["--version"]):
        p = subprocess.run([str(mlxd), *args], capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == 0 and p.stdout.strip() == version, (args, p.stderr)
    p = subprocess.run(
        [
            str(wheel_venv / "bin" / "python"),
            "-c",
            "import mlxd, mlxd.server, mlxd.api.app, mlxd.cli.main; print(mlxd.__file__)",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert Path(p.stdout.strip()).is_relative_to(wheel_venv), p.stdout  # not src/


def test_installed_wheel_serves(wheel_venv, tmp_path, tiny_llama):
    port = free_port()
    proc = subprocess.Popen(
        [
            str(wheel_venv / "bin" / "mlxd"),
            "serve",
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
        ],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 90
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "no healthy server after 90 s"
            time.sleep(0.2)
        assert r.json()["version"] == __version__
        ollama = httpx.get(f"http://127.0.0.1:{port}/api/version", timeout=10).json()
        assert ollama["mlxd_version"] == __version__
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        # the web UI's page and files come from the installed package
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert page.status_code == 200 and "/ui/static/app.js" in page.text
        js = httpx.get(f"http://127.0.0.1:{port}/ui/static/vendor/preact-htm.module.js", timeout=10)
        assert js.status_code == 200 and "export" in js.text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn drains, then re-raises the signal so the exit status says "terminated"
    assert proc.returncode in (0, -signal.SIGTERM), out[-2000:]
    assert "Application shutdown complete" in out
    assert "BLAS:" in out  # the start-up log names the BLAS it loaded (or why none)
