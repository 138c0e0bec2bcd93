# lib.sh -- shared helpers for the unmodified-program tests (sourced, not run).
#
# Every test starts its own servers on free ports in its own temp dir and kills
# them on any exit (trap), so it never depends on or collides with system
# daemons. Durations and timeouts scale with RSOCK_IN_VM (TCG is 10-50x slower).

set -euo pipefail

# Address the servers bind to / clients connect to. In the rxe VM use the rxe
# netdev's address so that rdma_cm can find rxe0 once librsock upgrades to RDMA;
# natively only loopback is ever used.
if [ -n "${RSOCK_TEST_HOST:-}" ]; then
  HOST=$RSOCK_TEST_HOST
elif [ "${RSOCK_IN_VM:-0}" = 1 ]; then
  HOST=10.77.0.1
else
  HOST=127.0.0.1
fi
# Timeout multiplier.
if [ "${RSOCK_IN_VM:-0}" = 1 ]; then SLOW=20; else SLOW=1; fi

TMP=$(mktemp -d /tmp/rsock-prog.XXXXXX)
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do
    # Give it a moment, then force.
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$p" 2>/dev/null || true
  done
  [ -n "${KEEP_TMP:-}" ] || rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

log() { printf '[%s] %s\n' "${TEST_NAME:-test}" "$*" >&2; }
# set -e ends a test at a failing command without a word: say which.
trap 'log "FAIL: line $LINENO: \"$BASH_COMMAND\" exited $?"' ERR
fail() { log "FAIL: $*"; exit 1; }

# t SECONDS -- scaled timeout value
t() { echo $(( $1 * SLOW )); }

# free_port -- a TCP port nobody listens on right now (kernel-chosen).
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("'"$HOST"'",0)); print(s.getsockname()[1]); s.close()'
}

# wait_port PORT SECONDS [PID] -- wait until a socket listens on PORT. Uses
# ss (no probe connection: a one-off server such as `iperf3 -1` would take a
# probe for its client); fail early if PID died.
wait_port() {
  local port=$1 deadline=$(( $(date +%s) + $2 )) pid=${3:-}
  while :; do
    if [ -n "$(ss -Htln "sport = :$port" 2>/dev/null)" ]; then return 0; fi
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then fail "server (pid $pid) died before listening on $port"; fi
    [ "$(date +%s)" -lt "$deadline" ] || fail "nothing listening on port $port after $2 s"
    sleep 0.1
  done
}

# kind LIB -- "preloaded" or "plain", for messages.
kind() { if [ -n "$1" ]; then echo preloaded; else echo plain; fi; }
# Start programs as `env ${lib:+LD_PRELOAD=$lib} prog ... &`: env execs prog, so
# $! is the program's own pid (check_mapped/kill/wait need that).

# check_mapped PID LIB -- prove the preload really took effect in PID.
check_mapped() {
  local pid=$1 lib=$2
  [ -z "$lib" ] && return 0
  grep -q "$(basename "$lib")" "/proc/$pid/maps" || fail "pid $pid does not map $lib (LD_PRELOAD ignored?)"
}

# require_lib LIB -- the preload library must exist.
require_lib() {
  [ -z "$1" ] || [ -f "$1" ] || fail "library $1 not found (build target rsock first)"
}
