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
import os, shutil, signal, socket, subprocess, sys, time

from rdma_env import held_echoes, report_forked_server, skip_unless_rdma

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
NOFORK = "--nofork" in sys.argv[2:]
skip_unless_rdma(ADDR)
if shutil.which("socat") is None:
    print("SKIP: no socat")
    sys.exit(77)
CONNS, N = 12, 2 * 1024 * 1024

probe = socket.socket()
probe.bind((ADDR, 0))
port = probe.getsockname()[1]
probe.close()
srv = subprocess.Popen(["socat", "TCP-LISTEN:%d,bind=%s,fork,reuseaddr" % (port, ADDR),
                        "EXEC:cat,nofork" if NOFORK else "EXEC:cat"])
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

counts = [[] for _ in range(CONNS)]
results, seen, whys, owners = held_echoes(ADDR, port, CONNS, N, counts)
srv.send_signal(signal.SIGTERM)
srv.wait(30)
sys.exit(report_forked_server("socat_exec" if NOFORK else "socat_fork", results, seen, whys,
                              owners, srv.pid, counts))
