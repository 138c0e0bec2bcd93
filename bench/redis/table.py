#!/usr/bin/env python3
# table.py -- merges classify.py's TSV outputs (CLASSIFY_TSV) of several
# rounds into one markdown table: CPU microseconds per request, the median
# over the rounds, per kind of work (rows) and per side and mode (columns).
#   table.py DIR   (files DIR/MODE.ROUND.tsv, MODE plain or rsock)
import glob
import os
import statistics
import sys
from collections import defaultdict

# Kinds folded into the rows of the table, in this order.
ROWS = [
    ("send: kernel TCP (tcp_sendmsg, with loopback delivery)", ("tcp: send",)),
    ("send: rxe post_send doorbell (requester, peer's responder, ACK, completer)", ("rxe: post_send",)),
    ("recv: kernel TCP", ("tcp: recv",)),
    ("epoll_ctl", ("epoll_ctl",)),
    ("waiting: epoll_wait, poll, ppoll (kernel)", ("epoll_wait", "poll/ppoll")),
    ("CQ arm and completion channel (ioctl, read)", ("cq arm", "completion channel", "syscall: ioctl", "syscall: ksys_read")),
    ("clock reads", ("clock read",)),
    ("other syscalls and syscall entry/exit", ("syscall:",)),
    ("librsock, user space", ("librsock (user)",)),
    ("verbs provider, user space (librxe, libibverbs)", ("verbs provider",)),
    ("application, libc, allocator, linker", ("application", "libc", "allocator", "dynamic linker", "user:")),
    ("other kernel (scheduler, rxe tasklets, ...)", ("",)),
]

def row_of(kind):
    for name, prefixes in ROWS:
        if any(kind.startswith(p) for p in prefixes):
            return name
    return ROWS[-1][0]

def main():
    d = sys.argv[1]
    # (mode, side, row) -> [per-round sums]
    vals = defaultdict(list)
    rounds = defaultdict(int)
    for f in sorted(glob.glob(os.path.join(d, "*.tsv"))):
        mode = os.path.basename(f).split(".")[0]
        rounds[mode] += 1
        sums = defaultdict(float)
        for line in open(f):
            side, kind, v = line.rstrip("\n").split("\t")
            sums[(side, row_of(kind) if side in ("server", "client") else side)] += float(v)
            if side in ("server", "client"):
                sums[(side, "total")] += float(v)
        for k, v in sums.items():
            vals[(mode,) + k].append(v)
    cols = [("server", "plain"), ("server", "rsock"), ("client", "plain"), ("client", "rsock")]
    def med(mode, side, row):
        v = vals.get((mode, side, row), [])
        v = v + [0.0] * (rounds[mode] - len(v))  # a round without such samples
        return statistics.median(v) if v else 0.0
    print(f"CPU us per request, median of {min(rounds.values()) if rounds else 0} round(s):")
    print()
    print("| kind of work | server, plain | server, librsock | client, plain | client, librsock |")
    print("|---|---:|---:|---:|---:|")
    for name, _ in ROWS + [("total", ())]:
        cells = [med(m, s, name) for s, m in cols]
        label = f"**{name}**" if name == "total" else name
        print(f"| {label} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print()
    print("| the rest of the guest | plain | librsock |")
    print("|---|---:|---:|")
    for extra in ("progress threads", "other (ksoftirqd, kworkers, ...)", "idle"):
        print(f"| {extra} | {med('plain', extra, extra):.1f} | {med('rsock', extra, extra):.1f} |")

main()
