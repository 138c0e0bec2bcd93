#!/usr/bin/env python3
# inetd_plain.py ADDR -- issue 12: an inetd-style server whose acceptor runs
# without librsock and uses the connection before it hands it on. The
# acceptor (see below) accepts, reads the
# client's 5-byte hello, writes a 7-byte banner, and forks a child that
# makes the connection its stdin and stdout and execs cat with librsock
# preloaded (as inetd or systemd's Accept=yes would start a service). cat
# adopts a connection nobody tracked, at the stream positions the kernel
# counts for it: 7 bytes out, 5 in, plus whatever the client sent meanwhile
# that still waits in the socket (docs/DESIGN.md, "Connections inherited
# from a process without librsock"). A switch from wrong positions would
# fail its marker check and reset the connection. Every other connection
# goes through a wrapper, `sh -c "exec /bin/cat"`: sh adopts it and execs
# in place, and the new image must adopt it again and serve the port.
# The acceptor is this script again, run without LD_PRELOAD, with a
# listening socket of its own (one opened under librsock would have an
# rdma_cm listener, which is another case: multiproc.inherited_*).
# The client (preloaded, from ctest) opens 4 connections one after the
# other, each held open. The first one's rendezvous finds no listener (its
# cat is not running yet) and is made once more at half the window; its cat
# takes the port's rdma_cm listener. The later ones, opened once the first
# has settled (past its first strike, 2 s), have their requests held there
# until their own cat publishes a side listener, and redirected to it. Each
# sends hello, more bytes at once (some wait in the socket across the exec),
# reads the banner, then 1 MiB echoed and checked.
# Every connection must reach RDMA, RC QPs in RTS owned by the cats, and at
# least 90 % of the payload over RDMA. Then 2 connections one at a time,
# each closed before the next: each must upgrade too (its retry).
import os, signal, socket, subprocess, sys, threading, time

from rdma_env import (bytes_of, fallback_of, qp_owners, recv_exactly, skip_unless_rdma,
                      transport_of)

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
if "--acceptor" not in sys.argv:
    skip_unless_rdma(ADDR)
LIB = os.environ.get("LD_PRELOAD", "")
CONNS, N = 4, 1 << 20
HELLO, BANNER, EARLY = b"hello", b"banner\n", b"sent before the exec;"


def run_acceptor(port, lib):
    # (Run without librsock: its own listening socket has no rdma_cm side.)
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((ADDR_ACCEPTOR, port))
    lsock.listen(16)
    print("listening", flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    n = 0
    while True:
        c, _ = lsock.accept()
        recv_exactly(c, len(HELLO))
        c.sendall(BANNER)
        if os.fork() == 0:
            os.dup2(c.fileno(), 0)
            os.dup2(c.fileno(), 1)
            env = dict(os.environ)
            if lib:
                env["LD_PRELOAD"] = lib
            if n % 2:
                # A wrapper that execs the server in place: sh adopts the
                # connection, then cat, the same process, adopts it again.
                os.execve("/bin/sh", ["sh", "-c", "exec /bin/cat"], env)
            os.execve("/bin/cat", ["cat"], env)
        c.close()
        n += 1


if len(sys.argv) > 3 and sys.argv[2] == "--acceptor":
    ADDR_ACCEPTOR = sys.argv[1]
    run_acceptor(int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
    sys.exit(0)

probe = socket.socket()
probe.bind((ADDR, 0))
port = probe.getsockname()[1]
probe.close()
env = dict(os.environ)
env.pop("LD_PRELOAD", None)
acc = subprocess.Popen([sys.executable, __file__, ADDR, "--acceptor", str(port), LIB], env=env,
                       stdout=subprocess.PIPE, text=True)
if acc.stdout.readline().strip() != "listening":
    print("FAIL: the acceptor did not listen")
    sys.exit(1)
pid = acc.pid

results, seen, counts = [None] * CONNS, [set() for _ in range(CONNS)], [None] * CONNS
whys = [""] * CONNS
arrived, go, first_settled = threading.Semaphore(0), threading.Event(), threading.Event()


def client(i):
    try:
        s = socket.create_connection((ADDR, port))
        data = os.urandom(N)
        s.sendall(HELLO + EARLY)
        got = bytearray()
        want = len(BANNER) + len(EARLY) + N

        def reader():
            while len(got) < want:
                b = s.recv(65536)
                if not b:
                    break
                got.extend(b)
                seen[i].add(transport_of(s))

        t = threading.Thread(target=reader)
        t.start()
        s.sendall(data[:65536])
        # Until the connection settles: its cat starts, its rendezvous is
        # made again at half the window. Then once more after a second: a
        # wrapper's sh that took the connection onto RDMA execs cat, which
        # goes back to TCP and up again (the previous image handed it off).
        for pause in (0, 1.0):
            time.sleep(pause)
            end = time.time() + 30
            while transport_of(s) in (1, 4) and time.time() < end:
                time.sleep(0.05)
            if i == 0:
                first_settled.set()
        for off in range(65536, N, 65536):
            s.sendall(data[off:off + 65536])
            seen[i].add(transport_of(s))
        t.join(120)
        end = time.time() + 30
        while transport_of(s) in (1, 4) and time.time() < end:
            time.sleep(0.05)
        seen[i].add(transport_of(s))
        results[i] = bytes(got) == BANNER + EARLY + data or "echo wrong (%d of %d bytes, %s)" % (
            len(got), want, fallback_of(s))
        counts[i] = bytes_of(s)
        whys[i] = fallback_of(s)
        arrived.release()
        go.wait(120)
        s.close()
    except Exception as e:  # noqa: BLE001
        results[i] = "error %r" % (e,)
        arrived.release()


threads = []
for i in range(CONNS):
    threads.append(threading.Thread(target=client, args=(i,)))
    threads[-1].start()
    # The first connection's failed rendezvous keeps the port skipped for
    # 2 s from its failure (the first strike): connections opened then stay
    # on TCP. Its retry, at 3 s (half the test's 6 s window), takes the port
    # out of the negative cache when it succeeds: the others open once the
    # first has settled. (A fixed 2.8 s was too short 3 times in one session:
    # the failure came 1.1-1.4 s after the open in the TCG guest, and its
    # strike still held at 2.8 and 3.1 s.)
    if i == 0:
        first_settled.wait(40)
    time.sleep(0.3)
for _ in range(CONNS):
    arrived.acquire(timeout=180)
owners = qp_owners() if LIB else set()
go.set()
for t in threads:
    t.join(120)

# Then one connection at a time, each closed (and its cat gone) before the
# next: nobody holds the port when a connection comes, so each one's first
# rendezvous finds no listener and upgrades on its retry. (The retry's
# success takes the port out of the negative cache; before, the second
# failure made the port's strike the whole TTL and the third connection
# stayed on TCP.)
SEQ = 2
seq_ok = []
for j in range(SEQ):
    time.sleep(1.5)
    s = socket.create_connection((ADDR, port))
    data = os.urandom(256 * 1024)
    s.sendall(HELLO + EARLY)
    end = time.time() + 30
    while transport_of(s) in (1, 4) and time.time() < end:
        time.sleep(0.05)
    t = transport_of(s)  # (at the end it may be back on TCP: cat's exit)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    got = bytearray()
    while True:
        b = s.recv(65536)
        if not b:
            break
        got.extend(b)
    b = bytes_of(s)
    seq_ok.append(bytes(got) == BANNER + EARLY + data and
                  (not LIB or (t == 2 and b is not None and b[2] > 0)))
    print("inetd_plain: one at a time, connection %d: echo %s, transport %d (%s)"
          % (j, bytes(got) == BANNER + EARLY + data, t, fallback_of(s)))
    s.close()

acc.send_signal(signal.SIGTERM)
acc.wait(30)

good = sum(1 for r in results if r is True)
on_rdma = sum(1 for s in seen if 2 in s)
per = [c for c in counts if c]
total = sum(sum(c) for c in per)
share = sum(c[2] + c[3] for c in per) / total if total else 0.0
cats = owners - {os.getpid(), pid}
print("inetd_plain: %d/%d echoes exact, %d/%d connections on RDMA, %.1f %% of %d bytes over RDMA, "
      "processes with RC QPs in RTS: %d" % (good, CONNS, on_rdma, CONNS, 100 * share, total, len(cats)))
for i in range(CONNS):
    if results[i] is not True or (LIB and 2 not in seen[i]):
        print("  connection %d: %s, transports %s, fallback reason %s"
              % (i, results[i], sorted(seen[i]), whys[i] or "?"))
if good != CONNS:
    print("FAIL: echoes wrong or missing")
    sys.exit(1)
if LIB and (on_rdma != CONNS or len(cats) < 2 or share < 0.9):
    print("FAIL: every connection must reach RDMA in its cat, 90 % of the payload over RDMA")
    sys.exit(1)
if not all(seq_ok):
    print("FAIL: every connection one at a time must echo and end on RDMA")
    sys.exit(1)
print("inetd_plain: PASS")
