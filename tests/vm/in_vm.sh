#!/bin/bash
# in_vm.sh BUILD_DIR LABELS [EXCLUDE_REGEX] -- guest side of vm.suite (runs inside tools/rxe-vm).
# Refuses to run without rxe0 (never a false pass), then runs the labelled
# tests with RSOCK_IN_VM=1 and fails if any `rdma` test skipped in here.
set -uo pipefail
BUILD=$1 LABELS=$2 EXCL=${3:-}
export RSOCK_IN_VM=1

echo "== in VM: $(uname -r), $(nproc) vCPUs"
devs=$(ibv_devices 2>&1)
echo "$devs"
if ! grep -qw rxe0 <<<"$devs"; then
  echo "vm.suite: FAIL: ibv_devices does not list rxe0 inside the VM"
  rdma link show 2>&1
  exit 1
fi
rdma link show 2>&1

# ctest writes Testing/ (LastTest.log, cost data) next to the CTestTestfile it
# reads. The outer ctest that runs vm.suite uses BUILD's Testing/ right now, so
# read BUILD's tests through a wrapper tree in guest /tmp instead.
W=$(mktemp -d /tmp/vm-ctest.XXXXXX)
printf 'subdirs("%s")\n' "$BUILD" > "$W/CTestTestfile.cmake"
LOG=$W/ctest.out
# Watchdog for every test: a process with librsock loaded that runs longer
# than RSOCK_WATCHDOG_S (default 240 s; no VM test program should) gets its
# rsock-stat and thread states dumped once, so that a hang is diagnosed from
# this log before ctest's timeout kills it.
. "$(dirname "$0")/../readiness/watchdog.sh"
export RSOCK_STAT=$BUILD/rsock-stat
(
  declare -A dumped
  while sleep 10; do
    for m in /proc/[0-9]*/maps; do
      p=${m#/proc/}; p=${p%/maps}
      [ -z "${dumped[$p]:-}" ] || continue
      grep -q librsock "$m" 2>/dev/null || continue
      age=$(ps -o etimes= -p "$p" 2>/dev/null | tr -d ' ')
      [ -n "$age" ] && [ "$age" -ge "${RSOCK_WATCHDOG_S:-240}" ] || continue
      dumped[$p]=1
      echo "watchdog: pid $p has run ${age}s under librsock"
      watchdog_dump "$p"
    done
  done
) &
WATCHDOG=$!
trap 'kill $WATCHDOG 2>/dev/null' EXIT
# A failing test is run once more before it counts as failed: the guest is a
# TCG emulation on a shared 2-core host, where a handful of timing-bound VM
# tests have shown rare flakes (docs/TESTING.md). A test that fails twice fails.
(cd "$W" && ctest -L "$LABELS" -LE vm ${EXCL:+-E "$EXCL"} --output-on-failure --repeat until-pass:2) 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
# Keep this run's log: any later ctest call in $W, even `ctest -N` below,
# rewrites Testing/Temporary/LastTest.log (the digest at the end once read
# that empty log and said nothing about a failed test).
cp "$W/Testing/Temporary/LastTest.log" "$W/run.log" 2>/dev/null
# And a copy in the build tree (the host's, through 9p), where tools/test-all
# reads each test's time: the outer ctest shows this output only on failure.
cp "$LOG" "$BUILD/vm-suite.ctest.log" 2>/dev/null
# Belt and braces: a pass needs ctest's own all-passed summary line too.
grep -q '^100% tests passed' "$LOG" || { [ $rc = 0 ] && rc=1; }

rdma_tests=$(cd "$W" && ctest -N -L rdma -LE vm | sed -n 's/^ *Test *#[0-9]*: //p')
skipped=$(sed -n 's/^[[:space:]]*[0-9]* - \([^ ]*\) (Skipped).*/\1/p' "$LOG")
bad=
for s in $skipped; do
  grep -qxF "$s" <<<"$rdma_tests" && bad="$bad $s"
done
if [ -n "$bad" ]; then
  echo "vm.suite: FAIL: rdma tests skipped inside the VM (rxe0 present):$bad"
  [ $rc = 0 ] && rc=1
fi
# Last: why each test failed, in a few lines (CI shows only the tail).
failed=$(awk '/^The following tests FAILED:/ {on = 1; next} on && /^[[:space:]]+[0-9]+ - / {print $3; next} {on = 0}' "$LOG")
if [ -n "$failed" ]; then
  echo "== digest of the failed tests (guest ctest)"
  bash "$(dirname "$0")/../../tools/ctest-digest" "$W/run.log" $failed
fi
exit $rc
