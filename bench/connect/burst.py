#!/usr/bin/env python3
# burst.py ADDR PORT N -- connect() durations of N connections opened back
# to back and kept open, each sending one redis PING after its connect and
# reading the reply once all are open. The first connect() pays for the
# process's setup (librsock's progress thread, the device); "rest" is the
# sum of the other N-1, which under librsock wait for whatever the progress
# thread holds the registry for while it sets up the earlier connections.
# A benchmark: prints one line, judges nothing.
import socket, sys, time

addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ts, keep = [], []
for i in range(n):
    t = time.perf_counter()
    s = socket.create_connection((addr, port))
    ts.append((time.perf_counter() - t) * 1000)
    keep.append(s)
    s.sendall(b"PING\r\n")
for s in keep:
    s.recv(16)
rest = sorted(ts[1:])
print("burst n=%d first_ms=%.2f rest_sum_ms=%.1f rest_median_ms=%.2f rest_p90_ms=%.2f rest_max_ms=%.2f"
      % (n, ts[0], sum(rest), rest[len(rest) // 2], rest[len(rest) * 9 // 10], rest[-1]))
