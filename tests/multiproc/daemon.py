#!/usr/bin/env python3
# daemon.py ADDR [--after-listen] -- issue 12 item 6: a daemonizing program (fork, setsid, close
# every fd, fork again) still gets its connections upgraded. Run preloaded in
# the RDMA VM. The daemon forks away before any socket exists, as daemons do;
# the original process then serves an echo, and the daemon (the grandchild)
# connects, sends 1 MiB, reads it back, checks it, and reports the transports
# it saw (getsockopt SOL_RSOCK) in a file. Exit 0 when every byte came back
# and the connection was on RDMA (transport 2) at some point.
#
# --after-listen: the process listens (librsock opens the RDMA devices for its
# rdma_cm listener) before the daemon forks away, like a preforking server.
# The kernel refuses a fork child's commands on device contexts its parent
# opened; librsock opens its own in the child, so the daemon's connection
# upgrades all the same.
import os, socket, sys, threading, time

from rdma_env import skip_unless_rdma, transport_of

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
AFTER_LISTEN = "--after-listen" in sys.argv
skip_unless_rdma(ADDR)
N = 1 << 20
tag = "/tmp/daemon-test.%d" % os.getpid()
port_file, result = tag + ".port", tag + ".result"

srv = None
if AFTER_LISTEN:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((ADDR, 0))
    srv.listen(4)

pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    os.closerange(0, 1024)  # what daemons do
    try:
        deadline = time.time() + 60
        while not os.path.exists(port_file) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.1)
        port = int(open(port_file).read())
        s = socket.create_connection((ADDR, port))
        data = os.urandom(N)
        seen, got, sent = set(), bytearray(), 0
        def look():
            seen.add(transport_of(s))
        while sent < N:
            sent += s.send(data[sent:sent + 65536])
            look()
            while len(got) < sent - 4 * 65536:
                got += s.recv(65536)
            if sent == 65536:
                time.sleep(1)  # let the upgrade land with most bytes still to go
        s.shutdown(socket.SHUT_WR)
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
            look()
        msg = "ok=%d transports=%s" % (bytes(got) == data, ",".join(map(str, sorted(seen))))
    except Exception as e:  # noqa: BLE001
        msg = "ok=0 error=%r" % (e,)
    with open(result + ".tmp", "w") as f:
        f.write(msg + "\n")
    os.rename(result + ".tmp", result)
    os._exit(0)
os.waitpid(pid, 0)  # the intermediate child exits at once

if srv is None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((ADDR, 0))
    srv.listen(4)
with open(port_file + ".tmp", "w") as f:
    f.write(str(srv.getsockname()[1]))
os.rename(port_file + ".tmp", port_file)

def serve():
    c, _ = srv.accept()
    while True:
        b = c.recv(65536)
        if not b:
            break
        c.sendall(b)
    c.close()

threading.Thread(target=serve, daemon=True).start()
deadline = time.time() + 150
while not os.path.exists(result) and time.time() < deadline:
    time.sleep(0.2)
msg = open(result).read().strip() if os.path.exists(result) else "no result"
for f in (port_file, result):
    if os.path.exists(f):
        os.unlink(f)
print("daemon:", msg)
seen = msg.split("transports=")[-1].split(",")
ok = msg.startswith("ok=1") and "2" in seen
sys.exit(0 if ok else 1)
