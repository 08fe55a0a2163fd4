#!/usr/bin/env bash
# What an idle relay costs the database, side by side for several relay
# binaries/configs: transactions per second (xact_commit + xact_rollback of
# pg_stat_database) and connections held (pg_stat_activity) over 60 s idle,
# the first event's latency after that idle spell (psql's COMMIT returned ->
# the webhook sink saw the request), and the same two figures under load
# (pgbench inserting RATE events/s; its own transactions are subtracted).
#
#   loadtest/idle-cost.sh ADMIN_URL NAME=BINARY[:EXTRA_TOML] ...
#
# Each NAME gets a fresh database NAME on ADMIN_URL's server, migrated by its
# BINARY. EXTRA_TOML (optional) is appended to the [relay] section, e.g.
# 'poll_interval = "60s"'. Prints a Markdown table.
set -euo pipefail
ADMIN=$1; shift
IDLE=${IDLE:-60} LOAD=${LOAD:-60} RATE=${RATE:-200}
BASE=${ADMIN%/*}
WORK=$(mktemp -d)
PORT=$((20000 + RANDOM % 20000))
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# The sink: 200 to every POST, one line "arrival-epoch path" per request.
python3 - "$PORT" "$WORK/sink.log" <<'PY' &
import sys, time, http.server
port, log = int(sys.argv[1]), open(sys.argv[2], "a", buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        log.write(f"{time.time():.6f} {self.path}\n")
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
PY
pids+=($!)

names=()
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; bin=${rest%%:*}; extra=""
  [[ $rest == *:* ]] && extra=${rest#*:}
  names+=("$name")
  psql -q "$ADMIN" -c "DROP DATABASE IF EXISTS $name" -c "CREATE DATABASE $name"
  DATABASE_URL="$BASE/$name" "$bin" migrate >/dev/null
  cat > "$WORK/$name.toml" <<TOML
[database]
url = "$BASE/$name"
[relay]
$extra
[server]
metrics_bind = "127.0.0.1:0"
[[routes]]
event_type = "*"
sink = "webhook"
destination = "http://127.0.0.1:$PORT/$name/{event_type}"
signing_secret = "whsec_AQID"
TOML
  OUTBOX_RELAY_LOG=warn "$bin" run --config "$WORK/$name.toml" 2>"$WORK/$name.log" &
  pids+=($!)
done

q() { psql -XAtq "$ADMIN" -c "$1"; }
xacts() { q "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '$1'"; }
rows() { psql -XAtq "$BASE/$1" -c "SELECT count(*) FROM outbox"; }
conns() { q "SELECT count(*) FROM pg_stat_activity WHERE datname = '$1' AND application_name LIKE 'outbox-relay%'"; }
declare -A x0 x1 c_idle lat l0 l1 r0 r1 c_load

sleep 20
for p in "${pids[@]}"; do kill -0 "$p" || { cat "$WORK"/*.log >&2; exit 1; }; done
for n in "${names[@]}"; do x0[$n]=$(xacts "$n"); done
sleep "$IDLE"
for n in "${names[@]}"; do x1[$n]=$(xacts "$n"); c_idle[$n]=$(conns "$n"); done

# First event after the idle spell (the relays have idled IDLE + 20 s).
for n in "${names[@]}"; do
  psql -XAtq "$BASE/$n" -c "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key) VALUES (gen_random_uuid(), 'probe', 'p', 'probe.first', '{}', 'first-$n')"
  echo "$(date +%s.%N) $n" >> "$WORK/committed"
done
sleep 5
for n in "${names[@]}"; do
  c=$(awk -v n="$n" '$2 == n {print $1}' "$WORK/committed")
  s=$(awk -v p="/$n/probe.first" '$2 == p {print $1; exit}' "$WORK/sink.log")
  lat[$n]=$(awk -v c="$c" -v s="${s:-0}" 'BEGIN { if (s == 0) print "not seen"; else printf "%.0f ms", (s - c) * 1000 }')
done

# Load: RATE single-row insert transactions a second into every database.
cat > "$WORK/insert.sql" <<'SQL'
INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key)
VALUES (gen_random_uuid(), 'order', 'k' || (random() * 100)::int, 'order.placed', '{"n": 1}', gen_random_uuid()::text);
SQL
for n in "${names[@]}"; do
  pgbench -n -c 2 -j 1 -R "$RATE" -T $((LOAD + 20)) -f "$WORK/insert.sql" "$BASE/$n" >"$WORK/$n.pgbench" 2>&1 &
  pids+=($!)
done
sleep 10
for n in "${names[@]}"; do l0[$n]=$(xacts "$n"); r0[$n]=$(rows "$n"); done
sleep "$LOAD"
for n in "${names[@]}"; do l1[$n]=$(xacts "$n"); r1[$n]=$(rows "$n"); c_load[$n]=$(conns "$n"); done
sleep 12
echo "| relay | idle: transactions/s | idle: connections | first event after $((IDLE + 20)) s idle | load: events/s inserted | load: relay transactions/s | load: connections | delivered |"
echo "|---|---|---|---|---|---|---|---|"
for n in "${names[@]}"; do
  ins=$(( r1[$n] - r0[$n] ))
  delivered=$(grep -c " /$n/" "$WORK/sink.log" || true)
  inserted=$(rows "$n")
  awk -v n="$n" -v xi=$(( x1[$n] - x0[$n] )) -v ti="$IDLE" -v ci="${c_idle[$n]}" -v lat="${lat[$n]}" \
      -v xl=$(( l1[$n] - l0[$n] )) -v ins="$ins" -v tl="$LOAD" -v cl="${c_load[$n]}" -v d="$delivered" -v all="$inserted" \
      'BEGIN { printf "| %s | %.1f | %s | %s | %.0f | %.1f | %s | %d of %d |\n", n, xi / ti, ci, lat, ins / tl, (xl - ins) / tl, cl, d, all }'
done
echo
echo "(work files in $WORK)"
