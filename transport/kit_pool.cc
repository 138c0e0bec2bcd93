#include "transport/kit_pool.h"

#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <new>

#include "transport/cq_group.h"
#include "transport/cq_hub.h"
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
std::atomic<uint64_t> g_qps_ahead{0};

// Under a finite budget the pool holds at most an eighth of it.
bool fits_locked(uint64_t bytes) {
  uint64_t b = pinned::budget();
  return b == pinned::kUnlimited || g_pinned + bytes <= b / 8;
}

// Under g_mu: keeps `k` if there is room within `max_idle` kits and the
// budget (give, and warm putting a kit back).
bool keep_locked(const Kit& k, uint32_t max_idle) {
  if (g_n >= std::min<int>(kMaxIdle, static_cast<int>(max_idle)) || !fits_locked(k.pinned))
    return false;
  g_kits[g_n++] = k;
  g_pinned += k.pinned;
  g_idle.store(g_n, std::memory_order_relaxed);
  return true;
}

// Under g_mu: takes the kit at `i` out of the pool.
Kit remove_locked(int i) {
  Kit k = g_kits[i];
  g_pinned -= k.pinned;
  g_kits[i] = g_kits[--g_n];
  g_kits[g_n] = Kit{};
  g_idle.store(g_n, std::memory_order_relaxed);
  return k;
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
    *out = remove_locked(i);
    g_reused.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  return false;
}

bool give(const Kit& k, uint32_t max_idle) {
  Kit kept = k;
  kept.warmed = false;  // (it served a connection: worth a QP again)
  kept.idle_since_ns = rsock::now_ns();
  std::lock_guard lk(g_mu);
  return keep_locked(kept, max_idle);
}

void drop_qp(Kit* k) {
  if (k->qp == nullptr) return;
  cq_group::leave(k->grp, k->grp_slot, k->qp);  // destroys it under the group's lock
  k->qp = nullptr;
  k->grp = nullptr;
}

void destroy(Kit* k) {
  drop_qp(k);  // before its PD
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
      // (A kit returned after our caller read the clock is younger than
      // now_ns: without the first test the difference wraps and it goes.)
      while (i < g_n && !all &&
             (g_kits[i].idle_since_ns > now_ns || now_ns - g_kits[i].idle_since_ns < kIdleNs))
        i++;
      if (i == g_n) return;
      k = remove_locked(i);
    }
    destroy(&k);
  }
}

ibv_qp* new_qp(const Kit& k, ibv_cq* cq, uint32_t inline_wanted, uint32_t* inline_got) {
  ibv_qp_init_attr qa{};
  qa.send_cq = cq;
  qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.sq_sig_all = 0;  // selective signalling (Connection::signal_next)
  qa.cap.max_send_wr = k.sq_depth;
  qa.cap.max_recv_wr = k.recv_slots;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qa.cap.max_inline_data = inline_wanted;
  ibv_qp* qp = ibv_create_qp(k.pd, &qa);
  if (qp == nullptr) {
    // Some devices cap inline data lower: without it (copies from the ring).
    qa.cap.max_inline_data = 0;
    qp = ibv_create_qp(k.pd, &qa);
    if (qp == nullptr) return nullptr;
  }
  *inline_got = qa.cap.max_inline_data;
  return qp;
}

namespace {
// Outside the pool's lock: a QP for `k` on a place in a CQ group of its
// context. False (nothing held) if either cannot be had.
bool make_qp_ahead(Kit* k, uint32_t inline_wanted) {
  ibv_comp_channel* ch = cq_hub::channel(k->ctx);
  if (ch == nullptr) return false;
  uint32_t slot = 0;
  cq_group::Group* g = cq_group::join(k->ctx, ch, cq_group::slots_for(k->sq_depth, k->recv_slots),
                                      nullptr, nullptr, &slot);
  if (g == nullptr) return false;
  uint32_t got = 0;
  ibv_qp* qp = new_qp(*k, cq_group::cq(g), inline_wanted, &got);
  if (qp == nullptr) {
    cq_group::leave(g, slot, nullptr);
    return false;
  }
  cq_group::set_qp(g, slot, qp->qp_num);
  k->qp = qp;
  k->grp = g;
  k->grp_slot = slot;
  k->qp_inline_wanted = inline_wanted;
  k->qp_inline = got;
  return true;
}
}  // namespace

int warm(uint32_t inline_wanted, int max, uint32_t max_idle) {
  int made = 0;
  while (made < max && g_idle.load(std::memory_order_relaxed) != 0) {
    Kit k;
    {
      std::lock_guard lk(g_mu);
      int i = 0;
      while (i < g_n && (g_kits[i].warmed || g_kits[i].qp)) i++;
      if (i == g_n) return made;
      k = remove_locked(i);
    }
    // (Out of the pool meanwhile: a connection that looks now makes a kit,
    // as it would with the pool empty.)
    k.warmed = true;
    if (make_qp_ahead(&k, inline_wanted)) made++;
    {
      std::lock_guard lk(g_mu);
      if (keep_locked(k, max_idle)) continue;  // (its idle time goes on from when it was kept)
    }
    destroy(&k);  // others were kept meanwhile: no room
  }
  return made;
}

int idle() { return g_idle.load(std::memory_order_relaxed); }
uint64_t reused() { return g_reused.load(std::memory_order_relaxed); }
void took_qp_ahead() { g_qps_ahead.fetch_add(1, std::memory_order_relaxed); }
uint64_t qps_ahead() { return g_qps_ahead.load(std::memory_order_relaxed); }

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
  g_qps_ahead.store(0, std::memory_order_relaxed);
}

}  // namespace rsock::transport::kit_pool
