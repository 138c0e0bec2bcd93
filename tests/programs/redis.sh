#!/bin/bash
# redis.sh -- unmodified redis-server + redis-cli + redis-benchmark, plain or
# under LD_PRELOAD=librsock.so.
#
#   redis.sh MODE [LIB]
#     MODE plain    server and clients plain
#          preload  server and clients preloaded with LIB
#          server   only the server preloaded     (peer without librsock)
#          client   only the clients preloaded    (peer without librsock)
#   For every mode but plain, a plain reference run is made first and the
#   functional transcripts (redis-cli replies, list lengths, checksums) of both
#   runs must be identical. Every run must complete without errors.
# Env: RSOCK_IN_VM=1 (fewer requests, longer timeouts), RSOCK_TEST_HOST,
#      REDIS_N (requests per benchmark, default 20000; 2000 in the VM).
MODE=${1:?usage: redis.sh plain|preload|server|client [LIB]}
LIB=${2:-}
TEST_NAME="redis.$MODE"
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
command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null ||
  fail "redis-server/redis-tools not installed (tools/install-deps)"

if [ "${RSOCK_IN_VM:-0}" = 1 ]; then N=${REDIS_N:-2000}; else N=${REDIS_N:-20000}; fi

# A 2 MiB binary value (fixed seed: same bytes in every run).
python3 -c 'import random,sys; r=random.Random(7); sys.stdout.buffer.write(bytes(r.getrandbits(8) for _ in range(2<<20)))' > "$TMP/big.bin"

# Fixed command script: replies are deterministic.
cat > "$TMP/cmds.txt" <<'EOF'
PING
SET greeting hello
GET greeting
APPEND greeting ",world"
GET greeting
INCR counter
INCRBY counter 41
RPUSH fruits apple banana cherry
LRANGE fruits 0 -1
HSET h a 1 b 2 c 3
HGET h b
SADD s x y z x
SCARD s
EXISTS greeting missing
DEL counter
DBSIZE
EOF

# run_one SERVER_LIB CLIENT_LIB TAG -- one full run; transcript in $TMP/TAG.out
run_one() {
  local slib=$1 clib=$2 tag=$3 port pid out=$TMP/$3.out dir=$TMP/$3
  mkdir -p "$dir"
  port=$(free_port)
  log "$tag: redis-server on $HOST:$port (server $(kind "$slib"), clients $(kind "$clib")), N=$N"
  env ${slib:+LD_PRELOAD=$slib} redis-server --port "$port" --bind "$HOST" --save '' --appendonly no \
      --dir "$dir" --logfile "$dir/redis.log" --daemonize no --protected-mode no \
      --unixsocket '' </dev/null &
  pid=$!; PIDS+=("$pid")
  wait_port "$port" "$(t 20)" "$pid"
  check_mapped "$pid" "$slib"
  local cli=(timeout "$(t 30)" env ${clib:+LD_PRELOAD=$clib} redis-cli -h "$HOST" -p "$port")

  : > "$out"
  # 1. Fixed commands over one connection.
  "${cli[@]}" < "$TMP/cmds.txt" >> "$out" || fail "$tag: redis-cli command script failed"
  # 2. Large binary value through the stream both ways.
  "${cli[@]}" -x SET big < "$TMP/big.bin" >> "$out" || fail "$tag: SET big failed"
  local want got
  want=$(sha256sum < "$TMP/big.bin" | cut -d' ' -f1)
  # Via a file: piped into `head -c`, redis-cli could die of SIGPIPE writing
  # its trailing newline after head exited (and pipefail would end the test).
  "${cli[@]}" --raw GET big > "$TMP/got.bin" || fail "$tag: GET big failed"
  got=$(head -c $((2<<20)) "$TMP/got.bin" | sha256sum | cut -d' ' -f1)
  [ "$got" = "$want" ] || fail "$tag: GET big returned different bytes"
  echo "big sha256 $got" >> "$out"
  # 3. Benchmarks: 50 concurrent connections, then pipelined.
  local bench=(timeout "$(t 120)" env ${clib:+LD_PRELOAD=$clib} redis-benchmark -h "$HOST" -p "$port" -q)
  local b
  for b in "-t set,get,lpush -n $N" "-t set,get,lpush -n $N -P 16"; do
    # shellcheck disable=SC2086
    "${bench[@]}" $b > "$dir/bench.txt" 2>&1 || { cat "$dir/bench.txt" >&2; fail "$tag: redis-benchmark $b exited $?"; }
    tr '\r' '\n' < "$dir/bench.txt" | grep -E 'requests per second' >&2 || true
    for op in SET GET LPUSH; do
      tr '\r' '\n' < "$dir/bench.txt" | grep -q "^$op: .*requests per second" ||
        { cat "$dir/bench.txt" >&2; fail "$tag: redis-benchmark $b: no $op result"; }
    done
    ! grep -qi 'error' "$dir/bench.txt" || { cat "$dir/bench.txt" >&2; fail "$tag: redis-benchmark reported an error"; }
  done
  # 4. Every request landed exactly once: 2 LPUSH runs of N each.
  local llen
  llen=$("${cli[@]}" LLEN mylist) || fail "$tag: LLEN failed"
  [ "$llen" = $((2 * N)) ] || fail "$tag: LLEN mylist = $llen, expected $((2 * N))"
  { echo "llen $llen"; "${cli[@]}" DBSIZE; "${cli[@]}" GET key:000000000000 | sha256sum; } >> "$out"
  # 5. The server survived and shuts down cleanly.
  kill -0 "$pid" 2>/dev/null || fail "$tag: redis-server died"
  "${cli[@]}" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  local rc=0 waited=0
  while kill -0 "$pid" 2>/dev/null && [ $waited -lt $((50 * SLOW)) ]; do sleep 0.1; waited=$((waited + 1)); done
  kill -0 "$pid" 2>/dev/null && fail "$tag: redis-server did not shut down"
  wait "$pid" || rc=$?
  [ $rc = 0 ] || { tail -20 "$dir/redis.log" >&2; fail "$tag: redis-server exit status $rc"; }
  log "$tag: ok"
}

if [ "$MODE" != plain ]; then
  run_one "" "" reference
fi
run_one "$SLIB" "$CLIB" "$MODE"
cat "$TMP/$MODE.out"
if [ "$MODE" != plain ]; then
  diff -u "$TMP/reference.out" "$TMP/$MODE.out" >&2 || fail "transcript differs from the plain run"
  log "transcript identical to the plain run"
fi
log "PASS"
