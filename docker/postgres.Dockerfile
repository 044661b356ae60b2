#
# PostgreSQL for docker/compose.yaml's "postgres" and "replicas" profiles where Docker Hub cannot
# be reached: Debian 12's postgresql-15 on the local base image (docker/base.sh). Only what
# compose uses of the official image is kept (docker/postgres/entrypoint.sh): on a first start
# with an empty data directory (/var/lib/postgresql/data, a volume) it makes the cluster with
# POSTGRES_USER (the superuser), POSTGRES_PASSWORD (required) and POSTGRES_DB; it listens on
# every address of the container, password (scram-sha-256) required over TCP; `pg_isready` is
# on PATH for the healthcheck. The official image's init scripts and other variables are not.
#
#   docker/build.sh postgres   # -> isagi-postgres:bookworm, FROM isagi-base:bookworm
#   ISAGI_POSTGRES_IMAGE=isagi-postgres:bookworm docker compose ... --profile replicas up -d haproxy
#
# No BuildKit-only syntax: the legacy builder (Debian's docker.io) builds this file.

ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

# No "main" cluster from the package: the entrypoint makes the one in the volume. The postgres
# user has the official image's ids (999:999), made before the package would pick some.
# hadolint ignore=DL3008
RUN groupadd --system --gid 999 postgres \
 && useradd --system --uid 999 --gid postgres --home-dir /var/lib/postgresql --no-create-home \
      --shell /bin/bash postgres \
 && mkdir -p /etc/postgresql-common/createcluster.d \
 && echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.d/isagi.conf \
 && apt-get update \
 && apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/postgresql/data /run/postgresql \
 && chown postgres:postgres /var/lib/postgresql/data /run/postgresql \
 && chmod 700 /var/lib/postgresql/data

COPY docker/postgres/entrypoint.sh /usr/local/bin/isagi-postgres
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
# Docker copies this ownership into a fresh named volume on first mount.
USER 999:999
VOLUME ["/var/lib/postgresql/data"]
EXPOSE 5432
# SIGINT: PostgreSQL's fast shutdown (SIGTERM would wait for every client to leave)
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/isagi-postgres"]
