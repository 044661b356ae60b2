# Two commands do all set-up on a fresh machine:
#   make web    install ISAGI in .venv and open the browser app on the embedded model
#   make test   install ISAGI with its test tools, start the test services, run every test
#
# TORCH pins the torch wheel installed *before* ISAGI. The default, 2.13.0, is
# the CPU build on the project's CI machines (a local wheel there). On a GPU
# box run `make web TORCH=torch` to let pip take its default CUDA build.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
export ISAGI_TEST_HOME ?= $(CURDIR)/.isagi/test-home

.PHONY: install install-dev web test lint services

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .

install-dev: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"

web: install
	$(BIN)/isagi web

lint: install-dev
	$(BIN)/ruff check .
	bash .ci/hadolint.sh

services:
	bash .ci/browser.sh
	mkdir -p .isagi && bash .ci/postgres.sh > .isagi/postgres.env

test: install-dev services
	. ./.isagi/postgres.env && $(BIN)/python -m pytest -m "" -p no:cacheprovider
