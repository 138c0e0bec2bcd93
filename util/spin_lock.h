// A test-and-set lock for the few short critical sections that hooks enter
// on any thread (the socket pool, a socket's epoll watch list, the stats
// segment's allocator): no allocation, no futex, safe to take again in a
// fork child after the parent's holder is gone (reset by the fork handlers).
//
// Its holder can still lose its CPU: with more runnable threads than CPUs a
// waiter that only spins burns its whole time slice while the holder waits
// for one. memcslap's ten threads on the guest's two vCPUs, creating their
// sockets at once, spent 14-21 us of CPU per request of a 4,000-request run
// spinning on the socket pool's lock (docs/PERFORMANCE.md, "memcached under
// concurrency"). So a waiter yields its CPU every kYieldTurns turns.
#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>

namespace rsock {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

inline void spin_lock(std::atomic<bool>& flag) {
  // (About 5 us of pauses on current x86 cores before the first yield: a
  // holder that is running is done long before.)
  constexpr uint32_t kYieldTurns = 128;
  uint32_t turns = 0;
  while (flag.exchange(true, std::memory_order_acquire)) {
    while (flag.load(std::memory_order_relaxed)) {
      if (++turns % kYieldTurns == 0) sched_yield();
      else cpu_relax();
    }
  }
}

// spin_lock that gives up after `turns` turns (yielding as spin_lock does):
// false if it did not take the lock. For a lock whose holder keeps it for
// a syscall or two and which a fork child may inherit taken (its holder,
// another thread of the parent, is not in the child), where going on
// without it costs less than waiting for ever.
inline bool spin_lock_for(std::atomic<bool>& flag, uint32_t turns) {
  constexpr uint32_t kYieldTurns = 128;
  for (uint32_t t = 0; flag.exchange(true, std::memory_order_acquire); t++) {
    if (t >= turns) return false;
    if ((t + 1) % kYieldTurns == 0) sched_yield();
    else cpu_relax();
  }
  return true;
}

inline void spin_unlock(std::atomic<bool>& flag) { flag.store(false, std::memory_order_release); }

}  // namespace rsock
