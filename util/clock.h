// Monotonic nanoseconds for deadlines and spin budgets (CLOCK_MONOTONIC).
#pragma once

#include <time.h>

#include <cstdint>

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

}  // namespace rsock
