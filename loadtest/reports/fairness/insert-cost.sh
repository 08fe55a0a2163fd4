#!/usr/bin/env bash
# What outbox_tenant_ready_idx (migration 0013) costs the producer: the same
# schema with and without it, on a throwaway cluster with production-like
# durability (../producer-cost/cluster.sh).
#  1. EXPLAIN ANALYZE of a 100,000-row INSERT ... SELECT into an empty outbox
#     (CPU and buffer cost per row, no commit wait), REPS runs per variant;
#  2. pgbench: a business row and an outbox row per transaction, 8 clients,
#     SECONDS per run, REPS runs per variant, interleaved.
# Usage: insert-cost.sh OUT_DIR RELAY_BIN [SECONDS] [REPS]
set -euo pipefail
out=$1 relay=$2 secs=${3:-15} reps=${4:-3}
here=$(cd "$(dirname "$0")" && pwd)
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
port=55433 dir=$(mktemp -d /tmp/fairness-insert-XXXX)
"$here/../producer-cost/cluster.sh" start "$dir" $port
trap '"$here/../producer-cost/cluster.sh" stop "$dir" $port; rm -rf "$dir"' EXIT
url() { echo "postgres://postgres@127.0.0.1:$port/$1"; }
psqlq() { "$bin/psql" -X -q -v ON_ERROR_STOP=1 "$(url "$1")" -c "$2" >/dev/null; }
mkdir -p "$out"
setup() { # database, with the index or not
    psqlq postgres "CREATE DATABASE $1"
    DATABASE_URL=$(url "$1") "$relay" migrate >/dev/null
    psqlq "$1" "CREATE TABLE orders (id bigserial PRIMARY KEY, account_id int NOT NULL,
        amount_cents int NOT NULL, note text, created_at timestamptz NOT NULL DEFAULT now())"
    [ "$2" = without ] && psqlq "$1" "DROP INDEX outbox_tenant_ready_idx"
    return 0
}
setup without_idx without
setup with_idx with
bulk="EXPLAIN (ANALYZE, BUFFERS) INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id,
    event_type, payload, idempotency_key)
  SELECT ('00000000-0000-0000-0000-0000000000' || lpad((i % 20)::text, 2, '0'))::uuid, 'order',
    i::text, 'order.placed', '{\"orderId\": \"o-1\", \"totalCents\": 1299}', 'k-' || i
  FROM generate_series(1, 100000) AS i"
echo "variant rep insert_ms_per_100k" > "$out/bulk.txt"
for rep in $(seq 1 "$reps"); do
  for v in without_idx with_idx; do
    psqlq "$v" "TRUNCATE orders, outbox"
    psqlq "$v" "CHECKPOINT"
    ms=$("$bin/psql" -X -q -At "$(url $v)" -c "$bulk" | sed -n 's/^Execution Time: \([0-9.]*\) ms/\1/p')
    echo "$v $rep $ms" | tee -a "$out/bulk.txt"
  done
done
echo "variant clients rep tps avg_latency_ms load1" > "$out/pgbench.txt"
for rep in $(seq 1 "$reps"); do
  for v in without_idx with_idx; do
    psqlq "$v" "TRUNCATE orders, outbox"
    psqlq "$v" "CHECKPOINT"
    load=$(cut -d' ' -f1 /proc/loadavg)
    "$bin/pgbench" -n -M prepared -c 8 -j 4 -T "$secs" -f "$here/producer.sql" "$(url $v)" \
        > "$out/$v-8-$rep.log" 2>&1
    tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$out/$v-8-$rep.log")
    lat=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' "$out/$v-8-$rep.log")
    echo "$v 8 $rep $tps $lat $load" | tee -a "$out/pgbench.txt"
  done
done
