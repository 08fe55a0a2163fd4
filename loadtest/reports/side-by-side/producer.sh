#!/usr/bin/env bash
# Target 4 of issue #24: the producer's insert rate into the relay's schema
# against the seed article's table, side by side on one durable cluster.
# Usage: producer.sh OUT_DIR SECONDS REPS NAME=OUTBOX_RELAY_BIN...
# Each NAME's schema is made by that binary's `migrate`; `seed` is
# loadtest/baseline/schema.sql. For each repetition and client count (8, 32)
# every variant runs in turn (the order reversed on even repetitions):
# TRUNCATE, CHECKPOINT, pgbench -n -M prepared -c N -j 4 -T SECONDS -f insert.sql.
set -euo pipefail
out=$1 secs=$2 reps=$3; shift 3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
port=${PORT:-55512} dir=$(mktemp -d /tmp/producer-side-XXXX)
"$root/loadtest/reports/producer-cost/cluster.sh" start "$dir" "$port"
trap '"$root/loadtest/reports/producer-cost/cluster.sh" stop "$dir" "$port"; rm -rf "$dir"' EXIT
url() { echo "postgres://postgres@127.0.0.1:$port/$1"; }
psqlq() { "$bin/psql" -X -q -v ON_ERROR_STOP=1 "$(url "$1")" -c "$2" >/dev/null; }
mkdir -p "$out"
variants=(seed)
psqlq postgres "CREATE DATABASE p_seed"
"$bin/psql" -X -q -v ON_ERROR_STOP=1 "$(url p_seed)" -f "$root/loadtest/baseline/schema.sql" >/dev/null
for v in "$@"; do
    name=${v%%=*} relay=${v#*=}
    psqlq postgres "CREATE DATABASE p_$name"
    DATABASE_URL=$(url "p_$name") "$relay" migrate >/dev/null
    variants+=("$name")
done
echo "variant clients rep tps avg_latency_ms load1_before indexes" > "$out/results.txt"
for rep in $(seq 1 "$reps"); do
  order=("${variants[@]}")
  if (( rep % 2 == 0 )); then
      order=(); for (( i=${#variants[@]}-1; i>=0; i-- )); do order+=("${variants[i]}"); done
  fi
  for clients in 8 32; do
    for variant in "${order[@]}"; do
      db=p_$variant
      psqlq "$db" "TRUNCATE outbox"
      psqlq "$db" "CHECKPOINT"
      load=$(cut -d' ' -f1 /proc/loadavg)
      indexes=$("$bin/psql" -X -At "$(url "$db")" -c "SELECT count(*) FROM pg_index WHERE indrelid = 'outbox'::regclass")
      "$bin/pgbench" -n -M prepared -c "$clients" -j 4 -T "$secs" -f "$here/insert.sql" "$(url "$db")" \
          > "$out/$variant-$clients-$rep.log" 2>&1
      tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$out/$variant-$clients-$rep.log")
      lat=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' "$out/$variant-$clients-$rep.log")
      echo "$variant $clients $rep $tps $lat $load $indexes" | tee -a "$out/results.txt"
    done
  done
done
