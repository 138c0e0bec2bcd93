// Monotonic nanoseconds for deadlines (CLOCK_MONOTONIC, vDSO: no syscall).
#pragma once

#include <time.h>

#include <cstdint>

namespace rsock {

inline uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

}  // namespace rsock
