#!/bin/bash
# in_vm.sh -- body of bench/redis/where, inside the rxe VM (as root).
#   bash bench/redis/in_vm.sh BUILD_DIR N ROUNDS
# redis-server and redis-benchmark -t get -c 10 -n N, plain and then with
# librsock on both ends, ROUNDS times alternating. Each benchmark runs under
# `perf record -a -g` (cpu-clock, the whole guest, only while it runs);
# bench/redis/classify.py turns the samples into CPU microseconds per request
# per side (server, client, progress threads, kernel threads, idle) and per
# kind of work. Prints req/s (lowered by perf's sampling) and the split of
# each round, then a table of the medians over the rounds (table.py).
set -uo pipefail
BUILD=$(realpath "${1:-build}") N=${2:-20000} ROUNDS=${3:-1}
LIB=$BUILD/librsock.so HOST=10.77.0.1 HZ=1000
HERE=$(cd "$(dirname "$0")" && pwd)
for t in perf redis-server redis-benchmark redis-cli python3; do
  command -v $t >/dev/null || { echo "in_vm: $t missing" >&2; exit 2; }
done
W=$(mktemp -d /tmp/rwhere.XXXXXX)

run() {  # mode round
  local mode=$1 r=$2 port=$((21000 + RANDOM % 9000)) pre=(env -u LD_PRELOAD) i
  [ "$mode" = rsock ] && pre=(env LD_PRELOAD="$LIB" RSOCK_LOG_LEVEL=info RSOCK_LOG_FILE="$W/$mode.$r.%p.log")
  "${pre[@]}" redis-server --port "$port" --bind "$HOST" --save '' --appendonly no \
    --protected-mode no > "$W/srv.$mode.$r.out" 2>&1 &
  local srv=$!
  for i in $(seq 100); do [ -n "$(ss -Htln "sport = :$port")" ] && break; sleep 0.3; done
  "${pre[@]}" redis-benchmark -h "$HOST" -p "$port" -t get -n 200 -c 10 -q > /dev/null 2>&1
  perf record -a -g -F $HZ -o "$W/$mode.$r.data" -- "${pre[@]}" redis-benchmark -h "$HOST" \
    -p "$port" -t get -n "$N" -c 10 -q > "$W/cli.$mode.$r.out" 2> "$W/perf.$mode.$r.err"
  env -u LD_PRELOAD redis-cli -h "$HOST" -p "$port" shutdown nosave > /dev/null 2>&1 || kill -INT $srv
  for i in $(seq 100); do kill -0 $srv 2>/dev/null || break; sleep 0.2; done
  wait $srv 2>/dev/null
  echo "== $mode, round $r: $(tr '\r' '\n' < "$W/cli.$mode.$r.out" | grep -o '[0-9.]* requests per second' | tail -1) (under perf)"
  perf script -i "$W/$mode.$r.data" -F comm,tid,ip,sym,dso 2>/dev/null |
    CLASSIFY_TSV="$W/$mode.$r.tsv" python3 "$HERE/classify.py" $HZ "$N"
  rm -f "$W/$mode.$r.data"
}

for r in $(seq "$ROUNDS"); do run plain "$r"; run rsock "$r"; done
echo
python3 "$HERE/table.py" "$W"
echo
echo "librsock exit summaries:"
grep -ho 'summary: .*' "$W"/rsock.*.log 2>/dev/null | cut -c1-160
rm -rf "$W"
