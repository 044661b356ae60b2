#!/bin/sh
# Entrypoint of docker/postgres.Dockerfile: what docker/compose.yaml needs of the official
# postgres image's. On a first start (no PG_VERSION in PGDATA) make the cluster: POSTGRES_USER
# (default postgres) is its superuser with POSTGRES_PASSWORD (required), POSTGRES_DB (default
# the user's name) is created, and clients from any address must give the password
# (scram-sha-256; the local socket trusts, as the official image's does). Then run the server
# in the foreground, listening on every address; arguments are passed on to it.
set -eu

PGDATA="${PGDATA:-/var/lib/postgresql/data}"
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "isagi-postgres: set POSTGRES_PASSWORD (the password of $user)" >&2
    exit 1
  fi
  pwfile="$(mktemp)"
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    # single-user mode: no server to start and stop for one statement
    echo "CREATE DATABASE \"$db\" OWNER \"$user\"" | postgres --single -D "$PGDATA" -jE postgres >/dev/null
  fi
  echo "isagi-postgres: made the cluster in $PGDATA (superuser $user, database $db)"
fi

exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
