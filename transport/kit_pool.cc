#include "transport/kit_pool.h"

#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <new>

#include "transport/pinned.h"
#include "util/clock.h"

namespace rsock::transport::kit_pool {

namespace {

// A fixed array, no heap: kits are given back from Connection destructors,
// which may run during exit. Guarded by g_mu (a leaf).
std::mutex g_mu;
Kit g_kits[kMaxIdle];
int g_n = 0;
uint64_t g_pinned = 0;  // pinned bytes the pooled kits hold
std::atomic<int> g_idle{0};
std::atomic<uint64_t> g_reused{0};

// Under a finite budget the pool holds at most an eighth of it.
bool fits_locked(uint64_t bytes) {
  uint64_t b = pinned::budget();
  return b == pinned::kUnlimited || g_pinned + bytes <= b / 8;
}

}  // namespace

bool take(ibv_context* ctx, uint32_t ring_bytes, uint32_t sq_depth, uint32_t recv_slots,
          Kit* out) {
  if (g_idle.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard lk(g_mu);
  // Newest first: its pages are the likeliest still in the cache.
  for (int i = g_n - 1; i >= 0; i--) {
    const Kit& k = g_kits[i];
    if (k.ctx != ctx || k.ring_bytes != ring_bytes || k.sq_depth != sq_depth ||
        k.recv_slots != recv_slots)
      continue;
    *out = k;
    g_pinned -= k.pinned;
    g_kits[i] = g_kits[--g_n];
    g_kits[g_n] = Kit{};
    g_idle.store(g_n, std::memory_order_relaxed);
    g_reused.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  return false;
}

bool give(const Kit& k, uint32_t max_idle) {
  std::lock_guard lk(g_mu);
  if (g_n >= std::min<int>(kMaxIdle, static_cast<int>(max_idle)) || !fits_locked(k.pinned))
    return false;
  g_kits[g_n] = k;
  g_kits[g_n++].idle_since_ns = rsock::now_ns();
  g_pinned += k.pinned;
  g_idle.store(g_n, std::memory_order_relaxed);
  return true;
}

void destroy(Kit* k) {
  for (ibv_mr* mr : {k->rx_mr, k->tx_mr, k->rbuf_mr})
    if (mr) ibv_dereg_mr(mr);
  if (k->pd) ibv_dealloc_pd(k->pd);
  if (k->rx_ring) munmap(k->rx_ring, k->rx_map);
  if (k->tx_mem) munmap(k->tx_mem, k->tx_map);
  if (k->rbufs) munmap(k->rbufs, k->rbuf_map);
  pinned::release(k->pinned);
  if (k->maps) pinned::give_maps();
  *k = Kit{};
}

void trim(uint64_t now_ns, bool all) {
  // One kit at a time, destroyed outside the lock (verbs calls are
  // syscalls; a small frame: hooks may call this on small stacks).
  while (g_idle.load(std::memory_order_relaxed) != 0) {
    Kit k;
    {
      std::lock_guard lk(g_mu);
      int i = 0;
      while (i < g_n && !all && now_ns - g_kits[i].idle_since_ns < kIdleNs) i++;
      if (i == g_n) return;
      k = g_kits[i];
      g_pinned -= k.pinned;
      g_kits[i] = g_kits[--g_n];
      g_kits[g_n] = Kit{};
      g_idle.store(g_n, std::memory_order_relaxed);
    }
    destroy(&k);
  }
}

int idle() { return g_idle.load(std::memory_order_relaxed); }
uint64_t reused() { return g_reused.load(std::memory_order_relaxed); }

void after_fork_child() {
  // The parent's kits: their contexts, CQs and QPs are not the child's to
  // use or destroy. Their pages are not pinned in the child (the kernel
  // counts pinned pages per process), so their share of the budget goes;
  // their mappings may have been copied, so those stay counted.
  new (&g_mu) std::mutex;
  for (int i = 0; i < g_n; i++) g_kits[i] = Kit{};
  g_n = 0;
  pinned::release(g_pinned);
  g_pinned = 0;
  g_idle.store(0, std::memory_order_relaxed);
  g_reused.store(0, std::memory_order_relaxed);  // the child's own count
}

}  // namespace rsock::transport::kit_pool
