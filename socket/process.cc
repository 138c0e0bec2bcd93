#include "socket/process.h"

#include <errno.h>  // program_invocation_short_name
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "socket/rendezvous.h"
#include "socket/signals.h"
#include "util/stats.h"

namespace rsock::socket {

namespace {

// States of the one-time load. kLoading makes concurrent first callers (and
// a hook re-entered by the loader itself) see "not yet": they leave their
// socket untracked rather than wait, which is always safe.
enum : int { kNotLoaded, kLoading, kLoaded };
std::atomic<int> g_state{kNotLoaded};

// Storage that is never destroyed: hooks run during exit() after static
// destructors, and must still be able to read the config.
alignas(config::Config) unsigned char g_storage[sizeof(config::Config)];
config::Config* g_config = nullptr;

}  // namespace

namespace {
std::atomic<pid_t> g_owner_pid{0};
}  // namespace

void note_state_owner() { g_owner_pid.store(getpid(), std::memory_order_relaxed); }

bool in_vfork_child() {
  pid_t owner = g_owner_pid.load(std::memory_order_relaxed);
  return owner != 0 && getpid() != owner;
}

void init_process() {
  int expected = kNotLoaded;
  if (!g_state.compare_exchange_strong(expected, kLoading, std::memory_order_acq_rel)) return;
  note_state_owner();
  g_config = new (g_storage) config::Config(config::load_for_process());
  signals_scan();  // handlers installed before we were loaded
  if (!g_config->passthrough && g_config->tunables.stats) {
    // Failure only means rsock-stat cannot see us; the library works the same.
    (void)stats::init({.enabled = true, .exe = program_invocation_short_name});
    // Registered after the stats segment's own exit handler, so it runs
    // first (atexit is LIFO) while the counters are still mapped.
    atexit(log_exit_summary);
  }
  // Runs before the summary (LIFO): connections on RDMA are handed to TCP so
  // that the kernel delivers what they still hold after the process is gone.
  if (!g_config->passthrough) atexit(progress_at_exit);
  g_state.store(kLoaded, std::memory_order_release);
  // (Once loaded: what it creates is tracked like any socket.)
  if (!g_config->passthrough) {
    adopt_after_exec();
    adopt_inherited_sockets();
  }
}

const config::Config& process_config() {
  static const config::Config* const kDefaults = new config::Config();
  if (g_state.load(std::memory_order_acquire) == kLoaded) return *g_config;
  return *kDefaults;
}

bool tracking_enabled() {
  if (g_state.load(std::memory_order_acquire) != kLoaded) init_process();
  return g_state.load(std::memory_order_acquire) == kLoaded && !g_config->passthrough;
}

}  // namespace rsock::socket
