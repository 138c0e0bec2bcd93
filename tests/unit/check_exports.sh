#!/bin/bash
# librsock.so must export every hook of util/libc_funcs.h (+ the variadic ones)
# and nothing else of ours: compares `nm -D --defined-only` with the list.
# Unless built with sanitizers ($3), it must not need the shared libstdc++:
# mapping that into every preloaded process cost about 0.8 ms per exec.
set -euo pipefail
lib=$1 src=$2 sanitize=${3:-}
if [ -z "$sanitize" ] && readelf -d "$lib" | grep NEEDED | grep -Eq 'libstdc\+\+|libgcc_s'; then
  echo "librsock.so needs the shared libstdc++ or libgcc_s (it must link them in):"
  readelf -d "$lib" | grep NEEDED
  exit 1
fi
want=$( (sed -n 's/^ *X([^,(]*, *\([A-Za-z_0-9]*\),.*/\1/p' "$src/util/libc_funcs.h"
         sed -n 's/^ *X(\([a-z0-9_]*\), Rsock.*/\1/p' "$src/util/libc_funcs.h") | sort -u)
have=$(nm -D --defined-only "$lib" | awk '{print $3}' | sed 's/@.*//' | sort -u)
if [ "$want" != "$have" ]; then
  echo "exported symbols differ from the hook list (< wanted, > exported):"
  diff <(echo "$want") <(echo "$have") || true
  exit 1
fi
echo "librsock.so exports exactly the $(echo "$want" | wc -l) hooks"
