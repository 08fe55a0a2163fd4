#!/usr/bin/env bash
# Target 3 of issue #24: what a claim costs, and what an idle relay burns,
# while 20,000 keys are held for QStash's delivery callbacks.
# Usage: [CONFIG=…] [WAIT=seconds] claim-held.sh OUT_DIR LOADTEST_BIN REPS NAME=OUTBOX_RELAY_BIN...
# On one durable cluster with pg_stat_statements, for each repetition and
# relay (the order reversed on even repetitions): `loadtest run
# config/loadtest/claim-held-20k.toml` (or $CONFIG) with that relay; 12 s
# (or $WAIT) after the relay starts (every key's first event is out, every key waits 40 s for its
# callback) the statement statistics are reset; 20 s later the script reads
# them, with the CPU the relay process and the run database's backends used
# in those 20 s; then it stops the run (the rest of the drain is not needed).
set -euo pipefail
out=$1 loadtest=$2 reps=$3; shift 3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
port=${PORT:-55513} dir=$(mktemp -d /tmp/claim-held-XXXX)
config=${CONFIG:-$root/config/loadtest/claim-held-20k.toml} wait=${WAIT:-12}
cluster="$root/loadtest/reports/producer-cost/cluster.sh"
EXTRA_OPTS="-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all -c max_connections=300" \
    "$cluster" start "$dir" "$port"
trap '"$cluster" stop "$dir" "$port"; rm -rf "$dir"' EXIT
url="postgres://postgres@127.0.0.1:$port/postgres"
q() { "$bin/psql" -X -q -At -v ON_ERROR_STOP=1 "$url" -c "$1"; }
q "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
tck=$(getconf CLK_TCK)
ticks() { local t=0 p; for p in "$@"; do
    [ -r "/proc/$p/stat" ] && t=$(( t + $(awk '{print $14 + $15}' "/proc/$p/stat") )); done; echo $t; }
mkdir -p "$out"
echo "relay rep window_s relay_cpu_s backends_cpu_s load1" > "$out/results.txt"
for rep in $(seq 1 "$reps"); do
  order=("$@")
  if (( rep % 2 == 0 )); then
      order=(); for (( i=$#; i>=1; i-- )); do order+=("${!i}"); done
  fi
  for v in "${order[@]}"; do
    name=${v%%=*} relay=${v#*=}
    run="$out/$name-$rep"
    "$loadtest" run "$config" --relay-bin "$relay" \
        --database-url "$url" --out "$run" --no-progress > "$run.txt" 2>&1 &
    harness=$!
    rpid=
    # The relay's `run` process, not the `migrate` the harness runs first.
    until rpid=$(pgrep -P "$harness" -f " run --config "); do sleep 0.2; done
    sleep "$wait"
    q "SELECT pg_stat_statements_reset()" >/dev/null
    backends=$(q "SELECT string_agg(pid::text, ' ') FROM pg_stat_activity WHERE datname LIKE 'loadtest_%'")
    load=$(cut -d' ' -f1 /proc/loadavg)
    r0=$(ticks "$rpid"); b0=$(ticks $backends)
    sleep 20
    r1=$(ticks "$rpid"); b1=$(ticks $backends)
    q "SELECT calls, rows, round(mean_exec_time::numeric, 3) AS mean_ms,
              round(shared_blks_hit::numeric / greatest(calls, 1), 0) AS hits_per_call,
              regexp_replace(left(query, 160), '\s+', ' ', 'g')
       FROM pg_stat_statements
       WHERE dbid = (SELECT oid FROM pg_database WHERE datname LIKE 'loadtest_%' LIMIT 1)
       ORDER BY total_exec_time DESC LIMIT 8" > "$run-statements.txt"
    echo "$name $rep 20 $(awk "BEGIN{print ($r1-$r0)/$tck}") $(awk "BEGIN{print ($b1-$b0)/$tck}") $load" | tee -a "$out/results.txt"
    kill "$rpid" 2>/dev/null || true
    kill "$harness" 2>/dev/null || true
    wait "$harness" 2>/dev/null || true
    kill -9 "$rpid" 2>/dev/null || true
    for db in $(q "SELECT datname FROM pg_database WHERE datname LIKE 'loadtest_%'"); do
        q "DROP DATABASE $db WITH (FORCE)"
    done
  done
done
