#!/usr/bin/env python3
# socat_fork.py ADDR -- issue 12: socat, unmodified, as an accept-fork-exec
# server: `socat TCP-LISTEN:PORT,fork,reuseaddr EXEC:cat` accepts, forks a
# child per connection, which forks and execs cat on a socketpair and relays
# between the connection and cat. Run preloaded in the RDMA VM (ctest sets
# LD_PRELOAD; socat inherits it): 12 concurrent clients of 2 MiB each, all
# echoes checked, each connection held open until every echo is back. Under
# librsock every connection must reach RDMA in the socat child that serves it
# (docs/DESIGN.md, "Upgrading again in the new owner"), with RC QPs in RTS
# owned by the children and none by the master. Skipped without socat.
# --nofork: `EXEC:cat,nofork`, the inetd shape: socat's child execs cat
# directly with the connection as its stdin and stdout, so each connection
# must reach RDMA in that cat, which inherited it across exec
# (docs/DESIGN.md, "Upgrading again after exec").
# --plain-acceptor: `EXEC:cat,nofork` with socat itself run without
# librsock (inetd or systemd's Accept=yes: the acceptor is not ours) and
# only cat preloaded, through `env LD_PRELOAD=...`: cat adopts the
# connection it inherited from a process without librsock, at the stream
# positions the kernel counts (docs/DESIGN.md, "Connections inherited from a
# process without librsock"). A first connection starts the first cat,
# which takes the port's rdma_cm listener; then the 12 connections' cats
# each publish a side listener and that cat redirects their requests.
import os, shutil, signal, socket, subprocess, sys, time

from rdma_env import (fallback_of, held_echoes, recv_exactly, report_forked_server,
                      skip_unless_rdma, transport_of)

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
PLAIN = "--plain-acceptor" in sys.argv[2:]
NOFORK = PLAIN or "--nofork" in sys.argv[2:]
skip_unless_rdma(ADDR)
if shutil.which("socat") is None:
    print("SKIP: no socat")
    sys.exit(77)
CONNS, N = 12, 2 * 1024 * 1024

probe = socket.socket()
probe.bind((ADDR, 0))
port = probe.getsockname()[1]
probe.close()
lib = os.environ.get("LD_PRELOAD", "")
env = dict(os.environ)
exec_addr = "EXEC:cat,nofork" if NOFORK else "EXEC:cat"
if PLAIN:
    env.pop("LD_PRELOAD", None)
    if lib:
        exec_addr = "EXEC:env LD_PRELOAD=%s cat,nofork" % lib
srv = subprocess.Popen(["socat", "TCP-LISTEN:%d,bind=%s,fork,reuseaddr" % (port, ADDR), exec_addr],
                       env=env)
end = time.time() + 30
while time.time() < end:
    ss = subprocess.run(["ss", "-Hltn", "sport = :%d" % port], capture_output=True, text=True).stdout
    if ss.strip():
        break
    time.sleep(0.1)
else:
    print("FAIL: socat did not listen")
    srv.kill()
    sys.exit(1)

first = None
if PLAIN and lib:
    # Its cat is the first to run: it binds the port's rdma_cm listener. Its
    # own rendezvous came before any cat ran (no listener), so the port is
    # skipped for 2 s (the first strike) while it waits to try once more;
    # then the rest, whose requests that cat redirects.
    first = socket.create_connection((ADDR, port))
    first.sendall(b"first connection")
    first.settimeout(60)
    got = recv_exactly(first, 16)
    if got != b"first connection":
        print("FAIL: the first connection echoed %r" % got)
        sys.exit(1)
    time.sleep(2.5)

counts = [[] for _ in range(CONNS)]
results, seen, whys, owners = held_echoes(ADDR, port, CONNS, N, counts)
first_ok = True
if first is not None:
    # Its rendezvous found no rdma_cm listener (its cat had not started) and
    # was made once more at half the window: on RDMA by now, or soon.
    end = time.time() + 30
    while transport_of(first) == 1 and time.time() < end:
        time.sleep(0.2)
    first.sendall(b"first, again")
    got = recv_exactly(first, 12)
    first_ok = got == b"first, again" and transport_of(first) == 2
    print("socat_exec_plain: the first connection echoed %r on transport %d (%s)"
          % (got, transport_of(first), fallback_of(first)))
    first.close()
srv.send_signal(signal.SIGTERM)
srv.wait(30)
if not first_ok:
    print("FAIL: the first connection must reach RDMA once its cat runs")
    sys.exit(1)
sys.exit(report_forked_server("socat_exec_plain" if PLAIN else "socat_exec" if NOFORK else "socat_fork", results, seen, whys,
                              owners, srv.pid, counts))
