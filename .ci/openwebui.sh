#!/usr/bin/env bash
# Install Open WebUI in a virtual environment of its own, for `make openwebui-test`
# (tests/e2e/test_openwebui.py: a real chat front end on ISAGI's OpenAI-compatible API).
#
# Idempotent: installs only when the environment has no working `open-webui`. Its
# torch is pinned first to the same CPU build as ISAGI's (TORCH), so pip does not
# fetch the multi-GB CUDA one; Open WebUI is pinned to the version the test was
# written against. Prints the environment's path (stdout) and its size.
set -euo pipefail

venv="${1:?usage: openwebui.sh VENV}"
python="${PYTHON:-python3}"
torch="${TORCH:-torch==2.13.0}"
version="${OPENWEBUI_VERSION:-0.12.4}"

if ! "$venv/bin/open-webui" --help >/dev/null 2>&1; then
    t0=$(date +%s)
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2
    "$venv/bin/pip" install -q "$torch" >&2
    "$venv/bin/pip" install -q "open-webui==$version" >&2
    echo "openwebui.sh: installed open-webui $version in $(( $(date +%s) - t0 )) s" >&2
fi
echo "openwebui.sh: $(du -sh "$venv" | cut -f1) in $venv" >&2
echo "$venv"
