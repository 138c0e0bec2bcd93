#!/bin/bash
# bench/compare/connect_diag.sh BUILD_DIR [N] -- inside tools/rxe-vm:
#   tools/rxe-vm -- 'bash bench/compare/connect_diag.sh build'
# Where connection setup time goes (docs/PERFORMANCE.md, "Where the time
# goes"): rsock_connect_bench's connect-to-first-byte and connect()-call
# medians for every preload combination (client/server), then both ends
# plain vs both preloaded with an untimed pause after each connection
# (GAP_MS 0, 50, 200), which tells per-connection cost from background work
# left by earlier connections. Each set runs twice, alternating. Prints the
# tool's lines and the servers' librsock exit summaries; judges nothing.
set -u
B=$(cd "${1:?usage: connect_diag.sh BUILD_DIR [N]}" && pwd) || exit 1
N=${2:-100}
LIB=$B/librsock.so CB=$B/bench/connect/rsock_connect_bench H=10.77.0.1
[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ] || { echo "SKIP: no RDMA device"; exit 77; }
ulimit -l unlimited
port=$((7400 + RANDOM % 500))
one() {  # CLIENT SERVER GAP_MS: plain|pre each
  local se=(env -u LD_PRELOAD) ce=(env -u LD_PRELOAD) s
  [ "$2" = pre ] && se=(env LD_PRELOAD="$LIB" RSOCK_LOG_LEVEL=info)
  [ "$1" = pre ] && ce=(env LD_PRELOAD="$LIB")
  port=$((port + 1))
  "${se[@]}" "$CB" server $H $port > /tmp/connect_diag.srv 2>&1 & s=$!
  sleep 1.5
  echo "client=$1 server=$2 gap_ms=$3: $("${ce[@]}" "$CB" client $H $port "$N" 5 "$3" | tr '\n' ' ')"
  kill $s; wait $s
  grep -o 'summary: .*fallbacks=[0-9]*' /tmp/connect_diag.srv | sed 's/^/    server /'
}
for _ in 1 2; do
  for combo in plain/plain pre/plain plain/pre pre/pre; do one "${combo%/*}" "${combo#*/}" 0; done
done
for _ in 1 2; do
  for gap in 50 200; do one plain plain $gap; one pre pre $gap; done
done
