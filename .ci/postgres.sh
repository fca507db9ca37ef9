#!/usr/bin/env bash
# Start the PostgreSQL server the tuning-DB tests use: 127.0.0.1:5432, role kilnx/kilnx, database kilnx.
# Idempotent: every step checks before it acts, so running it twice (or while tests run) is harmless.
# We run as root in CI containers without systemd, so the Debian cluster tools (pg_ctlcluster) drive the
# server directly; if the distribution's cluster cannot be used we fall back to a private data dir in /tmp.
set -euo pipefail

PORT=5432
ROLE=kilnx
PASSWORD=kilnx
DATABASE=kilnx
FALLBACK_DATA=/tmp/kilnx-pg-data
FALLBACK_LOG=/tmp/kilnx-pg.log

log() { echo "[postgres.sh] $*"; }

as_postgres() { runuser -u postgres -- "$@"; }

newest_pg_bin() {
    local dir
    dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
    [[ -n "$dir" && -x "$dir/initdb" ]] && echo "$dir"
}

accepting() { pg_isready -q -h 127.0.0.1 -p "$PORT" >/dev/null 2>&1; }

wait_until_accepting() {
    for _ in $(seq 1 60); do
        accepting && return 0
        sleep 0.5
    done
    log "the server on 127.0.0.1:$PORT did not accept connections within 30 s"
    [[ -f "$FALLBACK_LOG" ]] && tail -n 20 "$FALLBACK_LOG"
    tail -n 20 /var/log/postgresql/*.log 2>/dev/null || true
    return 1
}

# 1. Install the server from Debian if it is missing.
if [[ -z "$(newest_pg_bin)" ]] || ! command -v pg_isready >/dev/null; then
    log "installing PostgreSQL from Debian"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq postgresql >/dev/null
fi
PG_BIN=$(newest_pg_bin)
PG_VERSION=$(basename "$(dirname "$PG_BIN")")

# 2. Start a server on 127.0.0.1:$PORT unless one already answers there.
if ! accepting; then
    mkdir -p /var/run/postgresql && chown postgres:postgres /var/run/postgresql
    started=no
    if command -v pg_ctlcluster >/dev/null; then
        # The package normally creates cluster "main" on 5432; create it when the image skipped that step.
        cluster=$(pg_lsclusters -h 2>/dev/null | awk -v v="$PG_VERSION" -v p="$PORT" '$1 == v && $3 == p {print $2; exit}')
        if [[ -z "$cluster" ]] && ! pg_lsclusters -h 2>/dev/null | awk -v p="$PORT" '$3 == p {f=1} END {exit !f}'; then
            log "creating cluster $PG_VERSION/main on port $PORT"
            pg_createcluster "$PG_VERSION" main --port "$PORT" >/dev/null && cluster=main
        fi
        if [[ -n "$cluster" ]]; then
            log "starting cluster $PG_VERSION/$cluster"
            # "already running" (exit 2) is fine: another run of this script got there first.
            pg_ctlcluster "$PG_VERSION" "$cluster" start || true
            wait_until_accepting && started=yes
        fi
    fi
    if [[ "$started" == no ]]; then
        log "starting a private server with data dir $FALLBACK_DATA"
        if [[ ! -f "$FALLBACK_DATA/PG_VERSION" ]]; then
            rm -rf "$FALLBACK_DATA"
            mkdir -p "$FALLBACK_DATA" && chown postgres:postgres "$FALLBACK_DATA"
            as_postgres "$PG_BIN/initdb" -D "$FALLBACK_DATA" -U postgres --auth-local=peer \
                --auth-host=scram-sha-256 >/dev/null
        fi
        touch "$FALLBACK_LOG" && chown postgres:postgres "$FALLBACK_LOG"
        as_postgres "$PG_BIN/pg_ctl" -D "$FALLBACK_DATA" -l "$FALLBACK_LOG" -w \
            -o "-p $PORT -c listen_addresses=127.0.0.1 -k /var/run/postgresql" start >/dev/null
        wait_until_accepting
    fi
fi

# 3. Role and database (checked first so reruns do nothing).
psql_admin() { as_postgres psql -h /var/run/postgresql -p "$PORT" -v ON_ERROR_STOP=1 -qtAX "$@"; }
if [[ "$(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")" != 1 ]]; then
    log "creating role $ROLE"
    psql_admin -c "CREATE ROLE $ROLE LOGIN PASSWORD '$PASSWORD'"
fi
if [[ "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = '$DATABASE'")" != 1 ]]; then
    log "creating database $DATABASE"
    psql_admin -c "CREATE DATABASE $DATABASE OWNER $ROLE"
fi

# 4. Prove that the URL the tests use works (password auth over TCP, not just the admin socket).
PGPASSWORD=$PASSWORD psql -h 127.0.0.1 -p "$PORT" -U "$ROLE" -d "$DATABASE" -qtAX -c "SELECT 1" >/dev/null
log "ready: postgresql+psycopg://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DATABASE"
