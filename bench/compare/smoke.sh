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
