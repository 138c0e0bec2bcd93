#!/usr/bin/env python3
# forking_server.py ADDR -- issue 12: Python's socketserver.ForkingTCPServer,
# unmodified, an accept-then-fork server (the master accepts, forks a child
# that serves the connection and exits, and closes its own copy). Run
# preloaded in the RDMA VM (ctest sets LD_PRELOAD): the server process and 12
# concurrent client threads, each sending 2 MiB of random bytes (a pause
# after the first 64 KiB) and reading the echo. Every byte must come back,
# in order, as without librsock. Under librsock every connection must reach
# RDMA in the child that serves it: the master's copy was pending or on RDMA
# at fork, and the child, once it is the only process holding it, upgrades
# it again (docs/DESIGN.md, "Upgrading again in the new owner"). Proof: each
# client sees transport rdma (SOL_RSOCK), and the kernel's `rdma resource
# show qp`, read while every connection is still open, lists RC QPs in RTS
# owned by more than one forked child and none by the master.
import os, signal, socketserver, sys

from rdma_env import held_echoes, report_forked_server, skip_unless_rdma

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
skip_unless_rdma(ADDR)
CONNS, N = 12, 2 * 1024 * 1024


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

counts = [[] for _ in range(CONNS)]
results, seen, whys, owners = held_echoes(ADDR, port, CONNS, N, counts)
os.kill(spid, signal.SIGTERM)
os.waitpid(spid, 0)
sys.exit(report_forked_server("forking_server", results, seen, whys, owners, spid, counts))
