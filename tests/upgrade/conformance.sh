#!/bin/bash
# The conformance suite over RDMA: the same binary, preloaded, inside the VM,
# with its TCP tests on the rxe address so that connections upgrade. Passes
# only if every test case passes AND connections really moved to RDMA
# (librsock's exit summary, which counts from the stats segment).
# Usage: conformance.sh BUILD_DIR ADDR
set -u
B=$1 ADDR=${2:-10.77.0.1}
ls /sys/class/infiniband/* >/dev/null 2>&1 || { echo "SKIP: no RDMA device"; exit 77; }
log=$B/conformance-rdma.log  # in the build tree: survives the VM
RSOCK_LOG_LEVEL=info RSOCK_CONF_IPV4=$ADDR LD_PRELOAD=$B/librsock.so \
  timeout 900 "$B/tests/conformance/rsock_conformance" >"$log" 2>&1
rc=$?
grep -E "test cases|assertions" "$log"
grep "summary:" "$log" | head -3
if [ $rc -ne 0 ]; then
  grep -B2 -A12 -E "ERROR|FATAL|TEST CASE|WATCHDOG" "$log" | grep -v "^librsock" | head -150
  echo "FAIL: conformance suite over RDMA (rc=$rc)"
  exit 1
fi
# Every test process prints one summary line (forked children too).
# (No process substitution: the VM has no /dev/fd.)
sums=$(sed -n 's/.*summary: connections=\([0-9]*\) upgraded=\([0-9]*\) fallbacks=[0-9]* rdma_tx=\([0-9]*\) rdma_rx=\([0-9]*\).*/\1 \2 \3 \4/p' "$log" |
  awk '{c+=$1; u+=$2; t+=$3; r+=$4} END {print c+0, u+0, t+0, r+0}')
read -r conns ups rtx rrx <<<"$sums"
echo "connections=$conns upgraded=$ups rdma_tx=$rtx rdma_rx=$rrx"
grep "summary:" "$log" | head -3
# Many cases open a connection and close it within a few calls, before any
# rendezvous could finish (and some are meant to fail: refused connects), so
# not every connection upgrades; but a good share must, with real traffic.
if [ "$ups" -lt $((conns / 4)) ] || [ "$rtx" -lt 100000 ] || [ "$rrx" -lt 100000 ]; then
  echo "FAIL: the suite passed but too little of it went over RDMA"
  exit 1
fi
echo "PASS: conformance over RDMA"
