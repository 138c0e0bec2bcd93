#!/usr/bin/env python3
# reup_held.py ADDR -- a connection handed to a fork child that is not
# reachable yet must still go back onto RDMA (label rdma, in the VM; both
# processes preloaded by ctest).
#
# This process is the server: it accepts one connection from a client
# process of its own (this script with --client), waits until it is on
# RDMA, forks a child to serve it and closes its copy, as an
# accept-then-fork server does. The fork hands the connection off (the
# reverse switch); the client, back on TCP, tries to upgrade again after
# 0.5 s, and its request reaches this process, the listening socket's
# owner, which holds it until the child (the connection's only holder now)
# makes itself reachable. Here the child stops itself (SIGSTOP) at once and
# is continued only once the client's log says how its first attempt ended,
# so the hold (upgrade_timeout_ms, 3000 ms for this process: ctest's
# environment) has run out by then. The owner must answer "no resources"
# and the client try again ("upgrading again failed (rejected); next
# attempt"), and the connection must end on RDMA with every echoed byte
# right. Before, the answer was a refusal and the client stayed on TCP for
# good ("not upgrading again (rejected)"). The client's own bound for an
# attempt is longer (10 s), so that the owner's answer, not the client's
# timer, ends the first attempt. The parent closes its copy only once the
# child has stopped, so that the child cannot make itself reachable first.
#
# reup_held.py ADDR --stale: the other order. The child runs until it is the
# only holder and has published its redirect (its line in the librsock log,
# which this mode writes to a file), then stops, so
# the client's first attempt goes to the stopped child and ends at the
# client's bound. The request the child finds when continued is stale (the
# client gave up on it): its stream must wait for the client's next attempt
# and make itself reachable again (Stream::accept_failed), not refuse it
# for good, and the connection must end on RDMA.
import glob, os, signal, socket, subprocess, sys, tempfile, threading, time

from rdma_env import (bytes_of, echo_to_eof, fallback_of, listening, recv_exactly,
                      skip_unless_rdma, transport_of)

ADDR = sys.argv[1] if len(sys.argv) > 1 else "10.77.0.1"
CLIENT = "--client" in sys.argv[2:]
STALE = "--stale" in sys.argv[2:]
N = 256 * 1024


def wait_transport(s, want, secs, leave=False):
    # Polls the socket's transport until it is `want` (with leave: until it
    # is anything else) or secs pass; returns every transport seen, in
    # order, without repeats.
    seen, end = [], time.time() + secs
    while True:
        t = transport_of(s)
        if not seen or seen[-1] != t:
            seen.append(t)
        if (t != want if leave else t == want) or time.time() > end:
            return seen
        time.sleep(0.05)


def client(port):
    s = socket.create_connection((ADDR, port))
    s.sendall(b"hello")
    if recv_exactly(s, 5) != b"hello":
        print("client: FAIL: the first echo is wrong")
        return 1
    # On RDMA, off it at the server's fork (upgrading, waiting to go up
    # again), and on RDMA again.
    first = wait_transport(s, 2, 20)
    later = wait_transport(s, 2, 10, leave=True) if first[-1] == 2 else []
    # (40 s: with --stale the first attempt reaches the stopped child and
    # ends at the client's 10 s bound, and the next comes 2 s later.)
    again = wait_transport(s, 2, 40)
    data = os.urandom(N)
    s.sendall(data)
    got = recv_exactly(s, N)
    counts = bytes_of(s)
    print("client: transports %s then %s then %s, fallback reason %s, bytes (tcp tx/rx, rdma "
          "tx/rx) %s" % (first, later, again, fallback_of(s), counts))
    s.close()
    if got != data:
        print("client: FAIL: the echo after the fork is wrong (%d of %d bytes)" % (len(got), N))
        return 1
    if again[-1] != 2 or not counts or counts[2] < N:
        print("client: FAIL: the connection did not go back onto RDMA after the fork")
        return 1
    print("client: PASS")
    return 0


if CLIENT:
    sys.exit(client(int(sys.argv[3])))

if STALE and "RSOCK_TEST_LOG_DIR" not in os.environ:
    # The child must stop right after it published its redirect: it reads
    # that from this process's librsock log (its own lines, by pid), so the
    # test runs again with a debug log in a file of its own.
    d = tempfile.mkdtemp()
    os.execve(sys.executable, [sys.executable] + sys.argv,
              dict(os.environ, RSOCK_LOG_LEVEL="debug", RSOCK_TEST_LOG_DIR=d,
                   RSOCK_LOG_FILE=os.path.join(d, "server.%p.log")))



def server_log():
    # (--stale) every line of this process's and its child's librsock log.
    for f in glob.glob(os.path.join(os.environ["RSOCK_TEST_LOG_DIR"], "*")):
        with open(f, errors="replace") as fh:
            yield from fh


def new_server_lines(seen):
    # (--stale) the log lines written since the last call with `seen`
    # (file -> offset of the last whole line read).
    for f in glob.glob(os.path.join(os.environ["RSOCK_TEST_LOG_DIR"], "*")):
        with open(f, "rb") as fh:
            fh.seek(seen.get(f, 0))
            data = fh.read()
        whole = data[:data.rfind(b"\n") + 1]
        seen[f] = seen.get(f, 0) + len(whole)
        yield from whole.decode(errors="replace").splitlines()


skip_unless_rdma(ADDR)
if "librsock" not in os.environ.get("LD_PRELOAD", ""):
    print("SKIP: needs LD_PRELOAD=librsock.so (ctest sets it)")
    sys.exit(77)
lst, port = listening(ADDR)
cenv = dict(os.environ, RSOCK_UPGRADE_TIMEOUT_MS="10000", RSOCK_LOG_LEVEL="debug")
cenv.pop("RSOCK_LOG_FILE", None)  # (the client's log is read from its stderr)
cli = subprocess.Popen([sys.executable, __file__, ADDR, "--client", str(port)], env=cenv,
                       stderr=subprocess.PIPE, text=True)
log, ended = [], threading.Event()  # the client's librsock log; its first attempt's end


def read_log():
    for line in cli.stderr:
        log.append(line.rstrip("\n"))
        if "upgrading again failed" in line or "not upgrading again" in line:
            ended.set()


reader = threading.Thread(target=read_log, daemon=True)
reader.start()
c, _ = lst.accept()
c.sendall(recv_exactly(c, 5))
seen = wait_transport(c, 2, 20)
if seen[-1] != 2:
    print("FAIL: the connection never reached RDMA before the fork (transports %s, reason %s)"
          % (seen, fallback_of(c)))
    cli.kill()
    sys.exit(1)
pid = os.fork()
if pid == 0:
    try:
        lst.close()
        # (--stale: running until it made itself reachable. Each look reads
        # only the log lines new since the last: re-reading both processes'
        # whole debug logs every 10 ms made the look slow enough in the guest
        # that the client's next attempt, 0.5 s after the fork, reached the
        # child before it stopped, about 1 run in 11.)
        if STALE:
            me, end, seen = "librsock[%d]" % os.getpid(), time.time() + 20, {}
            while time.time() < end and not any(
                    me in l and "redirects its request" in l for l in new_server_lines(seen)):
                time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGSTOP)
        echo_to_eof(c)
    finally:
        os._exit(0)
if not STALE:
    # Stopped before it can be the only holder: it cannot publish its
    # redirect before the client's request arrives (it did, in most runs,
    # once the progress thread drove streams outside the registry's lock).
    os.waitpid(pid, os.WUNTRACED)
c.close()
arranged = ended.wait(40)  # 0.5 s, then the 3 s hold (the client's bound is 10 s)
os.kill(pid, signal.SIGCONT)
try:
    rc = cli.wait(90)
except subprocess.TimeoutExpired:
    cli.kill()
    rc = 1
    print("FAIL: the client did not finish")
os.kill(pid, signal.SIGTERM)
os.waitpid(pid, 0)
reader.join(10)
for line in log:
    if "again" in line or "RDMA" in line or "rendezvous" in line:
        print("client log: " + line)
retried = any("upgrading again failed (rejected); next attempt" in l for l in log)
# (--stale: the order the header describes.)
redirected_first = (any("rendezvous redirected" in l for l in log) and
                    any("upgrading again failed (timeout); next attempt" in l for l in log))
if STALE and rc == 0 and not redirected_first:
    print("FAIL: the client's first attempt was not redirected to the stopped child")
    rc = 1
if STALE and rc != 0:
    for l in server_log():
        if "again" in l or "RDMA" in l or "rendezvous" in l or "holder" in l:
            print("server log: " + l.rstrip("\n"))
if not STALE and rc == 0 and not retried:
    print("FAIL: the client's first attempt to upgrade again did not end in the owner's "
          "answer and a retry (%s)" % ("no such line in its log" if not arranged else "see above"))
    rc = 1
print("reup_held: %s" % ("PASS" if rc == 0 else "FAIL"))
sys.exit(0 if rc == 0 else 1)
