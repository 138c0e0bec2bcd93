#!/usr/bin/env python3
# client_exec_plain.py ADDR -- issue 12 item 4, a client's side: a program
# exec'd with LD_PRELOAD on a TCP connection that a process without
# librsock connect()ed and passed to it by number (tcpclient, `socat
# TCP:host:port EXEC:prog,nofork`, a plain launcher). The image adopts it as
# a client's connection at the stream positions its kernel counts and
# makes the rendezvous itself (docs/DESIGN.md, "Connections inherited from
# a process without librsock"). Run preloaded in the RDMA VM (ctest sets
# LD_PRELOAD): this process is the server (its echo writes a 7-byte banner
# first, then echoes); the connectors run with LD_PRELOAD removed:
#   - our own connector writes a 5-byte hello and reads the banner, so the
#     child starts at stream positions 5/7, then execs the child on that fd;
#   - socat (unmodified) connects and execs the child as its stdin and
#     stdout (`EXEC:...,nofork`); the banner is still unread in the kernel.
#   - once, our connector starts the child (fork + exec) and keeps its copy
#     of the socket: that child must leave the connection on TCP (a parent
#     that still holds a client connection shares it).
# The child (--child, preloaded again) sends 2 MiB of random bytes (a pause
# after the first 64 KiB, so the switch lands mid-stream), reads everything
# back in order (the hello's echo or the banner first), and, its connection
# still open, lists the kernel's RC QPs in RTS. Asserted per child: every
# byte right; its connection on RDMA; at least 90 % of its bytes over RDMA;
# an RC QP in RTS owned by the child itself. Before, every child stayed on
# TCP (its connection was taken for a server's).
import json, os, shutil, socket, subprocess, sys, threading, time

from rdma_env import bytes_of, echo_to_eof, fallback_of, qp_owners, recv_exactly, \
    skip_unless_rdma, transport_of

N = 2 * 1024 * 1024
BANNER, HELLO = b"banner!", b"hello"

if len(sys.argv) > 2 and sys.argv[1] == "--child":
    # The exec'd client: argv --child FD EXPECT_FIRST RESULT_FILE.
    fd, first, out = int(sys.argv[2]), sys.argv[3].encode(), sys.argv[4]
    s = socket.socket(fileno=fd)  # (socat's: stdin, and stdout is a dup of it)
    data, seen, got = os.urandom(N), set(), bytearray()

    def reader():
        while len(got) < len(first) + N:
            b = s.recv(65536)
            if not b:
                break
            got.extend(b)
            seen.add(transport_of(s))

    t = threading.Thread(target=reader)
    t.start()
    for off in range(0, N, 65536):
        s.sendall(data[off:off + 65536])
        seen.add(transport_of(s))
        if off == 0:
            time.sleep(1)
            end = time.time() + 20
            while transport_of(s) in (1, 4) and time.time() < end:
                time.sleep(0.05)
    t.join(120)
    seen.add(transport_of(s))
    owners = qp_owners()
    b = bytes_of(s)
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "exact": bytes(got) == first + data, "seen": sorted(seen),
                   "why": fallback_of(s), "bytes": b, "qp": os.getpid() in owners}, f)
    s.close()
    sys.exit(0)

if len(sys.argv) > 2 and sys.argv[1] in ("--connector", "--leaker"):
    # Our own connector, run without librsock: hello out, banner in, exec.
    # --leaker: it starts the child (fork + exec) and keeps its own copy of
    # the socket open meanwhile, as a program that leaks a connection into
    # a child does: the child must leave it alone (on TCP).
    addr, port, out = sys.argv[2], int(sys.argv[3]), sys.argv[4]
    c = socket.create_connection((addr, port))
    c.sendall(HELLO)
    if recv_exactly(c, len(BANNER)) != BANNER:
        sys.exit(3)
    os.set_inheritable(c.fileno(), True)
    env = dict(os.environ, LD_PRELOAD=os.environ["CHILD_PRELOAD"])
    argv = [sys.executable, os.path.abspath(__file__), "--child", str(c.fileno()),
            HELLO.decode(), out]
    if sys.argv[1] == "--leaker":
        sys.exit(subprocess.run(argv, env=env, pass_fds=[c.fileno()]).returncode)
    os.execve(sys.executable, argv, env)

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
skip_unless_rdma(ADDR)
preload = os.environ.get("LD_PRELOAD", "")
socat = shutil.which("socat")

srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((ADDR, 0))
srv.listen(16)
port = srv.getsockname()[1]


def serve():
    while True:
        c, _ = srv.accept()
        c.sendall(BANNER)
        threading.Thread(target=echo_to_eof, args=(c,), daemon=True).start()


threading.Thread(target=serve, daemon=True).start()
plain_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
plain_env["CHILD_PRELOAD"] = preload
me = os.path.abspath(__file__)
runs = []  # (kind, process, result file)
for i in range(3):
    out = "/tmp/client-exec-plain.%d.%d" % (os.getpid(), len(runs))
    runs.append(("connector", subprocess.Popen([sys.executable, me, "--connector", ADDR, str(port),
                                                out], env=plain_env), out))
out = "/tmp/client-exec-plain.%d.%d" % (os.getpid(), len(runs))
runs.append(("leaker", subprocess.Popen([sys.executable, me, "--leaker", ADDR, str(port), out],
                                        env=plain_env), out))
if socat:
    for i in range(2):
        out = "/tmp/client-exec-plain.%d.%d" % (os.getpid(), len(runs))
        child = "env LD_PRELOAD=%s %s %s --child 0 %s %s" % (preload, sys.executable, me,
                                                            BANNER.decode(), out)
        runs.append(("socat", subprocess.Popen([socat, "TCP:%s:%d" % (ADDR, port),
                                                "EXEC:%s,nofork" % child], env=plain_env), out))
else:
    print("(no socat: its two runs are skipped)")
failed = 0
for kind, p, out in runs:
    try:
        rc = p.wait(180)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = "timeout"
    try:
        r = json.load(open(out))
        os.unlink(out)
    except (OSError, ValueError):
        print("FAIL: %s: no result (exit %s)" % (kind, rc))
        failed += 1
        continue
    b = r["bytes"]
    share = (b[2] + b[3]) / sum(b) if b and sum(b) else 0.0
    print("%s child %d: exact %s, transports %s, fallback %s, %.1f %% of its bytes over RDMA, "
          "RC QP in RTS: %s" % (kind, r["pid"], r["exact"], r["seen"], r["why"], 100 * share,
                                r["qp"]))
    if not r["exact"]:
        print("FAIL: %s: the echo is wrong" % kind)
        failed += 1
    elif kind == "leaker":
        if 2 in r["seen"] or r["qp"]:
            print("FAIL: leaker: a connection its plain parent still holds must stay on TCP")
            failed += 1
    elif preload and (2 not in r["seen"] or share < 0.9 or not r["qp"]):
        print("FAIL: %s: the child's connection must reach RDMA (>= 90 %% of its bytes, its "
              "own RC QP in RTS)" % kind)
        failed += 1
print("client_exec_plain: %s" % ("PASS" if failed == 0 else "%d FAILED" % failed))
sys.exit(1 if failed else 0)
