#!/bin/bash
# bench/compare/smoke.sh BUILD_DIR -- ctest bench.compare.smoke (inside the
# VM): bench/compare/in_vm.sh --quick into BUILD_DIR/bench-compare-smoke,
# then report.py --check: every expected cell has a figure or an explained
# n/a, and every librsock figure is proven (exit summaries) to be RDMA.
# Keeps the harness from rotting; never judges speed. Exit 77 without RDMA.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=$(cd "${1:?usage: smoke.sh BUILD_DIR}" && pwd) || exit 1
OUT=$BUILD/bench-compare-smoke
bash "$HERE/in_vm.sh" "$BUILD" "$OUT" --quick
rc=$?
[ $rc = 0 ] || exit $rc
python3 "$HERE/report.py" "$OUT" --check
rc=$?
if [ $rc != 0 ]; then
  # From "== digest" on is what tools/ctest-digest shows of this test in CI.
  echo "== digest: why bench.compare.smoke failed"
  python3 "$HERE/report.py" "$OUT" --check | sed -n '/^INVALID librsock/,/^$/p; /^CHECK:/p'
  echo "smoke FAIL: librsock runs without a figure (results.tsv):"
  awk -F'\t' '$1 == "na" && $3 == "rsock" {print "  " $2 ": " $5}' "$OUT/results.tsv"
  echo "smoke FAIL: librsock warnings and errors in the logs:"
  grep -H -E "warn|error" "$OUT"/logs/*.log 2>/dev/null | sed "s|^$OUT/logs/|  |" | head -12
fi
exit $rc
