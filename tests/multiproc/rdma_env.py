# rdma_env.py -- shared by the multiproc tests: exit 77 ("SKIP") unless this
# host has a verbs device and ADDR is a local address to bind to; the
# transport librsock reports for a socket; one verified echo as a client.
import os, socket, subprocess, sys, threading, time

SOL_RSOCK, RSOCK_TRANSPORT, RSOCK_FALLBACK_REASON, RSOCK_BYTES = 0x5253, 1, 4, 5  # preload/librsock.h
# util/stats_layout.h FallbackReason, for reports.
FALLBACK_NAMES = ["none", "policy", "peer_not_rsock", "no_device", "resolve_failed", "rejected",
                  "timeout", "negative_cache", "no_resources", "protocol", "unsupported",
                  "peer_closed", "forked", "other", "memlock", "connect_failed", "path_failed",
                  "handed_off", "released", "fd_limit", "io_uring", "lossy_path", "slow_path"]


def transport_of(s):
    # Without librsock the kernel says EOPNOTSUPP: the same program runs plain too.
    try:
        return int.from_bytes(s.getsockopt(SOL_RSOCK, RSOCK_TRANSPORT, 4), "little", signed=True)
    except OSError:
        return -1


def bytes_of(s):
    # (tcp_tx, tcp_rx, rdma_tx, rdma_rx) of the connection so far; None
    # without librsock (or with its statistics off).
    try:
        b = s.getsockopt(SOL_RSOCK, RSOCK_BYTES, 32)
    except OSError:
        return None
    return tuple(int.from_bytes(b[i:i + 8], "little") for i in range(0, 32, 8))


def fallback_of(s):
    # Why the connection last stayed on (or went back to) TCP, by name
    # ("none" if it never did; "" without librsock).
    try:
        c = int.from_bytes(s.getsockopt(SOL_RSOCK, RSOCK_FALLBACK_REASON, 4), "little")
    except OSError:
        return ""
    name = FALLBACK_NAMES[c & 0xff] if (c & 0xff) < len(FALLBACK_NAMES) else str(c & 0xff)
    return name + (":peer %d" % (c >> 8) if c >> 8 else "")


def echo_once(addr, port, data, seen, chunk=32768, pause_after_first=0, hold=None, why=None,
              counts=None):
    # Connects, sends `data` in chunks (sleeping after the first if asked, so
    # that an upgrade lands mid-stream, then waiting while it is upgrading or
    # switching back), half-closes and reads the echo to EOF
    # in a second thread; adds the transport seen after every send and every
    # receive to `seen`. True if the echo is exact.
    # hold=(arrived, go): no half-close; once the whole echo is back (and a
    # switch still running is over), release the semaphore `arrived` and
    # keep the connection open until the event `go` is set, so that the
    # caller can look at it (its QP) meanwhile.
    # why: a list; the connection's fallback reason is appended at the end.
    # counts: a list; bytes_of() the connection is appended at the end.
    s = socket.create_connection((addr, port))
    got = bytearray()

    def reader():
        while hold is None or len(got) < len(data):
            b = s.recv(65536)
            if not b:
                break
            got.extend(b)
            seen.add(transport_of(s))

    t = threading.Thread(target=reader)
    t.start()
    for off in range(0, len(data), chunk):
        s.sendall(data[off:off + chunk])
        seen.add(transport_of(s))
        if off == 0 and pause_after_first:
            time.sleep(pause_after_first)
            # Then until the connection settles (on RDMA, or on TCP for
            # good), at most 20 s: a server that gets the connection across
            # fork, exec or fd passing takes seconds to start up in the TCG
            # guest (twelve at once), and the rest of the payload is what
            # the tests' share of RDMA bytes is about.
            end = time.time() + 20
            while transport_of(s) in (1, 4) and time.time() < end:
                time.sleep(0.05)
    if hold is None:
        s.shutdown(socket.SHUT_WR)
    t.join(120)
    if hold is not None:
        # A switch still running (a loaded machine: the whole echo went by on
        # TCP) is given time to finish: the connection is looked at as well.
        end = time.time() + 30
        while transport_of(s) == 1 and time.time() < end:
            time.sleep(0.05)
        seen.add(transport_of(s))
        hold[0].release()
        hold[1].wait(120)
    if why is not None:
        why.append(fallback_of(s))
    if counts is not None:
        counts.append(bytes_of(s))
    s.close()
    return bytes(got) == data


def recv_exactly(s, n):
    # Up to n bytes from s: fewer only at EOF.
    got = b""
    while len(got) < n:
        b = s.recv(n - len(got))
        if not b:
            break
        got += b
    return got


def echo_to_eof(c):
    # A server's side of one connection: every byte back until EOF.
    with c:
        while True:
            b = c.recv(65536)
            if not b:
                break
            c.sendall(b)


def listening(addr):
    # A listening TCP socket on addr at a port the kernel picks, and the port.
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind((addr, 0))
    lst.listen()
    return lst, lst.getsockname()[1]


def skip_unless_rdma(addr):
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        print("SKIP: no RDMA device")
        sys.exit(77)
    try:
        socket.socket().bind((addr, 0))
    except OSError as e:
        print("SKIP: cannot bind %s: %s" % (addr, e))
        sys.exit(77)


def echo_clients(addr, port, conns, n):
    # `conns` concurrent clients, each echo_once() with n random bytes.
    # Returns (exact echoes, sorted transports the clients saw).
    results, seen = [None] * conns, [set() for _ in range(conns)]

    def client(i):
        results[i] = echo_once(addr, port, os.urandom(n), seen[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return sum(1 for r in results if r), sorted(set().union(*seen))


def qp_owners():
    # Thread group of every RC QP in RTS the kernel lists (the listing names
    # the creating thread).
    out = subprocess.run(["rdma", "resource", "show", "qp"], capture_output=True, text=True).stdout
    owners = set()
    for line in out.splitlines():
        f = line.split()
        if "RC" not in f or "RTS" not in f or "pid" not in f:
            continue
        tid = f[f.index("pid") + 1]
        try:
            with open("/proc/%s/status" % tid) as st:
                owners.update(int(l.split()[1]) for l in st if l.startswith("Tgid:"))
        except OSError:
            pass
    return owners


def held_echoes(addr, port, conns, n, counts=None):
    # `conns` concurrent echo_once() clients of n random bytes each (a 1 s
    # pause after the first 64 KiB, so the upgrade lands mid-stream), every
    # connection held open until all echoes are back; the RC QPs in RTS the
    # kernel lists then (qp_owners(), only when librsock is preloaded).
    # Returns (results, transports seen, fallback reasons, owners).
    # counts: a list of per-connection lists, each given bytes_of() at the end.
    results, seen, whys = [None] * conns, [set() for _ in range(conns)], [[] for _ in range(conns)]
    arrived, go = threading.Semaphore(0), threading.Event()

    def client(i):
        try:
            results[i] = echo_once(addr, port, os.urandom(n), seen[i], chunk=65536,
                                   pause_after_first=1, hold=(arrived, go), why=whys[i],
                                   counts=counts[i] if counts is not None else None)
        except Exception as e:  # noqa: BLE001
            results[i] = "error %r" % (e,)
            arrived.release()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(conns)]
    for t in threads:
        t.start()
    for _ in range(conns):
        arrived.acquire(timeout=180)
    owners = qp_owners() if "librsock" in os.environ.get("LD_PRELOAD", "") else set()
    go.set()
    for t in threads:
        t.join(180)
    return results, seen, whys, owners


def rdma_share(counts):
    # From held_echoes' counts: (share of the payload, both directions, at
    # the clients, that went over RDMA; bytes in all; connections counted).
    per = [c[0] for c in counts if c and c[0]]
    total = sum(sum(b) for b in per)
    return (sum(b[2] + b[3] for b in per) / total if total else 0.0), total, len(per)


def tally(results, seen, counts):
    # From held_echoes: (exact echoes, connections seen on RDMA, and
    # rdma_share(counts)).
    return (sum(1 for r in results if r is True), sum(1 for s in seen if 2 in s)) + \
        rdma_share(counts or [])


def report_forked_server(name, results, seen, whys, owners, master, counts=None):
    # Every echo exact; under librsock, every connection on RDMA and RC QPs
    # in RTS owned by more than one process other than the clients' and the
    # master's. Exit status for the test.
    conns = len(results)
    preloaded = "librsock" in os.environ.get("LD_PRELOAD", "")
    good, rdma, share, total, counted = tally(results, seen, counts)
    children = owners - {os.getpid(), master}
    print("%s: %d/%d echoes exact, %d/%d connections on RDMA, %.1f %% of %d bytes over RDMA, "
          "forked children with RC QPs in RTS: %d, master with RC QPs: %s"
          % (name, good, conns, rdma, conns, 100 * share, total, len(children), master in owners))
    for i in range(conns):
        if results[i] is not True or (preloaded and 2 not in seen[i]):
            print("  connection %d: result %s, transports %s, fallback reason %s"
                  % (i, results[i], sorted(seen[i]), ",".join(whys[i]) or "?"))
    if good != conns:
        print("FAIL: %d of %d echoes wrong or missing" % (conns - good, conns))
        return 1
    if preloaded and (rdma != conns or len(children) < 2 or master in owners):
        print("FAIL: every connection must reach RDMA in the child serving it")
        return 1
    if preloaded and counts is not None and (counted != conns or share < 0.9):
        print("FAIL: at least 90 %% of the payload must go over RDMA (%d connections counted)"
              % counted)
        return 1
    print("%s: PASS" % name)
    return 0
