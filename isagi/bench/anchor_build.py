"""llama.cpp's own ``llama-server``, built once from the source llama-cpp-python vendors.

Owns the binary ``isagi bench serve`` measures ISAGI against (the anchor): the
llama.cpp that ISAGI's engine runs (llama-cpp-python's ``vendor/llama.cpp``,
taken from that package's source distribution on PyPI, of the installed
version), compiled as the project's Makefile compiles llama-cpp-python (for this
CPU, with Intel AMX compiled out on x86-64, where a virtual machine may refuse
it), only the ``llama-server`` target, linked statically. The binary is kept
under the data directory, one per llama-cpp-python version
(:func:`cached_path`), so it is built once; ``--anchor PATH`` names one built
elsewhere instead. Nothing of the source is kept: it is unpacked in a temporary
directory and removed after the build.

The build's own output goes to stderr as it runs (configure and compile take
minutes on two cores), so ``--json`` keeps stdout to its one object.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from isagi.errors import AnchorError

PACKAGE = "llama-cpp-python"
BINARY = "llama-server"
# The Makefile's NO_AMX: ggml's AMX kernels die with SIGILL where the CPU reports AMX but the
# virtual machine does not let a program use it; the AVX-512 ones stay.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The server and what it needs, nothing else: no examples, tests, web UI (its assets would be
# downloaded from Hugging Face), HTTPS (the anchor answers on loopback) or shared libraries
# (one self-contained binary to cache).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
)


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (the anchor is built from its source)."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        raise AnchorError(f"{PACKAGE} is not installed, so there is no llama.cpp to build the anchor from; "
                          f"install ISAGI's dependencies (make install), or pass --anchor PATH to a llama-server.") from None


def cached_path(home: Path, version: str | None = None) -> Path:
    """Where the anchor built from llama-cpp-python ``version`` (default: the installed one) is kept."""
    return home / "anchor" / f"{PACKAGE}-{version or llama_cpp_version()}" / BINARY


def compiler_env() -> dict[str, str]:
    """The environment of the build: the Makefile's AMX-off flags added to CFLAGS and CXXFLAGS on x86-64."""
    env = dict(os.environ)
    if platform.machine() in ("x86_64", "AMD64"):
        for var in ("CFLAGS", "CXXFLAGS"):
            env[var] = f"{env.get(var, '')} {NO_AMX}".strip()
    return env


def ensure(home: Path, anchor: Path | None = None, *, jobs: int = 2,
           say: Callable[[str], None] | None = None) -> Path:
    """The anchor binary: ``anchor`` when given (it must exist), else the cached build of the
    installed llama-cpp-python under ``home``, built first when missing."""
    if anchor is not None:
        anchor = anchor.expanduser()
        if not (anchor.is_file() and os.access(anchor, os.X_OK)):
            raise AnchorError(f"--anchor {anchor}: no executable file there; give the path of a built llama-server, "
                              "or leave --anchor out to build one.")
        return anchor
    target = cached_path(home)
    if target.is_file():
        return target
    return build(target, llama_cpp_version(), jobs=jobs, say=say)


def _need(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise AnchorError(f"building the anchor (llama-server) needs {tool}; install it (e.g. apt-get install "
                          f"cmake g++), or pass --anchor PATH to a built llama-server.")
    return found


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], what: str) -> None:
    """``cmd``, its output through to stderr; an :class:`AnchorError` naming ``what`` if it fails."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=sys.stderr, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise AnchorError(f"building the anchor failed at {what} (exit status {proc.returncode}; its output is "
                          f"above); pass --anchor PATH to a llama-server built by hand instead.")


def _unpack_vendor(sdist: Path, into: Path) -> Path:
    """The sdist's ``vendor/llama.cpp`` unpacked under ``into``; its path."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        if not members:
            raise AnchorError(f"{sdist.name} holds no vendor/llama.cpp; pass --anchor PATH to a built llama-server.")
        tar.extractall(into, members=members, filter="data")
    return next(into.glob("*/vendor/llama.cpp"))


def build(target: Path, version: str, *, jobs: int = 2, say: Callable[[str], None] | None = None) -> Path:
    """Download llama-cpp-python ``version``'s source from PyPI (pip), build its vendored
    llama.cpp's ``llama-server`` and install it at ``target``; ``target``."""
    tell = say or (lambda line: print(line, file=sys.stderr, flush=True))
    cmake = _need("cmake")
    _need("c++")
    env = compiler_env()
    with tempfile.TemporaryDirectory(prefix="isagi-anchor-") as tmp:
        work = Path(tmp)
        tell(f"anchor: downloading the source of {PACKAGE} {version} (pip download)")
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              "--progress-bar", "off", "-d", str(work), f"{PACKAGE}=={version}"], cwd=work, env=env,
             what="pip download")
        sdist = next(iter(sorted(work.glob("*.tar.gz"))), None)
        if sdist is None:
            raise AnchorError(f"pip found no source distribution of {PACKAGE} {version}; pass --anchor PATH "
                              "to a built llama-server.")
        source = _unpack_vendor(sdist, work / "src")
        build_dir = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        tell(f"anchor: configuring llama.cpp ({' '.join(CMAKE_OPTIONS)}; CXXFLAGS={env.get('CXXFLAGS', '')!r})")
        _run([cmake, "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_OPTIONS], cwd=work, env=env,
             what="cmake's configure")
        tell(f"anchor: compiling {BINARY} with {jobs} jobs (minutes on two cores)")
        _run([cmake, "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", BINARY],
             cwd=work, env=env, what="the compile")
        built = build_dir / "bin" / BINARY
        if not built.is_file():
            raise AnchorError(f"the build made no {built}; pass --anchor PATH to a built llama-server.")
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f".{BINARY}.{os.getpid()}.part")
        try:
            shutil.copy2(built, part)
            os.replace(part, target)  # whole or absent, also beside another build of the same
        finally:
            with contextlib.suppress(OSError):
                part.unlink()
    tell(f"anchor: {target}")
    return target
