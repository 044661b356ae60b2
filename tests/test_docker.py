"""Static checks of the Docker packaging: docker/cpu.Dockerfile (the CPU image),
docker/Dockerfile (the GPU image), docker/compose.yaml and .dockerignore.

The files are checked as text and as YAML, and what a container would run is
run outside Docker: the health check's command against a local HTTP server,
the images' and compose's settings through :func:`isagi.config.load_settings`,
and (marked ``model``) the CPU image's exact CMD and environment with
``ISAGI_HOME`` on a temporary directory until ``GET /health`` answers. The
images themselves are built and run by ``make docker-test``
(tests/test_docker_containers.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path, PurePosixPath

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = {"cpu": REPO / "docker" / "cpu.Dockerfile", "gpu": REPO / "docker" / "Dockerfile"}
INSTALL_DEPS = REPO / "docker" / "install-deps.sh"
COMPOSE = REPO / "docker" / "compose.yaml"
DOCKERIGNORE = REPO / ".dockerignore"
SOURCE_DIRS = ("isagi", "storage", "app")


# ---------------------------------------------------------------- parsing --


@dataclass
class Instr:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instrs: list[Instr] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instr]:
        return [i for i in self.instrs if i.keyword == keyword]

    def index(self, pred) -> int:
        for n, i in enumerate(self.instrs):
            if pred(i):
                return n
        return -1

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for i in self.all("ENV"):
            out.update(_env_pairs(i.args))
        return out


def _instructions(text: str) -> list[Instr]:
    """Dockerfile instructions with line continuations joined, comments dropped."""
    out: list[Instr] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        joined = " ".join(p for p in buf if p)
        buf = []
        keyword, _, args = joined.partition(" ")
        out.append(Instr(keyword.upper(), args.strip(), start))
    assert not buf, "the Dockerfile ends inside a line continuation"
    return out


def _env_pairs(args: str) -> dict[str, str]:
    parts = shlex.split(args)
    if parts and "=" not in parts[0]:  # legacy "ENV KEY value" form
        return {parts[0]: " ".join(parts[1:])}
    return dict(p.split("=", 1) for p in parts)


def _parse_dockerfile(flavor: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages of the ``flavor`` image's Dockerfile."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in _instructions(DOCKERFILES[flavor].read_text()):
        if ins.keyword == "FROM":
            words = ins.args.split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert ins.keyword == "ARG", f"line {ins.line}: only ARG may precede the first FROM"
            key, _, default = ins.args.partition("=")
            global_args[key] = default.strip('"')
        else:
            stages[-1].instrs.append(ins)
    return global_args, stages


def _exec_form(ins: Instr) -> list[str]:
    """A JSON (exec form) argument list; fails if the instruction uses shell form."""
    body = ins.args
    if ins.keyword == "HEALTHCHECK":
        body = re.sub(r"^(--\S+\s+)*", "", body)
        assert body.startswith("CMD "), f"HEALTHCHECK is not a CMD: {ins.args!r}"
        body = body[len("CMD ") :]
    try:
        argv = json.loads(body)
    except json.JSONDecodeError:
        pytest.fail(f"line {ins.line}: {ins.keyword} should use the JSON exec form, got {body!r}")
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def _stage(stages: list[Stage], name: str) -> Stage:
    found = [s for s in stages if s.name == name]
    assert found, f"no stage named {name!r} in {[s.name for s in stages]}"
    return found[0]


def _final_stage(stages: list[Stage]) -> Stage:
    return stages[-1]  # the default build target


def _image_cmd(stages: list[Stage]) -> list[str]:
    cmds = _final_stage(stages).all("CMD")
    assert cmds, "the final stage has no CMD"
    return _exec_form(cmds[-1])


def _image_env(flavor: str) -> dict[str, str]:
    """The ENV a container of the ``flavor`` image starts with (its final stage's)."""
    _, stages = _parse_dockerfile(flavor)
    return _final_stage(stages).env()


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interpolate_defaults(value: object) -> str:
    """Compose's ${VAR:-default} with nothing set in the environment."""
    return _INTERP.sub(lambda m: m.group(2) or "", str(value))


def _service_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: _interpolate_defaults(v) for k, v in env.items()}


def _ports(service: dict) -> list[tuple[str | None, str, str]]:
    """(host_ip, published, target) for each published port of a service."""
    out = []
    for p in service.get("ports") or []:
        if isinstance(p, dict):
            out.append((p.get("host_ip"), str(p.get("published")), str(p["target"])))
            continue
        parts = _interpolate_defaults(p).split("/")[0].rsplit(":", 2)
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
        elif len(parts) == 2:
            out.append((None, parts[0], parts[1]))
        else:
            out.append((None, "", parts[0]))
    return out


def _volume_mounts(service: dict) -> dict[str, str]:
    """target -> source of a service's volumes (short or long syntax)."""
    out = {}
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            out[v["target"]] = v.get("source", "")
        else:
            source, target = str(v).split(":")[:2]
            out[target] = source
    return out


# ------------------------------------------------------- health check fake --


class _Health(BaseHTTPRequestHandler):
    status = 200
    body: bytes = b'{"status": "ok"}'

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        code = self.status if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def _run_health_command(argv: list[str], status: int, body: bytes) -> int:
    """Run a health-check argv against a local fake /health on a free port given as the
    container's ISAGI_PORT; return its exit code."""
    handler = type("H", (_Health,), {"status": status, "body": body})
    server = HTTPServer(("127.0.0.1", 0), handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert argv[0] == "python", f"health check should run python, got {argv[0]!r}"
        assert "127.0.0.1:" in " ".join(argv) and "/health" in " ".join(argv)
        env = {**os.environ, "ISAGI_PORT": str(port)}
        return subprocess.run([sys.executable, *argv[1:]], capture_output=True, timeout=60,
                              env=env).returncode
    finally:
        server.shutdown()
        server.server_close()


def _assert_health_command_works(argv: list[str]) -> None:
    assert _run_health_command(argv, 200, b'{"status": "ok", "model": "x"}') == 0
    assert _run_health_command(argv, 200, b'{"status": "loading"}') != 0
    assert _run_health_command(argv, 503, b'{"status": "ok"}') != 0


# ------------------------------------------------------------ Dockerfiles --

FLAVORS = pytest.mark.parametrize("flavor", ["cpu", "gpu"])


def _resolve(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


@FLAVORS
def test_dockerfile_builds_with_the_legacy_builder_from_a_named_base(flavor: str) -> None:
    """No `# syntax=` line (BuildKit would fetch a frontend from Docker Hub), no BuildKit-only
    flags; every stage starts from BASE_IMAGE (the official image by default, a local base
    by build argument) or from an earlier stage of the same file."""
    text = DOCKERFILES[flavor].read_text()
    assert not re.search(r"^\s*#\s*syntax\s*=", text, re.M | re.I), "a # syntax= line needs BuildKit"
    global_args, stages = _parse_dockerfile(flavor)
    for st in stages:
        for ins in st.instrs:
            assert not re.search(r"--(mount|link|chmod|parents|exclude)\b", ins.args), (ins.line, ins.args)
            assert "<<" not in ins.args or ins.keyword != "RUN", f"line {ins.line}: a heredoc needs BuildKit"
    names = [st.name for st in stages]
    for n, st in enumerate(stages):
        assert st.base in ("${BASE_IMAGE}", "$BASE_IMAGE") or st.base in names[:n], st.base
    assert ":" in global_args["BASE_IMAGE"], "the default base image is not pinned to a tag"


def test_the_two_images_are_separate_files_and_cpu_never_names_cuda() -> None:
    """The legacy builder builds every stage of a file: the CPU file has nothing of the GPU's."""
    cpu_args, cpu_stages = _parse_dockerfile("cpu")
    text = DOCKERFILES["cpu"].read_text()
    assert "nvidia" not in text.lower() and not re.search(r"/whl/cu\d", text)
    # The CPU default base is Debian 12 with CPython 3.11: the interpreter and C library of
    # the local base (docker/base.sh) and of the host wheels docker/build.sh puts in the context.
    assert cpu_args["BASE_IMAGE"].startswith("python:3.11-") and "bookworm" in cpu_args["BASE_IMAGE"]
    assert "bookworm" in (REPO / "docker" / "base.sh").read_text()
    gpu_args, gpu_stages = _parse_dockerfile("gpu")
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?runtime-ubuntu\d+\.\d+", gpu_args["BASE_IMAGE"])
    assert m, f"the GPU base should be a pinned CUDA runtime image, got {gpu_args['BASE_IMAGE']!r}"
    # torch's index: the CUDA release of the base image for the GPU, the CPU index for the CPU
    for flavor, stages, expect in (("gpu", gpu_stages, f"/whl/cu{m.group(1)}{m.group(2)}"),
                                   ("cpu", cpu_stages, "/whl/cpu")):
        index = [a.args.partition("=")[2] for st in stages for a in st.all("ARG") if a.args.startswith("TORCH_INDEX=")]
        assert index == [f"https://download.pytorch.org{expect}"], (flavor, index)
        runs = [i.args for st in stages for i in st.all("RUN")]
        assert any(f"install-deps.sh {flavor}" in r for r in runs), (flavor, runs)


def test_install_deps_takes_wheels_from_the_context_and_falls_back_to_the_index() -> None:
    script = INSTALL_DEPS.read_text()
    assert "--no-index" in script and "--find-links" in script  # the context's wheels first
    assert "TORCH_INDEX" in script and "GGML_NATIVE=OFF" in script  # then the index, portable llama.cpp
    # The dependency layer reads pyproject.toml's dependencies and the postgres extra.
    assert "['dependencies']" in script and "['optional-dependencies']['postgres']" in script
    assert "pip\" check" in script
    r = subprocess.run(["sh", "-n", str(INSTALL_DEPS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@FLAVORS
def test_dockerfile_runs_as_non_root_user(flavor: str) -> None:
    _, stages = _parse_dockerfile(flavor)
    final = _final_stage(stages)
    users = final.all("USER")
    assert users, "the final stage never switches away from root"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1].args} is root"
    # The user is switched before the container's command is defined.
    assert final.index(lambda i: i.keyword == "USER") < final.index(lambda i: i.keyword == "CMD")


@FLAVORS
def test_dockerfile_cmd_is_the_web_app_on_all_interfaces(flavor: str) -> None:
    _, stages = _parse_dockerfile(flavor)
    argv = _image_cmd(stages)
    assert argv == ["isagi", "web"], argv
    env = _image_env(flavor)
    # `isagi web` reads where to listen from ISAGI_HOST / ISAGI_PORT
    assert env["ISAGI_HOST"] == "0.0.0.0"
    exposed = " ".join(i.args for i in _final_stage(stages).all("EXPOSE")).split()
    assert env["ISAGI_PORT"] in exposed, f"listens on {env['ISAGI_PORT']}, EXPOSE says {exposed}"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "isagi" in scripts
    # An ENTRYPOINT may only be a signal-forwarding init wrapper that execs CMD.
    for ep in _final_stage(stages).all("ENTRYPOINT"):
        wrapper = _exec_form(ep)
        assert Path(wrapper[0]).name == "tini" and wrapper[-1] == "--", wrapper


@FLAVORS
def test_dockerfile_healthcheck_hits_health_endpoint_and_works(flavor: str) -> None:
    _, stages = _parse_dockerfile(flavor)
    checks = _final_stage(stages).all("HEALTHCHECK")
    assert checks and "NONE" not in checks[-1].args.upper().split()
    argv = _exec_form(checks[-1])
    assert "ISAGI_PORT" in " ".join(argv), "the check asks the port the server was given"
    assert "--start-period=" in checks[-1].args, (
        "a first start with another model calibrates: needs a start period"
    )
    _assert_health_command_works(argv)


@FLAVORS
def test_dependencies_are_installed_before_the_source_is_copied(flavor: str) -> None:
    _, stages = _parse_dockerfile(flavor)
    for st in stages:
        for ins in st.all("COPY") + st.all("ADD"):
            srcs = [w for w in ins.args.split() if not w.startswith("--")][:-1]
            assert "." not in srcs and "./" not in srcs, (
                f"line {ins.line}: copies the whole context"
            )

    def copies(name: str):
        return lambda i: (
            i.keyword == "COPY"
            and any(PurePosixPath(w).parts[:1] == (name,) for w in i.args.split()[:-1])
        )

    # The build stage sees pyproject.toml, the installer and the wheels: never the source.
    build = _stage(stages, "build")
    assert build.index(copies("pyproject.toml")) >= 0
    assert all(build.index(copies(d)) < 0 for d in SOURCE_DIRS)
    final = _final_stage(stages)
    venv = final.index(lambda i: i.keyword == "COPY" and "--from=build" in i.args)
    first_source = min(final.index(copies(d)) for d in SOURCE_DIRS)
    project = final.index(
        lambda i: i.keyword == "RUN" and "pip install" in i.args and "--no-deps" in i.args
    )
    assert all(final.index(copies(d)) >= 0 for d in SOURCE_DIRS), "a package directory is never copied"
    assert 0 <= venv < first_source < project, (venv, first_source, project)
    # nothing after the project's install touches the dependencies
    assert not any("pip install" in i.args and "--no-deps" not in i.args
                   for i in final.instrs[project:] if i.keyword == "RUN")


def test_cpu_image_runs_the_embedded_model_on_the_cpu_and_gpu_image_nf4() -> None:
    cpu = _settings_from(_image_env("cpu"))
    assert cpu.model == "default" and cpu.device == "cpu" and cpu.backend == "llamacpp"
    gpu = _settings_from(_image_env("gpu"))
    assert gpu.quant == "nf4" and gpu.backend == "transformers" and gpu.device == "auto"


def _settings_from(env: dict[str, str]):
    from isagi.config import load_settings

    return load_settings({k: v for k, v in env.items() if k.startswith("ISAGI_")})


@FLAVORS
def test_image_keeps_data_and_hf_cache_on_volumes(flavor: str) -> None:
    _, stages = _parse_dockerfile(flavor)
    volumes: list[str] = []
    for ins in _final_stage(stages).all("VOLUME"):
        args = ins.args
        volumes += json.loads(args) if args.startswith("[") else args.split()
    env = _image_env(flavor)
    settings = _settings_from(env)
    for path in (
        settings.home,
        settings.sessions_dir,
        settings.models_dir,
        settings.profiles_dir,
        Path(env["HF_HOME"]),
    ):
        assert any(PurePosixPath(path).is_relative_to(v) for v in volumes), (
            f"{path} is not on a volume {volumes}"
        )
    assert settings.resolved_database_url == f"sqlite:///{settings.home}/history.sqlite3"
    assert str(settings.home) == "/data"


def test_dockerignore_lets_in_exactly_what_the_dockerfiles_copy() -> None:
    patterns = [
        p.strip()
        for p in DOCKERIGNORE.read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]

    def excluded(path: str) -> bool:
        verdict = False
        parts = PurePosixPath(path).parts
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        for pat in patterns:
            neg = pat.startswith("!")
            pat = pat.lstrip("!").rstrip("/")
            pat = pat[3:] if pat.startswith("**/") else pat
            if any(
                fnmatch(pre, pat) or fnmatch(PurePosixPath(pre).name, pat) and "/" not in pat
                for pre in prefixes
            ):
                verdict = not neg
        return verdict

    for flavor in DOCKERFILES:
        _, stages = _parse_dockerfile(flavor)
        for st in stages:
            for ins in st.all("COPY"):
                if "--from" in ins.args:
                    continue
                for src in [w for w in ins.args.split() if not w.startswith("--")][:-1]:
                    if src in SOURCE_DIRS:
                        src = f"{src}/__init__.py"
                    elif src == "docker/wheels":
                        src = "docker/wheels/torch-2-cp311-cp311-linux_x86_64.whl"
                    assert (REPO / src).exists() or src.endswith(".whl"), src
                    assert not excluded(src), src
    for junk in (
        ".venv/bin/python",
        ".git/HEAD",
        "isagi/__pycache__/x.pyc",
        "x.miku",
        "artifacts/a",
        "tests/test_docker.py",
        "model.safetensors",
        ".isagi/docker-base/bookworm.tar",
        "docker/compose.yaml",
    ):
        assert excluded(junk), f"{junk} would be sent to the build context"
    # README.md is the distribution's readme: the project install needs it.
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["readme"] == "README.md"
    assert not excluded("README.md")
    # the wheels are never committed, the directory is (a build without them still works)
    assert "docker/wheels/*.whl" in (REPO / ".gitignore").read_text().split()
    assert (REPO / "docker" / "wheels" / "README.md").is_file()


# ---------------------------------------------------------------- compose --


def test_compose_gpu_service_reserves_an_nvidia_gpu() -> None:
    svc = _compose()["services"]["isagi"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    gpus = [
        d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
    ]
    assert gpus, devices
    d = gpus[0]
    assert d.get("count") == "all" or int(d.get("count", 0)) >= 1 or d.get("device_ids")


def test_compose_builds_each_service_from_its_dockerfile_with_its_defaults() -> None:
    """The build arguments' defaults in compose are the Dockerfiles' own: they cannot drift."""
    services = _compose()["services"]
    for name, flavor in (("isagi", "gpu"), ("isagi-cpu", "cpu")):
        build = services[name]["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILES[flavor]
        global_args, stages = _parse_dockerfile(flavor)
        args = {k: _interpolate_defaults(v) for k, v in build["args"].items()}
        assert args["BASE_IMAGE"] == global_args["BASE_IMAGE"], (name, args)
        if "TORCH_INDEX" in args:
            index = [a.args.partition("=")[2] for st in stages for a in st.all("ARG")
                     if a.args.startswith("TORCH_INDEX=")]
            assert [args["TORCH_INDEX"]] == index, (name, args, index)
        assert services[name]["image"] == f"isagi:{flavor}"


def test_compose_keeps_data_and_model_cache_in_named_volumes() -> None:
    compose = _compose()
    env = _image_env("gpu")
    named = set(compose.get("volumes") or {})
    for name in ("isagi", "isagi-cpu"):
        mounts = _volume_mounts(compose["services"][name])
        for path in (env["ISAGI_HOME"], str(PurePosixPath(env["HF_HOME"]).parent)):
            assert path in mounts, f"{name}: nothing mounted at {path}"
            assert mounts[path] in named, f"{name}: {path} is not a named volume ({mounts[path]!r})"
    gpu_data = _volume_mounts(compose["services"]["isagi"])[env["ISAGI_HOME"]]
    cpu_data = _volume_mounts(compose["services"]["isagi-cpu"])[env["ISAGI_HOME"]]
    assert gpu_data != cpu_data, "the GPU and CPU services would share one SQLite database"


def test_compose_healthchecks_hit_health_endpoint_and_work() -> None:
    compose = _compose()
    for name in ("isagi", "isagi-cpu"):
        hc = compose["services"][name]["healthcheck"]
        test = hc["test"]
        assert isinstance(test, list) and test[0] == "CMD", test
        assert "start_period" in hc
        _assert_health_command_works(test[1:])
        # the image's own check, with Compose's timing
        _, stages = _parse_dockerfile("gpu" if name == "isagi" else "cpu")
        assert test[1:] == _exec_form(_final_stage(stages).all("HEALTHCHECK")[-1])


def test_compose_publishes_ports_on_loopback_only() -> None:
    compose = _compose()
    port = _image_env("cpu")["ISAGI_PORT"]
    assert port == _image_env("gpu")["ISAGI_PORT"]
    published = 0
    for name, svc in compose["services"].items():
        for host_ip, _, target in _ports(svc):
            published += 1
            assert host_ip == "127.0.0.1", (
                f"{name} publishes {target} on {host_ip or 'all interfaces'}"
            )
            if name.startswith("isagi"):
                assert target == port
    assert published >= 1
    assert any(h == "127.0.0.1" and p == "7860" for h, p, _ in _ports(compose["services"]["isagi"]))


def test_compose_postgres_is_optional_with_own_volume_and_healthcheck() -> None:
    compose = _compose()
    services = compose["services"]
    pg = services["postgres"]
    assert "postgres" in pg.get("profiles", [])
    assert ":" in pg["image"], "pin the postgres image tag"
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert not _ports(pg), "the database should not be published on the host"
    pg_volumes = set(_volume_mounts(pg).values())
    assert pg_volumes and pg_volumes <= set(compose["volumes"])
    for name in ("isagi", "isagi-cpu"):
        assert not pg_volumes & set(_volume_mounts(services[name]).values())
    # `docker compose up` without the profile must still work: the GPU
    # service may wait for postgres only as an optional dependency.
    dep = (services["isagi"].get("depends_on") or {}).get("postgres")
    if dep is not None:
        assert dep.get("required") is False and dep.get("condition") == "service_healthy"
    # Services outside a profile never depend on a profiled one unconditionally.
    assert "profiles" not in services["isagi"]
    assert services["isagi-cpu"]["profiles"] == ["cpu"]


def test_compose_settings_are_valid_isagi_settings() -> None:
    from isagi.config import Settings

    services = _compose()["services"]
    gpu_env = _service_env(services["isagi"])
    known = {f"ISAGI_{f.upper()}" for f in Settings.__dataclass_fields__}
    assert {k for k in gpu_env if k.startswith("ISAGI_")} <= known
    gpu = _settings_from(gpu_env)
    assert gpu.model == "Qwen/Qwen2.5-7B-Instruct"
    assert gpu.quant == "nf4" and gpu.device == "cuda"
    assert gpu.database_url is None  # empty default: SQLite in the data volume
    assert "ISAGI_DATABASE_URL" in gpu_env
    cpu = _settings_from(_service_env(services["isagi-cpu"]))
    assert cpu.model == "default" and cpu.device == "cpu"


# ------------------------------------------- the image's command, for real --


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_argv(image_argv: list[str]) -> list[str]:
    """The image's CMD with `isagi` resolved to this environment's console script."""
    script = Path(sys.executable).parent / image_argv[0]
    if script.exists():
        return [str(script), *image_argv[1:]]
    # Not pip-installed: call the same entry point the console script calls.
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][
        image_argv[0]
    ]
    module, func = target.split(":")
    code = f"import sys; from {module} import {func} as m; sys.argv[0] = {image_argv[0]!r}; sys.exit(m())"
    return [sys.executable, "-c", code, *image_argv[1:]]


@pytest.mark.model
def test_image_command_serves_a_healthy_app(tmp_path: Path) -> None:
    _, stages = _parse_dockerfile("cpu")
    argv = _image_cmd(stages)
    port = _free_port()

    home = tmp_path / "data"
    if shared := os.environ.get("ISAGI_TEST_HOME"):
        # Reuse the converted model and calibrated profile of this test run (a copy:
        # the server still writes only under its own temporary ISAGI_HOME).
        for sub in ("models", "profiles"):
            if (Path(shared) / sub).is_dir():
                shutil.copytree(Path(shared) / sub, home / sub)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISAGI_")}
    env.update({k: v for k, v in _image_env("cpu").items() if k != "PATH"})
    env.update(
        ISAGI_PORT=str(port),
        ISAGI_HOST="127.0.0.1",
        ISAGI_HOME=str(home),
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",  # the default model ships in a package: no downloads
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _local_argv(argv),
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        body = None
        deadline = time.monotonic() + 600  # first start converts the model and calibrates
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(
                    f"`{' '.join(argv)}` exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        body = json.load(r)
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        assert body is not None, f"/health never answered 200:\n{log_path.read_text()[-4000:]}"
        assert body.get("status") == "ok", body
        # The data directory is the one the image puts on its volume.
        assert home.is_dir() and any(home.iterdir()), "nothing was written under ISAGI_HOME"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
