#!/bin/bash
# burst.sh BUILD_DIR IP -- issue 17's regression test (label rdma, in the VM).
# Programs whose upgraded sockets become ready together, many times in a row,
# under perturbation (an `rdma resource show qp` loop and a CPU hog):
#   - the C/epoll echo (tests/readiness/epoll_echo.cc) with every connection
#     on RDMA first: level-triggered 50 and 200 connections, edge-triggered,
#     EPOLLONESHOT;
#   - the Python asyncio echo of the issue (asyncio_echo.py), as a user runs it.
# Every run has RSOCK_DEBUG_CHECKS=1 (an emulated epoll_wait about to sleep
# over a ready socket aborts with "invariant violated") and a watchdog that
# dumps rsock-stat and the thread states before it kills a hung run. Before
# the fix a burst of more than 64 ready sockets livelocked epoll_wait every
# time (docs/DESIGN.md, readiness).
set -uo pipefail
BUILD=$(cd "$1" && pwd) IP=$2
SRC=$(cd "$(dirname "$0")" && pwd)
LIB=${BURST_LIB:-$BUILD/librsock.so}  # BURST_LIB: try another build
ECHO=$BUILD/tests/readiness/rsock_epoll_echo
export RSOCK_STAT=$BUILD/rsock-stat
. "$SRC/watchdog.sh"
# (No `grep -q` in pipelines here: with pipefail, grep leaving early gives the
# writer SIGPIPE and the pipeline fails, which read as "skip" in vm.suite.)
if ! ibv_devices 2>/dev/null | grep rxe0 >/dev/null && ! ls /sys/class/infiniband 2>/dev/null | grep . >/dev/null; then
  echo "SKIP: no RDMA device"; exit 77
fi
ip -o addr show 2>/dev/null | grep " ${IP}/" >/dev/null || { echo "SKIP: $IP is not local"; exit 77; }
ulimit -n 65536 2>/dev/null || true
# One round in the suite (the livelock it guards against came every time);
# BURST_ROUNDS=N repeats the five small runs as a soak.
ROUNDS=${BURST_ROUNDS:-1}
T=$(mktemp -d /tmp/burst.XXXXXX)

# Perturbation for the whole test.
( while :; do rdma resource show qp >/dev/null 2>&1; sleep 0.5; done ) &
SAMPLER=$!
( exec nice -n 5 sh -c 'while :; do :; done' ) &
HOG=$!
trap 'kill $SAMPLER $HOG 2>/dev/null; rm -rf "$T"' EXIT

export RSOCK_DEBUG_CHECKS=1 RSOCK_LOG_LEVEL=info
# Generous rendezvous timers: under TCG (plus the hog) many simultaneous
# rdma_cm setups are slow, and a timeout would keep a pair on TCP.
export RSOCK_UPGRADE_TIMEOUT_MS=30000 RSOCK_CONNECT_TIMEOUT_MS=10000 RSOCK_RESOLVE_TIMEOUT_MS=5000
fail=0 runs=0
run() {  # NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  runs=$((runs + 1))
  run_watched "$limit" env LD_PRELOAD="$LIB" "$@" >"$T/out" 2>&1
  local rc=$?
  local sum=$(grep -o 'summary: connections=[0-9]* upgraded=[0-9]*' "$T/out" | tail -1)
  local conns=$(sed -n 's/.*connections=\([0-9]*\).*/\1/p' <<<"$sum")
  local up=$(sed -n 's/.*upgraded=\([0-9]*\).*/\1/p' <<<"$sum")
  # Most sockets must have been on RDMA, or the run tested nothing.
  if [ $rc = 0 ] && [ "${up:-0}" -lt $(( ${conns:-1} * 3 / 4 )) ]; then
    echo "    only ${up:-0} of ${conns:-?} sockets upgraded" >>"$T/out"
    rc=3
  fi
  if [ $rc = 0 ] && grep -q '^ok ' "$T/out" && ! grep -q 'invariant violated' "$T/out"; then
    echo "PASS $name ($(( $(date +%s) - t0 ))s; $sum)"
  else
    echo "FAIL $name (exit $rc, $(( $(date +%s) - t0 ))s)"
    sed 's/^/    /' "$T/out" | head -80
    fail=$((fail + 1))
  fi
}
for r in $(seq 1 "$ROUNDS"); do
  run "round $r: epoll LT, 50 connections" 60 "$ECHO" "$IP" --await-rdma --conns 50
  run "round $r: epoll ET, 100 connections" 90 "$ECHO" "$IP" --await-rdma --conns 100 --et
  run "round $r: epoll ONESHOT, 100 connections" 90 "$ECHO" "$IP" --await-rdma --conns 100 --oneshot
  run "round $r: asyncio echo, 50 clients" 60 python3 "$SRC/asyncio_echo.py" "$IP" 50
  run "round $r: asyncio echo, 50 clients (again)" 60 python3 "$SRC/asyncio_echo.py" "$IP" 50
done
# 200 connections (400 upgraded sockets) with small rings: 64 KiB each keeps
# the pinned memory of the run at ~50 MiB.
run "epoll LT, 200 connections, 64 KiB rings" 180 env RSOCK_RING_BYTES=64K "$ECHO" "$IP" --await-rdma --conns 200
run "asyncio echo, 150 clients, 64 KiB rings" 180 env RSOCK_RING_BYTES=64K python3 "$SRC/asyncio_echo.py" "$IP" 150

echo "burst: $((runs - fail)) passed, $fail failed"
[ $fail = 0 ]
