# rdma_env.py -- shared by the multiproc tests: exit 77 ("SKIP") unless this
# host has a verbs device and ADDR is a local address to bind to.
import os, socket, sys


def skip_unless_rdma(addr):
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        print("SKIP: no RDMA device")
        sys.exit(77)
    try:
        socket.socket().bind((addr, 0))
    except OSError as e:
        print("SKIP: cannot bind %s: %s" % (addr, e))
        sys.exit(77)
