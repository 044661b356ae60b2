#!/bin/sh
# Install ISAGI's dependencies into /opt/venv: run by the build stage of
# docker/cpu.Dockerfile (`install-deps.sh cpu`) and docker/Dockerfile
# (`install-deps.sh gpu`), with /tmp/build/pyproject.toml and the context's
# docker/wheels/ at /tmp/wheels. Nothing of the source tree is needed, so this
# layer is rebuilt only when pyproject.toml or a wheel changes.
#
#   torch             cpu: a wheel from /tmp/wheels that fits this interpreter
#                     (docker/build.sh puts the machine's CPU wheel there), else
#                     TORCH_INDEX (the CPU index); gpu: always TORCH_INDEX.
#   llama-cpp-python  a wheel from /tmp/wheels that fits (docker/build.sh copies
#                     the one pip built on the host), else compiled here from
#                     source with portable CPU code (GGML_NATIVE=OFF), the
#                     library only; the compilers stay in the build stage.
#   the rest          pyproject.toml's dependencies and the postgres extra, from
#                     the package index.
set -eu

flavor="${1:?usage: install-deps.sh cpu|gpu}"
wheels=/tmp/wheels
pip="/opt/venv/bin/pip"
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# The project's build backend, so that the source install of the app stage
# needs no download (pip install --no-build-isolation).
"$pip" install "setuptools>=69" wheel

# 1. torch. --no-deps: its own requirements (sympy, ...) are resolved with the rest in step 3.
if [ "$flavor" = cpu ] && "$pip" install --no-index --no-deps --find-links "$wheels" torch; then
    echo "install-deps: torch from the build context's wheels"
else
    "$pip" install --index-url "${TORCH_INDEX:?}" "torch>=2.4"
fi

# 2. llama-cpp-python.
llama_req="$(python3 -c "import tomllib; d = tomllib.load(open('/tmp/build/pyproject.toml', 'rb'))['project']['dependencies']; print(next(x for x in d if x.startswith('llama-cpp-python')))")"
if "$pip" install --no-index --no-deps --find-links "$wheels" "$llama_req"; then
    echo "install-deps: llama-cpp-python from the build context's wheels"
else
    echo "install-deps: no llama-cpp-python wheel for this interpreter in docker/wheels: compiling llama.cpp (many minutes)"
    if ! command -v cmake >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then
        apt-get update
        apt-get install -y --no-install-recommends build-essential cmake
    fi
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF" \
        "$pip" install --no-deps "$llama_req"
fi

# 3. Everything else pyproject.toml lists (torch and llama-cpp-python are
#    installed and satisfy their lines, so pip keeps them), with the postgres extra.
python3 -c "import tomllib; p = tomllib.load(open('/tmp/build/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['postgres']))" > /tmp/build/requirements.txt
"$pip" install -r /tmp/build/requirements.txt
"$pip" check
