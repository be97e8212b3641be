"""
test_manifests.py - the deployment files agree with modeld itself:
docker/compose.yaml, docker/k8s/*.yaml, docker/nginx.conf and docker/Dockerfile.

Every probe and health-check path they name is a GET route of the routing
table (handlers/routes.c); every port they name is the port modeld listens on
with the environment they give it (the binary's own `--print-config`); the
grace periods exceed drain_seconds; nginx's upstreams are compose's replica
services on their ports, it closes idle upstream connections before modeld
does, and its replay-safe location covers exactly the inference routes (a
deploy or a job must never be replayed on another replica).
"""
import glob
import json
import re

import pytest
import yaml

from conftest import REPO

DOCKER = REPO / "docker"


def routes():
    text = (REPO / "handlers" / "routes.c").read_text()
    found = re.findall(r'\{"([A-Z]+)",\s*"([^"]+)"', text)
    assert len(found) > 20, "could not read the routing table"
    return found


def get_paths():
    return {p for m, p in routes() if m == "GET"}


def dockerfile_env():
    text = (DOCKER / "Dockerfile").read_text().split("FROM ")[-1]  # the runtime stage
    env = {}
    for line in re.findall(r"^ENV (.*)$", text, re.M):
        for pair in line.split():
            k, _, v = pair.partition("=")
            env[k] = v
    return env


@pytest.fixture
def effective(run_modeld):
    """effective(env) -> modeld's settings (dict) under the image's ENV plus `env`."""

    def run(env):
        full = {**dockerfile_env(), **{k: str(v) for k, v in env.items()}}
        p = run_modeld("--print-config", env=full)
        assert p.returncode == 0, f"modeld rejects the environment {env}: {p.stderr}"
        return json.loads(p.stdout)

    return run


def load_compose():
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def k8s_docs():
    docs = []
    for path in sorted(glob.glob(str(DOCKER / "k8s" / "*.yaml"))):
        docs += [d for d in yaml.safe_load_all(open(path)) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PersistentVolumeClaim"} <= kinds, kinds
    return docs


def seconds(value):
    m = re.fullmatch(r"(\d+)(s|m)?", str(value))
    assert m, f"cannot read a duration from {value!r}"
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


def url_path_port(url):
    m = re.fullmatch(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/\S*)", url)
    assert m, f"unexpected health-check URL {url!r}"
    return int(m.group(1)), m.group(2)


def nginx_conf():
    """docker/nginx.conf without its comments."""
    return re.sub(r"#[^\n]*", "", (DOCKER / "nginx.conf").read_text())


def test_dockerfile_healthcheck_and_port(effective):
    text = (DOCKER / "Dockerfile").read_text()
    cfg = effective({})
    port, path = url_path_port(re.search(r"HEALTHCHECK .*?(http://\S+)", text).group(1))
    assert path in get_paths(), path
    assert port == cfg["port"]
    assert f"EXPOSE {cfg['port']}" in text


def test_compose_replicas(effective):
    compose = load_compose()
    replicas = {n: s for n, s in compose["services"].items() if s.get("image", "").startswith("modeld")}
    assert len(replicas) == 2, list(compose["services"])
    volumes = set()
    for name, svc in replicas.items():
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        cfg = effective(svc.get("environment", {}))
        test = svc["healthcheck"]["test"]
        port, path = url_path_port(next(a for a in test if a.startswith("http://")))
        assert path in get_paths(), f"{name}: health check {path} is not a GET route"
        assert port == cfg["port"], f"{name}: health check on {port}, modeld listens on {cfg['port']}"
        assert seconds(svc["stop_grace_period"]) > cfg["drain_seconds"], name
        mounts = [v for v in svc["volumes"] if v.endswith(":" + cfg["store"])]
        assert mounts, f"{name}: nothing mounted on the store {cfg['store']}"
        volumes.add(mounts[0].split(":")[0])
    assert len(volumes) == 1, f"the replicas must share one store volume: {volumes}"
    assert volumes <= set(compose["volumes"])


def test_nginx_upstreams_are_compose_replicas(effective):
    compose = load_compose()
    conf = nginx_conf()
    upstream = re.search(r"upstream modeld \{(.*?)\}", conf, re.S).group(1)
    servers = re.findall(r"^\s*server\s+([\w.-]+):(\d+)(.*);", upstream, re.M)
    assert len(servers) == 2, servers
    for host, port, params in servers:
        svc = compose["services"].get(host)
        assert svc is not None, f"nginx upstream {host} is not a compose service"
        cfg = effective(svc.get("environment", {}))
        assert int(port) == cfg["port"], f"nginx sends to {host}:{port}, modeld listens on {cfg['port']}"
        # a restarted replica is tried again before the next one stops
        fail = re.search(r"fail_timeout=(\w+)", params)
        assert fail and seconds(fail.group(1)) < cfg["drain_seconds"], params
        # nginx drops idle upstream connections before modeld closes them
        keep = re.search(r"keepalive_timeout\s+(\w+);", upstream)
        assert keep and seconds(keep.group(1)) < cfg["keepalive_timeout_s"]
    assert re.search(r"^\s*keepalive\s+\d+;", upstream, re.M), "no upstream keep-alive"
    assert "proxy_http_version 1.1;" in conf and 'proxy_set_header Connection "";' in conf
    # nginx listens where compose publishes it
    nginx = compose["services"]["nginx"]
    listen = re.search(r"^\s*listen\s+(\d+);", conf, re.M).group(1)
    assert any(p.split(":")[-1] == listen for p in nginx["ports"]), nginx["ports"]
    assert any(v.startswith("./nginx.conf:") for v in nginx["volumes"])


def test_nginx_replays_only_inference():
    conf = nginx_conf()
    m = re.search(r"location ~ (\S+) \{(.*?)\}", conf, re.S)
    assert m, "no inference location in docker/nginx.conf"
    pattern, body = re.compile(m.group(1)), m.group(2)
    assert "non_idempotent" in body
    # only the inference location may replay: everything else keeps nginx's default
    outside = conf.replace(m.group(0), "")
    assert "non_idempotent" not in outside
    # predictions (POST, and PUT as `curl -T img.png` sends an image) and
    # TorchServe's /predictions/NAME compute and store nothing: safe to replay
    inference = re.compile(r"(predict|infer)$|^/predictions/")
    for method, path in routes():
        sample = re.sub(r"\{[^}]+\}", "x", path)
        if method in ("POST", "PUT") and inference.search(path):
            assert pattern.fullmatch(sample), f"inference route {path} is not replay-safe in nginx"
        else:
            assert not pattern.fullmatch(sample), f"{method} {path} would be replayed by nginx"


def test_k8s_deployment(effective):
    docs = k8s_docs()
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    cfg = effective(env)
    ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
    assert cfg["port"] in ports.values(), f"containerPort {ports} vs modeld's {cfg['port']}"

    def port_of(ref):
        return ports[ref] if isinstance(ref, str) else ref

    for probe, want in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == want and want in get_paths()
        assert port_of(get["port"]) == cfg["port"], probe
    pre = container["lifecycle"]["preStop"]
    pre_s = 0
    if "exec" in pre:
        pre_s = int(pre["exec"]["command"][-1])
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > cfg["drain_seconds"] + pre_s, (grace, cfg["drain_seconds"], pre_s)
    res = container["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    # the loaded versions' budget leaves room under the memory limit for the rest
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    limit = res["limits"]["memory"]
    limit = int(limit[:-2]) * units[limit[-2:]] if limit[-2:] in units else int(limit)
    assert 0 < cfg["max_loaded_bytes"] <= limit // 2, (cfg["max_loaded_bytes"], limit)

    # the store: a PersistentVolumeClaim mounted where modeld keeps it
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    vols = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == cfg["store"])
    assert vols[mount["name"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]

    # the Service selects these pods and targets modeld's port
    svc = next(d for d in docs if d["kind"] == "Service")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    for p in svc["spec"]["ports"]:
        assert port_of(p["targetPort"]) == cfg["port"]
