#!/bin/bash
# iperf3.sh -- unmodified iperf3 server + client, plain or under LD_PRELOAD.
#
#   iperf3.sh MODE [LIB] [-R]
#     MODE plain | preload (both ends) | server | client (one end only), as in redis.sh
#     -R   reverse: the server sends, the client receives
#   The client sends a fixed byte count (-n; 200M natively, 20M with
#   RSOCK_IN_VM=1, or IPERF_BYTES). Asserts: both processes exit 0, neither JSON
#   report has an error, the sender sent exactly that count and the receiver got
#   a plausible part of it (iperf3 stops counting at the end-of-test message, so
#   up to a socket buffer's worth may be uncounted).
MODE=${1:?usage: iperf3.sh plain|preload|server|client [LIB] [-R]}
shift
LIB= REV=
for a in "$@"; do
  case $a in -R) REV=-R ;; *) LIB=$a ;; esac
done
TEST_NAME="iperf3.$MODE${REV:+.reverse}"
. "$(dirname "$0")/lib.sh"

case $MODE in
  plain) SLIB= CLIB= ;;
  preload) SLIB=$LIB CLIB=$LIB ;;
  server) SLIB=$LIB CLIB= ;;
  client) SLIB= CLIB=$LIB ;;
  *) fail "unknown mode $MODE" ;;
esac
[ "$MODE" = plain ] || [ -n "$LIB" ] || fail "mode $MODE needs LIB"
require_lib "$LIB"
command -v iperf3 >/dev/null || fail "iperf3 not installed (tools/install-deps)"

if [ "${RSOCK_IN_VM:-0}" = 1 ]; then BYTES=${IPERF_BYTES:-20M}; else BYTES=${IPERF_BYTES:-200M}; fi

port=$(free_port)
log "iperf3 server on $HOST:$port ($(kind "$SLIB")), client ($(kind "$CLIB")) -n $BYTES ${REV:-forward}"
env ${SLIB:+LD_PRELOAD=$SLIB} iperf3 -s -1 -B "$HOST" -p "$port" --json > "$TMP/server.json" 2> "$TMP/server.err" </dev/null &
spid=$!; PIDS+=("$spid")
wait_port "$port" "$(t 20)" "$spid"
check_mapped "$spid" "$SLIB"

crc=0
timeout "$(t 60)" env ${CLIB:+LD_PRELOAD=$CLIB} iperf3 -c "$HOST" -p "$port" -n "$BYTES" $REV --json \
  > "$TMP/client.json" 2> "$TMP/client.err" </dev/null || crc=$?
# The one-off server (-1) exits by itself once the test is over.
src=0 waited=0
while kill -0 "$spid" 2>/dev/null && [ $waited -lt $((100 * SLOW)) ]; do sleep 0.1; waited=$((waited + 1)); done
kill -0 "$spid" 2>/dev/null && { cat "$TMP/server.err" >&2; fail "iperf3 server did not exit after the test"; }
wait "$spid" || src=$?
cat "$TMP/client.err" "$TMP/server.err" >&2
[ $crc = 0 ] || { head -c 2000 "$TMP/client.json" >&2; fail "iperf3 client exit status $crc"; }
[ $src = 0 ] || { head -c 2000 "$TMP/server.json" >&2; fail "iperf3 server exit status $src"; }

python3 - "$TMP/client.json" "$TMP/server.json" "$BYTES" "${REV:+1}" <<'EOF' || fail "iperf3 results check failed"
import json, sys
cli, srv = (json.load(open(p)) for p in sys.argv[1:3])
want = sys.argv[3]
mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
want = int(want[:-1]) * mult[want[-1]] if want[-1] in mult else int(want)
reverse = bool(sys.argv[4])
for name, d in (("client", cli), ("server", srv)):
    if d.get("error"):
        sys.exit(f"{name} reported error: {d['error']}")
e = cli["end"]
sent, recv = e["sum_sent"]["bytes"], e["sum_received"]["bytes"]
bps = e["sum_received"]["bits_per_second"]
print(f"iperf3 {'reverse' if reverse else 'forward'}: sent {sent} B, received {recv} B, {bps / 1e9:.2f} Gbit/s")
if sent != want:
    sys.exit(f"sender sent {sent} bytes, expected exactly {want}")
if not 0 < recv <= sent or recv < sent - (32 << 20):
    sys.exit(f"receiver counted {recv} of {sent} bytes: implausible")
EOF
log "PASS"
