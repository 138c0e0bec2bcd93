#!/bin/bash
# suite.sh BUILD_DIR -- host side of ctest's vm.suite (run from the repo root).
# Boots tools/rxe-vm and runs `ctest -L "rdma|conformance" -LE vm` of BUILD_DIR
# inside it (tests/vm/in_vm.sh). Exit 77 = skipped (no VM possible here, or no
# such tests registered); otherwise the status of the in-VM run.
set -uo pipefail
BUILD=${1:?usage: suite.sh BUILD_DIR}
BUILD=$(cd "$BUILD" && pwd) || exit 1
ROOT=$PWD
LABELS='rdma|conformance'
# conformance.plain, .preload and .fortify_symbols use no RDMA and run
# natively already; conformance.same (both runs, compared) stays in the
# guest, with the device present, next to conformance.rxe_same.
EXCL='^conformance\.(plain|preload|fortify_symbols)$'

if [ "${RSOCK_IN_VM:-0}" = 1 ]; then
  echo "SKIP: already inside the rxe VM"; exit 77
fi
if ! why=$(tools/rxe-vm --check 2>&1); then
  echo "SKIP: cannot boot the rxe VM here: ${why:-tools/rxe-vm --check failed}"
  exit 77
fi
# Count through a wrapper tree: even `ctest -N` rewrites the build tree's
# Testing/Temporary/LastTest.log, which the outer ctest running us is writing.
W=$(mktemp -d /tmp/vm-suite.XXXXXX)
printf 'subdirs("%s")\n' "$BUILD" > "$W/CTestTestfile.cmake"
n=$(cd "$W" && ctest -N -L "$LABELS" -LE vm -E "$EXCL" | sed -n 's/^Total Tests: //p')
rm -rf "$W"
if [ "${n:-0}" = 0 ]; then
  echo "SKIP: no tests labelled $LABELS in $BUILD"; exit 77
fi
case $BUILD/ in
  "$ROOT"/*) ;;
  *) echo "vm.suite: warning: $BUILD is not under $ROOT: the guest sees it read-only (writes are lost)" ;;
esac
# The .deb for package.deb_rdma, built here natively (seconds; in the guest
# cpack takes over a minute). That test builds its own if this one is absent
# or older than the build.
rm -rf "$BUILD/vm-deb"
if command -v cpack >/dev/null && command -v dpkg-deb >/dev/null && [ -f "$BUILD/CPackConfig.cmake" ]; then
  (cd /tmp && cpack -G DEB --config "$BUILD/CPackConfig.cmake" -B "$BUILD/vm-deb" >/dev/null 2>&1) \
    || echo "vm.suite: note: cpack failed on the host; package.deb_rdma will build the .deb in the guest"
fi
# The guest bound (2400 s) leaves room above the runs seen (1212-1555 s; a
# loaded host runs a multiproc test in 20-25 s that takes 7 s on an idle
# one): a slow host should make CI slow, not red.
echo "vm.suite: running $n tests ($LABELS) of $BUILD in the rxe VM"
rc=0
tools/rxe-vm --timeout "${RSOCK_VM_TIMEOUT:-2400}" -- "bash $ROOT/tests/vm/in_vm.sh $BUILD '$LABELS' '$EXCL'" || rc=$?
case $rc in
  0) echo "vm.suite: PASS" ;;
  125) echo "vm.suite: FAIL: the VM died or timed out before the tests finished" ;;
  *) echo "vm.suite: FAIL (status $rc)" ;;
esac
# 77 from inside would be a false skip: only the host decides to skip.
[ $rc = 77 ] && rc=1
exit $rc
