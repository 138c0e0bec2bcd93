// Monotonic nanoseconds for deadlines and spin budgets (CLOCK_MONOTONIC).
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace rsock {

inline uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

// For timestamps that need only millisecond precision (keepalive, timeouts).
// CLOCK_MONOTONIC_COARSE is read from the vDSO page without a hardware
// counter, so it never becomes a syscall; CLOCK_MONOTONIC does in VMs whose
// clock source the vDSO cannot read (the rxe test VM: every call a syscall).
// It lags now_ns() by up to one timer tick (1-4 ms).
inline uint64_t coarse_now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

namespace spin_detail {
// TSC ticks per millisecond, 0 while unknown, 1 if unusable.
inline std::atomic<uint64_t> g_tsc_per_ms{0};
inline std::mutex g_calibration_mu;
inline uint64_t g_tsc0 = 0, g_ns0 = 0;  // under g_calibration_mu

// The TSC's rate, or 0 (not known yet, not usable, not x86-64): measured
// against CLOCK_MONOTONIC between the first call and one at least 10 ms
// later, with no waiting of its own.
inline uint64_t tsc_per_ms() {
#if defined(__x86_64__)
  uint64_t r = g_tsc_per_ms.load(std::memory_order_acquire);
  if (r != 0) return r > 1 ? r : 0;
  // try_lock: a fork child whose parent had a thread in here must not wait.
  std::unique_lock lk(g_calibration_mu, std::try_to_lock);
  if (!lk.owns_lock()) return 0;
  uint64_t ns = now_ns(), tsc = __rdtsc();
  if (g_ns0 == 0) {
    g_ns0 = ns;
    g_tsc0 = tsc;
    return 0;
  }
  if (ns - g_ns0 < 10'000'000) return 0;
  double rate = double(tsc - g_tsc0) * 1e6 / double(ns - g_ns0);
  r = tsc > g_tsc0 && rate >= 1e5 && rate <= 1e7 ? uint64_t(rate) : 1;  // 100 MHz - 10 GHz
  g_tsc_per_ms.store(r, std::memory_order_release);
  return r > 1 ? r : 0;
#else
  return 0;
#endif
}
}  // namespace spin_detail

// The end of a busy-poll budget (spin_us) that costs no clock syscall per
// turn: in VMs whose clock source the vDSO cannot read, every
// clock_gettime(CLOCK_MONOTONIC) is a syscall, and the spin loops made one
// per turn (redis-benchmark over librsock in the TCG guest: 3.7 clock reads
// per request, 0.8 without librsock). Timed by the TSC once its rate is
// known (x86-64), by the clock until then and elsewhere. A TSC that goes
// backwards (another CPU's) ends the spin.
class SpinDeadline {
 public:
  explicit SpinDeadline(uint32_t us) {
#if defined(__x86_64__)
    if (uint64_t r = spin_detail::tsc_per_ms(); r != 0) {
      tsc_ = true;
      start_ = __rdtsc();
      end_ = start_ + uint64_t{us} * r / 1000;
      return;
    }
#endif
    end_ = now_ns() + uint64_t{us} * 1000;
  }
  bool passed() const {
#if defined(__x86_64__)
    if (tsc_) {
      uint64_t t = __rdtsc();
      return t >= end_ || t < start_;
    }
#endif
    return now_ns() >= end_;
  }

 private:
  bool tsc_ = false;
  uint64_t start_ = 0, end_ = 0;
};

}  // namespace rsock
