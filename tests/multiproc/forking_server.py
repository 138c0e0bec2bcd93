#!/usr/bin/env python3
# forking_server.py ADDR -- issue 12: Python's socketserver.ForkingTCPServer,
# unmodified, an accept-then-fork server (the master accepts, a forked child
# serves each connection and exits). Run preloaded in the RDMA VM (ctest sets
# LD_PRELOAD): the server process and 12 concurrent client threads, each
# sending 256 KiB of random bytes, half-closing and reading the echo to EOF.
# Every byte must come back, in order, as without librsock. Connections
# served by a forked child do not upgrade there yet: the master accepted
# them, their upgrade was pending (fallback reason forked) or done (switched
# back at fork, handed_off), and a connection does not upgrade a second
# time; the test asserts correctness and prints the transports the clients
# saw.
import socketserver, sys, threading

from rdma_env import echo_clients, skip_unless_rdma

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
skip_unless_rdma(ADDR)
CONNS, N = 12, 256 * 1024


class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        while True:
            b = self.request.recv(65536)
            if not b:
                break
            self.request.sendall(b)


class Server(socketserver.ForkingTCPServer):
    allow_reuse_address = True


srv = Server((ADDR, 0), Echo)
port = srv.server_address[1]
threading.Thread(target=srv.serve_forever, daemon=True).start()

good, seen = echo_clients(ADDR, port, CONNS, N)
srv.shutdown()
srv.server_close()
print("forking_server: %d/%d echoes exact; client transports seen %s (-1 no librsock, 0 tcp, 1 upgrading, 2 rdma)"
      % (good, CONNS, seen))
if good != CONNS:
    print("FAIL: %d of %d echoes wrong or missing" % (CONNS - good, CONNS))
    sys.exit(1)
print("forking_server: PASS")
