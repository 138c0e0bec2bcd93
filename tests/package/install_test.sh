#!/bin/bash
# package.install: librsock installs like a system library (docs/INSTALL.md).
#   1. cmake --install into a temporary DESTDIR (prefix /opt/librsock, then
#      /usr): every file where it belongs, nothing outside DESTDIR;
#   2. etc/librsock.conf is all comments and parses as all defaults, and its
#      documented defaults (uncommented) are the real ones;
#   3. librsock.pc: version, Cflags, the `preload` variable;
#   4. the man pages lint clean (groff -ww) and carry the version;
#   5. the rsock launcher: version, --help, -- true, options, LD_PRELOAD
#      prepending, exit codes; rsock doctor (exit 1 without an RDMA device);
#   6. with dpkg-deb: cpack -G DEB builds librsock_<version>_<arch>.deb with
#      its Depends, Recommends, conffile and files.
#
#   install_test.sh BUILD_DIR SOURCE_DIR VERSION LIBDIR
set -uo pipefail
build=$1 src=$2 version=$3 libdir=$4
tmp=$(mktemp -d /tmp/rsock-package.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
failures=0
pass() { echo "ok:   $*"; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
# expect DESCRIPTION COMMAND...: the command must succeed.
expect() { local what=$1; shift; if "$@"; then pass "$what"; else fail "$what"; fi; }
has() { grep -qF -- "$2" <<<"$1"; }   # has TEXT NEEDLE

mans=(man1/rsock.1 man5/librsock.conf.5 man7/librsock.7 man8/rsock-stat.8)

# ---------------------------------------------------------------------------
# 1. cmake --install, prefix /opt/librsock, into DESTDIR.
prefix=/opt/librsock
dest=$tmp/root
if ! DESTDIR=$dest cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1; then
  cat "$tmp/install.log"
  fail "cmake --install"
  exit 1
fi
root=$dest$prefix
outside=$(sed -n 's/^-- \(Installing\|Up-to-date\): //p' "$tmp/install.log" | grep -v "^$dest/" || true)
[ -z "$outside" ] && pass "everything installed under DESTDIR" || fail "installed outside DESTDIR: $outside"
lib=$root/$libdir/librsock.so
for f in "$lib" "$root/include/librsock.h" "$root/$libdir/pkgconfig/librsock.pc" "$root/etc/librsock.conf" \
         "$root/share/doc/librsock/changelog.gz" "$root/share/doc/librsock/librsock.conf.example"; do
  expect "installed ${f#"$root"/}" test -f "$f"
done
for f in "$root/bin/rsock" "$root/bin/rsock-stat"; do
  expect "installed ${f#"$root"/} (executable)" test -x "$f"
done
for m in "${mans[@]}"; do
  expect "installed share/man/$m.gz" test -f "$root/share/man/$m.gz"
done
case $libdir in
  lib/*-linux-*) pass "library in the multiarch directory $libdir" ;;
  *) [ -e /etc/debian_version ] && fail "library in $libdir, not lib/<multiarch>" || pass "library in $libdir" ;;
esac

# Prefix /usr: the configuration goes to /etc, as for the .deb.
if DESTDIR=$tmp/usr cmake --install "$build" --prefix /usr >"$tmp/install-usr.log" 2>&1; then
  expect "prefix /usr: etc/librsock.conf in /etc" test -f "$tmp/usr/etc/librsock.conf"
  expect "prefix /usr: not in /usr/etc" test ! -e "$tmp/usr/usr/etc"
  expect "prefix /usr: library in /usr/$libdir" test -f "$tmp/usr/usr/$libdir/librsock.so"
else
  cat "$tmp/install-usr.log"; fail "cmake --install --prefix /usr"
fi

# ---------------------------------------------------------------------------
# 2. The installed configuration: comments only, all defaults.
conf=$root/etc/librsock.conf
live=$(grep -v '^[[:space:]]*\(#.*\)\{0,1\}$' "$conf" || true)
[ -z "$live" ] && pass "etc/librsock.conf: every line commented out" || fail "etc/librsock.conf has live lines: $live"
out=$(RSOCK_CONFIG=$conf RSOCK_LOG_LEVEL=info LD_PRELOAD=$lib env true 2>&1)
if has "$out" "info: config $conf: log_level=info" && ! has "$out" "passing all sockets through"; then
  pass "etc/librsock.conf parses as all defaults"
else
  fail "etc/librsock.conf does not parse as all defaults: $out"
fi
# Its global settings, uncommented, are the defaults it claims.
sed -n '1,/^# Rules:/p' "$conf" | sed -n 's/^# \([a-z_]* = \)/\1/p' >"$tmp/defaults.conf"
n=$(wc -l <"$tmp/defaults.conf")
out=$(RSOCK_CONFIG=$tmp/defaults.conf RSOCK_LOG_LEVEL=info LD_PRELOAD=$lib env true 2>&1)
if [ "$n" -ge 10 ] && has "$out" "info: config $tmp/defaults.conf: log_level=info"; then
  pass "the $n settings shown in etc/librsock.conf, uncommented, are the defaults"
else
  fail "uncommented settings of etc/librsock.conf ($n) differ from the defaults: $out"
fi
# ...and a broken file is noticed (so the checks above can fail).
printf 'no_such_key = 1\n' >"$tmp/bad.conf"
out=$(RSOCK_CONFIG=$tmp/bad.conf LD_PRELOAD=$lib env true 2>&1)
has "$out" "passing all sockets through" && pass "a broken config is reported" || fail "broken config not reported: $out"

# ---------------------------------------------------------------------------
# 3. pkg-config.
if command -v pkg-config >/dev/null; then
  export PKG_CONFIG_PATH=$root/$libdir/pkgconfig
  v=$(pkg-config --modversion librsock 2>&1)
  [ "$v" = "$version" ] && pass "librsock.pc version $v" || fail "librsock.pc version: $v (want $version)"
  v=$(pkg-config --cflags librsock 2>&1)
  v=${v%% }
  [ "$v" = "-I$prefix/include" ] && pass "librsock.pc Cflags $v" || fail "librsock.pc Cflags: $v"
  v=$(pkg-config --variable=preload librsock 2>&1)
  [ "$v" = "$prefix/$libdir/librsock.so" ] && pass "librsock.pc preload=$v" || fail "librsock.pc preload: $v"
  v=$(pkg-config --libs librsock 2>&1)
  [ -z "$v" ] && pass "librsock.pc has no Libs" || fail "librsock.pc Libs: $v"
  unset PKG_CONFIG_PATH
else
  echo "note: no pkg-config, librsock.pc not queried"
fi
if command -v cc >/dev/null; then
  printf '#include <librsock.h>\nint main(void) { return SOL_RSOCK == 0x5253 && RSOCK_TRANSPORT_RDMA == 2 ? 0 : 1; }\n' >"$tmp/t.c"
  expect "a C program builds with the installed librsock.h" \
    bash -c "cc -I'$root/include' -o '$tmp/t' '$tmp/t.c' && '$tmp/t'"
fi

# ---------------------------------------------------------------------------
# 4. Man pages: lint clean, version filled in.
for m in "${mans[@]}"; do
  page=$src/docs/man/${m#*/}
  w=$(groff -ww -man -z "$page" 2>&1)
  [ -z "$w" ] && pass "groff -ww lint ${m#*/}" || fail "groff -ww lint ${m#*/}: $w"
  w=$(zcat "$root/share/man/$m.gz" | groff -ww -man -z 2>&1)
  [ -z "$w" ] || fail "groff -ww lint of the installed $m.gz: $w"
  zcat "$root/share/man/$m.gz" | grep -q "^\.TH .*\"librsock $version\"" \
    && pass "installed $m.gz carries version $version" || fail "installed $m.gz: no version $version in .TH"
done
if command -v mandoc >/dev/null; then
  for m in "${mans[@]}"; do
    w=$(mandoc -T lint -W warning "$src/docs/man/${m#*/}" 2>&1)
    [ -z "$w" ] && pass "mandoc lint ${m#*/}" || fail "mandoc lint ${m#*/}: $w"
  done
fi
# The changelog's newest entry is this version.
head -1 "$src/docs/changelog" | grep -q "^librsock ($version) " \
  && pass "docs/changelog starts with $version" || fail "docs/changelog does not start with librsock ($version): bump it"

# ---------------------------------------------------------------------------
# 5. The launcher.
rsock=$root/bin/rsock
want_lib=$(readlink -f "$lib")
layout=$(sed -n 's/.*kLayoutVersion = \([0-9]*\);.*/\1/p' "$src/util/stats_layout.h")
wire=$(sed -n 's/.*kWireVersion = \([0-9]*\);.*/\1/p' "$src/transport/wire.h")
wire_min=$(sed -n 's/.*kWireMinVersion = \([0-9]*\);.*/\1/p' "$src/transport/wire.h")
rdv=$(sed -n 's/.*kRendezvousVersion = \([0-9]*\);.*/\1/p' "$src/socket/upgrade_wire.h")
rdv_min=$(sed -n 's/.*kRendezvousMinVersion = \([0-9]*\);.*/\1/p' "$src/socket/upgrade_wire.h")
out=$("$rsock" version 2>&1); rc=$?
if [ $rc = 0 ] && has "$out" "rsock $version (librsock $version)" && has "$out" "library:       $want_lib" &&
   has "$out" "stats layout:  $layout " && has "$out" "wire format:   $wire " && has "$out" "rendezvous:    $rdv " &&
   has "$out" "$wire_min..$wire spoken, negotiated" && has "$out" "$rdv_min..$rdv spoken, negotiated"; then
  pass "rsock version"
else
  fail "rsock version (exit $rc): $out"
fi
out=$("$rsock" --help 2>&1); rc=$?
[ $rc = 0 ] && has "$out" "usage: rsock" && has "$out" "doctor" && pass "rsock --help" || fail "rsock --help (exit $rc): $out"
out=$("$rsock" -- true 2>&1); rc=$?
[ $rc = 0 ] && [ -z "$out" ] && pass "rsock -- true" || fail "rsock -- true (exit $rc): $out"
out=$("$rsock" true 2>&1); rc=$?
[ $rc = 0 ] && pass "rsock true" || fail "rsock true (exit $rc): $out"
out=$(LD_PRELOAD=libc.so.6 "$rsock" -- printenv LD_PRELOAD 2>&1)
[ "$out" = "$want_lib libc.so.6" ] && pass "LD_PRELOAD prepended" || fail "LD_PRELOAD not prepended: $out"
out=$(env -u LD_PRELOAD "$rsock" --tcp --config "$conf" --log-level info -- printenv RSOCK_DEFAULT RSOCK_CONFIG RSOCK_LOG_LEVEL 2>"$tmp/err")
[ "$out" = "tcp"$'\n'"$conf"$'\n'"info" ] && pass "--tcp, --config, --log-level set RSOCK_DEFAULT, RSOCK_CONFIG, RSOCK_LOG_LEVEL" \
  || fail "--tcp/--config/--log-level: $out"
grep -q "info: config $conf: log_level=info default=tcp" "$tmp/err" && pass "the program ran with librsock loaded" \
  || fail "no librsock config line from the program: $(cat "$tmp/err")"
"$rsock" -- sh -c 'exit 3' >/dev/null 2>&1; rc=$?
[ $rc = 3 ] && pass "rsock passes the program's exit status" || fail "program exit status 3 came back as $rc"
for args in "" "--bogus true" "--log-level loud true" "--config $tmp/none true" "version extra"; do
  # shellcheck disable=SC2086
  "$rsock" $args >/dev/null 2>&1; rc=$?
  [ $rc = 2 ] && pass "usage error exits 2: rsock $args" || fail "rsock $args: exit $rc, want 2"
done
"$rsock" -- "$tmp/no-such-program" >/dev/null 2>&1; rc=$?
[ $rc = 127 ] && pass "missing program exits 127" || fail "missing program: exit $rc, want 127"
RSOCK_LIBRARY=$tmp/none.so "$rsock" true >/dev/null 2>&1; rc=$?
[ $rc = 125 ] && pass "missing library exits 125" || fail "missing library: exit $rc, want 125"
# The build tree's copy and the source tree's tools/rsock.
out=$("$build/rsock" version 2>&1)
has "$out" "library:       $(readlink -f "$build/librsock.so")" && pass "build-tree rsock finds $build/librsock.so" \
  || fail "build-tree rsock: $out"
out=$("$src/tools/rsock" version 2>&1)
has "$out" "rsock $version (librsock $version)" && has "$out" "wire format:   $wire " \
  && has "$out" "$wire_min..$wire spoken, negotiated" && pass "source-tree tools/rsock reads the versions from the sources" || fail "source-tree tools/rsock version: $out"

# rsock doctor: exit 1 and says so when there is no RDMA device.
out=$("$rsock" doctor 2>&1); rc=$?
echo "--- rsock doctor (exit $rc):"; echo "$out"; echo "---"
has "$out" "[ok]      library $want_lib loads" && pass "doctor: library loads" || fail "doctor: library check"
has "$out" "[ok]      config" && pass "doctor: config parses" || fail "doctor: config check"
has "$out" "memlock" && has "$out" "fd limit" && pass "doctor: memlock and fd limits" || fail "doctor: limits missing"
if [ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
  [ $rc = 1 ] && has "$out" "no RDMA device: every connection stays on TCP" \
    && pass "doctor without an RDMA device: exit 1, says so" || fail "doctor without an RDMA device: exit $rc"
else
  [ $rc = 0 ] || [ $rc = 1 ] && pass "doctor with an RDMA device: exit $rc" || fail "doctor: exit $rc"
fi
out=$("$rsock" --config "$tmp/bad.conf" doctor 2>&1); rc=$?
[ $rc = 1 ] && has "$out" "[PROBLEM] configuration error" && has "$out" "no_such_key" \
  && pass "doctor reports a broken config" || fail "doctor with a broken config (exit $rc): $out"
out=$("$rsock" doctor 127.0.0.1 2>&1); rc=$?
[ $rc = 1 ] && has "$out" "reached over loopback" && pass "doctor PEER: loopback has no RDMA" || fail "doctor 127.0.0.1 (exit $rc): $out"
"$rsock" doctor --bogus >/dev/null 2>&1; rc=$?
[ $rc = 2 ] && pass "doctor usage error exits 2" || fail "doctor --bogus: exit $rc"
# With a (fake) RDMA device: /sys and /dev under RSOCK_DOCTOR_SYSROOT, fake
# ibv_devinfo, rdma and ip on PATH (no hardware is needed to check the doctor).
fake=$tmp/fake
mkdir -p "$fake/sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs" "$fake/dev/infiniband" "$fake/bin"
echo "4: ACTIVE" >"$fake/sys/class/infiniband/rxe0/ports/1/state"
echo "5: LinkUp" >"$fake/sys/class/infiniband/rxe0/ports/1/phys_state"
echo "Ethernet" >"$fake/sys/class/infiniband/rxe0/ports/1/link_layer"
echo "eth7" >"$fake/sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/0"
: >"$fake/dev/infiniband/uverbs0"; : >"$fake/dev/infiniband/rdma_cm"
printf '#!/bin/sh\nprintf "1 HCA found:\\n\\trxe0\\n"\n' >"$fake/bin/ibv_devinfo"
printf '#!/bin/sh\necho "link rxe0/1 state ${FAKE_STATE:-ACTIVE} physical_state LINK_UP netdev eth7"\n' >"$fake/bin/rdma"
printf '#!/bin/sh\ncase "$3" in 10.7.*) echo "$3 dev eth7 src 10.7.0.1 uid 0" ;; *) echo "$3 dev eth0 src 192.0.2.1 uid 0" ;; esac\n' >"$fake/bin/ip"
# rping: resolves, then nobody listens (what the doctor expects of a good peer).
printf '#!/bin/sh\necho "cma event ${FAKE_CM:-RDMA_CM_EVENT_REJECTED}, error 8"\nexit 1\n' >"$fake/bin/rping"
chmod +x "$fake/bin/"*
doctor_fake() { RSOCK_DOCTOR_SYSROOT=$fake PATH=$fake/bin:$PATH "$rsock" doctor --connections 10 "$@" 2>&1; }
out=$(doctor_fake 10.7.0.2); rc=$?
[ $rc = 0 ] && has "$out" "[ok]      RDMA device rxe0 port 1: ACTIVE (Ethernet on eth7)" &&
  has "$out" "10.7.0.2 (10.7.0.2) is reached through eth7, RDMA port rxe0/1 ACTIVE" && has "$out" "no problem found" \
  && pass "doctor with an ACTIVE device and a peer behind it: exit 0" || fail "doctor, fake device, peer on eth7 (exit $rc): $out"
out=$(FAKE_CM=RDMA_CM_EVENT_ROUTE_ERROR doctor_fake 10.7.0.2); rc=$?
[ $rc = 1 ] && has "$out" "rdma_cm cannot resolve a route to 10.7.0.2" \
  && pass "doctor: a route rdma_cm cannot resolve is a problem" || fail "doctor, ROUTE_ERROR (exit $rc): $out"
out=$(doctor_fake 192.0.2.9); rc=$?
[ $rc = 1 ] && has "$out" "reached through eth0, which has no RDMA device" \
  && pass "doctor: a peer behind a netdev without RDMA is a problem" || fail "doctor, peer on eth0 (exit $rc): $out"
out=$(FAKE_STATE=DOWN doctor_fake 10.7.0.2); rc=$?
[ $rc = 1 ] && has "$out" "whose RDMA port rxe0/1 is DOWN" && pass "doctor: a peer behind a DOWN port is a problem" \
  || fail "doctor, DOWN link (exit $rc): $out"
echo "1: DOWN" >"$fake/sys/class/infiniband/rxe0/ports/1/state"
out=$(doctor_fake); rc=$?
[ $rc = 1 ] && has "$out" "no ACTIVE RDMA port" && pass "doctor: no ACTIVE port is a problem" || fail "doctor, port DOWN (exit $rc): $out"
echo "4: ACTIVE" >"$fake/sys/class/infiniband/rxe0/ports/1/state"
printf '#!/bin/sh\necho "0 HCAs found:"\n' >"$fake/bin/ibv_devinfo"
rm "$fake/dev/infiniband/rdma_cm"
out=$(doctor_fake); rc=$?
[ $rc = 1 ] && has "$out" "libibverbs finds none" && has "$out" "ibverbs-providers" && has "$out" "/dev/infiniband/rdma_cm is missing" \
  && pass "doctor: missing provider and rdma_cm device are problems" || fail "doctor, no provider (exit $rc): $out"

# Under an ordinary user's limits (8 MiB memlock, no CAP_IPC_LOCK): 139 connections fit.
if command -v setpriv >/dev/null && setpriv --bounding-set=-ipc_lock true 2>/dev/null; then
  out=$(setpriv --bounding-set=-ipc_lock bash -c "ulimit -l 8192 && '$rsock' doctor --connections 200" 2>&1)
  has "$out" "holds 139 connections (16 KiB rings, 44 KiB pinned each)" && has "$out" "ulimit -l" &&
    has "$out" "LimitMEMLOCK=" && has "$out" "/etc/security/limits.conf" \
    && pass "doctor: memlock 8 MiB holds 139 connections, says how to raise it" || fail "doctor memlock 8 MiB: $out"
elif [ "$(id -u)" != 0 ]; then
  out=$(bash -c "ulimit -l 8192 2>/dev/null && '$rsock' doctor --connections 200" 2>&1)
  has "$out" "holds 139 connections" && pass "doctor: memlock 8 MiB holds 139 connections" \
    || echo "note: memlock check under 8 MiB skipped: $out" | head -3
fi

# ---------------------------------------------------------------------------
# 6. The Debian package.
if command -v dpkg-deb >/dev/null && command -v cpack >/dev/null && [ -f "$build/CPackConfig.cmake" ]; then
  arch=$(dpkg --print-architecture)
  deb=$tmp/deb/librsock_${version}_$arch.deb
  if cpack -G DEB --config "$build/CPackConfig.cmake" -B "$tmp/deb" >"$tmp/cpack.log" 2>&1 && [ -f "$deb" ]; then
    pass "cpack -G DEB: ${deb##*/}"
    info=$(dpkg-deb -f "$deb")
    for want in "Package: librsock" "Version: $version" "Architecture: $arch" "Recommends: ibverbs-providers"; do
      has "$info" "$want" && pass "deb control: $want" || fail "deb control lacks '$want': $info"
    done
    depends=$(dpkg-deb -f "$deb" Depends)
    for d in libibverbs1 librdmacm1; do
      grep -qE "(^|, )$d( |,|$)" <<<"$depends" && pass "deb Depends $d" || fail "deb Depends lacks $d: $depends"
    done
    [ "$(dpkg-deb -I "$deb" conffiles 2>&1)" = /etc/librsock.conf ] && pass "deb conffile /etc/librsock.conf" \
      || fail "deb conffiles: $(dpkg-deb -I "$deb" conffiles 2>&1)"
    files=$(dpkg-deb -c "$deb" | awk '{print $6}')
    for f in ./etc/librsock.conf ./usr/bin/rsock ./usr/bin/rsock-stat ./usr/include/librsock.h \
             "./usr/$libdir/librsock.so" "./usr/$libdir/pkgconfig/librsock.pc" \
             ./usr/share/doc/librsock/changelog.gz ./usr/share/doc/librsock/librsock.conf.example; do
      grep -qxF -- "$f" <<<"$files" && pass "deb contains $f" || fail "deb lacks $f"
    done
    for m in "${mans[@]}"; do
      grep -qxF -- "./usr/share/man/$m.gz" <<<"$files" && pass "deb contains man page $m.gz" || fail "deb lacks ./usr/share/man/$m.gz"
    done
    stray=$( (grep -v -e '^\./$' -e '^\./\(usr\|etc\)\(/\|$\)' <<<"$files"; grep '^\./usr/local' <<<"$files") || true)
    [ -z "$stray" ] && pass "deb has files only in /usr and /etc" || fail "deb has stray files: $stray"
    dpkg-deb -x "$deb" "$tmp/x"
    v=$(PKG_CONFIG_PATH=$tmp/x/usr/$libdir/pkgconfig pkg-config --variable=preload librsock 2>&1)
    [ "$v" = "/usr/$libdir/librsock.so" ] && pass "deb librsock.pc preload=$v" || fail "deb librsock.pc preload: $v"
    out=$("$tmp/x/usr/bin/rsock" -- true 2>&1); rc=$?
    [ $rc = 0 ] && pass "the packaged rsock runs a program with the packaged library" || fail "packaged rsock -- true (exit $rc): $out"
    zcat "$tmp/x/usr/share/doc/librsock/changelog.gz" | head -1 | grep -q "^librsock ($version) " \
      && pass "deb changelog.gz starts with $version" || fail "deb changelog.gz"
  else
    cat "$tmp/cpack.log"
    fail "cpack -G DEB"
  fi
else
  echo "note: no dpkg-deb or cpack: the .deb is not checked"
fi

echo
if [ "$failures" -gt 0 ]; then
  echo "package.install: $failures check(s) FAILED"
  exit 1
fi
echo "package.install: all checks passed"
