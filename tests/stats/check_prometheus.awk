# Checks Prometheus text exposition format (what rsock-stat --prometheus
# prints), the subset node-exporter's textfile collector accepts:
#   - every sample line is  name{label="value",...} value  (labels optional),
#     value a non-negative integer, label values with only \\ \" \n escapes;
#   - every metric family has exactly one # HELP and one # TYPE line, both
#     before its samples; TYPE is counter or gauge; a counter's name ends in _total;
#   - the samples of a family are contiguous; no series appears twice;
#   - no empty lines, no timestamps.
# usage: awk -f check_prometheus.awk FILE   (exit 0: clean; else one line per problem)
function fail(msg) {
  printf "prometheus format, line %d: %s: [%s]\n", NR, msg, $0
  bad = 1
}
/^# HELP / {
  n = $3
  if (n !~ /^[a-zA-Z_:][a-zA-Z0-9_:]*$/) fail("bad metric name in HELP")
  if (help[n]++) fail("second HELP for " n)
  if (n in sampled) fail("HELP after samples of " n)
  if (NF < 4) fail("empty HELP text")
  next
}
/^# TYPE / {
  n = $3
  if (type[n]++) fail("second TYPE for " n)
  if (n in sampled) fail("TYPE after samples of " n)
  if (NF != 4 || ($4 != "counter" && $4 != "gauge")) fail("TYPE is not counter or gauge")
  if ($4 == "counter" && n !~ /_total$/) fail("counter " n " does not end in _total")
  next
}
/^#/ { next }  # a comment
{
  if (!match($0, /^[a-zA-Z_:][a-zA-Z0-9_:]*/)) { fail("no metric name"); next }
  n = substr($0, 1, RLENGTH)
  rest = substr($0, RLENGTH + 1)
  if (!(n in help) || !(n in type)) fail("sample of " n " before its HELP and TYPE")
  if (n != last && (n in sampled)) fail("samples of " n " are not together")
  sampled[n] = 1
  last = n
  label = "[a-zA-Z_][a-zA-Z0-9_]*=\"([^\"\\\\\n]|\\\\[\\\\\"n])*\""
  if (rest !~ ("^(\\{" label "(," label ")*\\})? (0|[1-9][0-9]*)$")) { fail("not name{labels} value"); next }
  series = n substr(rest, 1, length(rest) - length($NF) - 1)
  if (seen[series]++) fail("series twice")
}
END {
  for (n in help) if (!(n in type)) { printf "prometheus format: %s has HELP but no TYPE\n", n; bad = 1 }
  for (n in type) if (!(n in help)) { printf "prometheus format: %s has TYPE but no HELP\n", n; bad = 1 }
  if (NR == 0) { print "prometheus format: empty input"; bad = 1 }
  exit bad
}
