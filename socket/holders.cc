#include "socket/holders.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

namespace rsock::socket::holders {
namespace {

constexpr size_t kMapBytes = 64 * 1024;
constexpr int kSlots = int(kMapBytes / sizeof(Slot));
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free,
              "shared between processes: the atomics must be address-free");

// Made once per process tree, by the first process that forks with a
// connection to share; children inherit it with the rest of memory.
std::atomic<Slot*> g_slots{nullptr};

Slot* slots() {
  Slot* s = g_slots.load(std::memory_order_acquire);
  if (s) return s;
  void* m = mmap(nullptr, kMapBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  Slot* fresh = static_cast<Slot*>(m);  // zero-filled: every slot free
  if (g_slots.compare_exchange_strong(s, fresh, std::memory_order_acq_rel)) return fresh;
  munmap(m, kMapBytes);
  return s;
}

}  // namespace

Slot* claim(uint64_t tx, uint64_t rx) {
  Slot* all = slots();
  if (!all) return nullptr;
  for (int i = 0; i < kSlots; i++) {
    int32_t free = 0;
    if (all[i].holders.load(std::memory_order_relaxed) != 0 ||
        !all[i].holders.compare_exchange_strong(free, 1, std::memory_order_acq_rel))
      continue;
    all[i].poisoned.store(0, std::memory_order_relaxed);
    all[i].tx.store(tx, std::memory_order_relaxed);
    all[i].rx.store(rx, std::memory_order_relaxed);
    for (auto& p : all[i].pids) p.store(0, std::memory_order_relaxed);
    all[i].pids[0].store(getpid(), std::memory_order_release);
    return &all[i];
  }
  return nullptr;
}

void add(Slot* s) { s->holders.fetch_add(1, std::memory_order_acq_rel); }

void enlist(Slot* s) {
  for (auto& p : s->pids) {
    int32_t none = 0;
    if (p.compare_exchange_strong(none, getpid(), std::memory_order_acq_rel)) return;
  }
}

void release(Slot* s) {
  int32_t me = getpid();
  for (auto& p : s->pids) {
    int32_t v = me;
    if (p.compare_exchange_strong(v, 0, std::memory_order_acq_rel)) break;
  }
  s->holders.fetch_sub(1, std::memory_order_acq_rel);
}

bool reap(Slot* s, uint64_t now_ns) {
  static std::atomic<int32_t> alive_pid{0};
  static std::atomic<uint64_t> alive_until{0};
  int32_t me = getpid();
  for (auto& p : s->pids) {
    int32_t v = p.load(std::memory_order_acquire);
    if (v == 0 || v == me) continue;
    if (v == alive_pid.load(std::memory_order_acquire) &&
        now_ns < alive_until.load(std::memory_order_acquire))
      continue;
    if (kill(v, 0) == 0 || errno != ESRCH) {
      alive_pid.store(v, std::memory_order_release);
      alive_until.store(now_ns + 100'000'000, std::memory_order_release);
      continue;
    }
    // Gone without closing: whoever clears its pid takes its count off.
    if (p.compare_exchange_strong(v, 0, std::memory_order_acq_rel))
      s->holders.fetch_sub(1, std::memory_order_acq_rel);
  }
  return sole(s);
}
void poison(Slot* s) { s->poisoned.store(1, std::memory_order_release); }

int in_use() {
  Slot* all = g_slots.load(std::memory_order_acquire);
  int n = 0;
  for (int i = 0; all && i < kSlots; i++) n += all[i].holders.load(std::memory_order_relaxed) != 0;
  return n;
}

}  // namespace rsock::socket::holders
