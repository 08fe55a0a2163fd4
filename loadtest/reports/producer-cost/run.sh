#!/usr/bin/env bash
# Producer throughput with the relay's schema, with and without its triggers.
# Usage: run.sh OUT_DIR [SECONDS] [REPS]; needs BEFORE_BIN (outbox-relay built
# from the commit before this change) and AFTER_BIN (this change).
set -euo pipefail
out=$1 secs=${2:-20} reps=${3:-2}
here=$(cd "$(dirname "$0")" && pwd)
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
port=55432 dir=$(mktemp -d /tmp/producer-cost-XXXX)
"$here/cluster.sh" start "$dir" $port
trap '"$here/cluster.sh" stop "$dir" $port; rm -rf "$dir"' EXIT
url() { echo "postgres://postgres@127.0.0.1:$port/$1"; }
psqlq() { "$bin/psql" -X -q -v ON_ERROR_STOP=1 "$(url "$1")" -c "$2" >/dev/null; }
mkdir -p "$out"
setup() { # variant database binary
    psqlq postgres "CREATE DATABASE $2"
    DATABASE_URL=$(url "$2") "$3" migrate >/dev/null
    psqlq "$2" "CREATE TABLE orders (id bigserial PRIMARY KEY, account_id int NOT NULL,
        amount_cents int NOT NULL, note text, created_at timestamptz NOT NULL DEFAULT now())"
    if [ "$1" = none ]; then
        psqlq "$2" "DROP TRIGGER IF EXISTS outbox_fill_defaults ON outbox;
                    DROP TRIGGER IF EXISTS outbox_notify ON outbox"
    fi
}
setup none   p_none   "$AFTER_BIN"
setup before p_before "$BEFORE_BIN"
setup after  p_after  "$AFTER_BIN"
setup after  p_probe  "$AFTER_BIN"
echo "variant clients rep tps avg_latency_ms load1" > "$out/results.txt"
for rep in $(seq 1 "$reps"); do
  for clients in 1 8 32; do
    for variant in none before after probe; do
      db=p_$variant
      psqlq "$db" "TRUNCATE orders, outbox"
      psqlq "$db" "CHECKPOINT"
      probe_pid=
      if [ $variant = probe ]; then
          "$bin/pgbench" -n -c 1 -R 1000 -T "$secs" -f "$here/probe.sql" "$(url $db)" \
              > "$out/listener-probe-$clients-$rep.log" 2>&1 &
          probe_pid=$!
      fi
      load=$(cut -d' ' -f1 /proc/loadavg)
      "$bin/pgbench" -n -M prepared -c "$clients" -j $(( clients < 4 ? clients : 4 )) \
          -T "$secs" -f "$here/producer.sql" "$(url $db)" > "$out/$variant-$clients-$rep.log" 2>&1
      [ -n "$probe_pid" ] && wait "$probe_pid"
      tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$out/$variant-$clients-$rep.log")
      lat=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' "$out/$variant-$clients-$rep.log")
      echo "$variant $clients $rep $tps $lat $load" | tee -a "$out/results.txt"
    done
  done
done
