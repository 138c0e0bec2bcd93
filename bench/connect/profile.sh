#!/bin/bash
# bench/connect/profile.sh PROFILE_BUILD [ROUNDS] [SIZE] -- inside tools/rxe-vm:
# where a SIZE-byte (default 64) one-way goes (docs/PERFORMANCE.md, "Where a 64 B one-way
# goes"). PROFILE_BUILD is a build tree configured with -DRSOCK_PROFILE=ON
# (targets rsock and rsock_connect_bench are enough). Each round runs raw
# verbs (ib_send_lat, ib_write_lat), then rsock_connect_bench's blocking
# SIZE-byte ping-pong (4 s after 1 s of warm-up) over librsock, and prints the
# ping-pong's figures with both processes' data-path counters
# (util/profile.h). A benchmark: it measures, it never fails on speed.
set -uo pipefail
B=$(cd "${1:?usage: profile.sh PROFILE_BUILD [ROUNDS] [SIZE]}" && pwd) || exit 1
ROUNDS=${2:-3} SIZE=${3:-64} H=10.77.0.1
ITERS=20000; [ "$SIZE" -gt 1024 ] && ITERS=2000  # (a 16 KiB round trip takes ~2 ms here)
[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ] || { echo "SKIP: no RDMA device (run inside tools/rxe-vm)"; exit 77; }
ulimit -l unlimited 2>/dev/null
CB=$B/bench/connect/rsock_connect_bench
for f in "$B/librsock.so" "$CB"; do [ -e "$f" ] || { echo "FAIL: $f missing"; exit 1; }; done
grep -q 'RSOCK_PROFILE:BOOL=ON' "$B/CMakeCache.txt" 2>/dev/null ||
  echo "NOTE: $B is not a -DRSOCK_PROFILE=ON build: no counters will print"
T=$(mktemp -d /tmp/profile.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$T"' EXIT
raw() {  # TOOL -- one-way typical (median) in us
  "$1" -R -s "$SIZE" -n "$ITERS" >/dev/null 2>&1 &
  local s=$!
  sleep 2
  "$1" -R -s "$SIZE" -n "$ITERS" "$H" 2>/dev/null | awk -v s="$SIZE" '$1 == s {print $5}'
  wait $s
}
for r in $(seq "$ROUNDS"); do
  echo "== round $r"
  echo "raw ib_send_lat typical_us=$(raw ib_send_lat) ib_write_lat typical_us=$(raw ib_write_lat)"
  port=$((30000 + RANDOM % 20000))
  LD_PRELOAD=$B/librsock.so "$CB" server "$H" "$port" >"$T/srv" 2>&1 &
  srv=$!
  sleep 1
  LD_PRELOAD=$B/librsock.so "$CB" pingpong "$H" "$port" "$SIZE" 4 1 >"$T/cli" 2>&1
  sleep 1  # the server's connection thread prints at the client's end-of-file
  kill $srv 2>/dev/null
  wait $srv 2>/dev/null
  grep -E '^pingpong' "$T/cli"
  # (A process prints at every end-of-file read and at exit: its last
  # figure of each probe is its total.)
  for side in client:cli server:srv; do
    sed -n "s/^librsock\[[0-9]*\]: profile: /${side%%:*} /p" "$T/${side#*:}" |
      awk '!($2 in v) {o[++k] = $2} {v[$2] = $0} END {for (i = 1; i <= k; i++) print v[o[i]]}'
  done
done
