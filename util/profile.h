// Data-path cycle counters: where a message's time goes, measured inside
// the library (docs/PERFORMANCE.md, "Where a 64 B one-way goes").
//
// Built only with `cmake -DRSOCK_PROFILE=ON`. Otherwise every probe below is
// an empty inline and the data path is unchanged, so the counters cost
// nothing where users run. A profiling build times each probe with two TSC
// reads (a syscall-free 63 ns in the TCG guest, where clock_gettime costs
// 3.2 us) and adds it to a process-wide sum, printed to stderr at exit and
// whenever a read returns end-of-file (a server killed by a signal after its
// connections closed has printed by then).
#pragma once

#include <cstdint>

#if defined(RSOCK_PROFILE) && defined(__x86_64__)
#include <unistd.h>
#include <x86intrin.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "util/clock.h"
#endif

namespace rsock::profile {

enum class Probe {
  kRecv,      // a blocking or nonblocking receive on an upgraded socket
  kSend,      // a send on an upgraded socket
  kRecvStep,  // one locked attempt of a receive (progress + copy)
  kSendStep,  // one locked attempt of a send (progress + copy + post)
  kReadWait,  // a receive from its first EAGAIN to its return
  kSpinTurn,  // one turn of a busy-poll before a sleep
  kPostSend,  // ibv_post_send of data (on rxe: the whole protocol, in the kernel)
  kPollCq,    // one look at the connection's completions
  kCount,
};

#if defined(RSOCK_PROFILE) && defined(__x86_64__)

namespace detail {
struct Sum {
  std::atomic<uint64_t> cycles{0}, count{0};
};
inline Sum g_sums[static_cast<int>(Probe::kCount)];
inline constexpr const char* kNames[] = {"recv",      "send",      "recv_step", "send_step",
                                         "read_wait", "spin_turn", "post_send", "poll_cq"};
}  // namespace detail

inline void add(Probe p, uint64_t cycles) {
  auto& s = detail::g_sums[static_cast<int>(p)];
  s.cycles.fetch_add(cycles, std::memory_order_relaxed);
  s.count.fetch_add(1, std::memory_order_relaxed);
}

// One line per probe that ran: calls, mean and total, in ns once the TSC's
// rate is known (cycles before that).
inline void dump() {
  const uint64_t per_ms = spin_detail::tsc_per_ms();
  const double per_ns = per_ms ? double(per_ms) / 1e6 : 1.0;
  for (int i = 0; i < static_cast<int>(Probe::kCount); ++i) {
    uint64_t n = detail::g_sums[i].count.load(std::memory_order_relaxed);
    uint64_t c = detail::g_sums[i].cycles.load(std::memory_order_relaxed);
    if (n == 0) continue;
    char line[160];  // one write per line: no buffer to outgrow
    int len = snprintf(line, sizeof line,
                       "librsock[%d]: profile: %-9s n=%llu mean_%s=%.0f total_ms=%.1f\n", getpid(),
                       detail::kNames[i], static_cast<unsigned long long>(n),
                       per_ms ? "ns" : "cycles", double(c) / double(n) / per_ns,
                       per_ms ? double(c) / per_ns / 1e6 : 0.0);
    if (len > 0) (void)!write(2, line, std::min(size_t(len), sizeof line - 1));
  }
}

namespace detail {
inline const int g_at_exit = atexit(dump);
}

// Times the enclosing block.
class Scope {
 public:
  explicit Scope(Probe p) : p_(p), t0_(__rdtsc()) {}
  ~Scope() { add(p_, __rdtsc() - t0_); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Probe p_;
  uint64_t t0_;
};

// Times from start() (the first call counts) to the end of the enclosing
// block; nothing if start() was never called.
class Span {
 public:
  explicit Span(Probe p) : p_(p) {}
  ~Span() {
    if (t0_) add(p_, __rdtsc() - t0_);
  }
  void start() {
    if (!t0_) t0_ = __rdtsc();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  Probe p_;
  uint64_t t0_ = 0;
};

#else

inline void dump() {}
class Scope {
 public:
  explicit Scope(Probe) {}
};
class Span {
 public:
  explicit Span(Probe) {}
  void start() {}
};

#endif

}  // namespace rsock::profile
