"""The compose profile ``replicas`` (docker/compose.yaml): N replicas of the CPU image, PostgreSQL
and HAProxy, wired as README "Several replicas" says. The YAML is read as Compose reads it
(defaults interpolated); the HAProxy config it mounts is checked by Debian's ``haproxy -c`` in
the mode compose runs it (replicas found by DNS), and the whole file by ``docker compose config``
where a Compose v2 is at hand (neither needs a Docker daemon)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_docker import (
    COMPOSE,
    _compose,
    _interpolate_defaults,
    _ports,
    _service_env,
    _settings_from,
    _volume_mounts,
)

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "docker" / "haproxy" / "haproxy.cfg"
IMAGE_CFG = "/usr/local/etc/haproxy/haproxy.cfg"  # where the official haproxy image reads it


def _profile(name: str) -> dict[str, dict]:
    return {k: v for k, v in _compose()["services"].items() if name in v.get("profiles", [])}


def test_the_profile_starts_replicas_postgres_and_haproxy() -> None:
    services = _profile("replicas")
    assert set(services) == {"isagi-replica", "postgres", "haproxy"}
    replica = services["isagi-replica"]
    assert replica["image"] == "isagi:cpu" and int(_interpolate_defaults(replica["deploy"]["replicas"])) >= 2
    assert "container_name" not in replica and not _ports(replica)  # scalable; reached through the balancer
    assert replica["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "/health" in " ".join(replica["healthcheck"]["test"])
    # the public images by default; ISAGI_HAPROXY_IMAGE / ISAGI_POSTGRES_IMAGE name local ones
    # (docker/build.sh haproxy|postgres, where Docker Hub cannot be reached)
    assert _interpolate_defaults(services["haproxy"]["image"]).startswith("haproxy:2.6")
    assert _interpolate_defaults(services["postgres"]["image"]).startswith("postgres:17")
    assert "ISAGI_HAPROXY_IMAGE" in services["haproxy"]["image"]
    assert "ISAGI_POSTGRES_IMAGE" in services["postgres"]["image"]


def test_every_replica_shares_the_history_and_the_sessions_on_postgres() -> None:
    services = _profile("replicas")
    env = _service_env(services["isagi-replica"])
    settings = _settings_from(env)
    assert settings.database_url == settings.sessions_url
    assert settings.sessions_url is not None and "@postgres:5432/" in settings.sessions_url
    pg = _service_env(services["postgres"])
    assert settings.sessions_url.endswith(f"/{pg['POSTGRES_DB']}") and f"//{pg['POSTGRES_USER']}:" in settings.sessions_url
    # SIGTERM drains within ISAGI_DRAIN_S; Docker's SIGKILL comes only after the grace period
    grace = services["isagi-replica"]["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > settings.drain_s + 5


def test_the_replicas_believe_only_the_balancers_forwarded_address() -> None:
    compose = _compose()
    lb = compose["services"]["haproxy"]
    address = _interpolate_defaults(lb["networks"]["replicas"]["ipv4_address"])
    subnet = _interpolate_defaults(compose["networks"]["replicas"]["ipam"]["config"][0]["subnet"])
    assert ipaddress.ip_address(address) in ipaddress.ip_network(subnet)
    settings = _settings_from(_service_env(compose["services"]["isagi-replica"]))
    assert settings.trusted_proxies == (address,)
    assert compose["services"]["isagi-replica"]["networks"] == ["replicas"]
    assert "replicas" in compose["services"]["postgres"]["networks"]


def test_haproxy_mounts_the_shipped_config_and_publishes_on_loopback() -> None:
    lb = _compose()["services"]["haproxy"]
    mounts = _volume_mounts(lb)
    assert (COMPOSE.parent / mounts[IMAGE_CFG]).resolve() == HAPROXY_CFG
    env = _service_env(lb)
    assert env["ISAGI_REPLICA_HOST"] == "isagi-replica"
    published = {target: (host, port) for host, port, target in _ports(lb)}
    assert published[env["ISAGI_LB_BIND"].rpartition(":")[2]][0] == "127.0.0.1"
    assert published[env["ISAGI_LB_STATS_BIND"].rpartition(":")[2]][0] == "127.0.0.1"


def _haproxy() -> str:
    exe = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(exe).exists():
        pytest.skip("no haproxy: `bash .ci/haproxy.sh` installs Debian's")
    return exe


def test_haproxy_accepts_the_config_as_compose_and_as_the_tests_run_it() -> None:
    exe = _haproxy()
    base = {k: v for k, v in os.environ.items() if not k.startswith("ISAGI_")}
    dns = {**base, **_service_env(_compose()["services"]["haproxy"])}
    listed = {**base, "ISAGI_REPLICA_1": "127.0.0.1:7861", "ISAGI_REPLICA_2": "127.0.0.1:7862"}
    for env in (dns, listed):
        check = subprocess.run([exe, "-c", "-f", str(HAPROXY_CFG)], env=env, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "[WARNING]" not in check.stdout + check.stderr, check.stdout + check.stderr


def _compose_v2() -> list[str] | None:
    for cmd in (["docker", "compose"], [str(ROOT / ".isagi" / "docker-tools" / "docker-compose")]):
        if shutil.which(cmd[0]) or Path(cmd[0]).exists():
            ok = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True)
            if ok.returncode == 0 and ok.stdout.strip().lstrip("v")[:1] >= "2":
                return cmd
    return None


def test_docker_compose_config_accepts_the_profile() -> None:
    cmd = _compose_v2()
    if cmd is None:
        pytest.skip("no Compose v2 here (docker/compose.sh fetches one; make docker-test runs it)")
    run = subprocess.run([*cmd, "-f", str(COMPOSE), "--profile", "replicas", "config", "--quiet"],
                         capture_output=True, text=True, cwd=COMPOSE.parent)
    assert run.returncode == 0, run.stderr


def test_haproxy_accepts_the_config_as_two_peered_balancers_and_names_a_wrong_peer() -> None:
    """ISAGI_LB_PEER_*: the API's stick table synced between two balancers (a "peers" section);
    each of lb1 and lb2 passes `haproxy -c` clean, and a name that is neither is reported (its
    table would silently stay unsynced)."""
    exe = _haproxy()
    base = {k: v for k, v in os.environ.items() if not k.startswith("ISAGI_")}
    peered = {**base, "ISAGI_REPLICA_1": "127.0.0.1:7861", "ISAGI_REPLICA_2": "127.0.0.1:7862",
              "ISAGI_LB_PEER_1": "127.0.0.1:10001", "ISAGI_LB_PEER_2": "127.0.0.1:10002"}
    for name in ("lb1", "lb2"):
        check = subprocess.run([exe, "-c", "-f", str(HAPROXY_CFG)], env={**peered, "ISAGI_LB_PEER_NAME": name},
                               capture_output=True, text=True)
        said = check.stdout + check.stderr
        assert check.returncode == 0 and "[WARNING]" not in said, said
    wrong = subprocess.run([exe, "-c", "-f", str(HAPROXY_CFG)], env={**peered, "ISAGI_LB_PEER_NAME": "lb3"},
                           capture_output=True, text=True)
    assert "no peer named 'lb3'" in wrong.stdout + wrong.stderr
    assert "peers isagi_balancers" in HAPROXY_CFG.read_text()
