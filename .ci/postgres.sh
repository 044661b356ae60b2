#!/usr/bin/env bash
# Start a throw-away PostgreSQL server on loopback for the `postgres` tests.
#
# Run as root. Idempotent: installs Debian's `postgresql` package only when it
# is missing, (re)uses the distribution's default cluster, starts it on
# 127.0.0.1, and creates the role and database only when they do not exist.
# The last line of stdout is a shell `export` of ISAGI_TEST_POSTGRES_URL, so
#   eval "$(.ci/postgres.sh | tail -n 1)"
# makes the URL available to pytest.
set -euo pipefail

PGUSER_NAME="${ISAGI_PG_USER:-isagi}"
PGPASS="${ISAGI_PG_PASSWORD:-isagi}"
PGDB="${ISAGI_PG_DB:-isagi_test}"
PGPORT="${ISAGI_PG_PORT:-5432}"

if [ "$(id -u)" -ne 0 ]; then
    echo "postgres.sh: run as root (it installs and starts a system service)" >&2
    exit 1
fi

if ! command -v pg_lsclusters >/dev/null 2>&1 || [ -z "$(ls /usr/lib/postgresql 2>/dev/null)" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends postgresql >&2
fi

PGVER="$(ls /usr/lib/postgresql | sort -V | tail -n 1)"
if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -x "$PGVER main" >/dev/null; then
    pg_createcluster "$PGVER" main --port "$PGPORT" >&2
fi

# Loopback only, password auth for TCP.
# (a conf.d drop-in overrides postgresql.conf; pg_conftool quoting is unreliable)
CONF_DIR="/etc/postgresql/$PGVER/main"
pg_conftool "$PGVER" main remove listen_addresses >&2 || true
mkdir -p "$CONF_DIR/conf.d"
printf "listen_addresses = '127.0.0.1'\nport = %s\n" "$PGPORT" > "$CONF_DIR/conf.d/isagi-ci.conf"

status="$(pg_lsclusters -h | awk -v v="$PGVER" '$1==v && $2=="main" {print $4}')"
if [ "$status" != "online" ]; then
    pg_ctlcluster "$PGVER" main start >&2
else
    pg_ctlcluster "$PGVER" main reload >&2
fi

for _ in $(seq 1 30); do
    if su postgres -c "pg_isready -q -h 127.0.0.1 -p $PGPORT"; then break; fi
    sleep 1
done
su postgres -c "pg_isready -h 127.0.0.1 -p $PGPORT" >&2

psql_admin() { su postgres -c "psql -v ON_ERROR_STOP=1 -qAt -p $PGPORT $*"; }

if [ "$(psql_admin "-c \"SELECT 1 FROM pg_roles WHERE rolname='$PGUSER_NAME'\"")" != "1" ]; then
    psql_admin "-c \"CREATE ROLE $PGUSER_NAME LOGIN PASSWORD '$PGPASS'\"" >&2
fi
if [ "$(psql_admin "-c \"SELECT 1 FROM pg_database WHERE datname='$PGDB'\"")" != "1" ]; then
    psql_admin "-c \"CREATE DATABASE $PGDB OWNER $PGUSER_NAME\"" >&2
fi

URL="postgresql+psycopg://$PGUSER_NAME:$PGPASS@127.0.0.1:$PGPORT/$PGDB"
echo "PostgreSQL $PGVER is up on 127.0.0.1:$PGPORT (database $PGDB)" >&2
echo "export ISAGI_TEST_POSTGRES_URL=$URL"
