# Helpers for VM tests that run programs under librsock (sourced).
#   watchdog_dump PID...     what the library and the threads of PID are doing:
#                            rsock-stat -p, per-thread state, wchan and syscall
#   run_watched LIMIT CMD... runs CMD in its own process group; if it still
#                            runs after LIMIT seconds, dumps every process of
#                            the group, kills it and returns 124
# So the next hang is diagnosed from the CI log alone. RSOCK_STAT: path of
# rsock-stat (default: rsock-stat on PATH).
watchdog_dump() {
  local p t
  for p in "$@"; do
    [ -d "/proc/$p" ] || continue
    echo "---- watchdog: pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-200)"
    "${RSOCK_STAT:-rsock-stat}" -p "$p" 2>&1 | head -60
    for t in /proc/"$p"/task/*; do
      printf '  tid %s %-16s state=%s wchan=%s syscall=%s\n' "${t##*/}" \
        "$(cat "$t/comm" 2>/dev/null)" "$(awk '{print $3}' "$t/stat" 2>/dev/null)" \
        "$(cat "$t/wchan" 2>/dev/null)" "$(cut -d' ' -f1 "$t/syscall" 2>/dev/null)"
    done
    echo "  open fds: $(ls "/proc/$p/fd" 2>/dev/null | wc -l)"
  done
}
run_watched() {
  local limit=$1; shift
  setsid "$@" &
  local pid=$! end=$(( $(date +%s) + limit ))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$end" ]; then
      echo "watchdog: still running after ${limit}s: $*"
      watchdog_dump $(pgrep -g "$pid" 2>/dev/null || echo "$pid")
      kill -KILL -- "-$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      return 124
    fi
    sleep 0.2
  done
  wait "$pid"
}
