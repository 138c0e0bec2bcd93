#!/bin/bash
# in_vm.sh -- body of bench/syscalls/run, inside the rxe VM (as root).
#   bash bench/syscalls/in_vm.sh BUILD_DIR N
# redis-server and redis-benchmark -t get -c 10 -n N, once plain and once
# with librsock on both ends, each process wrapped by
# `perf stat -e 'syscalls:sys_enter_*'` (wrapped, not attached with -p: an
# attach once stalled the guest). Prints, per GET, each side's syscalls by
# name (those of at least 0.05 per request), their sum, and how many bytes
# went over RDMA (librsock's exit summaries) so the figure is for upgraded
# connections. perf's tracing makes every syscall dearer: the req/s printed
# is for orientation only, the counts are exact.
# Then the same per connection: rsock_connect_bench client (socket, connect,
# 1 byte each way, close; C sequential connections) against its server, both
# ends wrapped alike; with the default upgrade_delay_ms such a connection
# never starts a rendezvous, so this is what the hooks add to a short one.
set -uo pipefail
BUILD=$(realpath "${1:-build}") N=${2:-20000} C=${3:-150}
LIB=$BUILD/librsock.so HOST=10.77.0.1 CB=$BUILD/bench/connect/rsock_connect_bench
for t in perf redis-server redis-benchmark redis-cli; do
  command -v $t >/dev/null || { echo "in_vm: $t missing" >&2; exit 2; }
done
W=$(mktemp -d /tmp/sysc.XXXXXX)
EV='syscalls:sys_enter_*'

run() {  # mode: plain|rsock
  local mode=$1 port=$((21000 + RANDOM % 9000)) pre=(env -u LD_PRELOAD)
  [ "$mode" = rsock ] && pre=(env LD_PRELOAD="$LIB" RSOCK_LOG_LEVEL=info RSOCK_LOG_FILE="$W/$mode.%p.log")
  perf stat -x, -e "$EV" -o "$W/srv.$mode" "${pre[@]}" redis-server --port "$port" --bind "$HOST" \
    --save '' --appendonly no --protected-mode no > "$W/srv.$mode.out" 2>&1 &
  local srv=$! i
  for i in $(seq 100); do [ -n "$(ss -Htln "sport = :$port")" ] && break; sleep 0.3; done
  # (a warm-up run first: the first connection of a process pays one-time costs)
  "${pre[@]}" redis-benchmark -h "$HOST" -p "$port" -t get -n 200 -c 10 -q > /dev/null 2>&1
  perf stat -x, -e "$EV" -o "$W/cli.$mode" "${pre[@]}" redis-benchmark -h "$HOST" -p "$port" \
    -t get -n "$N" -c 10 -q > "$W/cli.$mode.out" 2>&1
  env -u LD_PRELOAD redis-cli -h "$HOST" -p "$port" shutdown nosave > /dev/null 2>&1 || kill -INT $srv
  for i in $(seq 100); do kill -0 $srv 2>/dev/null || break; sleep 0.2; done
  wait $srv 2>/dev/null
}

# per-request counts of one perf output: "name count/N" lines, largest first
per_req() {
  awk -F, -v n="$N" '$3 ~ /syscalls:sys_enter_/ && $1 ~ /^[0-9]+$/ && $1 > 0 {
      name = $3; sub(/syscalls:sys_enter_/, "", name); printf "%s %.2f\n", name, $1 / n }' "$1" |
    sort -k2 -rn
}

run_conn() {  # mode: plain|rsock
  local mode=$1 port=$((31000 + RANDOM % 9000)) pre=(env -u LD_PRELOAD) i
  [ "$mode" = rsock ] && pre=(env LD_PRELOAD="$LIB" RSOCK_UPGRADE_DELAY_MS=60000 RSOCK_LOG_LEVEL=info RSOCK_LOG_FILE="$W/c$mode.%p.log")
  perf stat -x, -e "$EV" -o "$W/csrv.$mode" "${pre[@]}" "$CB" server "$HOST" "$port" > /dev/null 2>&1 &
  local srv=$!
  for i in $(seq 100); do [ -n "$(ss -Htln "sport = :$port")" ] && break; sleep 0.3; done
  perf stat -x, -e "$EV" -o "$W/ccli.$mode" "${pre[@]}" "$CB" client "$HOST" "$port" "$C" 0 \
    > "$W/ccli.$mode.out" 2>&1
  pkill -TERM -P $srv; wait $srv 2>/dev/null  # (the server, not perf: perf then prints)
}

table() {  # PREFIX DIVISOR WHAT
  local side label
  for side in srv cli; do
    label=server; [ $side = cli ] && label=client
    N=$2 per_req "$W/$1$side.plain" > "$W/$1$side.plain.pr"
    N=$2 per_req "$W/$1$side.rsock" > "$W/$1$side.rsock.pr"
    tp=$(awk '{s += $2} END {printf "%.2f", s}' "$W/$1$side.plain.pr")
    tr=$(awk '{s += $2} END {printf "%.2f", s}' "$W/$1$side.rsock.pr")
    echo "$label: total plain $tp librsock $tr per $3"
    # union of names, ordered by the librsock count
    awk 'NR == FNR {p[$1] = $2; next} {r[$1] = $2; if (!($1 in p)) p[$1] = 0}
         END {for (k in p) if (!(k in r)) r[k] = 0;
              for (k in r) if (r[k] >= 0.05 || p[k] >= 0.05) printf "  %-18s %6.2f %6.2f\n", k, p[k], r[k]}' \
      "$W/$1$side.plain.pr" "$W/$1$side.rsock.pr" | sort -k3 -rn
  done
}

run plain
run rsock
[ -x "$CB" ] && { run_conn plain; run_conn rsock; }
echo "syscalls per GET (redis-benchmark -t get -c 10 -n $N, perf stat wrapped), plain vs librsock:"
table "" "$N" GET
for m in plain rsock; do
  echo "req/s under perf, $m: $(grep -ho '[0-9.]* requests per second' "$W/cli.$m.out" | tail -1)"
done
echo "librsock exit summaries (redis):"
grep -ho 'summary: .*' "$W"/rsock.*.log 2>/dev/null | cut -c1-200
if [ -x "$CB" ]; then
  echo
  echo "syscalls per connection (rsock_connect_bench client, $C connections, perf stat wrapped):"
  table c "$C" connection
  for m in plain rsock; do echo "$m (under perf): $(head -2 "$W/ccli.$m.out" | tr '\n' ' ')"; done
  echo "librsock exit summaries (connections):"
  grep -ho 'summary: .*' "$W"/crsock.*.log 2>/dev/null | cut -c1-200
fi
rm -rf "$W"
