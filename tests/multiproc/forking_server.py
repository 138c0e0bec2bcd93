#!/usr/bin/env python3
# forking_server.py ADDR -- issue 12: Python's socketserver.ForkingTCPServer,
# unmodified, an accept-then-fork server (the master accepts, forks a child
# that serves the connection and exits, and closes its own copy). Run
# preloaded in the RDMA VM (ctest sets LD_PRELOAD): the server process and 12
# concurrent client threads, each sending 256 KiB of random bytes (a pause
# after the first 64 KiB) and reading the echo. Every byte must come back,
# in order, as without librsock. Under librsock every connection must reach
# RDMA in the child that serves it: the master's copy was pending or on RDMA
# at fork, and the child, once it is the only process holding it, upgrades
# it again (docs/DESIGN.md, "Upgrading again in the new owner"). Proof: each
# client sees transport rdma (SOL_RSOCK), and the kernel's `rdma resource
# show qp`, read while every connection is still open, lists RC QPs in RTS
# owned by more than one forked child and none by the master.
import os, signal, socketserver, sys, threading

from rdma_env import echo_once, qp_owners, skip_unless_rdma, transport_of

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
skip_unless_rdma(ADDR)
CONNS, N = 12, 256 * 1024
preloaded = "librsock" in os.environ.get("LD_PRELOAD", "")


class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        while True:
            b = self.request.recv(65536)
            if not b:
                break
            self.request.sendall(b)


class Server(socketserver.ForkingTCPServer):
    allow_reuse_address = True


# The server runs in a process of its own, as a real one would (it listens
# there, so it owns its rdma_cm listener): its forks copy none of the
# clients' sockets.
rd, wr = os.pipe()
spid = os.fork()
if spid == 0:
    try:
        os.close(rd)
        srv = Server((ADDR, 0), Echo)
        os.write(wr, b"%d\n" % srv.server_address[1])
        srv.serve_forever()
    finally:
        os._exit(0)
os.close(wr)
port = int(os.read(rd, 16))
os.close(rd)

results, seen, whys = [None] * CONNS, [set() for _ in range(CONNS)], [[] for _ in range(CONNS)]
arrived, go = threading.Semaphore(0), threading.Event()


def client(i):
    try:
        results[i] = echo_once(ADDR, port, os.urandom(N), seen[i], chunk=65536,
                               pause_after_first=1, hold=(arrived, go), why=whys[i])
    except Exception as e:  # noqa: BLE001
        results[i] = "error %r" % (e,)
        arrived.release()


threads = [threading.Thread(target=client, args=(i,)) for i in range(CONNS)]
for t in threads:
    t.start()
for _ in range(CONNS):
    arrived.acquire(timeout=180)
owners = qp_owners() if preloaded else set()
go.set()
for t in threads:
    t.join(180)
os.kill(spid, signal.SIGTERM)
os.waitpid(spid, 0)
good = sum(1 for r in results if r is True)
rdma = sum(1 for s in seen if 2 in s)
children = owners - {os.getpid(), spid}
print("forking_server: %d/%d echoes exact, %d/%d connections on RDMA, forked children with RC QPs "
      "in RTS: %d, master with RC QPs: %s" % (good, CONNS, rdma, CONNS, len(children), spid in owners))
for i in range(CONNS):
    if results[i] is not True or (preloaded and 2 not in seen[i]):
        print("  connection %d: result %s, transports %s, fallback reason %s"
              % (i, results[i], sorted(seen[i]), ",".join(whys[i]) or "?"))
if good != CONNS:
    print("FAIL: %d of %d echoes wrong or missing" % (CONNS - good, CONNS))
    sys.exit(1)
if preloaded and (rdma != CONNS or len(children) < 2 or spid in owners):
    print("FAIL: every connection must reach RDMA in the child serving it")
    sys.exit(1)
print("forking_server: PASS")
