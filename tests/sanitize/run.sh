#!/bin/bash
# sanitize/run.sh SRC ASAN_BUILD -- librsock built with AddressSanitizer and
# UndefinedBehaviorSanitizer, preloaded into the (unsanitized) conformance
# suite natively; in the Soft-RoCE VM (when one can boot) also under the
# reverse-switch and switch tests, where upgrades, fork hand-offs and path
# failures run. Any sanitizer report fails it (halt_on_error). The sanitizer
# runtimes go first in LD_PRELOAD, as they must for a preloaded library.
set -uo pipefail
SRC=$(cd "${1:?usage: run.sh SRC BUILD}" && pwd)
B=$2
mkdir -p "$B"
B=$(cd "$B" && pwd)
cd "$SRC" || exit 1
if [ ! -f "$B/CMakeCache.txt" ]; then
  cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRSOCK_SANITIZE=address,undefined \
    -DRSOCK_WERROR=ON >/dev/null || exit 1
fi
cmake --build "$B" -j2 --target rsock rsock_conformance rsock_revert rsock_switch_test \
  rsock_transport_vmtest rsock_fork_after_listen rsock_exit_race >/dev/null || {
  cmake --build "$B" -j1 --target rsock 2>&1 | tail -20; exit 1; }
ASAN_RT=$(gcc -print-file-name=libasan.so)
UBSAN_RT=$(gcc -print-file-name=libubsan.so)
# ASan resolves its real sigaction with dlsym(RTLD_NEXT), which finds
# librsock's (instrumented) hook, and calling it while ASan initialises
# recurses into ASan's init: so ASan installs no signal handlers of its own.
# No leak check: a fork child leaks its parent's registries on purpose.
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=0:exitcode=66:handle_segv=0:handle_sigbus=0:handle_abort=0:handle_sigfpe=0:handle_sigill=0:use_sigaltstack=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:exitcode=67
PRE="$ASAN_RT:$UBSAN_RT:$B/librsock.so"
fail=0
echo "== native: conformance suite with the sanitized librsock"
if ! LD_PRELOAD=$PRE "$B/tests/conformance/rsock_conformance" >"$B/conf-native.log" 2>&1; then
  tail -40 "$B/conf-native.log"; echo "FAIL: conformance (native) under ASan+UBSan"; fail=1
else
  tail -3 "$B/conf-native.log"
fi
echo "== native: main returns while a thread is in the hooks (no librsock global destroyed)"
if ! LD_PRELOAD=$PRE "$B/tests/sanitize/rsock_exit_race" 20 >"$B/exit-race.log" 2>&1; then
  grep -m1 -A40 -E '==[0-9]+==ERROR|runtime error:' "$B/exit-race.log"; tail -5 "$B/exit-race.log"
  echo "FAIL: exit_race under ASan+UBSan"; fail=1
else
  tail -1 "$B/exit-race.log"
fi
if why=$(tools/rxe-vm --check 2>&1); then
  echo "== VM: conformance over rxe, reverse switch, switch tests with the sanitized librsock"
  cat > "$B/in_vm.sh" <<IN
set -u
export ASAN_OPTIONS=$ASAN_OPTIONS UBSAN_OPTIONS=$UBSAN_OPTIONS
P="$PRE"
rc=0
cd /tmp
# A failing run shows the sanitizer's report itself (its stack), not only
# the log's tail, which is mostly the shadow-byte legend.
report() { grep -m1 -A60 -E '==[0-9]+==ERROR|runtime error:' "\$1"; tail -30 "\$1"; }
# Real IPv6 for the dual-stack cases, as upgrade.conformance sets it up.
ip -6 addr add fd77::1/64 dev rxe-eth0 nodad 2>/dev/null
sleep 1
# The timeouts of upgrade.conformance (which demands every pair upgrade
# too): under ASan in this guest eight pairs set up at once once left one
# on TCP with the defaults (500 ms address resolution).
LD_PRELOAD=\$P RSOCK_CONF_EXPECT_RDMA=1 RSOCK_CONF_IPV4=10.77.0.1 RSOCK_CONF_IPV6=fd77::1 RSOCK_UPGRADE_TIMEOUT_MS=30000 RSOCK_CONNECT_TIMEOUT_MS=10000 RSOCK_RESOLVE_TIMEOUT_MS=5000 $B/tests/conformance/rsock_conformance > conf.log 2>&1 || { report conf.log; echo "FAIL: conformance over rxe"; rc=1; }
tail -3 conf.log
for c in revert_client fail_server fork_child fork_parent fdpass; do
  LD_PRELOAD=\$P RSOCK_UPGRADE_TIMEOUT_MS=10000 $B/tests/upgrade/rsock_revert \$c 4 > rv.log 2>&1 || { report rv.log; echo "FAIL: revert \$c"; rc=1; }
  grep -h PASS rv.log
done
for c in a_bidirectional_across_switch d_forged_request_upgraded_connection e_forged_request_plain_client f_hostile_offer_after_switch f3_hostile_unknown_control_after_switch f4_hostile_tcp_bytes_after_switch; do
  LD_PRELOAD=\$P RSOCK_UPGRADE_TIMEOUT_MS=5000 $B/tests/upgrade/rsock_switch_test -tc=\$c > sw.log 2>&1 || { report sw.log; echo "FAIL: switch \$c"; rc=1; }
  tail -1 sw.log
done
# The RDMA connection failing mid-switch (after READY, before any marker).
LD_PRELOAD=\$P RSOCK_UPGRADE_TIMEOUT_MS=5000 RSOCK_DEBUG_BREAK_SWITCH=1 $B/tests/upgrade/rsock_switch_test -tc=h_rdma_fails_mid_switch > sw.log 2>&1 || { report sw.log; echo "FAIL: switch h_rdma_fails_mid_switch"; rc=1; }
tail -1 sw.log
# listen() then fork() at once: the child must not inherit a lock of the
# progress thread's start-up (the sanitizer's allocator: it hung here).
LD_PRELOAD=\$P $B/tests/multiproc/rsock_fork_after_listen 10.77.0.1 60 > fal.log 2>&1 || { report fal.log; echo "FAIL: fork_after_listen"; rc=1; }
tail -1 fal.log
# Preforked workers: fork children with their own verbs contexts, the
# shared listen table, redirects, and vfork (the test samples QPs through
# Python's subprocess); a worker taking over from an exited master (pidfd);
# a SO_REUSEPORT group through its named table. Long upgrade and
# resolution timeouts: a slow host once timed a worker's rendezvous out, and
# once the client's address resolution (500 ms by default: 3 of 12
# connections resolve_failed under ASan with 12 streams at once); the
# test then names each connection's fallback reason.
for v in "" --master-exits --reuseport-each; do
  LD_PRELOAD=\$P RSOCK_UPGRADE_TIMEOUT_MS=20000 RSOCK_RESOLVE_TIMEOUT_MS=5000 python3 $SRC/tests/multiproc/prefork.py 10.77.0.1 \$v > pf.log 2>&1 || { report pf.log; echo "FAIL: multiproc prefork \$v"; rc=1; }
  grep -h "^prefork" pf.log
done
# A listening socket inherited across exec: two exec'd servers join the
# launcher's listener through the port's named table, are redirected, and
# one takes it over when the launcher exits.
LD_PRELOAD=\$P RSOCK_UPGRADE_TIMEOUT_MS=20000 RSOCK_RESOLVE_TIMEOUT_MS=5000 python3 $SRC/tests/multiproc/inherited_listener.py 10.77.0.1 --fork-exec-exits > il.log 2>&1 || { report il.log; echo "FAIL: multiproc inherited_listener"; rc=1; }
grep -h "^inherited_listener" il.log
# Hostile peers against the transport, itself built with the sanitizers, and
# closed connections' kits serving new ones (one of them attacked).
for c in hostile foreign_rkey kit_reuse; do
  $B/tests/rdma/rsock_transport_vmtest \$c > tr.log 2>&1 || { report tr.log; echo "FAIL: transport \$c"; rc=1; }
  tail -1 tr.log
done
exit \$rc
IN
  tools/rxe-vm --timeout 900 -- "bash $B/in_vm.sh" || fail=1
else
  echo "SKIP (VM part): $why"
fi
[ $fail = 0 ] && echo "sanitize: PASS" || echo "sanitize: FAIL"
exit $fail
