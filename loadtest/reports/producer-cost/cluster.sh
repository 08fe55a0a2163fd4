#!/usr/bin/env bash
# A throwaway PostgreSQL cluster with production-like durability: fsync,
# synchronous_commit and full_page_writes on, autovacuum on, 512MB of
# shared_buffers. Usage: cluster.sh start|stop DIR PORT; EXTRA_OPTS adds
# server options (`-c name=value ...`).
set -euo pipefail
cmd=$1 dir=$2 port=$3
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
case $cmd in
start)
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres: "$dir"
    as_pg "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >/dev/null
    opts="-c listen_addresses=127.0.0.1 -p $port -k $dir"
    opts+=" -c fsync=on -c synchronous_commit=on -c full_page_writes=on"
    opts+=" -c shared_buffers=512MB -c max_connections=200"
    opts+=" -c max_wal_size=1GB -c checkpoint_timeout=15min"
    opts+=" -c autovacuum=on -c wal_level=replica ${EXTRA_OPTS:-}"
    as_pg "$bin/pg_ctl" -D "$dir/data" -w -l "$dir/server.log" -o "$opts" start >/dev/null
    ;;
stop)
    as_pg "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
    ;;
esac
