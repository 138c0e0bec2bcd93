#!/usr/bin/env python3
# prefork.py ADDR [--master-exits | --master-closes | --master-reexecs | --reuseport |
#                  --reuseport-each] -- issue 12 item 1: a preforking server, unmodified in
# shape: a master listens, forks WORKERS workers that accept on the listening
# socket they inherited, and then only sleeps (signal.pause: sigsuspend).
# Run preloaded in the RDMA VM (ctest sets LD_PRELOAD). The test process is
# the client: CONNS concurrent connections, each sending 2 MiB of random
# bytes (after a pause past the first 64 KiB, so that the upgrade lands
# mid-stream), half-closing and reading the echo to EOF.
# --master-exits: the master exits 2 s after forking the workers (the
# clients start once it is gone): a worker takes its rdma_cm listener over.
# --master-closes: the master closes its listening socket 2 s after forking
# and goes on sleeping: the listener is given up alive, a worker takes over.
# --reuseport: the master opens one SO_REUSEPORT listening socket per worker
# on the same port (nginx's `listen ... reuseport`), each worker accepts on
# its own; the kernel spreads the connections over them.
# --reuseport-each: each worker opens its own SO_REUSEPORT socket on the
# port after the fork (processes that share no librsock state: only the
# group's named table).
# --passed: the master hands its listening socket to WORKERS new processes
# (fork + exec, nothing inherited) over UNIX sockets with SCM_RIGHTS, as
# HAProxy's reload or a supervisor's fd store does, and sleeps holding the
# port's rdma_cm listener: half the connections come then (the master
# redirects them through the port's named table), the other half after
# the master exited (a worker took the listener over).
# --master-reexecs: the master execs itself in place 2 s after forking the
# workers (a binary upgrade or reload that keeps the listening socket, its
# pid and its workers); the new image only sleeps. Its rdma_cm listener is
# the new image's, which shares no memory with the workers: they publish
# their connections in the port's named table from then on.
#
# Asserted: every byte comes back in order; every connection was on RDMA
# (SOL_RSOCK transport 2) at some point, and at least 90 % of the payload,
# both directions, went over RDMA (RSOCK_BYTES at the clients), although the process holding the
# rdma_cm listener (the master) accepts none of them; more than one worker
# served connections; no worker died; and the kernel's `rdma resource show
# qp`, read while every connection is still open (the clients hold them
# once their echo is back), lists RC QPs in RTS owned by the workers (by
# thread group) and none owned by the master.
import os, signal, socket, subprocess, sys, threading, time

from rdma_env import echo_to_eof, held_echoes, skip_unless_rdma, tally

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
MASTER_EXITS = "--master-exits" in sys.argv
MASTER_CLOSES = "--master-closes" in sys.argv
MASTER_REEXECS = "--master-reexecs" in sys.argv
if len(sys.argv) > 3 and sys.argv[2] == "--reexeced-master":
    # The master's new image: it holds the listening socket (fd argv[3])
    # and sleeps; librsock took the socket in at its start.
    keep = socket.socket(fileno=int(sys.argv[3]))
    while True:
        signal.pause()
PASSED = "--passed" in sys.argv
REUSEPORT = "--reuseport" in sys.argv
REUSEPORT_EACH = "--reuseport-each" in sys.argv
skip_unless_rdma(ADDR)
WORKERS, CONNS, N = 3, 12, 2 * 1024 * 1024
tag = "/tmp/prefork-test.%d" % os.getpid()


def reuseport_socket(port):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    srv.bind((ADDR, port))
    return srv


def worker(srv, ready=None):
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if ready is not None:
        # (the master's socket reserved the port: bound, never listening)
        port = srv.getsockname()[1]
        srv = reuseport_socket(port)
        srv.listen(64)
        os.write(ready, b"r")
    def serve(c):
        echo_to_eof(c)
        with open("%s.served.%d" % (tag, os.getpid()), "a") as f:
            f.write("1\n")

    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def received_worker(unix_fd):
    # A worker exec'd with nothing but a UNIX socket: the listener comes
    # over it.
    u = socket.socket(fileno=unix_fd)
    _, fds, _, _ = socket.recv_fds(u, 1, 1)
    srv = socket.socket(fileno=fds[0])
    u.send(b"r")
    worker(srv)


if len(sys.argv) > 4 and sys.argv[2] == "--received-worker":
    tag = sys.argv[4]
    received_worker(int(sys.argv[3]))
    os._exit(0)


def reap(*_):
    # A worker that dies (a crash prints nothing when the sanitizers leave
    # SIGSEGV alone) is named in the report, with how it died.
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with open(tag + ".died", "a") as f:
            f.write("worker %d: %s\n" % (pid, "signal %d" % os.WTERMSIG(st) if os.WIFSIGNALED(st)
                                          else "exit %d" % os.WEXITSTATUS(st)))


def master(wfd):
    os.setpgid(0, 0)  # the test kills the whole group at the end
    signal.signal(signal.SIGCHLD, reap)
    socks = []
    for i in range(WORKERS if REUSEPORT else 1):
        srv = reuseport_socket(socks[0].getsockname()[1] if socks else 0) if REUSEPORT or \
            REUSEPORT_EACH else socket.socket()
        if not (REUSEPORT or REUSEPORT_EACH):
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((ADDR, 0))
        if not REUSEPORT_EACH:
            srv.listen(64)
        socks.append(srv)
    rr, rw = os.pipe()
    pids = []
    for i in range(WORKERS if PASSED else 0):
        a, b = socket.socketpair()
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), ADDR, "--received-worker",
                              str(b.fileno()), tag], pass_fds=[b.fileno()])
        b.close()
        socket.send_fds(a, [b"L"], [socks[0].fileno()])
        a.recv(1)  # it accepts from now on
        pids.append(p.pid)
    if PASSED:
        signal.signal(signal.SIGUSR1, lambda *_: os._exit(0))
    for i in range(0 if PASSED else WORKERS):
        pid = os.fork()
        if pid == 0:
            worker(socks[i % len(socks)], rw if REUSEPORT_EACH else None)
            os._exit(0)
        pids.append(pid)
    if REUSEPORT_EACH:
        got = b""
        while len(got) < WORKERS:
            got += os.read(rr, WORKERS)
    os.write(wfd, " ".join(map(str, [socks[0].getsockname()[1]] + pids)).encode())
    os.close(wfd)
    if MASTER_EXITS:
        # Once the workers wait in accept() (they watch the master then):
        # its exit is an event they see, not a state they find.
        time.sleep(2)
        os._exit(0)
    if MASTER_CLOSES:
        time.sleep(2)
        for srv in socks:
            srv.close()
    if MASTER_REEXECS:
        # Once the workers wait in accept(). (Its workers, no longer its
        # children in Python's eyes, are reaped by nobody: the test kills
        # the group.)
        time.sleep(2)
        os.set_inheritable(socks[0].fileno(), True)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), ADDR,
                                  "--reexeced-master", str(socks[0].fileno())])
    reap()
    while True:
        signal.pause()


r, w = os.pipe()
mpid = os.fork()
if mpid == 0:
    os.close(r)
    try:
        master(w)
    finally:
        os._exit(1)
os.close(w)
started = (os.read(r, 256) or b"0").split()
os.close(r)
port, worker_pids = int(started[0]), set(map(int, started[1:]))
if port == 0:
    print("prefork: the master did not start")
    sys.exit(1)
if MASTER_EXITS:
    os.waitpid(mpid, 0)
    time.sleep(1)
if MASTER_CLOSES:
    # its close, then its listener's grace (upgrade_timeout_ms, 2 s), then a
    # tick of the workers
    time.sleep(5)
if MASTER_REEXECS:
    time.sleep(5)  # its exec, and the new image's start (an interpreter: seconds in TCG)

# Every connection's echo is back and the connection still open when the QPs
# are listed, however quickly (or slowly) the transfers ran.
counts = [[] for _ in range(CONNS)]
if PASSED:
    # Half while the master holds the rdma_cm listener, half once it exited.
    half = CONNS // 2
    results, transports, whys, qp_seen = held_echoes(ADDR, port, half, N, counts[:half])
    os.kill(mpid, signal.SIGUSR1)
    os.waitpid(mpid, 0)
    time.sleep(3)  # a worker's takeover (its watch of the master's pidfd)
    more = held_echoes(ADDR, port, CONNS - half, N, counts[half:])
    results, transports, whys = results + more[0], transports + more[1], whys + more[2]
    qp_seen |= more[3]
else:
    results, transports, whys, qp_seen = held_echoes(ADDR, port, CONNS, N, counts)
time.sleep(0.5)  # the workers' served files
died = []
if os.path.exists(tag + ".died"):
    died = open(tag + ".died").read().splitlines()
os.killpg(mpid, signal.SIGKILL)
if not (MASTER_EXITS or PASSED):
    os.waitpid(mpid, 0)
served = {}
for name in os.listdir("/tmp"):
    path = "/tmp/" + name
    if path == tag + ".died":
        os.unlink(path)
    elif path.startswith(tag + ".served."):
        served[name.rsplit(".", 1)[1]] = len(open(path).read().split())
        os.unlink(path)
qp_workers = qp_seen & worker_pids
ok, rdma, share, total, counted = tally(results, transports, counts)
print("prefork%s: %d/%d echoes exact, %d/%d connections on RDMA, %.1f %% of %d bytes over RDMA, "
      "served per worker %s, workers with RC QPs in RTS: %d, master with RC QPs: %s"
      % (" (master exited)" if MASTER_EXITS else " (listener passed)" if PASSED else " (master re-exec'd)" if MASTER_REEXECS else " (master closed its socket)" if MASTER_CLOSES else " (SO_REUSEPORT)" if REUSEPORT else
         " (SO_REUSEPORT in each worker)" if REUSEPORT_EACH else "", ok,
         CONNS, rdma, CONNS, 100 * share, total, sorted(served.values()), len(qp_workers),
         mpid in qp_seen))
bad = [(i, results[i], sorted(transports[i]), ",".join(whys[i]) or "?") for i in range(CONNS)
       if results[i] is not True or 2 not in transports[i]]
for b in bad:
    print("  connection %d: result %s, transports %s, fallback reason %s" % b)
for d in died:
    print("  " + d + " (before the test ended)")
sys.exit(0 if not died and ok == CONNS and rdma == CONNS and len(served) > 1 and len(qp_workers) > 1
         and mpid not in qp_seen and counted == CONNS and share >= 0.9 else 1)
