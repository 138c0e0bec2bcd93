// The stats reader: consistent snapshots of live processes' segments, for
// rsock-stat and the tests. Never writes to a segment; never blocks a writer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "util/stats_layout.h"
#include "util/status.h"

namespace rsock::stats {

// Plain copy of Traffic.
struct TrafficTotals {
  uint64_t tx_bytes[kTransports] = {};
  uint64_t rx_bytes[kTransports] = {};
  uint64_t tx_ops[kTransports] = {};
  uint64_t rx_ops[kTransports] = {};
  uint64_t credit_stalls = 0;

  void add(const TrafficTotals& o);
};

struct ConnSnapshot {
  uint32_t file_index = 0;
  uint32_t slot_index = 0;
  SlotInfo info{};
  bool torn = false;  // seqlock never settled (writer died mid-update?)
  TrafficTotals traffic;
  uint32_t send_ring_fill = 0;
  uint32_t recv_ring_fill = 0;
  uint32_t ring_bytes = 0;
  uint32_t send_credits = 0;
  uint32_t upgrade_us = 0;  // socket start to first on RDMA (0: not yet)
  uint32_t switch_us = 0;   // the latest switch onto RDMA (0: none yet)
};

struct ProcessSnapshot {
  int pid = 0;
  uint32_t uid = 0;
  uint64_t start_time = 0;
  uint64_t start_unix_ms = 0;
  std::string exe;
  std::string release;  // the librsock release of the process (layout 4 on)
  uint64_t conns_seen = 0;
  uint64_t conns_upgraded = 0;
  uint64_t conns_untracked = 0;
  uint64_t handshake_errors = 0;
  uint64_t fallbacks[kFallbackReasons] = {};
  // Resources (layout 7): gauges the progress thread writes at its ticks.
  uint64_t pinned_bytes = 0;
  uint64_t pinned_budget = 0;  // UINT64_MAX: unlimited
  uint64_t kits_idle = 0;
  uint64_t kits_reused = 0;
  // Switches (layout 9): switches onto RDMA timed, their total and longest
  // length, and the first upgrades' time from socket start (conns_upgraded
  // of them).
  uint64_t switches = 0;
  uint64_t switch_us_sum = 0;
  uint64_t switch_us_max = 0;
  uint64_t upgrade_us_sum = 0;
  TrafficTotals closed;  // connections already closed
  TrafficTotals total;   // closed + open connections
  uint32_t files = 0;    // main + extensions read
  uint32_t slots = 0;    // capacity over all files
  std::vector<ConnSnapshot> conns;  // open connections only
};

struct SegmentRef {
  std::string dir;  // <root>/<uid>
  int pid = 0;
  uint32_t uid = 0;
};

// Segments under `root` (main files only): our own uid's directory, or every
// uid directory when `all_users` (root). With `clean`, stale files of dead
// processes are removed first (where we have the permission).
std::vector<SegmentRef> list_segments(const std::string& root, bool all_users, bool clean);

// Reads <dir>/<pid> and its extensions. Errors: ENOENT (no such segment),
// EAGAIN (being created), EINVAL/EPROTO with *why set for a segment that is
// corrupt or of another layout version.
Status<ProcessSnapshot> read_process(const std::string& dir, int pid, std::string* why);

// "10.0.0.1:80", "[fd00::1]:80"
std::string format_endpoint(uint8_t family, const uint8_t* addr, uint16_t port);

}  // namespace rsock::stats
