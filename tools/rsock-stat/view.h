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

std::string render_text(View v, const Round& r, const Rates& rates);
std::string render_json(View v, const Round& r, const Rates& rates);

// "1.5K", "12.0M", "950"
std::string human_bytes(double v);

}  // namespace rsock_stat
