#!/bin/bash
# check_fortify.sh BINARY: the conformance binary must call glibc's fortified
# entry points, so that LD_PRELOAD hooks for them get exercised.
set -u
bin=${1:?usage: check_fortify.sh BINARY}
missing=0
for sym in __read_chk __recv_chk __recvfrom_chk __poll_chk; do
  if nm -D --undefined-only "$bin" | grep -q " $sym@"; then
    echo "ok: $sym"
  else
    echo "MISSING: $sym (is the suite still built with -O2 -D_FORTIFY_SOURCE=2?)"; missing=1
  fi
done
exit $missing
