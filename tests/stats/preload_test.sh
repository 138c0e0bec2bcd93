#!/bin/bash
# stats.preload: an unmodified TCP program under LD_PRELOAD=librsock.so shows
# up in rsock-stat with its two connections and exact TCP byte counts.
# usage: preload_test.sh RSOCK_STAT LIBRSOCK_SO STATS_TCP_PAIR
set -u
STAT=$1
LIB=$2
APP=$3
ROOT=$(mktemp -d)
export RSOCK_STATS_DIR=$ROOT/stats
APID=
cleanup() {
  [[ -n $APID ]] && kill -KILL "$APID" 2>/dev/null
  rm -rf "$ROOT"
}
trap cleanup EXIT
# No config file from the host; plain TCP on loopback is what we measure.
RSOCK_CONFIG=/dev/null LD_PRELOAD=$LIB "$APP" 100000 7000 "$ROOT/ready" &
APID=$!
for _ in $(seq 1 200); do [[ -s $ROOT/ready ]] && break; sleep 0.05; done
[[ -s $ROOT/ready ]] || { echo "FAIL: program did not get ready"; exit 1; }
J=$("$STAT" -p "$APID" --json)
echo "$J"
fails=0
check() {
  if [[ "$J" == *"$1"* ]]; then echo "ok: $1"; else echo "FAIL: missing $1"; fails=$((fails + 1)); fi
}
check "\"exe\":\"stats_tcp_pair\""
check '"conns_open":2,'
check '"direction":"client"'
check '"direction":"server"'
# Whatever carried the bytes, every byte is counted once each way.
check '"tx_bytes":107000,"rx_bytes":107000,'
echo "$((5 - fails)) passed, $fails failed"
[[ $fails == 0 ]]
