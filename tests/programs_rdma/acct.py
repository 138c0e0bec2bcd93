#!/usr/bin/python3
"""acct.py -- byte accounting helper for tests/programs_rdma/run.sh.

Every command prints one line of seven integers,
    conns upgraded fallbacks rdma_tx rdma_rx tcp_tx tcp_rx
so the shell can `read` them:

  acct.py stat BEFORE AFTER   difference of two `rsock-stat -p PID --json`
                              snapshots of one process (BEFORE may be "-": zero);
                              exit 4 (why on stderr) if the connections upgraded
                              in between have no switch timings
  acct.py logs FILE...        sum of the librsock exit-summary lines
                              ("info: summary: connections=...") in the logs;
                              exit 3 if no file holds one
  acct.py iperf3 JSON         iperf3 -J result: "sent_bytes received_bytes"
"""
import json
import re
import sys

FIELDS = ("conns", "upgraded", "fallbacks", "rdma_tx", "rdma_rx", "tcp_tx", "tcp_rx")
SWITCH_FIELDS = ("switches", "switch_us_sum", "upgrade_us_sum", "switch_us_max")
SUMMARY = re.compile(r"summary: connections=(\d+) upgraded=(\d+) fallbacks=(\d+) rdma_tx=(\d+) "
                     r"rdma_rx=(\d+) tcp_tx=(\d+) tcp_rx=(\d+)")


def snapshot(path):
    if path == "-":
        return dict.fromkeys(FIELDS + SWITCH_FIELDS, 0)
    with open(path) as f:
        p = json.loads(f.readline())["process"]
    return {
        "switches": p["switches"]["count"], "switch_us_sum": p["switches"]["switch_us_sum"],
        "upgrade_us_sum": p["switches"]["upgrade_us_sum"], "switch_us_max": p["switches"]["switch_us_max"],
        "conns": p["conns_seen"], "upgraded": p["conns_upgraded"],
        "fallbacks": sum(p["fallbacks"].values()),
        "rdma_tx": p["rdma"]["tx_bytes"], "rdma_rx": p["rdma"]["rx_bytes"],
        "tcp_tx": p["tcp"]["tx_bytes"], "tcp_rx": p["tcp"]["rx_bytes"],
    }


def main(argv):
    cmd = argv[1]
    if cmd == "stat":
        a, b = snapshot(argv[2]), snapshot(argv[3])
        print(*(b[k] - a[k] for k in FIELDS))
        # Every upgrade is a timed switch (rsock-stat's switch timings): a
        # switch that takes no time at all is not one this guest can make.
        up = b["upgraded"] - a["upgraded"]
        sw = {k: b[k] - a[k] for k in ("switches", "switch_us_sum", "upgrade_us_sum")}
        if up > 0 and (sw["switches"] < up or sw["switch_us_sum"] <= 0 or sw["upgrade_us_sum"] <= 0
                       or b["switch_us_max"] <= 0):
            print(f"switch timings missing: {up} upgraded, {sw}, switch_us_max {b['switch_us_max']}",
                  file=sys.stderr)
            return 4
    elif cmd == "logs":
        tot, found = [0] * len(FIELDS), 0
        for path in argv[2:]:
            with open(path, errors="replace") as f:
                for line in f:
                    m = SUMMARY.search(line)
                    if m:
                        found += 1
                        tot = [t + int(v) for t, v in zip(tot, m.groups())]
        if not found:
            return 3
        print(*tot)
    elif cmd == "iperf3":
        with open(argv[2]) as f:
            end = json.load(f)["end"]
        print(end["sum_sent"]["bytes"], end["sum_received"]["bytes"])
    else:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
