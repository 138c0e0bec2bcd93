#!/bin/bash
# compare.sh BINARY LIBRSOCK_SO [doctest args...]
# Runs the conformance binary natively and under LD_PRELOAD=LIBRSOCK_SO, each
# with doctest's XML reporter, reduces each run to "test case <TAB> result"
# (pass / fail / skipped / INCOMPLETE when the run died inside the case) and
# fails on any difference. The verdict is about *sameness*: a case that fails
# both ways is conformance.plain's problem, not this test's.
set -u
bin=${1:?usage: compare.sh BINARY LIBRSOCK_SO [doctest args]}
lib=${2:?usage: compare.sh BINARY LIBRSOCK_SO [doctest args]}
shift 2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# One line per test case, in run order.
summarize() {
  awk '
    function attr(s, a,   m) {
      if (match(s, a "=\"[^\"]*\"")) { m = substr(s, RSTART + length(a) + 2, RLENGTH - length(a) - 3); return m }
      return ""
    }
    /<TestCase / {
      if (cur != "") print cur "\tINCOMPLETE"
      cur = attr($0, "name")
      if (attr($0, "skipped") == "true") { print cur "\tskipped"; cur = "" }
      next
    }
    /test_case_success=/ && cur != "" {
      print cur "\t" (attr($0, "test_case_success") == "true" ? "pass" : "fail"); cur = ""
    }
    END { if (cur != "") print cur "\tINCOMPLETE" }
  ' "$1"
}

"$bin" --reporters=xml --out="$tmp/plain.xml" "$@" >"$tmp/plain.log" 2>&1
rc_plain=$?
if [ $rc_plain = 77 ]; then cat "$tmp/plain.log"; exit 77; fi  # SKIP (see the binary's message)
LD_PRELOAD=$lib "$bin" --reporters=xml --out="$tmp/preload.xml" "$@" >"$tmp/preload.log" 2>&1
rc_preload=$?
summarize "$tmp/plain.xml" >"$tmp/plain.txt"
summarize "$tmp/preload.xml" >"$tmp/preload.txt"

echo "plain:   exit $rc_plain, $(grep -c . "$tmp/plain.txt") test cases, $(grep -c $'\tpass$' "$tmp/plain.txt") passed"
echo "preload: exit $rc_preload, $(grep -c . "$tmp/preload.txt") test cases, $(grep -c $'\tpass$' "$tmp/preload.txt") passed"
for run in plain preload; do
  if grep -qv $'\t\(pass\|skipped\)$' "$tmp/$run.txt"; then
    echo "not passing in the $run run:"; grep -v $'\t\(pass\|skipped\)$' "$tmp/$run.txt" | sed 's/^/  /'
  fi
done
if [ ! -s "$tmp/plain.txt" ]; then
  echo "FAIL: the plain run produced no test cases"; cat "$tmp/plain.log"; exit 1
fi
if diff -u --label plain --label preload "$tmp/plain.txt" "$tmp/preload.txt"; then
  echo "SAME: per-test-case results identical with and without LD_PRELOAD"
  exit 0
fi
echo "DIFFERENT: see the diff above (- plain, + preload)"
# Failed assertions of both runs, straight from the XML (file:line, expression, values).
for run in plain preload; do
  fails=$(awk '
    /<TestCase / { if (match($0, /name="[^"]*"/)) tc = substr($0, RSTART + 6, RLENGTH - 7) }
    /<Expression success="false"/ {
      match($0, /line="[0-9]*"/); ln = substr($0, RSTART + 6, RLENGTH - 7)
      printf "  [%s] line %s:", tc, ln; grab = 1; next
    }
    /<\/Expression>/ { if (grab) print ""; grab = 0; next }
    grab && !/<\/?(Original|Expanded)>/ {
      gsub(/^ +/, ""); gsub(/&lt;/, "<"); gsub(/&gt;/, ">"); gsub(/&quot;/, "\""); gsub(/&amp;/, "\\&")
      printf " %s", $0
    }
  ' "$tmp/$run.xml" | head -n 40)
  [ -z "$fails" ] || printf -- "--- failed assertions, %s run:\n%s\n" "$run" "$fails"
done
echo "--- last lines of the preload run's stdout/stderr:"
tail -n 20 "$tmp/preload.log"
exit 1
