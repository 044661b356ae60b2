#
# HAProxy for docker/compose.yaml's "replicas" profile where Docker Hub cannot be reached:
# Debian 12's haproxy package (2.6, the version of the default haproxy:2.6 image) on the local
# base image (docker/base.sh). It behaves as the official image does for this use: the config
# is mounted at /usr/local/etc/haproxy/haproxy.cfg, it runs in the foreground as the haproxy
# user (uid 990), and SIGUSR1 stops it gracefully.
#
#   docker/build.sh haproxy    # -> isagi-haproxy:bookworm, FROM isagi-base:bookworm
#   ISAGI_HAPROXY_IMAGE=isagi-haproxy:bookworm docker compose ... --profile replicas up -d haproxy
#
# No BuildKit-only syntax: the legacy builder (Debian's docker.io) builds this file.

ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

# The haproxy user gets fixed ids (990:990: a system user for adduser, which the official
# image's 99 is not), made before the package would pick some.
# hadolint ignore=DL3008
RUN groupadd --system --gid 990 haproxy \
 && useradd --system --uid 990 --gid haproxy --home-dir /var/lib/haproxy --no-create-home \
      --shell /usr/sbin/nologin haproxy \
 && apt-get update \
 && apt-get install -y --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /usr/local/etc/haproxy

USER 990:990
STOPSIGNAL SIGUSR1
# -W: master-worker (reloads on SIGUSR2); -db: foreground, logs to stdout as the config says
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
