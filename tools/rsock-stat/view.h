// rsock-stat views: what is shown, as text tables or JSON. main.cc collects
// snapshots and picks the view; rates come from the previous round (-i).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "util/stats_reader.h"

namespace rsock_stat {

using rsock::stats::ConnSnapshot;
using rsock::stats::ProcessSnapshot;

struct ReadError {
  int pid = 0;
  std::string message;
};

// One round of reading: every process we could read, and the ones we could not.
struct Round {
  std::vector<ProcessSnapshot> procs;
  std::vector<ReadError> errors;
  uint64_t unix_ms = 0;
};

// Byte rates since the previous round, per process and per connection.
struct Rates {
  double seconds = 0;  // 0: no previous round, no rates
  std::map<std::pair<int, uint64_t>, std::pair<double, double>> proc;  // (pid,start) -> tx/s, rx/s
  std::map<std::tuple<int, uint32_t, uint32_t, uint32_t>, std::pair<double, double>> conn;
  // (pid, file, slot, generation) -> tx/s, rx/s
};
Rates compute_rates(const Round& prev, const Round& cur);

enum class View { kList, kProcess, kNetstat };

// What every view derives from a process snapshot (one place, so the views
// cannot disagree): open connections by current transport, fallbacks summed.
struct ProcessSummary {
  uint64_t conns_open = 0;
  uint64_t conns_rdma = 0;  // open and on RDMA
  uint64_t conns_tcp = 0;   // open and on TCP (also while connecting or upgrading)
  uint64_t fallbacks = 0;   // all reasons
};
ProcessSummary summarize(const ProcessSnapshot& p);

std::string render_text(View v, const Round& r, const Rates& rates);
std::string render_json(View v, const Round& r, const Rates& rates);
// Prometheus text exposition format (node-exporter textfile collector): the
// per-process counters of every process in the round, labelled pid and exe.
std::string render_prometheus(const Round& r);
// A Prometheus label value: \, \" and \n escaped, invalid UTF-8 replaced by U+FFFD.
std::string prometheus_label_value(const std::string& s);

// "1.5K", "12.0M", "950"
std::string human_bytes(double v);

}  // namespace rsock_stat
