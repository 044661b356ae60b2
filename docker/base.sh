#!/usr/bin/env bash
# Make the local base image of docker/cpu.Dockerfile and docker/Dockerfile,
# for machines that reach Debian's mirror and the package index but not
# Docker Hub: a Debian 12 (bookworm) root filesystem made with
# `debootstrap --variant=minbase` from this machine's own Debian mirror, with
# Python 3.11, venv, pip, CA certificates, tini and libgomp1, imported as an
# image (default isagi-base:bookworm; ISAGI_BASE_IMAGE names another).
#
# The machine's extra CA certificates (/usr/local/share/ca-certificates) are
# added to the image's bundle, and PIP_CERT points pip at it, so pip inside a
# build verifies the index through the same TLS proxy the host uses.
#
# Cached: the root filesystem is kept as a tarball under .isagi/docker-base/,
# named by a hash of everything that goes into it (packages, mirror, extra
# certificates, this script); an image with that hash as its label is reused
# as it is. Run as root (debootstrap). Prints the image name on the last line.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

image="${ISAGI_BASE_IMAGE:-isagi-base:bookworm}"
suite=bookworm
packages="python3,python3-venv,python3-pip,ca-certificates,tini,libgomp1,passwd"
cache_dir="${ISAGI_BASE_CACHE:-$root/.isagi/docker-base}"
certs_dir=/usr/local/share/ca-certificates

# The Debian mirror apt uses here (deb822 .sources or a classic list), else deb.debian.org.
mirror="$(
  { cat /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } |
    awk '!found && tolower($1) == "uris:" && $2 ~ /\/debian\/?$/ { print $2; found = 1 }'
)"
if [[ -z "$mirror" ]]; then
  mirror="$(
    { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } |
      awk '!found && $1 == "deb" && $2 !~ /^\[/ && $2 ~ /\/debian\/?$/ { print $2; found = 1 }'
  )"
fi
mirror="${ISAGI_DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}"

key="$(
  {
    echo "$suite $packages $mirror"
    cat "${BASH_SOURCE[0]}"
    find "$certs_dir" -type f -name '*.crt' -print0 2>/dev/null | sort -z | xargs -0r cat
  } | sha256sum | cut -c1-16
)"
tarball="$cache_dir/$suite-$key.tar"

if [[ "$(docker image inspect -f '{{ index .Config.Labels "isagi.base.key" }}' "$image" 2>/dev/null || true)" == "$key" ]]; then
  echo "base: $image is up to date (key $key)" >&2
  echo "$image"
  exit 0
fi

if [[ ! -s "$tarball" ]]; then
  if [[ "$(id -u)" -ne 0 ]]; then
    echo "base.sh: run as root (debootstrap)" >&2
    exit 1
  fi
  if ! command -v debootstrap >/dev/null 2>&1; then
    echo "base.sh: debootstrap is missing (apt-get install debootstrap)" >&2
    exit 1
  fi
  mkdir -p "$cache_dir"
  rootfs="$(mktemp -d "$cache_dir/rootfs.XXXXXX")"
  cleanup() {
    for m in proc sys dev/pts dev; do
      umount -l "$rootfs/$m" 2>/dev/null || true
    done
    rm -rf --one-file-system "$rootfs"
  }
  trap cleanup EXIT
  echo "base: debootstrap --variant=minbase $suite from $mirror (+ $packages)" >&2
  start=$(date +%s)
  debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >&2
  # The host's extra CA certificates, for pip (PIP_CERT) behind a TLS proxy.
  if compgen -G "$certs_dir/*.crt" >/dev/null; then
    mkdir -p "$rootfs$certs_dir"
    cp "$certs_dir"/*.crt "$rootfs$certs_dir/"
  fi
  chroot "$rootfs" update-ca-certificates >&2
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/tmp/* \
    "$rootfs"/var/log/*.log
  tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" \
    --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* .
  mv "$tarball.tmp" "$tarball"
  echo "base: root filesystem made in $(( $(date +%s) - start )) s: $tarball ($(du -h "$tarball" | cut -f1))" >&2
fi

start=$(date +%s)
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change "LABEL isagi.base.key=$key" \
  --change 'CMD ["/bin/bash"]' \
  "$tarball" "$image" >/dev/null
echo "base: imported $image in $(( $(date +%s) - start )) s (key $key)" >&2
echo "$image"
