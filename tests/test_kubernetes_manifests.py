"""The Kubernetes manifests (docker/kubernetes/): every object valid against the Kubernetes
OpenAPI schemas, offline, and the references between them that no schema sees.

The schemas are those kubernetes-validate ships (strict: an unknown field is an error), for
every Kubernetes release it carries from :data:`OLDEST` on. What a schema cannot check is
checked here against the objects themselves and against ISAGI's code: the Services select the
replicas' pods and name their port, the Ingresses route to those Services, the probes ask
``/health`` on the container's port, every ``ISAGI_*`` variable is one ISAGI reads, every Secret
key referenced is in the example Secret, whose values make valid settings, and PostgreSQL
admits as many connections as the replicas' engines may open (counted from the engines ISAGI
itself builds).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "docker" / "kubernetes"
KUSTOMIZATION = K8S / "kustomization.yaml"
EXAMPLE_SECRET = K8S / "secret.example.yaml"
OLDEST = "1.30"  # the oldest Kubernetes release the manifests are checked against
RESERVED = 3  # PostgreSQL's superuser_reserved_connections (its default)


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _manifests() -> dict[Path, list[dict[str, Any]]]:
    """Every Kubernetes object of the folder, by file (the kustomization is kustomize's, not an object)."""
    return {p: _docs(p) for p in sorted(K8S.glob("*.yaml")) if p != KUSTOMIZATION}


def _objects() -> list[dict[str, Any]]:
    return [d for docs in _manifests().values() for d in docs]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _all(kind: str) -> list[dict[str, Any]]:
    return [o for o in _objects() if o["kind"] == kind]


def _replicas() -> dict[str, Any]:
    return _one("Deployment", "isagi")


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _port_number(container: dict[str, Any], port: int | str) -> int:
    """A port named or numbered as a probe or a Service's targetPort does: the container's port."""
    ports = container["ports"]
    if isinstance(port, str):
        named = [p["containerPort"] for p in ports if p.get("name") == port]
        assert named, f"no container port named {port!r}"
        return int(named[0])
    assert port in [p["containerPort"] for p in ports], f"{port} is not a container port"
    return port


# ------------------------------------------------------------------- schemas --


def _versions() -> list[str]:
    from kubernetes_validate.utils import all_versions
    from packaging.version import Version

    return sorted({v for v in all_versions() if Version(v) >= Version(OLDEST)}, key=Version)


def test_every_manifest_matches_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    versions = _versions()
    assert versions, f"kubernetes-validate ships no schemas from {OLDEST} on"
    failures = []
    checked = 0
    for path, docs in _manifests().items():
        assert docs, f"{path.name} holds no object"
        for doc in docs:
            for version in versions:
                try:  # strict: an unknown or misspelt field fails too; a kind without a schema raises
                    kubernetes_validate.validate(doc, version, strict=True)
                    checked += 1
                except kubernetes_validate.ValidationError as exc:
                    where = ".".join(str(p) for p in exc.path)
                    failures.append(f"{path.name} {doc['kind']}/{doc['metadata']['name']} on {version}: "
                                    f"{where}: {exc.message}")
    assert not failures, "\n".join(failures)
    kinds = {o["kind"] for o in _objects()}
    assert {"Deployment", "Service", "Ingress", "StatefulSet", "Secret"} <= kinds
    assert checked == len(_objects()) * len(versions)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    import kubernetes_validate

    bad = _replicas()
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError, match="pathh"):
        kubernetes_validate.validate(bad, _versions()[-1], strict=True)


def test_the_kustomization_applies_every_manifest_but_the_example_secret() -> None:
    kustomization = _docs(KUSTOMIZATION)[0]
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    files = {p.name for p in _manifests()}
    assert set(listed) == files - {EXAMPLE_SECRET.name}, "a manifest is missing from kustomization.yaml"
    assert kustomization["namespace"] == _one("Namespace", kustomization["namespace"])["metadata"]["name"]
    assert not any(o["metadata"].get("namespace") for o in _objects()), "the kustomization sets the namespace"


# ----------------------------------------------------------- cross-references --


def test_each_service_selects_the_pods_of_its_workload_and_their_port() -> None:
    replicas, postgres = _replicas(), _one("StatefulSet", "isagi-postgres")
    for workload in (replicas, postgres):
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert _matches(workload["spec"]["selector"]["matchLabels"], pod_labels)
    pods = {"isagi-page": replicas, "isagi-api": replicas, "isagi-postgres": postgres}
    assert {s["metadata"]["name"] for s in _all("Service")} == set(pods)
    for service in _all("Service"):
        workload = pods[service["metadata"]["name"]]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert _matches(service["spec"]["selector"], labels), service["metadata"]["name"]
        others = [w for w in (replicas, postgres) if w is not workload]
        assert not any(_matches(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
                       for w in others), f"{service['metadata']['name']} selects the other workload's pods too"
        for port in service["spec"]["ports"]:
            _port_number(_container(workload), port["targetPort"])
    assert postgres["spec"]["serviceName"] == "isagi-postgres"
    assert _one("Service", "isagi-postgres")["spec"]["clusterIP"] == "None"  # the StatefulSet's headless Service
    pdb = _one("PodDisruptionBudget", "isagi")
    assert pdb["spec"]["selector"]["matchLabels"] == replicas["spec"]["selector"]["matchLabels"]


def test_the_ingresses_reach_the_page_and_the_api_each_through_a_service_of_its_own() -> None:
    services = {s["metadata"]["name"]: s for s in _all("Service")}
    backends: dict[str, str] = {}  # Ingress -> Service
    paths: dict[str, list[str]] = {}
    for ingress in _all("Ingress"):
        name = ingress["metadata"]["name"]
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["name"] in services, f"{name} routes to no Service {backend['name']!r}"
                exposed = services[backend["name"]]["spec"]["ports"]
                port = backend["port"]
                assert any(p.get("name") == port.get("name") if "name" in port else p["port"] == port["number"]
                           for p in exposed), f"{name}: {backend['name']} exposes no port {port}"
                backends.setdefault(name, backend["name"])
                assert backends[name] == backend["name"]
                paths.setdefault(name, []).append(path["path"])
    # ingress-nginx keeps one balancing rule per Service and port: two Ingresses on one Service
    # would both get the first one's (its affinity docs), so each Ingress has a Service of its own.
    assert len(set(backends.values())) == len(backends)
    page, api = _one("Ingress", "isagi-page"), _one("Ingress", "isagi-api")
    assert paths == {"isagi-page": ["/"], "isagi-api": ["/v1"]}
    notes = page["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/affinity"] == "cookie"
    assert notes["nginx.ingress.kubernetes.io/affinity-mode"] == "persistent"
    assert api["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_authorization"
    assert "nginx.ingress.kubernetes.io/affinity" not in api["metadata"]["annotations"]


def test_the_request_bodies_the_ingresses_admit_are_what_the_app_accepts() -> None:
    from isagi.app.api import MAX_BODY_BYTES
    from isagi.storage.miku.limits import MAX_MIKU_BYTES

    def limit(name: str) -> int:
        value = _one("Ingress", name)["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"]
        number, unit = re.fullmatch(r"(\d+)([km]?)", value).groups()  # type: ignore[union-attr]
        return int(number) * {"": 1, "k": 1024, "m": 1024**2}[unit]

    assert MAX_MIKU_BYTES < limit("isagi-page") <= MAX_MIKU_BYTES + 2 * 1024**2  # an upload and its form
    assert MAX_BODY_BYTES < limit("isagi-api") <= MAX_BODY_BYTES + 2 * 1024**2


def test_the_probes_ask_health_on_the_port_the_server_listens_on() -> None:
    container = _container(_replicas())
    env = {e["name"]: e.get("value") for e in container["env"]}
    port = _port_number(container, "http")
    dockerfile = (REPO / "docker" / "cpu.Dockerfile").read_text(encoding="utf-8")
    assert re.search(rf"^EXPOSE {port}$", dockerfile, re.M), "the image exposes another port"
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert cmd and container["args"] == yaml.safe_load(cmd.group(1))  # the image's own command
    assert env["ISAGI_PORT"] == str(port) and env["ISAGI_HOST"] == "0.0.0.0"
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]["httpGet"]
        assert probe["path"] == "/health", kind
        assert _port_number(container, probe["port"]) == port, kind
    postgres = _container(_one("StatefulSet", "isagi-postgres"))
    for kind in ("readinessProbe", "livenessProbe"):
        assert postgres[kind]["exec"]["command"][0] == "pg_isready"


def test_a_drain_fits_the_grace_period_and_never_trips_liveness() -> None:
    from isagi.app.shutdown import GRACE_S

    spec = _replicas()["spec"]["template"]["spec"]
    container = _container(_replicas())
    grace = spec["terminationGracePeriodSeconds"]
    pause = shlex.join(container["lifecycle"]["preStop"]["exec"]["command"])
    prestop = int(re.fullmatch(r"sleep (\d+)", pause).group(1))  # type: ignore[union-attr]
    assert grace > prestop + GRACE_S  # uvicorn's last resort comes after the pause, within the period
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= grace  # draining (503) is not "dead"
    start = container["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 900  # compose's start_period: a first calibration


def _settings_names() -> set[str]:
    """Every environment variable ISAGI reads: load_settings' (isagi/config.py), asked of a
    mapping that records each name, and the servers' --host/--port (typer's envvar)."""
    import typer

    from isagi.cli import app
    from isagi.config import load_settings

    asked: set[str] = set()

    class Recording(dict[str, str]):
        def get(self, key: str, default: Any = None) -> Any:
            asked.add(key)
            return super().get(key, default)

    load_settings(Recording())
    command = typer.main.get_command(app)
    for name in ("web", "serve"):
        for param in command.commands[name].params:  # type: ignore[attr-defined]
            envvars = param.envvar if isinstance(param.envvar, list | tuple) else [param.envvar]
            asked.update(e for e in envvars if e)
    return asked


def test_every_isagi_variable_set_is_one_isagi_reads() -> None:
    names = _settings_names()
    assert {"ISAGI_SESSIONS_URL", "ISAGI_DATABASE_URL", "ISAGI_PORT"} <= names  # the recording works
    container = _container(_replicas())
    ours = {e["name"] for e in container["env"] if e["name"].startswith("ISAGI_")}
    assert ours - names == set()
    assert {"ISAGI_SESSIONS_URL", "ISAGI_DATABASE_URL"} <= ours


def _secret_refs() -> list[tuple[str, str, str]]:
    """(workload, Secret name, key) of every secretKeyRef of the workloads."""
    refs = []
    for workload in (_replicas(), _one("StatefulSet", "isagi-postgres")):
        for env in _container(workload)["env"]:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert not ref.get("optional"), f"{env['name']}: a missing secret must stop the pod"
                refs.append((workload["metadata"]["name"], ref["name"], ref["key"]))
    return refs


def test_every_secret_key_referenced_is_in_the_example_secret() -> None:
    (secret,) = _docs(EXAMPLE_SECRET)
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    refs = _secret_refs()
    assert refs
    missing = [r for r in refs if r[1] != secret["metadata"]["name"] or r[2] not in keys]
    assert not missing, f"referenced but not in {EXAMPLE_SECRET.name}: {missing}"
    assert keys == {key for _, _, key in refs}, "the example Secret holds a key nothing reads"


def _replica_env() -> dict[str, str]:
    """The replicas' environment as Kubernetes would give it, the Secret's values from the example."""
    (secret,) = _docs(EXAMPLE_SECRET)
    values = secret["stringData"]
    env = {}
    for e in _container(_replicas())["env"]:
        env[e["name"]] = e["value"] if "value" in e else values[e["valueFrom"]["secretKeyRef"]["key"]]
    return env


def test_the_example_secret_makes_valid_settings_that_reach_the_postgres_service() -> None:
    from sqlalchemy.engine import make_url

    from isagi.app.api_request import parse_api_keys
    from isagi.app.server import parse_auth
    from isagi.config import load_settings

    env = _replica_env()
    settings = load_settings({k: v for k, v in env.items() if k.startswith("ISAGI_")})
    assert settings.sessions_url and settings.database_url
    assert settings.threads == 2 and settings.trusted_proxies
    assert parse_auth(settings.auth) and parse_api_keys(settings.api_keys)
    pg = _container(_one("StatefulSet", "isagi-postgres"))
    pg_env = {e["name"]: e.get("value") for e in pg["env"]}
    service = _one("Service", "isagi-postgres")
    for url in (settings.sessions_url, settings.database_url):
        u = make_url(url)
        assert (u.host, u.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
        assert (u.username, u.database) == (pg_env["POSTGRES_USER"], pg_env["POSTGRES_DB"])
        assert u.password is None  # libpq reads PGPASSWORD, set from the same key as the server's
        # a dead connection is noticed within a minute, not after the kernel's defaults
        assert {"keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout"} <= set(u.query)
    postgres_password = next(e for e in pg["env"] if e["name"] == "POSTGRES_PASSWORD")
    replica_password = next(e for e in _container(_replicas())["env"] if e["name"] == "PGPASSWORD")
    assert postgres_password["valueFrom"] == replica_password["valueFrom"]


# ---------------------------------------------------------------- connections --


def _connections_per_replica(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> int:
    """The most connections one replica's engines may hold, read from the engines ISAGI builds
    (pointed at a port where nothing listens, so each is built and then fails to connect)."""
    import sqlalchemy
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool, QueuePool

    from isagi.errors import StorageError
    from isagi.session.dbstore import DatabaseSessionFiles
    from isagi.session.lease import AdvisoryLeases
    from isagi.storage.history import _engine_for

    url = "postgresql+psycopg://isagi@127.0.0.1:1/isagi?connect_timeout=2"
    built: list[sqlalchemy.engine.Engine] = []
    real = sqlalchemy.create_engine

    def recording(*args: Any, **kwargs: Any) -> sqlalchemy.engine.Engine:
        engine = real(*args, **kwargs)
        built.append(engine)
        return engine

    monkeypatch.setattr(sqlalchemy, "create_engine", recording)
    history = _engine_for(make_url(url))  # the history store's engine (HistoryStore)
    for make in (lambda: DatabaseSessionFiles(url, tmp_path), lambda: AdvisoryLeases(url)):
        with pytest.raises(StorageError):
            make()
    store, leases = built
    total = 0
    for engine in (history, store):
        assert isinstance(engine.pool, QueuePool)
        total += engine.pool.size() + engine.pool._max_overflow  # QueuePool's bound
    assert isinstance(leases.pool, NullPool)  # the lease keeps one connection of its own
    for engine in (history, store, leases):
        engine.dispose()
    return total + 1


def test_postgres_admits_every_replicas_connections(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    per_replica = _connections_per_replica(monkeypatch, tmp_path)
    assert per_replica == 31  # the figure docs/architecture.md and postgres.yaml state
    args = _container(_one("StatefulSet", "isagi-postgres"))["args"]
    settings = dict(a.split("=", 1) for a in args if "=" in a)
    replicas = _replicas()["spec"]["replicas"]
    assert int(settings["max_connections"]) >= replicas * per_replica + RESERVED
    # the server notices a vanished replica (and frees its leases) within a minute
    idle, interval, count = (int(settings[f"tcp_keepalives_{k}"]) for k in ("idle", "interval", "count"))
    assert idle + interval * count <= 60
