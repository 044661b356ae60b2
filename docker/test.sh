#!/usr/bin/env bash
# `make docker-test` (cpu) and `make docker-test-gpu` (gpu): prove the images
# on this machine, from nothing.
#
#   1. installs Debian's docker.io and debootstrap when missing (services are
#      not started by the install);
#   2. starts dockerd when none answers (--iptables=false --bridge=none: the
#      containers and the builds use the host's network) and stops it at the
#      end, only if it started it;
#   3. makes the local base image (docker/base.sh, cached under .isagi/docker-base/);
#   4. builds the image (docker/build.sh) from that base, and for cpu also the HAProxy and
#      PostgreSQL images of docker/compose.yaml's replicas profile (docker/build.sh
#      haproxy|postgres: Debian's packages, Docker Hub's images cannot be pulled here);
#   5. runs the container tests (pytest -m docker tests/test_docker_containers.py, and for
#      cpu tests/test_docker_replicas.py: the replicas profile, failover through HAProxy),
#      with a Compose v2 from docker/compose.sh for the compose tests;
#   6. prints the figures: base, build time, image size, start to healthy, total.
#
# Run as root. ISAGI_VENV names the virtual environment with the test tools
# (default .venv, made by `make install-dev`).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
flavor="${1:-cpu}"
venv="${ISAGI_VENV:-$root/.venv}"
t0=$(date +%s)
mkdir -p .isagi
figures="$root/.isagi/docker-figures-$flavor.json"
rm -f "$figures"

# 1. packages --------------------------------------------------------------
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if ((${#need[@]})); then
  echo "== docker-test: apt-get install ${need[*]}"
  policy=""
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    # keep the package's init script from starting a daemon: this script starts its own
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    policy=/usr/sbin/policy-rc.d
  fi
  s=$(date +%s)
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  [[ -n "$policy" ]] && rm -f "$policy"
  echo "   installed in $(( $(date +%s) - s )) s"
fi

# 2. the daemon ------------------------------------------------------------
dockerd_pid=""
stop_dockerd() {
  if [[ -n "$dockerd_pid" ]]; then
    echo "== docker-test: stopping the dockerd it started (pid $dockerd_pid)"
    kill "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
  fi
}
trap stop_dockerd EXIT
if ! docker info >/dev/null 2>&1; then
  echo "== docker-test: starting dockerd (log: .isagi/dockerd.log)"
  dockerd --iptables=false --bridge=none >.isagi/dockerd.log 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { tail -n 20 .isagi/dockerd.log; exit 1; }
    sleep 1
  done
  docker info >/dev/null
fi
echo "   $(docker version -f 'daemon {{ .Server.Version }}, client {{ .Client.Version }}')"

# 3. the local base --------------------------------------------------------
echo "== docker-test: base image"
s=$(date +%s)
base="$(bash docker/base.sh | tail -n 1)"
base_s=$(( $(date +%s) - s ))

# 4. the image -------------------------------------------------------------
echo "== docker-test: build $flavor image"
if [[ "$flavor" == gpu ]]; then
  # torch's default build from PyPI (it carries CUDA); the CUDA index is not reachable here
  built="$(BASE_IMAGE="$base" TORCH_INDEX="${TORCH_INDEX:-https://pypi.org/simple}" ISAGI_VENV="$venv" \
    bash docker/build.sh gpu | tail -n 1)"
else
  built="$(BASE_IMAGE="$base" ISAGI_VENV="$venv" bash docker/build.sh cpu | tail -n 1)"
fi
eval "$built"  # build_s, size_bytes, image
side=""  # the replicas profile's HAProxy and PostgreSQL images (cpu), for the figures
if [[ "$flavor" == cpu ]]; then
  for part in haproxy postgres; do
    echo "== docker-test: build $part image"
    out="$(BASE_IMAGE="$base" bash docker/build.sh "$part" | tail -n 1)"
    part_s="${out#build_s=}" part_size="${out#*size_bytes=}" part_image="${out##*image=}"
    side+="   $part image ($part_image): built in ${part_s%% *} s, $(( ${part_size%% *} / 1000000 )) MB"$'\n'
    if [[ "$part" == haproxy ]]; then
      export ISAGI_DOCKER_HAPROXY_IMAGE="$part_image"
    else
      export ISAGI_DOCKER_POSTGRES_IMAGE="$part_image"
    fi
  done
fi

# 5. the container tests ---------------------------------------------------
echo "== docker-test: container tests ($image)"
if [[ -z "${ISAGI_TEST_POSTGRES_URL:-}" && -f .isagi/postgres.env ]]; then
  # shellcheck disable=SC1091
  . .isagi/postgres.env
fi
if [[ "$flavor" == gpu ]]; then
  export ISAGI_DOCKER_GPU_IMAGE="$image"
  select=(-k gpu_image)
else
  export ISAGI_DOCKER_IMAGE="$image"
  select=(-k "not gpu_image")
fi
files=(tests/test_docker_containers.py)
if [[ "$flavor" == cpu ]]; then
  files+=(tests/test_docker_replicas.py)
  # Compose v2 for the compose tests (.isagi/docker-tools/ unless one is installed)
  ISAGI_VENV="$venv" bash docker/compose.sh >/dev/null || echo "   no Compose v2: the compose tests will say so"
fi
s=$(date +%s)
rc=0
ISAGI_DOCKER_FIGURES="$figures" "$venv/bin/python" -m pytest -m docker -p no:cacheprovider -v -rs \
  "${select[@]}" "${files[@]}" || rc=$?
tests_s=$(( $(date +%s) - s ))

# 6. the figures -----------------------------------------------------------
echo "== docker-test ($flavor) figures"
echo "   base image ($base):     ${base_s} s"
echo "   image build ($image):  ${build_s} s"
echo "   image size:              $(( size_bytes / 1000000 )) MB"
printf '%s' "$side"
if [[ -f "$figures" ]]; then
  "$venv/bin/python" - "$figures" <<'EOF'
import json, sys
for key, value in json.load(open(sys.argv[1])).items():
    print(f"   {key + ':':<24} {value}")
EOF
fi
echo "   container tests:         ${tests_s} s (pytest exit $rc)"
echo "   total:                   $(( $(date +%s) - t0 )) s"
exit "$rc"
