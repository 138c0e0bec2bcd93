# rdma_env.py -- shared by the multiproc tests: exit 77 ("SKIP") unless this
# host has a verbs device and ADDR is a local address to bind to; the
# transport librsock reports for a socket; one verified echo as a client.
import os, socket, sys, threading, time

SOL_RSOCK, RSOCK_TRANSPORT = 0x5253, 1  # preload/librsock.h


def transport_of(s):
    # Without librsock the kernel says EOPNOTSUPP: the same program runs plain too.
    try:
        return int.from_bytes(s.getsockopt(SOL_RSOCK, RSOCK_TRANSPORT, 4), "little", signed=True)
    except OSError:
        return -1


def echo_once(addr, port, data, seen, chunk=32768, pause_after_first=0, hold=None):
    # Connects, sends `data` in chunks (sleeping after the first if asked, so
    # that an upgrade lands mid-stream), half-closes and reads the echo to EOF
    # in a second thread; adds the transport seen after every send and every
    # receive to `seen`. True if the echo is exact.
    # hold=(arrived, go): no half-close; once the whole echo is back (and a
    # switch still running is over), release the semaphore `arrived` and
    # keep the connection open until the event `go` is set, so that the
    # caller can look at it (its QP) meanwhile.
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
    s.close()
    return bytes(got) == data


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
