#!/bin/bash
# classify_test.sh -- ctest bench.redis.classify (native): classify.py on a
# fixture of perf-script samples (bench/redis/classify_fixture.txt): each
# sample lands in its side and kind, and per-request figures are samples x
# (1e6 / hz) / requests; table.py merges rounds into medians per row.
# Keeps bench/redis/where's report from rotting.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
out=$(python3 "$HERE/classify.py" 1000 10 < "$HERE/classify_fixture.txt") || { echo "$out"; exit 1; }
echo "$out"
fail=0
expect() {  # a line of the report, as a regular expression
  grep -Eq "$1" <<<"$out" || { echo "classify_test: FAIL: no line matching: $1"; fail=1; }
}
# 1000 Hz, 10 requests: one sample is 100 us per request.
expect '^server: 300\.0 us per request$'
expect '^  rxe: post_send .* 100\.0$'
expect '^  cq arm \(req_notify ioctl\) +100\.0$'
expect '^  syscall: ksys_read +100\.0$'
expect '^client: 300\.0 us per request$'
expect '^  librsock \(user\) +200\.0$'
expect '^  application \(user\) +100\.0$'
expect '^    rsock::socket::Stream::advance_locked +200\.0$'
expect '^progress threads: 100\.0 us per request$'
expect '^idle: 200\.0 us per request$'
# table.py: two rounds of the same samples in each mode, medians per row.
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
for f in plain.1 plain.2 rsock.1 rsock.2; do
  CLASSIFY_TSV=$T/$f.tsv python3 "$HERE/classify.py" 1000 10 < "$HERE/classify_fixture.txt" > /dev/null
done
out=$(python3 "$HERE/table.py" "$T") || { echo "$out"; exit 1; }
echo "$out"
expect '^CPU us per request, median of 2 round\(s\):$'
expect '^\| \*\*total\*\* \| 300\.0 \| 300\.0 \| 300\.0 \| 300\.0 \|$'
expect '^\| CQ arm and completion channel \(ioctl, read\) \| 200\.0 \| 200\.0 \| 0\.0 \| 0\.0 \|$'
expect '^\| idle \| 200\.0 \| 200\.0 \|$'
[ $fail = 0 ] && echo "classify_test: ok"
exit $fail
