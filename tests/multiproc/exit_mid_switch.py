#!/usr/bin/env python3
# exit_mid_switch.py ADDR -- a client process that exits in the middle of
# its connection's switch onto RDMA (label rdma, in the VM; this process,
# the server, preloaded by ctest).
#
# As redis-cli does: connect, send a request, read the reply, exit, while
# the connection's rendezvous runs in the background. Here the exit is
# placed exactly: the client runs with RSOCK_DEBUG_EXIT_AT_READY=1 and
# RSOCK_UPGRADE_DELAY_MS=0, so its process ends (exit_group) the moment its
# switch gets the server's READY, before its marker. The server has the
# client's offer by then, and sees both paths end there: the RDMA
# connection dies and TCP reads EOF right at the offer. It must read the
# request, then EOF, stay on TCP with the fallback reason peer_closed, and
# log no warning: a client going away is no failure. Before, the server
# called it a failed path (path_failed, a handshake error) and logged
# "warning: fd N: RDMA upgrade abandoned (the RDMA connection failed during
# the switch)" for each such client: 3 runs in 4 of a redis benchmark as an
# ordinary user, for its closing redis-cli.
import os, socket, subprocess, sys, time

from rdma_env import fallback_of, listening, recv_exactly, skip_unless_rdma, transport_of

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
REQ, REP = b"*1\r\n$6\r\nDBSIZE\r\n", b":1\r\n"

if len(sys.argv) > 3 and sys.argv[2] == "--client":
    s = socket.create_connection((ADDR, int(sys.argv[3])))
    s.sendall(REQ)
    assert recv_exactly(s, len(REP)) == REP
    time.sleep(30)  # the library ends the process at its switch's READY
    sys.exit(3)

skip_unless_rdma(ADDR)
if "librsock" not in os.environ.get("LD_PRELOAD", ""):
    print("SKIP: needs LD_PRELOAD=librsock.so (ctest sets it)")
    sys.exit(77)
# This process's librsock log (ctest: RSOCK_LOG_FILE=/tmp/...%p.log).
log = os.environ.get("RSOCK_LOG_FILE", "").replace("%p", str(os.getpid()))
if not log or not os.path.exists(log):
    print("FAIL: no librsock log file of this process (%r)" % log)
    sys.exit(1)

ROUNDS = 3
fails = 0
lst, port = listening(ADDR)
cenv = dict(os.environ, RSOCK_DEBUG_EXIT_AT_READY="1", RSOCK_UPGRADE_DELAY_MS="0")
cenv.pop("RSOCK_LOG_FILE", None)  # (the client's goes to its stderr)
for r in range(ROUNDS):
    t0 = time.time()
    cli = subprocess.Popen([sys.executable, __file__, ADDR, "--client", str(port)], env=cenv)
    c, _ = lst.accept()
    ok = recv_exactly(c, len(REQ)) == REQ
    c.sendall(REP)
    c.settimeout(60)
    rest = c.recv(100)  # EOF once the client is gone
    try:
        rc = cli.wait(40)
    except subprocess.TimeoutExpired:
        cli.kill()
        rc = None
    # Until the stream settles on TCP (its progress thread may still be
    # between the two ends it saw).
    end = time.time() + 10
    while transport_of(c) in (1, 4) and time.time() < end:
        time.sleep(0.05)
    why, tr = fallback_of(c), transport_of(c)
    print("round %d: request %s, then %r, client exit %s after %.1f s, transport %d, reason %s"
          % (r, "right" if ok else "WRONG", rest, rc, time.time() - t0, tr, why))
    if rc != 0:
        print("FAIL: the client did not end at its switch's READY (exit %s): the switch never "
              "got that far, so the case was not made" % rc)
        fails += 1
    elif not ok or rest != b"" or tr != 0 or not why.startswith("peer_closed"):
        print("FAIL: want the request, then EOF, TCP (0) and peer_closed")
        fails += 1
    c.close()
lst.close()
with open(log, errors="replace") as f:
    warnings = [l.rstrip("\n") for l in f if "warning" in l]
os.unlink(log)
for w in warnings:
    print("server log: " + w)
if warnings:
    print("FAIL: the server logged a warning for a client that went away")
    fails += 1
print("exit_mid_switch: %s" % ("PASS" if fails == 0 else "FAIL"))
sys.exit(1 if fails else 0)
