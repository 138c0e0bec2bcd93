#!/bin/bash
# deb_rdma.sh BUILD_DIR IP -- the .deb as a user installs it (label rdma, in
# the VM): cpack builds it, dpkg -i installs it into the throw-away guest,
# and an unmodified redis pair runs over RDMA through the installed `rsock`
# launcher with installed files only (the library mapped from
# /usr/lib/<multiarch>, nothing from the build tree). `rsock doctor` must be
# happy on the guest's rxe device.
set -uo pipefail
B=$(cd "$1" && pwd) IP=$2
ls /sys/class/infiniband/* >/dev/null 2>&1 || { echo "SKIP: no RDMA device"; exit 77; }
[ -n "${RSOCK_IN_VM:-}" ] || { echo "SKIP: installs a package: only inside the throw-away VM"; exit 77; }
for t in cpack dpkg redis-server redis-benchmark; do
  command -v $t >/dev/null || { echo "SKIP: $t missing"; exit 77; }
done
T=$(mktemp -d /tmp/deb.XXXXXX)
SRV=
trap '[ -n "$SRV" ] && kill $SRV 2>/dev/null; rm -rf "$T"' EXIT
fail=0
check() { if [ "$2" = 0 ]; then echo "PASS $1"; else echo "FAIL $1"; fail=$((fail + 1)); fi; }

# vm.suite's host side builds the .deb natively into BUILD/vm-deb before it
# boots the guest (cpack here took 72 s of TCG, most of it make's walk over
# the 9p build tree; package.install checks cpack itself natively). A .deb
# older than the build's library or launcher is not used.
deb=$(ls "$B"/vm-deb/librsock_*.deb 2>/dev/null | head -1)
if [ -n "$deb" ] && [ "$deb" -nt "$B/librsock.so" ] && [ "$deb" -nt "$B/rsock" ]; then
  echo "    using $deb (built on the host by vm.suite)"
else
  t0=$(date +%s)
  (cd "$T" && cpack -G DEB --config "$B/CPackConfig.cmake" -B "$T/out" >"$T/cpack.log" 2>&1)
  echo "    cpack: $(( $(date +%s) - t0 )) s"
  deb=$(ls "$T"/out/librsock_*.deb 2>/dev/null | head -1)
fi
check "cpack built $(basename "${deb:-none}")" $([ -n "$deb" ]; echo $?)
[ -n "$deb" ] || { tail -20 "$T/cpack.log"; exit 1; }
# man-db's dpkg trigger rebuilds the index of every man page on the
# (host's) filesystem: minutes under TCG, and nothing this test looks at.
# The guest is thrown away, so its switch is simply removed.
rm -f /var/lib/man-db/auto-update
t0=$(date +%s)
dpkg -i "$deb" >"$T/dpkg.log" 2>&1
check "dpkg -i" $?
echo "    dpkg -i: $(( $(date +%s) - t0 )) s"
lib=$(dpkg -L librsock | grep '/librsock\.so$' | head -1)
check "installed library $lib" $([ -n "$lib" ] && [[ $lib == /usr/lib/*-linux-*/librsock.so ]]; echo $?)
for f in /usr/bin/rsock /usr/bin/rsock-stat /etc/librsock.conf /usr/include/librsock.h; do
  check "installed $f" $([ -e "$f" ]; echo $?)
done

# Bounded (here and below): a hang is a FAIL with the logs, within the
# test's own timeout, not a ctest timeout that takes the VM suite down.
timeout 120 /usr/bin/rsock doctor "$IP" >"$T/doctor" 2>&1
rc=$?
sed 's/^/    /' "$T/doctor"
check "rsock doctor $IP: exit 0 on the rxe device" $([ $rc = 0 ]; echo $?)

PORT=$(( 20000 + RANDOM % 20000 ))
cd "$T"
env -u LD_PRELOAD /usr/bin/rsock --log-level info -- redis-server --port $PORT --bind "$IP" --protected-mode no --save '' --appendonly no \
  >"$T/server.log" 2>&1 &
SRV=$!
for _ in $(seq 1 100); do redis-cli -h "$IP" -p $PORT ping 2>/dev/null | grep -q PONG && break; sleep 0.2; done
timeout 240 env -u LD_PRELOAD /usr/bin/rsock --log-level info -- redis-benchmark -h "$IP" -p $PORT -n 4000 -c 4 -t set,get -q \
  >"$T/client.log" 2>&1
rc=$?
check "redis-benchmark through rsock: exit 0 (124: still running after 240 s)" $rc
[ $rc = 0 ] || { tail -20 "$T/client.log"; tail -20 "$T/server.log"; /usr/bin/rsock-stat -p $SRV 2>&1 | head -30; }
maps=$(awk '$6 ~ /librsock\.so$/ {print $6}' "/proc/$SRV/maps" 2>/dev/null | sort -u)
check "server maps the installed library only ($maps)" $([ "$maps" = "$lib" ]; echo $?)
stat=$(/usr/bin/rsock-stat -p $SRV 2>&1)
qps=$(rdma resource show qp 2>/dev/null | grep -c 'type RC.*state RTS')
sum=$(grep -o 'summary: connections=[0-9]* upgraded=[0-9]* fallbacks=[0-9]* rdma_tx=[0-9]*' "$T/client.log" | tail -1)
up=$(sed -n 's/.*upgraded=\([0-9]*\).*/\1/p' <<<"$sum")
rtx=$(sed -n 's/.*rdma_tx=\([0-9]*\).*/\1/p' <<<"$sum")
echo "    client: $sum"
echo "$stat" | head -4 | sed 's/^/    server: /'
check "client connections upgraded and bytes on RDMA (upgraded=${up:-0} rdma_tx=${rtx:-0})" \
  $([ "${up:-0}" -ge 4 ] && [ "${rtx:-0}" -gt 100000 ]; echo $?)
check "server's installed rsock-stat shows RDMA traffic" $(grep -q '^rdma tx [1-9]' <<<"$stat"; echo $?)
echo "    RC QPs in RTS after the run (the server's, idle): $qps"
t0=$(date +%s)
dpkg -r librsock >/dev/null 2>&1
check "dpkg -r" $?
echo "    dpkg -r: $(( $(date +%s) - t0 )) s"
echo "deb_rdma: $(( 11 - fail )) passed, $fail failed"
[ $fail = 0 ]
