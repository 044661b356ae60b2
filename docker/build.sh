#!/usr/bin/env bash
# Build an ISAGI image with the legacy builder, taking this machine's wheels
# where they fit:
#
#   docker/build.sh cpu    # docker/cpu.Dockerfile -> isagi:cpu
#   docker/build.sh gpu    # docker/Dockerfile     -> isagi:gpu
#   docker/build.sh haproxy   # docker/haproxy.Dockerfile  -> isagi-haproxy:bookworm
#   docker/build.sh postgres  # docker/postgres.Dockerfile -> isagi-postgres:bookworm
#
# (the last two: Debian's haproxy and postgresql-15 for docker/compose.yaml's replicas
# profile where Docker Hub cannot be reached; no wheels, BASE_IMAGE the local base.)
#
# Before the build, docker/wheels/ (the build context) gets
#   - torch's CPU build (cpu only): the wheel of the version installed in the
#     project's virtual environment, from PIP_FIND_LINKS (e.g. /opt/wheels);
#   - llama-cpp-python: the wheel of the installed version from PIP_FIND_LINKS,
#     else from pip's cache (pip keeps the wheel it compiled for `make install`),
#     else packed back from the virtual environment (docker/repack_wheel.py),
#     else built here with `pip wheel` (library only, as the Makefile builds it).
# docker/install-deps.sh installs a wheel from there when it fits the image's
# interpreter and falls back to the index and a source build otherwise. The
# llama-cpp-python wheel from pip's cache was compiled for this machine's CPU
# (`make install` builds with GGML_NATIVE on): the image then runs on CPUs with
# the same instruction sets. ISAGI_WHEELS=none builds without any of them
# (portable llama.cpp, compiled inside the build stage: many minutes).
#
# Settings (environment): BASE_IMAGE (default: the Dockerfile's own), TAG,
# TORCH_INDEX, ISAGI_VENV (default .venv). The build runs on the host's
# network (--network host): the daemon may have no bridge.
# Prints "build_s=<seconds> size_bytes=<bytes> image=<tag>" on the last line.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

flavor="${1:?usage: docker/build.sh cpu|gpu}"
case "$flavor" in
  cpu) dockerfile=docker/cpu.Dockerfile ;;
  gpu) dockerfile=docker/Dockerfile ;;
  haproxy | postgres) dockerfile="docker/$flavor.Dockerfile" ;;
  *) echo "build.sh: flavour is cpu, gpu, haproxy or postgres, not $flavor" >&2; exit 2 ;;
esac
# only ISAGI's own images take wheels from docker/wheels/
case "$flavor" in
  cpu | gpu) tag="${TAG:-isagi:$flavor}" with_wheels=true ;;
  *) tag="${TAG:-isagi-$flavor:bookworm}" with_wheels=false ;;
esac
venv="${ISAGI_VENV:-$root/.venv}"
py="$venv/bin/python"
wheels="$root/docker/wheels"
mkdir -p "$wheels"
keep=()  # the wheels of this build; others are removed, these keep their files (and mtimes)

# The Makefile's llama.cpp build: the library only (used when pip has to compile the wheel here).
LIBRARY_ONLY="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF"

installed() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null; }

if $with_wheels && [[ "${ISAGI_WHEELS:-host}" != none && -x "$py" ]]; then
  if [[ "$flavor" == cpu ]] && torch_v="$(installed torch)"; then
    for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
      for whl in "$dir"/torch-"$torch_v"-*.whl; do
        if [[ -f "$whl" ]]; then
          [[ -f "$wheels/${whl##*/}" ]] || ln "$whl" "$wheels/" 2>/dev/null || cp -p "$whl" "$wheels/"
          keep+=("${whl##*/}")
          echo "build: torch $torch_v from $whl" >&2
          break 2
        fi
      done
    done
  fi
  if llama_v="$(installed llama-cpp-python)"; then
    cached=""
    for dir in "$wheels" ${PIP_FIND_LINKS:-} /opt/wheels; do  # the one of the last build first
      for whl in "$dir"/llama_cpp_python-"$llama_v"-*.whl; do
        if [[ -f "$whl" && -z "$cached" ]]; then cached="$whl"; fi
      done
    done
    [[ -n "$cached" ]] ||
      cached="$("$py" -m pip cache list --format=abspath "llama_cpp_python-$llama_v-" 2>/dev/null | sed -n 1p || true)"
    if [[ -n "$cached" && -f "$cached" ]]; then
      [[ -f "$wheels/${cached##*/}" ]] || cp -p "$cached" "$wheels/"
      keep+=("${cached##*/}")
      echo "build: llama-cpp-python $llama_v from $cached" >&2
    elif repacked="$("$py" "$root/docker/repack_wheel.py" llama-cpp-python "$wheels")"; then
      keep+=("${repacked##*/}")
      echo "build: llama-cpp-python $llama_v repacked from $venv (pip's cache no longer has its wheel)" >&2
    elif CMAKE_ARGS="${CMAKE_ARGS:-$LIBRARY_ONLY}" "$py" -m pip wheel --no-deps "llama-cpp-python==$llama_v" -w "$wheels" >&2; then
      keep+=("$(cd "$wheels" && ls llama_cpp_python-"$llama_v"-*.whl | sed -n 1p)")
      echo "build: llama-cpp-python $llama_v from pip wheel" >&2
    else
      echo "build: no llama-cpp-python wheel: the image compiles llama.cpp" >&2
    fi
  fi
fi
for whl in "$wheels"/*.whl; do
  [[ -f "$whl" ]] && $with_wheels || continue
  [[ " ${keep[*]:-} " == *" ${whl##*/} "* ]] || rm -f "$whl"
done
if $with_wheels; then ls -l "$wheels" >&2; fi

args=(--network host -f "$dockerfile" -t "$tag")
[[ -n "${BASE_IMAGE:-}" ]] && args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
[[ -n "${TORCH_INDEX:-}" ]] && args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")

echo "build: docker build ${args[*]} ." >&2
start=$(date +%s)
DOCKER_BUILDKIT=0 docker build "${args[@]}" . >&2
build_s=$(( $(date +%s) - start ))
size="$(docker image inspect -f '{{ .Size }}' "$tag")"
echo "build: $tag built in $build_s s, $(( size / 1000000 )) MB" >&2
echo "build_s=$build_s size_bytes=$size image=$tag"
