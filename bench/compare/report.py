#!/usr/bin/env python3
"""bench/compare/report.py -- turn bench/compare's raw results into the report.

  report.py RESULTS_DIR [--passthrough FILE] [--md OUT.md] [--png OUT.png]
            [--command CMD] [--machine TEXT] [--check]

RESULTS_DIR/results.tsv is written by bench/compare/in_vm.sh (format in its
header); --passthrough is the stdout of bench/compare/run's native
bench/passthrough/run. Prints the results table (Markdown) on stdout; --md
writes the whole docs/PERFORMANCE.md (the part of an existing file below the
HAND_WRITTEN marker is kept: measured notes on missed targets); --png draws
latency vs message size with gnuplot. --check (the ctest smoke): exit 1
unless every expected (workload, transport) cell has a figure or an
explained n/a, and every librsock figure is proven to have run over RDMA.
Stdlib only.
"""
import argparse
import collections
import datetime
import os
import statistics
import subprocess
import sys

HAND_WRITTEN = "<!-- Everything below this line is hand-written and kept by bench/compare/report.py. -->"
TRANSPORTS = ("raw", "tcp", "rsp", "rsock")
TNAME = {"raw": "raw verbs", "tcp": "TCP", "rsp": "rspreload", "rsock": "librsock"}
SIZES = (64, 1024, 16384)   # the full run's; a --quick run measures fewer


def size_name(s):
    return f"{s // 1024} KiB" if s >= 1024 else f"{s} B"


# (workload id, label, kind, librsock server group); kind: lat (us, lower is
# better), bw (MiB/s), rps (requests/s), conn (us), cpu (us of CPU per
# request, server / client; lower is better).
WORKLOADS = (
    [(f"pp{s}", f"sockperf ping-pong {size_name(s)}", "lat", "sockperf") for s in SIZES]
    + [(f"bpp{s}", f"blocking ping-pong {size_name(s)}", "lat", "cb") for s in SIZES]
    # What each round trip of those costs in CPU, server and client (a spin
    # before sleeping buys latency with CPU).
    + [(f"bpp{s}_cpu", f"blocking ping-pong {size_name(s)}: CPU per round trip (server / client)", "cpu", "cb")
       for s in SIZES]
    + [("sp_tp", "sockperf throughput 65000 B msgs", "bw", "sockperf"),
       ("iperf3", "iperf3 single stream", "bw", "iperf3"),
       ("bstream", "blocking stream 64 KiB writes", "bw", "cb"),
       ("redis_set", "redis-benchmark SET -c 10", "rps", "redis"),
       ("redis_get", "redis-benchmark GET -c 10", "rps", "redis"),
       # CPU time per request of that run (SET and GET together), server and
       # client, from /proc and getrusage: where a request's cost goes.
       ("redis_cpu", "redis CPU per request (server / client)", "cpu", "redis"),
       ("mc_set", "memcached set, memcslap 10 threads", "rps", "memcached"),
       ("echo64", "epoll echo, 64 connections in one process", "bw", "echo64"),
       ("connect", "connect() to first echoed byte", "conn", "cb"),
       # diagnostics for connection setup (median only, no check): the
       # connect() call alone, and librsock with default = tcp on both ends
       # (hooks only: no upgrade is started)
       ("connect_call", "diagnostic: the connect() call alone", "diag", "cb"),
       ("connect_noup", "diagnostic: connect to first byte, librsock default = tcp", "diag", "cb"),
       ("connect_call_noup", "diagnostic: connect() call alone, librsock default = tcp", "diag", "cb")])
UNIT = {"lat": "us", "bw": "MiB/s", "rps": "req/s", "conn": "us", "diag": "us median",
        "cpu": "CPU us / request, server / client"}
# (The ping-pong rows' request is a round trip.)
# Which raw-verbs figure each workload is compared with.
RAW_FROM = {"pp64": "ib_send_lat -s 64", "pp1024": "ib_send_lat -s 1024", "pp16384": "ib_send_lat -s 16384",
            "bpp64": "ib_send_lat -s 64", "bpp1024": "ib_send_lat -s 1024",
            "bpp16384": "ib_send_lat -s 16384", "sp_tp": "ib_write_bw -s 65536",
            "iperf3": "ib_write_bw -s 65536", "bstream": "ib_write_bw -s 65536"}
# Back-to-back pairs (in_vm.sh run_pairs): (workload, transport, label,
# librsock server group, kind, metric, op, limit, the target they judge).
# noup (librsock loaded with default = tcp) upgrades nothing on purpose: no
# group, as no exit summary makes its figure valid.
PAIR_WORKLOADS = (
    ("connect_pair", "rsock", "connect() to first echoed byte", "connect_pair", "conn", "median_us",
     "<=", 1.1, "connect-to-first-byte median <= 1.1x TCP"),
    ("connect_pair", "noup", "diagnostic: connect() to first echoed byte, librsock default = tcp",
     None, "conn", "median_us", "<=", 1.1, None),
    ("redis_pair_set", "rsock", "redis-benchmark SET -c 10", "redis_pair", "rps", "rps", ">=", 1.0,
     "redis-benchmark SET >= 1.0x TCP"),
    ("redis_pair_get", "rsock", "redis-benchmark GET -c 10", "redis_pair", "rps", "rps", ">=", 1.0,
     "redis-benchmark GET >= 1.0x TCP"),
    # Diagnostic, no target of its own: the same workload run longer, to show
    # how much of a short run's gap is the connections' setup at its start.
    ("redis_long_pair_set", "rsock", "redis-benchmark SET -c 10, long run", "redis_long_pair", "rps",
     "rps", ">=", 1.0, None),
    ("redis_long_pair_get", "rsock", "redis-benchmark GET -c 10, long run", "redis_long_pair", "rps",
     "rps", ">=", 1.0, None))
RDMA_SHARE = 0.9   # librsock figure valid only if >= 90% of its bytes moved over RDMA


def load(path):
    res = collections.defaultdict(list)      # (w, t, metric) -> [(round, value)]
    na = collections.defaultdict(list)       # (w, t) -> [(round, why)]
    sums = {}                                # (group, t, round, role) -> [7 ints] or None
    qps = collections.defaultdict(list)      # (w, t) -> [n]
    meta = {}
    with open(path) as f:
        for line in f:
            r = line.rstrip("\n").split("\t")
            if r[0] == "res":
                res[(r[1], r[2], r[4])].append((int(r[3]), float(r[5])))
            elif r[0] == "na":
                na[(r[1], r[2])].append((int(r[3]), r[4]))
            elif r[0] == "sum":
                v = r[5:]
                # 7 counts, then (since the exit summary has them) the
                # switches onto RDMA, their total and longest length in ms.
                sums[(r[1], r[2], int(r[3]), r[4])] = ([int(x) for x in v[:7]] + [float(x) for x in v[7:]]
                                                       if len(v) in (7, 10) else None)
            elif r[0] == "qp":
                qps[(r[1], r[2])].append(int(r[4]))
            elif r[0] == "meta":
                meta[r[1]] = r[2]
    return res, na, sums, qps, meta


def rdma_ok(s):
    """(ok, text) for one exit summary [c u f rtx rrx ttx trx (sw sw_ms sw_max_ms)]."""
    if s is None:
        return False, "no exit summary"
    c, u, f, rtx, rrx, ttx, trx = s[:7]
    rdma, tcp = rtx + rrx, ttx + trx
    txt = f"conns={c} upgraded={u} rdma={rdma} B tcp={tcp} B"
    if len(s) == 10 and s[7] > 0:
        txt += f" switches={s[7]:.0f} (avg {s[8] / s[7]:.1f} ms, max {s[9]:.1f} ms)"
    if u < 1:
        return False, txt + " (no upgrade)"
    if rdma + tcp and rdma < RDMA_SHARE * (rdma + tcp):
        return False, txt + f" (RDMA < {RDMA_SHARE:.0%} of bytes)"
    return True, txt


def validity(w, group, kind, rnd, sums):
    """Is the librsock figure of workload w in round rnd proven to be RDMA?"""
    # (redis_get's and redis_cpu's run is redis_set's; so for redis_pair_*.)
    cw = w.rsplit("_", 1)[0] + "_set" if w.startswith("redis") and w.endswith(("_get", "_cpu")) \
        else w.removesuffix("_cpu")
    cli = sums.get((cw, "rsock", rnd, "client"), "missing")
    srv = sums.get((group, "rsock", rnd, "server"), "missing")
    if kind == "conn":  # 1-byte connections close before the background upgrade: by design
        txt = rdma_ok(cli)[1].split(" (")[0] if cli not in ("missing", None) else "no summary"
        return True, "not required (1-byte connections close before the background upgrade): client " + txt
    notes, ok = [], True
    for role, s in (("client", cli), ("server", srv)):
        if s == "missing":
            ok = False
            notes.append(f"{role}: no summary recorded")
            continue
        good, txt = rdma_ok(s)
        # A client summary may count no bytes at all (connections closed just
        # before exit are not summed, README): then the server's decides.
        if s is not None and role == "client" and good is False and s[1] >= 1 and s[3] + s[4] + s[5] + s[6] == 0:
            good, txt = True, txt + " (bytes not in summary)"
        ok &= good
        notes.append(f"{role}: {txt}")
    return ok, "; ".join(notes)


def meets(q, op, limit):
    """Does ratio q meet a target "op limit" (op: "<=" or ">=")?"""
    return q <= limit if op == "<=" else q >= limit


def fmt(v, kind):
    if v is None:
        return "n/a"
    if kind in ("lat", "conn", "cpu"):
        return f"{v:.1f}" if v < 1000 else f"{v:.0f}"
    return f"{v:.1f}" if kind == "bw" else f"{v:.0f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--passthrough")
    ap.add_argument("--md")
    ap.add_argument("--png")
    ap.add_argument("--command", default="bench/compare/run")
    ap.add_argument("--machine", default="")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    res, na, sums, qps, meta = load(os.path.join(a.dir, "results.tsv"))
    rounds = int(meta.get("rounds", "1"))
    sizes = meta.get("sizes", " ".join(map(str, SIZES))).split()
    workloads = [wl for wl in WORKLOADS
                 if not wl[0].lstrip("b").startswith("pp")
                 or wl[0].lstrip("b").removesuffix("_cpu")[2:] in sizes]

    med = {}            # (w, t, metric) -> median of valid runs
    runs_of = {}        # (w, t, metric) -> the valid runs' values (the spread)
    cell_why = {}       # (w, t) -> why there is no figure
    invalid = []        # (w, round, why)
    proof = []          # (w, round, text)
    problems = []
    for w, label, kind, group in workloads:
        if kind == "diag":
            for t in TRANSPORTS:
                v = dict(res.get((w, t, "median_us"), []))
                if v:
                    med[(w, t, "median_us")] = statistics.median(v.values())
            continue
        metrics = ("median_us", "p99_us", "avg_us") if kind in ("lat", "conn") else (
            ("srv_us", "cli_us") if kind == "cpu" else ("mibps",) if kind == "bw" else ("rps",))
        for t in TRANSPORTS:
            runs = {m: dict(res.get((w, t, m), [])) for m in metrics}
            good_rounds = set(runs[metrics[0]])
            if t == "rsock":
                for rnd in sorted(good_rounds):
                    ok, txt = validity(w, group, kind, rnd, sums)
                    proof.append((w, rnd, ("" if ok else "INVALID: ") + txt))
                    if not ok:
                        invalid.append((w, rnd, txt))
                        good_rounds.discard(rnd)
            if good_rounds:
                for m in metrics:
                    med[(w, t, m)] = statistics.median(runs[m][r] for r in good_rounds)
                    runs_of[(w, t, m)] = [runs[m][r] for r in sorted(good_rounds)]
            else:
                whys = [why for _, why in na.get((w, t), [])]
                if runs[metrics[0]]:
                    cell_why[(w, t)] = "invalid: not proven to run over RDMA (see below)"
                elif whys:
                    cell_why[(w, t)] = whys[0]
                else:
                    cell_why[(w, t)] = "no result recorded"
                    problems.append(f"{w}/{t}: neither a figure nor an explained n/a")
            if t == "rsock" and (w, t) in cell_why:
                problems.append(f"{w}/librsock: no valid figure: {cell_why[(w, t)]}")

    # Pass-through (native): "| SET | plain | preload | ratio | verdict |" rows.
    passthrough, pt_spread, pt_cpu = {}, {}, {}
    if a.passthrough and os.path.exists(a.passthrough):
        with open(a.passthrough) as f:
            for line in f:
                c = [x.strip() for x in line.strip().strip("|").split("|")]
                if len(c) == 5 and c[0] in ("SET", "GET") and c[1].replace(".", "").isdigit():
                    passthrough[c[0]] = (float(c[1]), float(c[2]))
                # "| SET pairs | r1 r2 ... | lo-hi |": each run's pair as a ratio.
                elif len(c) == 3 and c[0] in ("SET pairs", "GET pairs"):
                    pt_spread[c[0].split()[0]] = c[2]
                # "| server CPU | plain | preload | ratio |": CPU us per request.
                elif len(c) == 4 and c[0] in ("server CPU", "client CPU") and c[1].replace(".", "").isdigit():
                    pt_cpu[c[0]] = (float(c[1]), float(c[2]))

    notes = {}  # footnote text -> number
    def note(text):
        if text not in notes:
            notes[text] = len(notes) + 1
        return f"n/a [{notes[text]}]"

    def val(w, t, m):
        return med.get((w, t, m))

    def ratio(a_, b_):
        return f"{a_ / b_:.2f}" if a_ is not None and b_ else "–"

    def spread(w, t, m):
        """Half the range of the valid runs, relative to their median: the
        noise a ratio of two cells has to beat. None with fewer than 2 runs."""
        v = runs_of.get((w, t, m), [])
        md = med.get((w, t, m))
        if len(v) < 2 or not md:
            return None
        return (max(v) - min(v)) / 2 / md

    def with_spread(w, t, m, kind):
        sp = spread(w, t, m)
        return fmt(val(w, t, m), kind) + ("" if sp is None else f" ±{sp:.0%}")

    lines = []
    lines.append("| workload | unit | raw verbs | TCP | rspreload | librsock | librsock/raw | librsock/rspreload | librsock/TCP |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for w, label, kind, group in workloads:
        m0 = "median_us" if kind in ("lat", "conn", "diag") else (
            "srv_us" if kind == "cpu" else "mibps" if kind == "bw" else "rps")
        cells = []
        for t in TRANSPORTS:
            if kind == "diag":
                cells.append(fmt(val(w, t, m0), "conn") if (w, t, m0) in med else "–")
            elif (w, t, m0) in med:
                if kind in ("lat", "conn"):
                    cells.append(" / ".join([with_spread(w, t, "median_us", kind)] +
                                            [fmt(val(w, t, m), kind) for m in ("p99_us", "avg_us")]))
                elif kind == "cpu":
                    cells.append(" / ".join(with_spread(w, t, m, kind) for m in ("srv_us", "cli_us")))
                else:
                    cells.append(with_spread(w, t, m0, kind))
            else:
                cells.append(note(f"{TNAME[t]}: {cell_why[(w, t)]}"))
        r = val(w, "rsock", m0)
        unit = "us med / p99 / avg" if kind in ("lat", "conn") else UNIT[kind]
        lines.append(f"| {label} | {unit} | " + " | ".join(cells) + " | " +
                     " | ".join(ratio(r, val(w, t, m0)) for t in ("raw", "rsp", "tcp")) + " |")
    pt_targets = []  # the pass-through rows of the targets table, made here with their figures
    for t in ("SET", "GET"):
        if t in passthrough:
            p, q = passthrough[t]
            lines.append(f"| pass-through redis {t} (native, no RDMA device) | req/s | – | {p:.0f} | – | {q:.0f} | – | – | {q / p:.3f} |")
            spread = pt_spread.get(t, "–")
            verdict = "met" if q / p >= 0.98 else "MISSED"
            if "-" in spread[1:]:
                lo, hi = (float(x) for x in spread.split("-"))
                if lo <= 0.98 <= hi:
                    verdict += " (within the spread: not decided by these runs)"
            pt_targets.append(f"| pass-through redis {t} >= 0.98x plain | {q:.0f} vs {p:.0f} req/s | {q / p:.3f} | {spread} | {verdict} |")
        else:
            lines.append(f"| pass-through redis {t} (native, no RDMA device) | req/s | – | {note('pass-through: bench/passthrough/run did not run or printed no table')} | – | n/a | – | – | – |")
            pt_targets.append(f"| pass-through redis {t} >= 0.98x plain | – | – | – | not measured |")
    if len(pt_cpu) == 2:
        (sp, sq), (cp, cq) = pt_cpu["server CPU"], pt_cpu["client CPU"]
        r = lambda q, p: f"{q / p:.3f}" if p else "–"  # (a --quick run may count 0 ticks)
        lines.append(f"| pass-through redis CPU per request (server / client) | CPU us / request, server / client | – | {sp:.2f} / {cp:.2f} | – | {sq:.2f} / {cq:.2f} | – | – | {r(sq, sp)} / {r(cq, cp)} |")
    table = "\n".join(lines)

    # Back-to-back pairs (in_vm.sh run_pairs): each pair's librsock run over
    # its TCP run, a few seconds apart. The targets against TCP are judged on
    # these ratios when there are any: the rounds' cells are minutes apart.
    pair_rows = ["| workload | unit | TCP, pair by pair | librsock, pair by pair | librsock/TCP, pair by pair | median ratio |",
                 "|---|---|---|---|---|---:|"]
    pair_target = {}  # target name -> its targets-table row
    for w, tr, label, group, kind, m, op, limit, name in PAIR_WORKLOADS:
        tcp = dict(res.get((w, "tcp", m), []))
        rs = dict(res.get((w, tr, m), []))
        pairs = []
        for p in sorted(set(tcp) & set(rs)):
            ok, txt = True, ""
            if group:
                ok, txt = validity(w, group, kind, p, sums)
                proof.append((w, p, ("" if ok else "INVALID: ") + txt))
            if not ok:
                invalid.append((w, p, txt))
            elif tcp[p]:
                pairs.append((tcp[p], rs[p], rs[p] / tcp[p]))
        # --check, as for the rounds: every librsock run needs a valid figure
        # (an explained TCP n/a only leaves its pair out).
        ran = int(meta.get("redis_long_n", "0")) > 0 if w.startswith("redis_long") else True
        if int(meta.get("pairs", "0")) > 0 and ran:
            bad = ([txt for w_, _, txt in invalid if w_ == w] if group else []) + \
                [why for _, why in na.get((w, tr), [])]
            if bad or not rs:
                problems.append(f"{w}/{'librsock' if tr == 'rsock' else tr}: " +
                                (bad[0] if bad else "no figure recorded"))
        if not pairs:
            continue
        f = lambda v: fmt(v, kind)
        rq = [q for _, _, q in pairs]
        qm = statistics.median(rq)
        pair_rows.append(f"| {label} | {UNIT[kind]} | {' '.join(f(a_) for a_, _, _ in pairs)} | "
                         f"{' '.join(f(b_) for _, b_, _ in pairs)} | {' '.join(f'{q:.2f}' for q in rq)} | {qm:.2f} |")
        if name is None:
            continue  # (a diagnostic: no target to judge)
        n_meet = sum(1 for q in rq if meets(q, op, limit))
        lo, hi = min(rq), max(rq)
        verdict = "met" if meets(qm, op, limit) else "MISSED"
        if len(rq) >= 2 and lo <= limit <= hi:
            verdict += " (within the spread: not decided by these pairs)"
        pair_target[name] = (f"| {name} | {f(statistics.median(b_ for _, b_, _ in pairs))} vs "
                             f"{f(statistics.median(a_ for a_, _, _ in pairs))} ({len(rq)} back-to-back pairs) | "
                             f"{qm:.2f} | {lo:.2f}-{hi:.2f}, {n_meet} of {len(rq)} pairs meet it | {verdict} |")
    pairs_table = "\n".join(pair_rows) if len(pair_rows) > 2 else ""

    # Targets.
    tl = ["| target | figure | ratio | ratio over the runs | verdict |", "|---|---|---:|---|---|"]
    def target(name, w, t, m, op, limit):
        r_ = val(w, "rsock", m)
        b = val(w, t, m)
        if r_ is None or not b:  # no figure, or a zero one (no ratio)
            tl.append(f"| {name} | {w}: librsock vs {TNAME[t]} | – | – | not measured (n/a above) |")
            return
        q = r_ / b
        ok = meets(q, op, limit)
        # The ratio any pairing of the two cells' runs gives: when the limit
        # falls inside, the runs do not decide the verdict (more rounds).
        rv, bv = runs_of.get((w, "rsock", m), []), [x for x in runs_of.get((w, t, m), []) if x]
        span, verdict = "–", "met" if ok else "MISSED"
        if len(rv) >= 2 and len(bv) >= 2:
            lo, hi = min(rv) / max(bv), max(rv) / min(bv)
            span = f"{lo:.2f}-{hi:.2f}"
            if lo <= limit <= hi:
                verdict += " (within the spread: not decided by these runs)"
        kind = "lat" if "us" in m else "bw"
        tl.append(f"| {name} | {fmt(r_, kind)} vs {fmt(b, kind)} | {q:.2f} | {span} | {verdict} |")
    for w in ("pp64", "bpp64"):
        lab = "sockperf" if w == "pp64" else "blocking"
        target(f"64 B ping-pong ({lab}) median <= 1.15x raw verbs", w, "raw", "median_us", "<=", 1.15)
        target(f"64 B ping-pong ({lab}) median <= 0.8x rspreload", w, "rsp", "median_us", "<=", 0.8)
    for w, lab in (("iperf3", "iperf3"), ("sp_tp", "sockperf tp"), ("bstream", "blocking stream")):
        target(f"streaming ({lab}) >= 0.85x ib_write_bw", w, "raw", "mibps", ">=", 0.85)
        target(f"streaming ({lab}) >= 1.3x rspreload", w, "rsp", "mibps", ">=", 1.3)
    for name, w, m, op, limit in (("connect-to-first-byte median <= 1.1x TCP", "connect", "median_us", "<=", 1.1),
                                  ("redis-benchmark SET >= 1.0x TCP", "redis_set", "rps", ">=", 1.0),
                                  ("redis-benchmark GET >= 1.0x TCP", "redis_get", "rps", ">=", 1.0)):
        if name in pair_target:
            tl.append(pair_target[name])
        else:
            target(name, w, "tcp", m, op, limit)
    tl.extend(pt_targets)
    targets = "\n".join(tl)
    if pairs_table:
        targets += ("\n\nThe back-to-back pairs behind the rows that say so (each pair: one run over "
                    "TCP and one over librsock, seconds apart, which goes first alternating; the "
                    "connect pairs' pass-through run, librsock with default = tcp, between the two; "
                    "the rounds' cells above are minutes apart):\n\n" + pairs_table)

    foot = "\n".join(f"{n}. {t}" for t, n in notes.items())
    prooft = ["| workload | round | librsock exit summaries (client; server of that round) |", "|---|---:|---|"]
    for w, rnd, txt in proof:
        prooft.append(f"| {w} | {rnd} | {txt} |")
    qpt = ", ".join(f"{w}: {max(v)}" for (w, t), v in sorted(qps.items()) if t == "rsp")

    print(table)
    print()
    print(targets)
    print()
    print(foot)
    if invalid:
        print("\nINVALID librsock runs (excluded):")
        for w, rnd, txt in invalid:
            print(f"  {w} round {rnd}: {txt}")

    if a.png:
        plot(a.png, os.path.join(a.dir, "performance.dat"), med)
    if a.md:
        write_md(a, meta, rounds, table, targets, foot, "\n".join(prooft), qpt, invalid)
    if a.check:
        for p in problems:
            print("CHECK:", p)
        print("check:", "FAIL" if problems else "PASS")
        return 1 if problems else 0
    return 0


def plot(png, data, med):
    """Latency vs message size: blocking ping-pong over every transport (the
    workload rspreload can run), ib_send_lat, and sockperf's ping-pong. The
    gnuplot data file goes to DATA (next to the raw results)."""
    series = [("bpp", "raw", "raw verbs (ib\\_send\\_lat)"), ("bpp", "tcp", "TCP"), ("bpp", "rsp", "rspreload"),
              ("bpp", "rsock", "librsock"), ("pp", "tcp", "TCP, sockperf"), ("pp", "rsock", "librsock, sockperf")]
    with open(data, "w") as f:
        f.write("# size " + " ".join(f"{p}_{t}" for p, t, _ in series) + "  (median one-way latency, us; NaN = n/a)\n")
        for s in SIZES:
            f.write(f"{s} " + " ".join(
                f"{med[(p + str(s), t, 'median_us')]:.3f}" if (p + str(s), t, "median_us") in med else "NaN"
                for p, t, _ in series) + "\n")
    styles = ["lc rgb '#000000' dt 2", "lc rgb '#1f77b4'", "lc rgb '#2ca02c'", "lc rgb '#d62728'",
              "lc rgb '#1f77b4' dt 3", "lc rgb '#d62728' dt 3"]
    plots = ", ".join(f"'{data}' using 1:{i + 2} with linespoints lw 2 pt 7 {styles[i]} title '{title}'"
                      for i, (_, _, title) in enumerate(series))
    script = f"""set terminal pngcairo size 900,560 font 'DejaVu Sans,11'
set output '{png}'
set title 'Ping-pong latency vs message size (median, one way; QEMU TCG guest, Soft-RoCE rxe)'
set xlabel 'message size (bytes)'
set ylabel 'latency (us)'
set logscale xy
set xtics ('64' 64, '1K' 1024, '16K' 16384)
set grid
set key top left
set datafile missing 'NaN'
plot {plots}
"""
    r = subprocess.run(["gnuplot"], input=script, text=True, capture_output=True)
    if r.returncode != 0:
        print("gnuplot failed:", r.stderr, file=sys.stderr)


def write_md(a, meta, rounds, table, targets, foot, prooft, qpt, invalid):
    kept = ""
    if os.path.exists(a.md):
        with open(a.md) as f:
            old = f.read()
        if HAND_WRITTEN in old:
            kept = old[old.index(HAND_WRITTEN) + len(HAND_WRITTEN):]
    png = os.path.basename(a.png) if a.png else "performance.png"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    doc = f"""# Performance: librsock vs raw verbs, rsocket and kernel TCP

Generated by `bench/compare/run` (do not edit above the hand-written marker;
rerun the command instead).

## How to run

```sh
bench/compare/run [--quick] [--build DIR]     # from the repository root, as root; ~10 min
```

It boots the Soft-RoCE VM once (`tools/rxe-vm`) and runs
`bench/compare/in_vm.sh` inside it: every workload over every transport,
{rounds} rounds, the transport order rotating each round (raw, TCP,
rspreload, librsock; then TCP, rspreload, librsock, raw; ...) so that drift
of the guest hits all alike. Raw results and every program's log go to
`BUILD/bench-compare/`. Back on the host it runs `bench/passthrough/run`
natively (no RDMA device) and `bench/compare/report.py`, which prints the
table, writes this file and draws `docs/{png}` with gnuplot. `--quick` is the
ctest smoke `bench.compare.smoke` (label `rdma`: `vm.suite` runs it in the
VM): 1 round of ~1 s runs; it checks that every cell has a figure or an
explained n/a, never speed.

Transports (both ends of every connection use the same one):
- **raw verbs**: perftest over rdma_cm (`-R`): `ib_send_lat` for ping-pong
  (its t_typical, 99% percentile and t_avg), `ib_write_bw -s 65536` for
  streaming (perftest's MB/s are MiB/s);
- **TCP**: the kernel, no preload;
- **rspreload**: `LD_PRELOAD=/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so`
  (rdma-core's rsocket preload);
- **librsock**: `LD_PRELOAD=BUILD/librsock.so` with `RSOCK_LOG_LEVEL=info`.
  A librsock figure counts only if the exit summaries (`summary:
  connections=.. upgraded=.. rdma_tx=.. rdma_rx=.. tcp_tx=.. tcp_rx=..`) of
  the client and of the server show an upgraded connection and >= 90 % of
  the bytes on RDMA; otherwise it is excluded and listed as invalid. The
  proof table also gives each round's switches onto RDMA with their average
  and longest length (the summaries' `switches=.. switch_ms_avg=..
  switch_ms_max=..`): how long a request could wait for its connection's
  switch.

Workloads (server on 10.77.0.1 in the guest):
- **sockperf ping-pong** `sockperf pp --tcp -m SIZE -t S --pre-warmup-wait 1`
  against `sockperf sr --tcp`: sockperf's percentile 50 / percentile 99 /
  average latency (one way, us). The 1 s wait lets librsock's background
  upgrade finish before measuring.
- **blocking ping-pong / stream / connect** (`bench/connect`,
  `rsock_connect_bench`): plain blocking `read`/`write`, so that rspreload
  runs them too (it cannot run sockperf, iperf3 or redis, see the notes).
  Ping-pong: one connection, SIZE bytes echoed, round trip / 2, after 1 s of
  warm-up. Stream: 64 KiB writes for 1 + S s, the last S s counted up to the
  server's byte-count reply. Connect: N sequential connections, time from
  `connect()` to the first echoed byte (1 byte each way), then `close()`.
  Each ping-pong's CPU row: CPU microseconds per round trip, the server's
  (`/proc/PID/stat` over the client's run, divided by every round trip,
  warm-up included) and the client's (`getrusage` over the measured part,
  every thread).
- **sockperf throughput** `sockperf tp -m 65000`: messages sent / time.
- **iperf3** `iperf3 -c -t S -O 1` (first second omitted): receiver bytes/s.
- **redis-benchmark** `-t set,get -c 10 -n N` against `redis-server --save ''
  --appendonly no`. Its CPU row: the server's user + system time over the
  client's run (`/proc/PID/stat`) and the client's (`getrusage` of the
  waited-for client), each divided by the 2N requests; the ratio columns
  compare the server's.
- **memcached** (2 worker threads, each with its own epoll loop):
  `memcslap --concurrency=10 --execute-number=M --test=set`, keys / the time
  memcslap reports (no get row: memcslap loads the keys for it through one
  more connection, which closes before its upgrade, so the run cannot be
  shown to be 90 % RDMA).
- **epoll echo** (`tests/readiness/epoll_echo.cc`): one process holds 64
  connections to itself in one level-triggered epoll set; each client sends
  B bytes, which the server side echoes back; bytes echoed per second after
  every socket settled (on RDMA, or TCP); B = 200000 (quick: 20000).
- **pass-through** (native, no RDMA device): `bench/passthrough/run`,
  redis-benchmark plain vs preloaded, alternating runs; besides the rates,
  each side's CPU microseconds per request (a diagnostic row), and in the
  targets table the range of the runs' pairs (preloaded/plain, run by run).
- **back-to-back pairs** (connect and redis, the targets set against TCP):
  after the rounds, {meta.get('pairs', '?')} pairs of runs, each one over TCP
  and one over librsock a few seconds apart (which goes first alternates),
  each side with a fresh server. The targets table judges those two targets
  on the pairs' ratios (their median, their range, and how many pairs meet
  the target) rather than on the rounds' medians, which are minutes apart in
  a guest whose speed drifts over minutes. Each pair also runs redis a
  second time, longer (`-n {meta.get('redis_long_n', '?')}`, the "long run"
  rows, a diagnostic): a short run's rate includes the connections' setup
  at its start, which the long one spreads over more requests. Each connect
  pair also runs the pass-through between its two runs (librsock loaded on
  both ends with `default = tcp`, a diagnostic row against the same pair's
  TCP): what the hooks alone add to a connection's setup, with no upgrade.
- **diagnostic** rows (median only, no target): the `connect()` call alone,
  and connection setup with librsock on both ends but `RSOCK_DEFAULT=tcp`
  (hooks only, no upgrade started).

Sizes: full run S = 2 s, ping-pong 64 B / 1 KiB / 16 KiB, `ib_send_lat -n
2000`, 150 connections (+5 warm-up), `redis-benchmark -n 6000`, memcslap
M = 400 (4000 keys), `iperf3 -t 3`, {meta.get('pairs', '?')} back-to-back pairs (`PAIRS=`),
pass-through `-n 100000 --runs 9` (at `-n 20000 --runs 3` one side's runs
spread 29k-82k req/s natively); `--quick`: S = 1 s, 64 B only, 20
connections, `-n 5000`, M = 200, `iperf3 -t 2`, 1 pair, pass-through `-n
2000 --runs 1`.

Columns: each figure is the median over the rounds (latency cells: median /
p99 / average of the per-round values). "±x%" after a median is its
spread: half the range of the valid rounds, relative to the median (with
one round, none). Ratios are librsock divided by the other transport, on
the median latency or the throughput; for latency lower is better, for
throughput higher. In the targets table, "ratio over the runs" is the
range any pairing of the two cells' rounds gives (for pass-through, and
for connect and redis when they ran in pairs, the range of the pairs'
ratios, each pair's two sides back to back); a verdict
whose limit falls inside it says so: the rounds do not decide it, more are
needed.
"n/a [k]" points to note k below, which says why there is no figure.

## Results

- Command: `{a.command}`
- Machine: {a.machine}
- Guest: QEMU TCG guest, 2 vCPUs, Soft-RoCE rxe ({meta.get('guest', '?')})
- {rounds} round(s) of {meta.get('secs', '?')} s runs; VM part took {meta.get('elapsed_s', '?')} s; generated {when}

{table}

Notes (why a cell has no figure):

{foot if foot else '(none)'}

### Targets

Benchmarks, not tests: a missed target is reported, never fails anything.

{targets}

![latency vs message size](./{png})

`docs/{png}`: median one-way ping-pong latency vs message size; solid lines
are the blocking ping-pong (the one latency workload every transport runs),
dashed black is `ib_send_lat`, dotted lines are sockperf.

### Proof that librsock ran over RDMA

{('INVALID runs (excluded from the medians): ' + '; '.join(f'{w} round {r}' for w, r, _ in invalid)) if invalid else 'Every librsock figure above is backed by these exit summaries.'}

{prooft}

rspreload: RC QPs listed by `rdma resource show qp` 0.5 s into its client
runs (> 0 means it really used RDMA; pp* are its failed sockperf attempts):
{qpt or 'not sampled'}.

{HAND_WRITTEN}"""
    with open(a.md, "w") as f:
        f.write(doc + (kept if kept else "\n"))


if __name__ == "__main__":
    sys.exit(main())
