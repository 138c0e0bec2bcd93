#!/usr/bin/env python3
# classify.py -- reads `perf script -F comm,tid,ip,sym,dso` output (callchains,
# cpu-clock samples of the whole guest) and prints CPU microseconds per
# request by process side and by what the time was spent on.
#   classify.py SAMPLE_HZ REQUESTS [SIDES] < perf-script-output
# SIDES names the processes by their comm's prefix, "side=prefix|prefix,..."
# (default: redis-server and its threads as "server", redis-benchmark as
# "client"). rsock-progress threads, the idle task and other comms get
# sides of their own.
# A sample is charged to the first rule (in RULES order) that one of its
# frames matches, so a doorbell write that runs rxe's whole send path in the
# caller is "rxe: post_send" and not "syscall: other".
import os
import sys
from collections import defaultdict

# (category, test on the list of (sym, dso) frames, leaf first)
def any_sym(*names):
    return lambda fr: any(s in names for s, _ in fr)
def sym_prefix(*pre):
    return lambda fr: any(s.startswith(pre) for s, _ in fr)

RULES = [
    ("rxe: post_send (requester, loopback responder, ACK, completer)", any_sym("rxe_post_send", "ib_uverbs_post_send")),
    ("rxe: other (tasklets, softirq)", sym_prefix("rxe_")),
    ("tcp: send", any_sym("tcp_sendmsg", "tcp_sendmsg_locked")),
    ("tcp: recv", any_sym("tcp_recvmsg", "tcp_recvmsg_locked")),
    ("net softirq (tcp rx, loopback)", any_sym("net_rx_action", "__netif_receive_skb_one_core")),
    ("cq arm (req_notify ioctl)", any_sym("ib_uverbs_req_notify_cq")),
    ("completion channel read", any_sym("ib_uverbs_event_read", "ib_uverbs_comp_event_read")),
    ("clock read (syscall)", any_sym("__x64_sys_clock_gettime", "__x64_sys_gettimeofday", "read_hpet")),
    ("epoll_wait/epoll_pwait2 (kernel)", any_sym("do_epoll_wait", "__x64_sys_epoll_wait", "__x64_sys_epoll_pwait2", "__x64_sys_epoll_pwait")),
    ("poll/ppoll (kernel)", any_sym("do_sys_poll", "__x64_sys_ppoll", "__x64_sys_poll")),
    ("epoll_ctl (kernel)", any_sym("__x64_sys_epoll_ctl", "do_epoll_ctl")),
    ("syscall:", any_sym("do_syscall_64", "entry_SYSCALL_64_after_hwframe")),
    ("scheduler / idle switch", any_sym("schedule", "__schedule", "finish_task_switch.isra.0", "finish_task_switch")),
    ("other kernel", lambda fr: bool(fr) and fr[0][1] == "[kernel.kallsyms]"),
    ("librsock (user)", lambda fr: bool(fr) and "librsock" in fr[0][1]),
    ("verbs provider (user)", lambda fr: bool(fr) and ("librxe" in fr[0][1] or "libibverbs" in fr[0][1] or "librdmacm" in fr[0][1])),
    ("libc (user)", lambda fr: bool(fr) and "libc.so" in fr[0][1]),
    ("dynamic linker (user: TLS lookups, lazy binding)", lambda fr: bool(fr) and "ld-linux" in fr[0][1]),
    ("allocator (user: jemalloc, malloc)", lambda fr: bool(fr) and ("jemalloc" in fr[0][1] or fr[0][0].startswith(("malloc", "free", "_int_", "cfree")))),
    ("application (user)", lambda fr: bool(fr) and not fr[0][1].startswith("[")),
    ("user:", lambda fr: True),
]

def syscall_name(frames):
    """The system call a kernel stack is in: its __x64_sys_ frame, else the
    frame the syscall dispatch called (some entry points are inlined)."""
    syms = [f for f, _ in frames]
    for f in syms:
        if f.startswith("__x64_sys_"):
            return f[10:]
    for i, f in enumerate(syms):
        if f in ("x64_sys_call", "do_syscall_64") and i > 0:
            j = i - 1
            while j > 0 and syms[j] in ("x64_sys_call",):
                j -= 1
            return syms[j]
    return "?"

SIDES = [("server", ("redis-server", "bio_close_file", "bio_aof_fsync", "bio_lazy_free", "jemalloc_bg_thd")),
         ("client", ("redis-benchmark",))]
FIXED = ["progress threads", "other (ksoftirqd, kworkers, ...)", "idle"]

def side(comm):
    for name, prefixes in SIDES:
        if comm.startswith(prefixes):
            return name
    if comm == "rsock-progress":
        return "progress threads"
    if comm == "swapper":
        return "idle"
    return "other (ksoftirqd, kworkers, ...)"

def main():
    global SIDES
    hz, reqs = float(sys.argv[1]), float(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[3]:
        SIDES = [(n, tuple(p.split("|"))) for n, p in (x.split("=", 1) for x in sys.argv[3].split(","))]
    us_per_sample = 1e6 / hz
    counts = defaultdict(float)
    leaf = defaultdict(float)  # (side, librsock symbol) -> samples
    comm, frames = None, []
    def flush():
        if comm is None: return
        s = side(comm)
        if s == "idle":
            counts[(s, "idle")] += 1
            return
        for name, test in RULES:
            if test(frames):
                if name == "syscall:":  # which one: the __x64_sys_ frame
                    name = "syscall: " + syscall_name(frames)
                elif name == "user:":
                    name = "user: " + (frames[0][1] if frames else "?")
                counts[(s, name)] += 1
                if name in ("librsock (user)", "dynamic linker (user: TLS lookups, lazy binding)"):
                    # who: the leaf, or for the linker the first caller outside it
                    who = frames[0][0]
                    if "ld-linux" in frames[0][1]:
                        who = next((f"{f} <- {d.split('/')[-1]}" for f, d in frames if "ld-linux" not in d), who)
                    leaf[(s, who)] += 1
                return
    for line in sys.stdin:
        if not line.strip():
            flush(); comm, frames = None, []
            continue
        if not line[0].isspace():
            flush()
            comm, frames = line.split()[0], []
            continue
        parts = line.split()
        if len(parts) >= 2:
            sym = parts[1].split("+")[0]
            dso = parts[-1].strip("()")
            frames.append((sym, dso))
    flush()
    order = [n for n, _ in SIDES] + FIXED
    sides = sorted({s for s, _ in counts}, key=order.index)
    if os.environ.get("CLASSIFY_TSV"):  # machine-readable: side, kind, us per request
        with open(os.environ["CLASSIFY_TSV"], "w") as f:
            for (ss, name), v in sorted(counts.items()):
                f.write(f"{ss}\t{name}\t{v * us_per_sample / reqs:.2f}\n")
    for s in sides:
        tot = sum(v for (ss, _), v in counts.items() if ss == s)
        print(f"{s}: {tot * us_per_sample / reqs:.1f} us per request")
        for (ss, name), v in sorted(counts.items(), key=lambda kv: -kv[1]):
            if ss == s and v * us_per_sample / reqs >= 0.5:
                print(f"  {name:<66} {v * us_per_sample / reqs:6.1f}")
        top = sorted(((v, n) for (ss, n), v in leaf.items() if ss == s), reverse=True)[:12]
        if top:
            print("  librsock and linker (user), by function:")
            for v, n in top:
                print(f"    {n[:70]:<70} {v * us_per_sample / reqs:6.1f}")
main()
