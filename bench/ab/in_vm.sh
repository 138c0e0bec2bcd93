#!/bin/bash
# in_vm.sh OLD_BUILD NEW_BUILD [ROUNDS] -- two librsock builds side by side
# in one VM session, alternating per round: redis SET/GET (-c 10, both ends
# preloaded), the 64 B blocking ping-pong, the connect() time of 30
# connections opened back to back after the first (bench/connect/burst.py)
# and the 64-connection epoll echo.
# A benchmark: prints one line per build and round, judges nothing.
#   git worktree add /tmp/old REV && cmake -S /tmp/old -B scratch/oldbuild && cmake --build scratch/oldbuild
#   tools/rxe-vm -- 'bash bench/ab/in_vm.sh scratch/oldbuild build 5'
# (Both build trees under the repository root: the guest sees only that.)
OLD=$(cd "$1" && pwd) NEW=$(cd "$2" && pwd) R=${3:-3}
H=10.77.0.1
ulimit -l unlimited
export RSOCK_LOG_LEVEL=warn
for r in $(seq $R); do
  for v in old new; do
    B=$OLD; [ $v = new ] && B=$NEW
    L=$B/librsock.so
    p=$((30000 + RANDOM % 20000))
    LD_PRELOAD=$L redis-server --port $p --bind $H --save '' --appendonly no --protected-mode no >/dev/null 2>&1 & s=$!
    sleep 2
    out=$(LD_PRELOAD=$L timeout 120 redis-benchmark -h $H -p $p -t set,get -n 4000 -c 10 --csv 2>/dev/null | tr -d '"' | awk -F, '/^SET|^GET/{printf "%s=%s ", $1, $2}')
    kill $s; wait $s 2>/dev/null
    p=$((30000 + RANDOM % 20000))
    LD_PRELOAD=$L $B/bench/connect/rsock_connect_bench server $H $p >/dev/null 2>&1 & s=$!
    sleep 1
    pp=$(LD_PRELOAD=$L timeout 60 $B/bench/connect/rsock_connect_bench pingpong $H $p 64 2 2>/dev/null | sed -n 's/^pingpong_us .*median=\([0-9.]*\).*/\1/p')
    kill $s; wait $s 2>/dev/null
    # (30 connections opened back to back: bench/connect/burst.py)
    p=$((30000 + RANDOM % 20000))
    LD_PRELOAD=$L redis-server --port $p --bind $H --save '' --appendonly no --protected-mode no >/dev/null 2>&1 & s=$!
    sleep 2
    b=$(LD_PRELOAD=$L timeout 120 python3 $(dirname "$0")/../connect/burst.py $H $p 30 2>/dev/null | sed -n 's/.*rest_sum_ms=\([0-9.]*\).*/\1/p')
    kill $s; wait $s 2>/dev/null
    e=$(LD_PRELOAD=$L timeout 120 $B/tests/readiness/rsock_epoll_echo $H --conns 64 --bytes 262144 --await-settled 2>/dev/null | sed -n 's/^echo conns=.* mibps=\([0-9.]*\).*/\1/p')
    echo "round $r $v: $out pp64_us=$pp burst30_rest_ms=$b echo64_mibps=$e"
  done
done
