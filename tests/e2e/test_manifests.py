"""
test_manifests.py - the deployment files agree with modeld itself:
docker/compose.yaml, docker/compose.cluster.yaml, docker/k8s/*.yaml,
docker/k8s/cluster/*.yaml, docker/nginx.conf and docker/Dockerfile.

Every probe and health-check path they name is a GET route of the routing
table (handlers/routes.c); every port they name is the port modeld listens on
with the environment they give it (the binary's own `--print-config`); the
grace periods exceed drain_seconds; nginx's upstreams are compose's replica
services on their ports, it closes idle upstream connections before modeld
does, and its replay-safe location covers exactly the inference routes (a
deploy or a job must never be replayed on another replica).

The several-hosts recipes (compose.cluster.yaml, k8s/cluster/): every MODELD_*
name is a setting modeld reads, the index URL names the PostgreSQL service
and the blob URL the bucket the recipe creates, no two replicas share a
volume, no claim is ReadWriteMany, and the secrets come from a Secret. The
one-node recipe (k8s/pvc.yaml, deployment.yaml) says it is for one node,
asks for ReadWriteOnce and keeps its pods on one node.
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


def load_compose(name="compose.yaml"):
    return yaml.safe_load((DOCKER / name).read_text())


def interpolate(value):
    """A compose value with its ${VAR:-default} references at their defaults."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def k8s_docs(folder="k8s"):
    """The manifests of one folder (docker/k8s: the one-node recipe)."""
    docs = []
    for path in sorted(glob.glob(str(DOCKER / folder / "*.yaml"))):
        docs += [d for d in yaml.safe_load_all(open(path)) if d]
    kinds = {d["kind"] for d in docs}
    want = {"Deployment", "Service", "PersistentVolumeClaim" if folder == "k8s" else "Secret"}
    assert want <= kinds, kinds
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


def pod_env(container, docs):
    """The container's environment, secretKeyRef values read from the Secret in `docs`."""
    secrets = {d["metadata"]["name"]: d.get("stringData", {}) for d in docs
               if d["kind"] == "Secret"}
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"]["secretKeyRef"]
        assert ref["name"] in secrets, f"{e['name']}: no Secret {ref['name']} beside it"
        assert ref["key"] in secrets[ref["name"]], f"{e['name']}: Secret has no key {ref['key']}"
        env[e["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def memory_bytes(text):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


def check_k8s_pod(docs, effective):
    """What both Deployments must get right; returns (pod, container, env, cfg)."""
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = pod_env(container, docs)
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
    limit = memory_bytes(res["limits"]["memory"])
    assert 0 < cfg["max_loaded_bytes"] <= limit // 2, (cfg["max_loaded_bytes"], limit)

    # the Service selects these pods and targets modeld's port
    svc = next(d for d in docs if d["kind"] == "Service")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    for p in svc["spec"]["ports"]:
        assert port_of(p["targetPort"]) == cfg["port"]
    return pod, container, env, cfg


def test_k8s_deployment(effective):
    docs = k8s_docs()
    pod, container, _, cfg = check_k8s_pod(docs, effective)
    # the store: a PersistentVolumeClaim mounted where modeld keeps it
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    vols = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == cfg["store"])
    assert vols[mount["name"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_k8s_sqlite_recipe_is_for_one_node():
    """SQLite's WAL needs every replica on one machine: the claim is
    ReadWriteOnce, the pods must share a node, and both files say so."""
    docs = k8s_docs()
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"], pvc["spec"]["accessModes"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    terms = dep["spec"]["template"]["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert any(t["topologyKey"] == "kubernetes.io/hostname"
               and t["labelSelector"]["matchLabels"].items() <= labels.items() for t in terms)
    for name in ("pvc.yaml", "deployment.yaml"):
        text = (DOCKER / "k8s" / name).read_text()
        assert "ONE NODE ONLY" in text and "docker/k8s/cluster/" in text, name


def check_cluster_env(cfg, env, where):
    """The several-hosts settings: a PostgreSQL index, S3 blobs, a cache."""
    assert cfg["index_url"].startswith("postgresql://"), f"{where}: index_url {cfg['index_url']}"
    assert "***" in cfg["index_url"], f"{where}: the index URL carries no password"
    assert env["MODELD_BLOB_URL"].startswith("s3://"), where
    assert int(env["MODELD_CACHE_MAX_BYTES"]) > 0, where
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        assert env.get(name), f"{where}: no {name}"
    return env["MODELD_BLOB_URL"][len("s3://"):].split("/")[0]


def test_k8s_cluster_deployment(effective):
    docs = k8s_docs("k8s/cluster")
    pod, container, env, cfg = check_k8s_pod(docs, effective)
    check_cluster_env(cfg, env, "k8s/cluster/deployment.yaml")
    # the secrets come from the Secret, never as plain values in the Deployment
    plain = {e["name"] for e in container["env"] if "value" in e}
    for name in ("MODELD_INDEX_URL", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"):
        assert name not in plain, f"{name} is a plain value; it belongs in the Secret"
    # the store is a per-pod emptyDir cache, larger than cache_max_bytes; no claim at all
    assert all(d["kind"] != "PersistentVolumeClaim" for d in docs)
    vols = {v["name"]: v for v in pod["volumes"]}
    assert all("persistentVolumeClaim" not in v for v in vols.values()), vols
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == cfg["store"])
    cache = vols[mount["name"]]["emptyDir"]
    assert memory_bytes(cache["sizeLimit"]) > int(env["MODELD_CACHE_MAX_BYTES"]), cache
    # a cluster Service of its own, not the one-node recipe's
    one_node = {d["metadata"]["name"] for d in k8s_docs() if d["kind"] in ("Deployment", "Service")}
    assert not one_node & {d["metadata"]["name"] for d in docs}, "names clash with docker/k8s/"


def test_no_claim_is_read_write_many():
    for path in glob.glob(str(DOCKER / "k8s" / "**" / "*.yaml"), recursive=True):
        for d in yaml.safe_load_all(open(path)):
            if d and d["kind"] == "PersistentVolumeClaim":
                assert "ReadWriteMany" not in d["spec"]["accessModes"], path


def test_compose_cluster(effective):
    compose = load_compose("compose.cluster.yaml")
    services = compose["services"]
    replicas = {n: s for n, s in services.items() if s.get("image", "").startswith("modeld")}
    assert len(replicas) == 2, list(services)
    # nginx.conf is shared with the one-host recipe: its upstreams are these replicas
    conf = nginx_conf()
    upstream = re.search(r"upstream modeld \{(.*?)\}", conf, re.S).group(1)
    hosts = set(re.findall(r"^\s*server\s+([\w.-]+):\d+", upstream, re.M))
    assert hosts == set(replicas), (hosts, list(replicas))
    assert any(v.startswith("./nginx.conf:") for v in services["nginx"]["volumes"])
    pg = services["postgres"]
    assert str(pg["image"]).startswith("postgres:15"), pg["image"]
    pg_env = {k: interpolate(v) for k, v in pg["environment"].items()}
    assert str(services["minio"]["image"]).startswith("minio/minio")
    made = " ".join(services["minio-bucket"]["command"])
    assert str(services["minio-bucket"]["image"]).startswith("minio/mc")
    volumes = []
    for name, svc in replicas.items():
        env = {k: interpolate(v) for k, v in svc["environment"].items()}
        cfg = effective(env)
        bucket = check_cluster_env(cfg, env, name)
        assert re.search(rf"mc mb (--ignore-existing )?\S+/{re.escape(bucket)}\b", made), made
        # the index is the PostgreSQL service, with its user, password and database
        m = re.fullmatch(r"postgresql://(\w+):([^@]+)@([\w-]+):(\d+)/(\w+)",
                         env["MODELD_INDEX_URL"])
        assert m, env["MODELD_INDEX_URL"]
        assert (m.group(1), m.group(2), m.group(5)) == (
            pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], pg_env["POSTGRES_DB"])
        assert m.group(3) == "postgres" and m.group(4) == "5432"
        # S3 is the MinIO service, with its root credentials
        minio_env = {k: interpolate(v) for k, v in services["minio"]["environment"].items()}
        assert re.fullmatch(r"http://minio:9000/?", env["AWS_ENDPOINT_URL_S3"])
        assert env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
        assert env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
        assert env["MODELD_S3_PATH_STYLE"] == "true", "MinIO needs path-style addressing"
        deps = svc["depends_on"]
        assert deps["postgres"]["condition"] == "service_healthy"
        assert deps["minio-bucket"]["condition"] == "service_completed_successfully"
        # the health check and the grace as in the one-host recipe
        test = svc["healthcheck"]["test"]
        port, path = url_path_port(next(a for a in test if a.startswith("http://")))
        assert path in get_paths() and port == cfg["port"], name
        assert seconds(svc["stop_grace_period"]) > cfg["drain_seconds"], name
        mounts = [v for v in svc["volumes"] if v.endswith(":" + cfg["store"])]
        assert mounts, f"{name}: nothing mounted on the store (the cache) {cfg['store']}"
        volumes.append(mounts[0].split(":")[0])
    assert len(set(volumes)) == len(volumes), f"replicas share a cache volume: {volumes}"
    assert set(volumes) <= set(compose["volumes"])
