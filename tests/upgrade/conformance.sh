#!/bin/bash
# The conformance suite over RDMA: the same binary, preloaded, inside the VM,
# with its TCP tests on the rxe address so that connections upgrade. With
# RSOCK_CONF_EXPECT_RDMA=1 every connected pair a case uses must be on RDMA at
# both ends before the case goes on (tests/conformance/helpers.h), so each case
# runs over upgraded connections. Passes only if every case passes, nothing
# fell back for any reason but the documented ones, and the exit summaries
# (counted from the stats segment) show the traffic on RDMA.
# Usage: conformance.sh BUILD_DIR ADDR
set -u
B=$1 ADDR=${2:-10.77.0.1}
ls /sys/class/infiniband/* >/dev/null 2>&1 || { echo "SKIP: no RDMA device"; exit 77; }
log=$B/conformance-rdma.log  # in the build tree: survives the VM
# Real IPv6 for the dual-stack cases: an address on the same rxe netdev
# (rxe adds its GID by itself). Only where we may configure it (the VM).
V6=fd77::1
dev=$(ip -o -4 addr show 2>/dev/null | awk -v a="$ADDR" 'index($4, a "/") == 1 {print $2; exit}')
if [ -n "$dev" ] && ! ip -o -6 addr show dev "$dev" 2>/dev/null | grep -q " $V6/"; then
  ip -6 addr add "$V6/64" dev "$dev" nodad 2>/dev/null || V6=
fi
[ -n "$dev" ] || V6=
sleep 1  # the GID table follows the address asynchronously
RSOCK_CONF_EXPECT_RDMA=1 RSOCK_LOG_LEVEL=info RSOCK_CONF_IPV4=$ADDR RSOCK_CONF_IPV6=$V6 LD_PRELOAD=$B/librsock.so \
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
sums=$(sed -n 's/.*summary: connections=\([0-9]*\) upgraded=\([0-9]*\) fallbacks=\([0-9]*\) rdma_tx=\([0-9]*\) rdma_rx=\([0-9]*\) tcp_tx=\([0-9]*\) tcp_rx=\([0-9]*\).*/\1 \2 \3 \4 \5 \6 \7/p' "$log" |
  awk '{for (i = 1; i <= 7; i++) s[i] += $i} END {print s[1]+0, s[2]+0, s[3]+0, s[4]+0, s[5]+0, s[6]+0, s[7]+0}')
read -r conns ups fbs rtx rrx ttx trx <<<"$sums"
echo "connections=$conns upgraded=$ups fallbacks=$fbs rdma_tx=$rtx rdma_rx=$rrx tcp_tx=$ttx tcp_rx=$trx"
# Fallback reasons other than the expected ones are failures:
#  forked         a fork() while an upgrade was pending (the fork cases);
#  peer_not_rsock the peer is a plain program: the exec case's child, and the
#                 accepted side whose client was a fork child (no rendezvous);
#  peer_closed    the peer closed a connection while its switch was under
#                 way (cases that connect and close at once do not await the
#                 upgrade; seen in 2 of ~10 runs, after the switch got faster);
#  handed_off     connections on RDMA switched back to TCP at fork() or when
#                 sent with SCM_RIGHTS (the fork, exec and fd passing cases);
#  released       the peer of such a connection, which switched back with it;
#  negative_cache, rejected, connect_failed, timeout: a connect to the
#                 process's own lingering rdma_cm listener after the TCP
#                 listener moved to a fork child (the preforking case: refused,
#                 no accepted socket matches), and what the cache then skips.
bad=$(grep "summary:" "$log" | sed -n 's/.*fallbacks:\(.*\))$/\1/p' | tr ' ' '\n' |
  grep -vE '^(none|forked=[0-9]+|handed_off=[0-9]+|released=[0-9]+|peer_not_rsock=[0-9]+|peer_closed=[0-9]+|negative_cache=[0-9]+|rejected=[0-9]+|connect_failed=[0-9]+|timeout=[0-9]+)?$' | sort | uniq -c)
if [ -n "$bad" ]; then
  echo "FAIL: unexpected fallbacks: $bad"
  exit 1
fi
# Every pair a case builds upgraded (asserted inside the cases); the share of
# all connections (also the ones cases open and close at once) must be high,
# and the bulk of the bytes must be on RDMA.
if [ "$ups" -lt $((conns * 3 / 5)) ] || [ "$rtx" -lt $((ttx * 4)) ] || [ "$rrx" -lt $((trx * 4)) ]; then
  echo "FAIL: the suite passed but too little of it went over RDMA"
  exit 1
fi
echo "PASS: conformance over RDMA"
