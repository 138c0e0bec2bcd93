#include "socket/holders.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "util/clock.h"
#include "util/user_shm.h"

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

namespace {

// A passed slot: the holders' Slot first (the calls above take it), then the
// key a receiver finds it by.
struct Passed {
  Slot slot;
  std::atomic<uint64_t> ino;      // the socket's inode (0: none)
  std::atomic<uint64_t> born_ns;  // claimed at (CLOCK_MONOTONIC)
  std::atomic<int32_t> client;    // the role of the socket's end
  // exec: the process whose next image takes the socket in, at these fd
  // numbers (-1: none), which exec keeps (pid and numbers alike).
  std::atomic<int32_t> exec_pid;
  std::atomic<int32_t> exec_fds[kExecFds];
};
constexpr int kPassedSlots = 1024;
constexpr size_t kPassedBytes = sizeof(Passed) * kPassedSlots;
// A slot still held this long after its claim, by no process that is
// alive, was left by holders that died or never enlisted (a receiver
// without librsock): it is taken again.
constexpr uint64_t kStaleNs = 600ull * 1000000000;

std::atomic<Passed*> g_passed{nullptr};

// `create`: a sender makes the table; a receiver only looks (no sender
// ever made it: nothing to find, and no file left behind).
Passed* passed(bool create) {
  Passed* p = g_passed.load(std::memory_order_acquire);
  if (p) return p;
  char name[64];
  // (v1: this layout; a librsock with another one uses another name.)
  snprintf(name, sizeof name, "/librsock-held-v1-%u", unsigned(geteuid()));
  auto* fresh = static_cast<Passed*>(sys::map_user_shm(name, kPassedBytes, create));
  if (!fresh) return nullptr;
  if (g_passed.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return fresh;
  munmap(fresh, kPassedBytes);
  return p;
}

bool stale(Passed& p, uint64_t now) {
  if (p.born_ns.load(std::memory_order_acquire) + kStaleNs > now) return false;
  for (auto& pid : p.slot.pids) {
    int32_t v = pid.load(std::memory_order_acquire);
    if (v != 0 && (kill(v, 0) == 0 || errno != ESRCH)) return false;
  }
  return true;
}

}  // namespace

Slot* claim_passed(uint64_t ino, bool client, uint64_t tx, uint64_t rx) {
  Passed* all = passed(true);
  if (!all || ino == 0) return nullptr;
  const uint64_t now = now_ns();
  Passed* got = nullptr;
  for (int round = 0; round < 2 && !got; round++) {
    for (int i = 0; i < kPassedSlots; i++) {
      Passed& p = all[i];
      int32_t h = p.slot.holders.load(std::memory_order_acquire);
      if (round == 0 && h > 0 && p.ino.load(std::memory_order_relaxed) == ino) {
        // An older socket's (this inode's socket is new): nobody can look
        // it up any more; freed by its holders, or as stale.
        p.ino.store(0, std::memory_order_relaxed);
        poison(&p.slot);
      }
      if (got || (h > 0 && (round == 0 || !stale(p, now)))) continue;
      if (!p.slot.holders.compare_exchange_strong(h, 1, std::memory_order_acq_rel)) continue;
      got = &p;
    }
  }
  if (!got) return nullptr;
  got->slot.poisoned.store(0, std::memory_order_relaxed);
  got->slot.tx.store(tx, std::memory_order_relaxed);
  got->slot.rx.store(rx, std::memory_order_relaxed);
  for (auto& p : got->slot.pids) p.store(0, std::memory_order_relaxed);
  got->slot.pids[0].store(getpid(), std::memory_order_relaxed);
  got->client.store(client ? 1 : 0, std::memory_order_relaxed);
  got->exec_pid.store(0, std::memory_order_relaxed);
  got->born_ns.store(now, std::memory_order_relaxed);
  got->ino.store(ino, std::memory_order_release);
  return &got->slot;
}

Slot* find_passed(uint64_t ino, bool* client) {
  Passed* all = passed(false);
  if (!all || ino == 0) return nullptr;
  Passed* best = nullptr;
  for (int i = 0; i < kPassedSlots; i++) {
    Passed& p = all[i];
    if (p.ino.load(std::memory_order_acquire) != ino ||
        p.slot.holders.load(std::memory_order_acquire) <= 0)
      continue;
    if (!best || p.born_ns.load(std::memory_order_relaxed) > best->born_ns.load(std::memory_order_relaxed))
      best = &p;
  }
  if (!best) return nullptr;
  *client = best->client.load(std::memory_order_relaxed) != 0;
  return &best->slot;
}

bool is_passed(const Slot* s) {
  auto* all = reinterpret_cast<const char*>(g_passed.load(std::memory_order_acquire));
  auto* at = reinterpret_cast<const char*>(s);
  return all && at >= all && at < all + kPassedBytes;
}

void drop(Slot* s) { s->holders.fetch_sub(1, std::memory_order_acq_rel); }

void mark_exec(Slot* s, const int* fds, int n) {
  auto* p = reinterpret_cast<Passed*>(s);  // (Slot is Passed's first member)
  for (int i = 0; i < kExecFds; i++)
    p->exec_fds[i].store(i < n ? fds[i] : -1, std::memory_order_relaxed);
  p->exec_pid.store(getpid(), std::memory_order_release);
}

void unmark_exec(Slot* s) {
  reinterpret_cast<Passed*>(s)->exec_pid.store(0, std::memory_order_release);
}

Slot* take_exec(int* cursor, uint64_t* ino, bool* client, int fds[kExecFds]) {
  Passed* all = passed(false);
  if (!all) return nullptr;
  const int32_t me = getpid();
  for (; *cursor < kPassedSlots; ++*cursor) {
    Passed& p = all[*cursor];
    int32_t v = me;
    if (p.exec_pid.load(std::memory_order_acquire) != me ||
        p.slot.holders.load(std::memory_order_acquire) <= 0 ||
        !p.exec_pid.compare_exchange_strong(v, 0, std::memory_order_acq_rel))
      continue;
    *ino = p.ino.load(std::memory_order_relaxed);
    *client = p.client.load(std::memory_order_relaxed) != 0;
    for (int i = 0; i < kExecFds; i++) fds[i] = p.exec_fds[i].load(std::memory_order_relaxed);
    return &all[(*cursor)++].slot;
  }
  return nullptr;
}

int in_use() {
  Slot* all = g_slots.load(std::memory_order_acquire);
  int n = 0;
  for (int i = 0; all && i < kSlots; i++) n += all[i].holders.load(std::memory_order_relaxed) != 0;
  return n;
}

}  // namespace rsock::socket::holders
