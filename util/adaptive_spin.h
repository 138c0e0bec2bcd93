// How long a thread busy-polls before it sleeps, learnt from its own waits.
//
// A fixed spin (spin_us) is either too short or wasteful: in the TCG guest a
// sleep and its wakeup cost 100-200 us, so a 4 KiB ping-pong whose answer
// comes after ~200 us paid that on every round trip with a 20 us spin (188
// us one way against 99 us with a 300 us spin), while a connection whose
// peer answers after milliseconds would burn every microsecond of a long
// spin for nothing. So each thread remembers how its recent waits ended:
//   - hit rate: the share of waits that ended within spin_max_us (an EWMA
//     with weight 1/8, in 1/256ths);
//   - the typical short wait: an EWMA of those waits' lengths.
// While at least half of the recent waits were short, the next spin lasts
// twice the typical short wait (at least spin_us, at most spin_max_us);
// otherwise only spin_us. The spin therefore costs CPU only where it
// replaces a sleep/wakeup round trip that would have come sooner than
// spin_max_us, and a thread whose peer goes quiet is back to spin_us after
// a few long waits (from a 100 % hit rate: 6). spin_max_us is the CPU
// budget per wait; at or below spin_us the spin is fixed, as before. At
// most one thread per CPU spins at a time, and one fewer spins longer than
// spin_us (SpinPlace).
//
// The policy is pure arithmetic (unit-tested); WaitTimer gives it lengths
// read from the TSC, so a wait costs no clock syscall (the guest's clock
// source is not readable from the vDSO). Before the TSC's rate is known, and
// off x86-64, nothing is learnt and the spin is spin_us.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include "util/clock.h"

namespace rsock {

class SpinPolicy {
 public:
  static constexpr uint32_t kOne = 256;  // hit rate 1.0 in fixed point

  // The spin before the next sleep, in microseconds.
  uint32_t budget_us(uint32_t base_us, uint32_t max_us) const {
    if (max_us <= base_us || hits_ < kOne / 2) return base_us;
    uint64_t want = short_ns_ * 2 / 1000 + 1;
    return want <= base_us ? base_us : want >= max_us ? max_us : static_cast<uint32_t>(want);
  }

  // A wait ended after `waited_ns` (ready, timed out or interrupted alike).
  void record(uint64_t waited_ns, uint32_t max_us) {
    const bool hit = waited_ns <= uint64_t{max_us} * 1000;
    hits_ = hits_ - hits_ / 8 + (hit ? kOne / 8 : 0);
    // (The first short wait seeds the average.)
    if (hit) short_ns_ = short_ns_ ? short_ns_ - short_ns_ / 8 + waited_ns / 8 : waited_ns;
  }

  uint32_t hit_rate() const { return hits_; }  // in 1/256ths

 private:
  uint32_t hits_ = 0;
  uint64_t short_ns_ = 0;  // EWMA of the short waits; 0 before the first
};

// A place among the process's spinning threads, held for the spin only (not
// the sleep after it). More threads spinning than CPUs would only take the
// CPU from the threads whose answers they wait for. (memcslap's ten threads
// on the guest's two vCPUs spend 50-75 us of CPU per request in the spin
// and its progress steps with this limit as without it: there it seldom
// bites; docs/PERFORMANCE.md, "memcached under concurrency".) So:
//   - at most one spinning thread per CPU the process may run on; a thread
//     that finds them all taken sleeps at once (its spin is 0);
//   - at most one fewer than the CPUs spins longer than spin_us (ten
//     threads of a thread-per-connection server, each with a quick peer;
//     on a single CPU a long spin takes the CPU from everything else
//     there, with Soft-RoCE from the kernel work that carries the awaited
//     message: a one-vCPU guest streamed slower with a longer spin); a
//     thread that finds those taken spins spin_us.
// A single-threaded program always gets its spin. Not fair: a thread that
// slept at once finds the places taken again more often than the threads
// that spun and got their answers, so under more waiting threads than CPUs
// some connections see the slower, sleeping latency (memcslap's sets per
// second did not move beyond the guest's noise either way:
// docs/PERFORMANCE.md).
class SpinPlace {
 public:
  SpinPlace(uint32_t us, uint32_t base_us) {
    if (us == 0) return;
    if (all().fetch_add(1, std::memory_order_acq_rel) >= cpus()) {
      all().fetch_sub(1, std::memory_order_acq_rel);
      return;  // us_ = 0: sleep at once
    }
    held_ = true;
    us_ = us;
    if (us <= base_us) return;
    // (Counted apart: short spins do not use up the longer ones' places.)
    if (longer().fetch_add(1, std::memory_order_acq_rel) < cpus() - 1) {
      longer_ = true;
    } else {
      longer().fetch_sub(1, std::memory_order_acq_rel);
      us_ = base_us;
    }
  }
  ~SpinPlace() {
    if (longer_) longer().fetch_sub(1, std::memory_order_acq_rel);
    if (held_) all().fetch_sub(1, std::memory_order_acq_rel);
  }
  SpinPlace(const SpinPlace&) = delete;
  SpinPlace& operator=(const SpinPlace&) = delete;
  uint32_t us() const { return us_; }

  // A fork child has none of its parent's other threads: the places they
  // held at the fork are free (the forking thread holds none: a fork from
  // inside librsock passes through its hooks).
  static void after_fork_child() {
    all().store(0, std::memory_order_relaxed);
    longer().store(0, std::memory_order_relaxed);
  }

  // The CPUs the process may run on: its main thread's affinity (a worker
  // pinned to one CPU must not make it one for every thread), at most the
  // CPUs online; read at first use; 1 when unknown.
  static int cpus() {
    static const int n = [] {
      cpu_set_t set;
      CPU_ZERO(&set);
      int c = sched_getaffinity(getpid(), sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
      long online = sysconf(_SC_NPROCESSORS_ONLN);
      if (online > 0 && c > online) c = int(online);
      return c > 0 ? c : 1;
    }();
    return n;
  }

 private:
  static std::atomic<int>& all() {
    static std::atomic<int> n{0};
    return n;
  }
  static std::atomic<int>& longer() {
    static std::atomic<int> n{0};
    return n;
  }
  uint32_t us_ = 0;
  bool held_ = false, longer_ = false;
};

// The calling thread's policy: one sequence of waits per thread.
inline SpinPolicy& thread_spin_policy() {
  static thread_local SpinPolicy policy;
  return policy;
}

// Times one wait (spin plus sleep) and tells the thread's policy how long it
// took: start() at the first attempt that would block, the destructor when
// the call returns. Two TSC reads; nothing when the TSC's rate is not known.
class WaitTimer {
 public:
  WaitTimer() = default;
  ~WaitTimer() {
#if defined(__x86_64__)
    if (rate_ == 0) return;
    uint64_t t = __rdtsc();
    if (t < start_) return;  // another CPU's TSC: no length to learn from
    // (Capped at a second, far above any spin budget, so that the product
    // cannot overflow.)
    uint64_t ticks = t - start_ < rate_ * 1000 ? t - start_ : rate_ * 1000;
    thread_spin_policy().record(ticks * 1000000 / rate_, max_us_);
#endif
  }
  WaitTimer(const WaitTimer&) = delete;
  WaitTimer& operator=(const WaitTimer&) = delete;

  // Once per wait (later calls keep the first start); returns the spin.
  uint32_t start(uint32_t base_us, uint32_t max_us) {
    if (started_) return budget_us_;
    started_ = true;
    max_us_ = max_us;
    budget_us_ = base_us;
#if defined(__x86_64__)
    if (max_us > base_us && (rate_ = spin_detail::tsc_per_ms()) != 0) {
      start_ = __rdtsc();
      budget_us_ = thread_spin_policy().budget_us(base_us, max_us);
    }
#endif
    return budget_us_;
  }
  uint32_t spin_us() const { return budget_us_; }

 private:
  bool started_ = false;
  uint32_t max_us_ = 0, budget_us_ = 0;
  uint64_t rate_ = 0, start_ = 0;
};

}  // namespace rsock
