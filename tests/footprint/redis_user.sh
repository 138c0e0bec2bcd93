#!/bin/bash
# redis_user.sh BUILD_DIR IP -- redis as an ordinary user runs it (issue 11,
# label rdma, in the VM): redis-server and redis-benchmark, both unmodified,
# as user nobody with Debian's default limits (RLIMIT_MEMLOCK 8 MiB,
# RLIMIT_NOFILE 1024) and 300 client connections, first plain, then with
# librsock preloaded into both. With librsock the program must behave as
# without it, and the connections its budget holds must run on RDMA:
#  - redis-benchmark exits 0 and reports SET and GET, as without librsock;
#  - the server processed at least every request and refused no client;
#  - the same maxclients as without librsock (redis derives it from the fd
#    limit it sees);
#  - no EMFILE, no error in the server's log;
#  - the server logs nothing it does not log without librsock;
#  - RC QPs in RTS while the benchmark runs, and upgraded connections in the
#    server's exit summary (what 8 MiB of pinned memory holds: about 140 of
#    the 300 at a time), the client's others on TCP with reason memlock only,
#    one memlock warning line at most.
# Request rates are printed, not judged (bench/ does that).
set -uo pipefail
BUILD=$(cd "$1" && pwd) IP=$2
LIB=$BUILD/librsock.so
CONNS=${REDIS_USER_CONNS:-300} N=${REDIS_USER_REQUESTS:-30000}
if ! ls /sys/class/infiniband 2>/dev/null | grep . >/dev/null; then echo "SKIP: no RDMA device"; exit 77; fi
ip -o addr show 2>/dev/null | grep " ${IP}/" >/dev/null || { echo "SKIP: $IP is not local"; exit 77; }
[ "$(id -u)" = 0 ] || { echo "SKIP: needs root to become another user"; exit 77; }
for p in setpriv prlimit redis-server redis-benchmark redis-cli rdma; do
  command -v $p >/dev/null || { echo "SKIP: no $p"; exit 77; }
done
T=$(mktemp -d /tmp/redis_user.XXXXXX)
chmod 777 "$T"
SRV=
trap '[ -n "$SRV" ] && kill $SRV 2>/dev/null; rm -rf "$T"' EXIT
fail=0
check() {  # NAME CONDITION-RESULT
  if [ "$2" = 0 ]; then echo "PASS $1"; else echo "FAIL $1"; fail=$((fail + 1)); fi
}
as_user() {  # PRELOAD CMD...: as nobody, memlock 8 MiB, nofile 1024
  local pre=$1; shift
  cd "$T" && exec prlimit --memlock=8388608:8388608 --nofile=1024:1024 \
     setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all \
     env ${pre:+LD_PRELOAD=$pre} RSOCK_LOG_LEVEL=info RSOCK_STATS_DIR="$T/stats" "$@"
}
rts() { rdma resource show qp 2>/dev/null | grep -c 'type RC .*state RTS'; }

run() {  # TAG PRELOAD PORT
  local tag=$1 pre=$2 port=$3
  (as_user "$pre" redis-server --port "$port" --bind "$IP" --save '' --appendonly no \
     --dir "$T" --logfile "$T/$tag.server.log" --daemonize no --protected-mode no \
     >"$T/$tag.server.err" 2>&1) &
  SRV=$!
  local k
  for k in $(seq 1 300); do
    redis-cli -h "$IP" -p "$port" PING 2>/dev/null | grep -q PONG && break
    sleep 0.1
  done
  redis-cli -h "$IP" -p "$port" CONFIG GET maxclients | tail -1 >"$T/$tag.maxclients"
  ( (as_user "$pre" timeout 300 redis-benchmark -h "$IP" -p "$port" -c "$CONNS" -n "$N" -t set,get -q \
     >"$T/$tag.bench" 2>&1); echo $? >"$T/$tag.rc") &
  local b=$! max=0 q
  while kill -0 $b 2>/dev/null; do
    q=$(rts); [ "$q" -gt "$max" ] && max=$q
    sleep 0.5
  done
  wait $b
  echo "$max" >"$T/$tag.rts"
  redis-cli -h "$IP" -p "$port" INFO stats | tr -d '\r' >"$T/$tag.stats"
  kill -TERM $SRV; wait $SRV 2>/dev/null; SRV=
  echo "-- $tag: $(results $tag | tr '\n' ' ')"
  echo "   maxclients $(cat "$T/$tag.maxclients"), RC QPs in RTS at most $(cat "$T/$tag.rts")"
}
# The result lines (-q prints progress with \r in between).
results() { tr '\r' '\n' <"$T/$1.bench" | grep -E 'requests per second' | sed 's/^ *//'; }
stat_of() { sed -n "s/^$2:\([0-9]*\)/\1/p" "$T/$1.stats"; }

run plain "" 16390
run rsock "$LIB" 16391
sum=$(grep -h 'summary:' "$T/rsock.server.err" 2>/dev/null | tail -1)
echo "   server: $sum"
csum=$(tr '\r' '\n' <"$T/rsock.bench" | grep 'summary:' | sed 's/.*librsock/librsock/' | tail -1)
echo "   client: $csum"
up=$(sed -n 's/.* upgraded=\([0-9]*\).*/\1/p' <<<"$sum")
for tag in plain rsock; do
  check "$tag: redis-benchmark exits 0 with SET and GET" \
    $([ "$(cat "$T/$tag.rc")" = 0 ] && results $tag | grep -q '^SET: ' && results $tag | grep -q '^GET: ' &&
      ! grep -qi 'error' "$T/$tag.bench"; echo $?)
  done_cmds=$(stat_of $tag total_commands_processed)
  check "$tag: the server processed every request (${done_cmds:-0} >= $((2 * N)))" \
    $([ "${done_cmds:-0}" -ge $((2 * N)) ]; echo $?)
  check "$tag: no client refused" $([ "$(stat_of $tag rejected_connections)" = 0 ]; echo $?)
done
check "same maxclients as without librsock ($(cat "$T/plain.maxclients") / $(cat "$T/rsock.maxclients"))" \
  $([ "$(cat "$T/plain.maxclients")" = "$(cat "$T/rsock.maxclients")" ]; echo $?)
# (Redis logs the same lines either way but for times, pids and ports.)
norm() { sed 's/^[0-9]*:[A-Z] [0-9]* [A-Za-z]* [0-9]* [0-9:.]* //; s/[0-9][0-9]*/N/g' "$T/$1.server.log" | sort -u; }
norm plain >"$T/plain.norm"; norm rsock >"$T/rsock.norm"  # (no /dev/fd in the guest)
extra=$(comm -13 "$T/plain.norm" "$T/rsock.norm")
check "the server logs nothing it did not log without librsock${extra:+: $extra}" $([ -z "$extra" ]; echo $?)
check "no EMFILE" $(! grep -qiE 'too many open files|EMFILE' "$T/rsock.server.log" "$T/rsock.server.err" "$T/rsock.bench"; echo $?)
check "RC QPs in RTS while it ran ($(cat "$T/rsock.rts"))" $([ "$(cat "$T/rsock.rts")" -ge 2 ]; echo $?)
check "upgraded connections in the server's summary (${up:-none})" $([ "${up:-0}" -ge 1 ]; echo $?)
cfb=$(sed -n 's/.*fallbacks: \(.*\))$/\1/p' <<<"$csum")
sfb=$(sed -n 's/.*fallbacks: \(.*\))$/\1/p' <<<"$sum")
# Both ends share one memlock limit: whichever reaches its budget first for
# a connection says memlock, and a server that does rejects the request, so
# the client says rejected (at most as often as the server said memlock).
rej=$(grep -o 'rejected=[0-9]*' <<<"$cfb" | cut -d= -f2)
smem=$(grep -o 'memlock=[0-9]*' <<<"$sfb" | cut -d= -f2)
other=$(tr ' ' '\n' <<<"$cfb" | grep -v -e '^memlock=' -e '^rejected=' -e '^$')
check "the client's connections that stayed on TCP say why: memlock, or rejected by a server at its memlock budget (client ${cfb:-none}; server ${sfb:-none})" \
  $([ -z "$other" ] && [ "${rej:-0}" -le "${smem:-0}" ]; echo $?)
for who in server client; do
  f=$T/rsock.server.err; [ $who = client ] && f=$T/rsock.bench
  w=$(tr '\r' '\n' <"$f" | grep -c 'pinned-memory limit')
  check "the $who: at most one memlock warning line (got $w)" $([ "$w" -le 1 ]; echo $?)
done
[ $fail = 0 ] || for f in "$T"/*.bench "$T"/*.server.*; do echo "== $f"; tr '\r' '\n' <"$f" | grep -v 'rps=' | tail -15; done
echo "redis_user: $((13 - fail)) passed, $fail failed"
[ $fail = 0 ]
