#!/bin/bash
# stats.rsock_stat: a live stats writer (stats_fake_app) checked through
# rsock-stat: per-process JSON, list/netstat views, watch mode, fork child,
# growth into an extension file, stale cleanup, corrupt/wrong-version segments,
# --prometheus (exact values, format checked by check_prometheus.awk).
# usage: run_test.sh RSOCK_STAT STATS_FAKE_APP
set -u
STAT=$1
APP=$2
PROMCHECK=$(dirname "$0")/check_prometheus.awk
ROOT=$(mktemp -d /dev/shm/rsock-stats-test.XXXXXX 2>/dev/null || mktemp -d)
export RSOCK_STATS_DIR=$ROOT
UDIR=$ROOT/$(id -u)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$ROOT"
}
trap cleanup EXIT
fails=0
passes=0
ok() { passes=$((passes + 1)); echo "ok: $1"; }
bad() { fails=$((fails + 1)); echo "FAIL: $1"; }
expect() {  # expect NAME HAYSTACK NEEDLE
  if [[ "$2" == *"$3"* ]]; then ok "$1"; else bad "$1: missing [$3] in:"; echo "$2" | head -c 3000; echo; fi
}
wait_file() {
  for _ in $(seq 1 100); do [[ -s $1 ]] && return 0; sleep 0.05; done
  return 1
}

# --- a live writer: 10 connections, 4 initial slots -> must grow to 2 files, fork a child
"$APP" 10 4 "$ROOT/ready" fork &
PIDS+=($!)
wait_file "$ROOT/ready" || { echo "FAIL: fake app did not start"; exit 1; }
wait_file "$ROOT/ready.child" || { echo "FAIL: fake app child did not start"; exit 1; }
PID=$(cat "$ROOT/ready")
CHILD=$(cat "$ROOT/ready.child")
PIDS+=("$CHILD")

[[ $(stat -c %a "$UDIR") == 700 ]] && ok "uid dir is 0700" || bad "uid dir mode $(stat -c %a "$UDIR")"
[[ $(stat -c %a "$UDIR/$PID") == 600 ]] && ok "segment is 0600" || bad "segment mode $(stat -c %a "$UDIR/$PID")"
[[ -f $UDIR/$PID.1 ]] && ok "grew into extension file $PID.1" || bad "no extension file"

J=$("$STAT" -p "$PID" --json)
rc=$?
[[ $rc == 0 ]] && ok "-p --json exit 0" || bad "-p --json exit $rc"
if command -v python3 >/dev/null; then
  echo "$J" | python3 -m json.tool >/dev/null && ok "-p output is valid JSON" || bad "-p output is not JSON"
fi
expect "process counts" "$J" '"exe":"stats_fake_app"'
[[ $J =~ \"librsock\":\"[0-9]+\.[0-9]+\.[0-9]+\" ]] && ok "the segment names its librsock release" || bad "no release in the segment"
T=$("$STAT" -p "$PID")
[[ $T =~ librsock\ [0-9]+\.[0-9]+\.[0-9]+ ]] && ok "-p says the librsock release" || bad "-p: no release: $(head -1 <<<"$T")"
expect "open conns" "$J" '"conns_open":10,"conns_rdma":5,"conns_tcp":5,"conns_seen":11,"conns_upgraded":5,"conns_untracked":0'
expect "fallback reason" "$J" '"peer_not_rsock":5'
expect "resources" "$J" '"pinned_bytes":3145728,"pinned_budget":6291456,"kits_idle":3,"kits_reused":7,'
expect "rdma totals" "$J" '"rdma":{"tx_bytes":25000,"rx_bytes":12500,"tx_ops":25,"rx_ops":25}'
expect "tcp totals incl. closed conn" "$J" '"tcp":{"tx_bytes":30007,"rx_bytes":15000,"tx_ops":31,"rx_ops":30}'
expect "segment grew" "$J" '"segment_files":2,"segment_slots":12'
expect "rdma conn" "$J" '{"fd":108,"direction":"client","local":"127.0.0.1:40008","peer":"10.0.0.9:6379","state":"established","transport":"rdma","fallback_reason":"none","qp_num":1008,"tx_bytes":9000,"rx_bytes":4500'
expect "tcp conn" "$J" '{"fd":109,"direction":"client","local":"127.0.0.1:40009","peer":"10.0.0.10:6379","state":"established","transport":"tcp","fallback_reason":"peer_not_rsock","qp_num":0,"tx_bytes":10000,"rx_bytes":5000'
expect "ring fill" "$J" '"send_ring_fill":576,"recv_ring_fill":288,"ring_bytes":0,"send_credits":16'
expect "conn credit stalls" "$J" '"credit_stalls":8,"send_ring_fill":512,'
expect "conn switch timings" "$J" '"send_credits":16,"upgrade_us":90000,"switch_us":2500,'
expect "tcp conn no switch timings" "$J" '"send_credits":16,"upgrade_us":0,"switch_us":0,"opened_unix_ms"'
expect "process switch timings" "$J" '"switches":{"count":6,"switch_us_sum":27500,"switch_us_max":9000,"upgrade_us_sum":250000},'
expect "process credit stalls" "$J" '"credit_stalls":20,"segment_files"'
n=$(echo "$J" | grep -o '"fd":' | wc -l)
[[ $n == 10 ]] && ok "10 connections in JSON" || bad "$n connections in JSON"

# --- fork child: own file, same connections, zeroed counters
CJ=$("$STAT" -p "$CHILD" --json)
expect "child has its own segment" "$CJ" "\"pid\":$CHILD,"
expect "child inherits connections, counters zeroed" "$CJ" '"conns_open":10,"conns_rdma":5,"conns_tcp":5,"conns_seen":0'
expect "child traffic zero" "$CJ" '"rdma":{"tx_bytes":0,"rx_bytes":0,"tx_ops":0,"rx_ops":0}'
expect "child switch counters zero" "$CJ" '"switches":{"count":0,"switch_us_sum":0,"switch_us_max":0,"upgrade_us_sum":0}'
J2=$("$STAT" -p "$PID" --json)
expect "parent unaffected by child" "$J2" '"rdma":{"tx_bytes":25000,'

# --- text views
T=$("$STAT")
expect "list shows parent" "$T" "$PID "
expect "list shows child" "$T" "$CHILD "
expect "list shows exe" "$T" "stats_fake_app"
LJ=$("$STAT" --json)
expect "list json" "$LJ" "{\"pid\":$PID,"
P=$("$STAT" -p "$PID")
expect "-p text conn" "$P" "10.0.0.10:6379"
expect "-p text fallback" "$P" "fallbacks: peer_not_rsock=5"
expect "-p text resources" "$P" "rdma resources: 3.0M pinned of 6.0M, 3 kits kept for new connections, 7 reused"
# STALLS column (14th) of the connection table: fd 108 has 8 credit stalls.
st=$(echo "$P" | awk '$1 == "FD" { col = 0; for (i = 1; i <= NF; i++) if ($i == "STALLS") col = i }
                      $1 == "108" && col { print $col }')
[[ $st == 8 ]] && ok "-p text STALLS column" || { bad "-p text STALLS column: [$st]"; echo "$P"; }
expect "-p text switches" "$P" "switches onto rdma: 6, 4.6 ms on average, 9.0 ms the longest; on rdma 50.0 ms after the socket's start on average"
# UP_MS and SWITCH_MS columns: fd 108 on RDMA 90 ms after its start, its latest switch 2.5 ms; fd 109 never.
tm=$(echo "$P" | awk '$1 == "FD" { u = 0; w = 0; for (i = 1; i <= NF; i++) { if ($i == "UP_MS") u = i; if ($i == "SWITCH_MS") w = i } }
                      ($1 == "108" || $1 == "109") && u && w { printf "%s %s/%s ", $1, $u, $w }')
[[ $tm == "108 90.0/2.5 109 -/- " ]] && ok "-p text UP_MS and SWITCH_MS columns" || { bad "-p text timing columns: [$tm]"; echo "$P"; }
N=$("$STAT" -n)
n=$(echo "$N" | grep -c " $PID/stats_fake_app:")
[[ $n == 10 ]] && ok "netstat shows 10 conns of $PID" || { bad "netstat shows $n conns of $PID"; echo "$N"; }
W=$("$STAT" -p "$PID" -i 0.2 -c 3 --json)
[[ $(echo "$W" | wc -l) == 3 ]] && ok "watch: 3 rounds" || bad "watch: $(echo "$W" | wc -l) rounds"
expect "watch: rates" "$(echo "$W" | tail -1)" '"tx_bytes_per_s":0.0'
WT=$("$STAT" -i 0.1 -c 2)
expect "watch text has rate columns" "$WT" "TX/s"

# --- --prometheus: every listed process, exact values, valid format
prom_ok() {  # prom_ok NAME TEXT: the text passes the format check
  local w
  if w=$(printf '%s\n' "$2" | awk -f "$PROMCHECK" 2>&1); then ok "$1"; else bad "$1: $w"; fi
}
M=$("$STAT" --prometheus)
rc=$?
[[ $rc == 0 ]] && ok "--prometheus exit 0" || bad "--prometheus exit $rc"
prom_ok "--prometheus format" "$M"
L="pid=\"$PID\",exe=\"stats_fake_app\""
for want in "rsock_connections_seen_total{$L} 11" "rsock_connections_upgraded_total{$L} 5" \
            "rsock_connections_untracked_total{$L} 0" "rsock_connections_open{$L} 10" \
            "rsock_transport_connections_open{$L,transport=\"rdma\"} 5" \
            "rsock_transport_connections_open{$L,transport=\"tcp\"} 5" \
            "rsock_fallbacks_total{$L,reason=\"peer_not_rsock\"} 5" \
            "rsock_fallbacks_total{$L,reason=\"policy\"} 0" \
            "rsock_handshake_errors_total{$L} 0" "rsock_credit_stalls_total{$L} 20" \
            "rsock_pinned_bytes{$L} 3145728" "rsock_kits_idle{$L} 3" "rsock_kits_reused_total{$L} 7" \
            "rsock_switches_total{$L} 6" "rsock_switch_microseconds_total{$L} 27500" \
            "rsock_switch_microseconds_max{$L} 9000" "rsock_upgrade_microseconds_total{$L} 250000" \
            "rsock_tx_bytes_total{$L,transport=\"rdma\"} 25000" "rsock_rx_bytes_total{$L,transport=\"rdma\"} 12500" \
            "rsock_tx_ops_total{$L,transport=\"rdma\"} 25" "rsock_rx_ops_total{$L,transport=\"rdma\"} 25" \
            "rsock_tx_bytes_total{$L,transport=\"tcp\"} 30007" "rsock_rx_bytes_total{$L,transport=\"tcp\"} 15000" \
            "rsock_tx_ops_total{$L,transport=\"tcp\"} 31" "rsock_rx_ops_total{$L,transport=\"tcp\"} 30" \
            "rsock_connections_seen_total{pid=\"$CHILD\",exe=\"stats_fake_app\"} 0" \
            "rsock_stat_unreadable_segments 0" "# TYPE rsock_fallbacks_total counter" \
            "# TYPE rsock_connections_open gauge"; do
  if grep -qxF -- "$want" <<<"$M"; then ok "prometheus: $want"; else bad "prometheus: no line [$want]"; fi
done
# Every reason but none, as many as the layout has.
LAYOUT=$(dirname "$0")/../../util/stats_layout.h
want_n=$(( $(sed -n 's/^constexpr int kFallbackReasons = \([0-9]*\);/\1/p' "$LAYOUT") - 1 ))
n=$(grep -c "^rsock_fallbacks_total{$L,reason=" <<<"$M")
[[ $n == "$want_n" ]] && ok "prometheus: all $want_n fallback reasons listed" || bad "prometheus: $n fallback reasons, want $want_n"
n=$(grep -c "reason=\"none\"" <<<"$M")
[[ $n == 0 ]] && ok "prometheus: no reason=none" || bad "prometheus: reason=none listed"
MP=$("$STAT" -p "$PID" --prometheus)
rc=$?
[[ $rc == 0 ]] && ok "-p --prometheus exit 0" || bad "-p --prometheus exit $rc"
prom_ok "-p --prometheus format" "$MP"
expect "-p --prometheus has the process" "$MP" "rsock_connections_open{$L} 10"
[[ $MP != *"pid=\"$CHILD\""* ]] && ok "-p --prometheus: that process only" || bad "-p --prometheus shows the child"
ME=$("$STAT" --dir "$ROOT/none" --prometheus)
rc=$?
[[ $rc == 0 ]] && ok "--prometheus, no process: exit 0" || bad "--prometheus, no process: exit $rc"
prom_ok "--prometheus, no process: format" "$ME"
expect "--prometheus, no process: HELP still there" "$ME" "# HELP rsock_connections_open "
# An odd executable name: quote, backslash, newline and a byte that is not UTF-8.
STATS_FAKE_EXE=$'q"u\\o\nte\xffd' "$APP" 1 4 "$ROOT/ready.odd" &
ODD=$!
PIDS+=("$ODD")
if wait_file "$ROOT/ready.odd"; then
  MO=$("$STAT" -p "$ODD" --prometheus)
  prom_ok "--prometheus, odd exe: format" "$MO"
  want="rsock_connections_open{pid=\"$ODD\",exe=\"q\\\"u\\\\o\\nte"$'\xef\xbf\xbd'"d\"} 1"
  if grep -qxF -- "$want" <<<"$MO"; then ok "--prometheus, odd exe: escaped"; else bad "--prometheus, odd exe: no line [$want] in: $MO"; fi
else
  bad "fake app with an odd exe did not start"
fi
kill -KILL $ODD; wait $ODD 2>/dev/null
# The checker itself catches what it is there for.
for broken in $'# HELP a_total x\n# TYPE a_total counter\na_total{pid="1"} 1\na_total{pid="1"} 2' \
              $'# HELP a x\n# TYPE a counter\na 1' $'# HELP a x\na 1' \
              $'# HELP a x\n# HELP a x\n# TYPE a gauge\na 1' $'# HELP a x\n# TYPE a gauge\na{pid=1} 1' \
              $'# HELP a x\n# TYPE a gauge\na{pid="\\q"} 1' \
              $'# HELP a x\n# TYPE a gauge\n# HELP b x\n# TYPE b gauge\na 1\nb 1\na{x="y"} 2'; do
  if printf '%s\n' "$broken" | awk -f "$PROMCHECK" >/dev/null 2>&1; then
    bad "format check accepted: $broken"
  else
    ok "format check rejects: ${broken//$'\n'/ | }"
  fi
done
# Usage errors: exit 1, with the reason.
for combo in "--json" "-i 1" "-n" "-i 1 -c 2"; do
  # shellcheck disable=SC2086
  E=$("$STAT" --prometheus $combo 2>&1)
  rc=$?
  [[ $rc == 1 && $E == *"rsock-stat: --prometheus"* ]] && ok "--prometheus $combo: usage error" \
    || bad "--prometheus $combo: exit $rc: $E"
done

# --- corrupt and wrong-version segments of a live process: clean errors
sleep 60 &
SLEEPER=$!
PIDS+=($SLEEPER)
head -c 600 /dev/urandom | tr '\0' 'x' > "$UDIR/$SLEEPER"
E=$("$STAT" -p "$SLEEPER" 2>&1)
rc=$?
[[ $rc == 2 ]] && ok "corrupt: exit 2" || bad "corrupt: exit $rc"
expect "corrupt: clean message" "$E" "not a librsock stats segment (bad magic)"
{ printf 'RSOCKST\0'; printf '\x63\x00\x00\x00'; head -c 1000 /dev/zero; } > "$UDIR/$SLEEPER"
E=$("$STAT" -p "$SLEEPER" 2>&1)
rc=$?
[[ $rc == 2 ]] && ok "wrong version: exit 2" || bad "wrong version: exit $rc"
LV=$(sed -n 's/^constexpr uint32_t kLayoutVersion = \([0-9]*\);/\1/p' "$(dirname "$0")/../../util/stats_layout.h")
expect "wrong version: clean message" "$E" "layout version 99, this rsock-stat reads version $LV"
T=$("$STAT" 2>&1)
rc=$?
[[ $rc == 0 ]] && ok "list with a bad segment: exit 0" || bad "list with a bad segment: exit $rc"
expect "list flags the bad segment" "$T" "unreadable: $UDIR/$SLEEPER: layout version 99"
expect "list still shows the good one" "$T" "stats_fake_app"
LJ=$("$STAT" --json)
expect "list json carries the error" "$LJ" "\"errors\":[{\"pid\":$SLEEPER,"
M=$("$STAT" --prometheus)
rc=$?
[[ $rc == 0 ]] && ok "--prometheus with a bad segment: exit 0" || bad "--prometheus with a bad segment: exit $rc"
prom_ok "--prometheus with a bad segment: format" "$M"
expect "--prometheus counts the bad segment" "$M" $'\nrsock_stat_unreadable_segments 1\n'
expect "--prometheus says why" "$M" "# rsock-stat: pid $SLEEPER unreadable: $UDIR/$SLEEPER: layout version 99"
expect "--prometheus still has the good one" "$M" "rsock_connections_open{$L} 10"
"$STAT" -p "$SLEEPER" --prometheus >/dev/null 2>&1
rc=$?
[[ $rc == 2 ]] && ok "-p --prometheus of a bad segment: exit 2" || bad "-p --prometheus of a bad segment: exit $rc"
kill -KILL $SLEEPER; wait $SLEEPER 2>/dev/null

# --- stale files: a dead pid's segment is removed (unless --no-clean)
"$STAT" --no-clean >/dev/null
[[ -f $UDIR/$SLEEPER ]] && ok "--no-clean keeps stale file" || bad "--no-clean removed the file"
"$STAT" >/dev/null
[[ ! -e $UDIR/$SLEEPER ]] && ok "stale file of dead pid removed" || bad "stale file still there"
kill -KILL "$PID"; wait "$PID" 2>/dev/null
[[ -f $UDIR/$PID ]] && ok "SIGKILLed writer left its file" || bad "file vanished on SIGKILL?"
"$STAT" >/dev/null
[[ ! -e $UDIR/$PID && ! -e $UDIR/$PID.1 ]] && ok "killed writer's files cleaned" || bad "killed writer's files remain"
E=$("$STAT" -p "$PID" 2>&1)
expect "-p of a dead process" "$E" "no librsock stats for pid $PID"

echo "$passes passed, $fails failed"
[[ $fails == 0 ]]
