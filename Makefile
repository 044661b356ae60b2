# Two commands do all set-up on a fresh machine:
#   make web    install ISAGI in .venv and open the browser app on the embedded model
#               (PORT=7861 / HOST=0.0.0.0 to listen elsewhere)
#   make test   install ISAGI with its test tools, start the test services (Chromium, HAProxy,
#               PostgreSQL), run every test but those of the three targets below (Open WebUI,
#               containers, profile rebuild)
#   make openwebui-test   install Open WebUI in .isagi/owui-venv (2.9 GB) and chat with ISAGI
#               through it in Chromium (tests/e2e/test_openwebui.py)
#   make docker-test      install Docker (Debian's docker.io) if missing, build the CPU image
#               (and the replicas profile's HAProxy and PostgreSQL images) from a local Debian
#               base and run the container tests, the replicas profile's failover included
#               (docker/test.sh)
#   make rebuild-test     calibrate the default backend's shipped profile again from scratch
#               and compare it with the shipped file (about 15 min; not in CI)
#   make docker-test-gpu  the same for the GPU image (not in CI: torch's CUDA build is several GB)
#
# TORCH pins the torch wheel installed *before* ISAGI. The default, 2.13.0, is
# the CPU build on the project's CI machines (a local wheel there). On a GPU
# box run `make web TORCH=torch` to let pip take its default CUDA build.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 7860
BIN := $(VENV)/bin
# llama-cpp-python (ISAGI's CPU engine) compiles llama.cpp when pip finds no
# wheel for this machine: build the library only, none of its tools, server,
# examples, tests or the multimodal library ISAGI does not use.
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
# llama.cpp compiles for this CPU (-march=native). Where the CPU reports Intel AMX
# but the virtual machine does not let a program use it (Firecracker VMs, such as
# the project's CI machines), ggml's AMX matrix multiply dies at the first
# decode with SIGILL; the AMX kernels are compiled out, the AVX-512 ones stay.
# (CMAKE_ARGS is split on spaces by the build backend, so the flags go in the
# compilers' own variables, which CMake reads on its first configure.)
ifeq ($(shell uname -m),x86_64)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export CFLAGS := $(strip $(CFLAGS) $(NO_AMX))
export CXXFLAGS := $(strip $(CXXFLAGS) $(NO_AMX))
endif
PIP := $(BIN)/pip install --progress-bar on
export ISAGI_TEST_HOME ?= $(CURDIR)/.isagi/test-home

.PHONY: install install-dev web test lint services docker-test docker-test-gpu openwebui-test rebuild-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	@echo "== 1/2 torch ($(TORCH))"
	$(PIP) "$(TORCH)"
	@echo "== 2/2 ISAGI and its dependencies (the first time, pip compiles llama.cpp: several minutes on 2 cores)"
	$(PIP) -e .

install-dev: $(BIN)/python
	@echo "== 1/2 torch ($(TORCH))"
	$(PIP) "$(TORCH)"
	@echo "== 2/2 ISAGI, its dependencies and the test tools (the first time, pip compiles llama.cpp: several minutes on 2 cores)"
	$(PIP) -e ".[dev]"

web: install
	$(BIN)/isagi web --host $(HOST) --port $(PORT)

# mypy reads its settings (the packages, strict for isagi.session, isagi.pipeline and storage)
# from pyproject.toml's [tool.mypy]
lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/mypy
	bash .ci/hadolint.sh

services:
	bash .ci/browser.sh
	bash .ci/haproxy.sh
	mkdir -p .isagi && bash .ci/postgres.sh > .isagi/postgres.env

test: install-dev services
	. ./.isagi/postgres.env && $(BIN)/python -m pytest -m "not docker and not openwebui and not rebuild" -p no:cacheprovider --durations=40

# The container tests' PostgreSQL is the one `make services` starts (idempotent).
docker-test: install-dev
	mkdir -p .isagi && bash .ci/postgres.sh > .isagi/postgres.env
	ISAGI_VENV=$(abspath $(VENV)) bash docker/test.sh cpu

# Open WebUI (a real chat front end) on ISAGI's OpenAI-compatible API, in Chromium. Open
# WebUI is installed in a virtual environment of its own (.ci/openwebui.sh: 2.9 GB with the
# CPU torch, about 5 minutes the first time), so it is not part of `make test`.
OWUI_VENV ?= .isagi/owui-venv
openwebui-test: install-dev
	bash .ci/browser.sh
	bash .ci/openwebui.sh $(abspath $(OWUI_VENV)) > /dev/null
	ISAGI_TEST_OPENWEBUI=$(abspath $(OWUI_VENV)) $(BIN)/python -m pytest -m openwebui -p no:cacheprovider \
		tests/e2e/test_openwebui.py

# The whole calibration of the default backend's shipped profile again, compared with the
# shipped file (isagi/profiles/README.md: run it after remaking a profile). About 15 min on
# 2 cores, so `make test` checks a sample of each profile's corpora instead.
rebuild-test: install-dev
	$(BIN)/python -m pytest -m rebuild -p no:cacheprovider tests/test_shipped_profiles.py

docker-test-gpu: install-dev
	ISAGI_VENV=$(abspath $(VENV)) bash docker/test.sh gpu
