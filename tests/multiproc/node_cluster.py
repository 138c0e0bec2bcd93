#!/usr/bin/env python3
# node_cluster.py ADDR [--shared] -- issue 12, fd passing with an unmodified
# program: Node's cluster module (tests/multiproc/node_cluster.js).
# --shared: its shared-handle mode (SCHED_NONE). The primary binds the
# listening socket without listen() and sends it to both workers over
# SCM_RIGHTS; each worker listen()s on its copy and accepts on it. The
# first worker to listen holds the port's rdma_cm listener, the other
# publishes its connections in the port's named table (docs/DESIGN.md,
# "Listening sockets received with SCM_RIGHTS"), so again every connection
# must reach RDMA in the worker that accepted it. Otherwise its primary
# accepts every connection and hands it to one of two worker processes over
# SCM_RIGHTS; the workers are fork + exec'd node processes. Run preloaded
# in the RDMA VM (ctest sets LD_PRELOAD for node and for these clients):
# 12 concurrent clients each send 2 MiB of random bytes (a pause after the
# first 64 KiB) and read the echo. Every byte must come back, in order, as
# without librsock. Under librsock every connection must reach RDMA in the
# worker that serves it: the primary passes each one while its upgrade is
# pending (or on RDMA), leaving it shared; the worker's recvmsg takes it in
# and, once the primary closed its copy, upgrades it (docs/DESIGN.md,
# "Upgrading again in the receiver"). Proof: each client sees transport
# rdma, and `rdma resource show qp`, read while every connection is open,
# lists RC QPs in RTS owned by both workers and none by the primary.
import os, shutil, signal, subprocess, sys, time

from rdma_env import held_echoes, report_forked_server, skip_unless_rdma

args = [a for a in sys.argv[1:] if not a.startswith("--")]
ADDR = args[0] if args else "10.77.0.1"
MODE = "shared" if "--shared" in sys.argv else "rr"
skip_unless_rdma(ADDR)
node = shutil.which("node") or shutil.which("nodejs")
if not node:
    print("SKIP: no node")
    sys.exit(77)
CONNS, N = 12, 2 * 1024 * 1024
here = os.path.dirname(os.path.abspath(__file__))
# A new V8 under TCG: no JIT tiers that the emulator is known to trip over.
srv = subprocess.Popen([node, "--jitless", os.path.join(here, "node_cluster.js"), ADDR, "2", MODE],
                       stdout=subprocess.PIPE, text=True)
port = None
deadline = time.time() + 120
while time.time() < deadline:
    line = srv.stdout.readline()
    if not line:
        break
    if line.startswith("PORT "):
        port = int(line.split()[1])
        break
if port is None:
    srv.kill()
    print("FAIL: the node cluster did not start (exit %s)" % srv.poll())
    sys.exit(1)

counts = [[] for _ in range(CONNS)]
results, seen, whys, owners = held_echoes(ADDR, port, CONNS, N, counts)
srv.send_signal(signal.SIGTERM)
try:
    srv.wait(30)
except subprocess.TimeoutExpired:
    srv.kill()
sys.exit(report_forked_server("node_cluster" + ("_shared" if MODE == "shared" else ""), results, seen, whys, owners, srv.pid, counts))
