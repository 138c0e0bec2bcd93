#include "transport/cq_group.h"

#include <infiniband/verbs.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <new>

#include "transport/cm_hub.h"
#include "transport/connection.h"
#include "util/clock.h"
#include "util/log.h"

namespace rsock::transport::cq_group {

namespace {
struct Member {
  // nullptr while a kept kit holds the place for the QP it made ahead
  // (kit_pool::warm): that QP is in RESET, so none of its completions can
  // come; one that did would find no box and be dropped (find).
  Connection* c = nullptr;
  uint32_t qp_num = 0;      // 0 until set_qp
  uint32_t slots = 0;       // 0: the place is free (a member reserves at least 1)
  ibv_wc* box = nullptr;  // ring of `slots`
  uint32_t head = 0, count = 0;
};
}  // namespace

struct Group {
  std::mutex mu;
  ibv_context* ctx = nullptr;
  ibv_cq* cq = nullptr;   // nullptr: trimmed (no members for kIdleNs); join makes a new one
  // The CQ will raise an event for its next completion. Written under mu;
  // read without it only as a hint (poll_disarmed). A group with a CQ and
  // armed == false is counted in g_disarmed.
  std::atomic<bool> armed{false};
  uint64_t empty_since_ns = 0;
  uint32_t cqe = 0;       // what members may reserve in all
  uint32_t reserved = 0;  // what they do
  uint32_t cap = 0;       // members at most (<= kMaxMembers)
  uint32_t n = 0;         // members now
  Member m[kMaxMembers];
};

namespace {
// Groups live for the process (their CQs' cq_context); a few hundred at
// 10,000 connections. Guarded by g_mu, which is taken before a group's mutex
// and never under a stream's lock for long (join only creates CQs).
constexpr uint32_t kMaxGroups = 4096;
std::mutex g_mu;
Group* g_groups[kMaxGroups];
std::atomic<uint32_t> g_ngroups{0};  // Group structs made
std::atomic<uint32_t> g_cqs{0};      // of which hold a CQ
std::atomic<uint32_t> g_empty{0};    // of which hold a CQ and no member (trim's work)
// Arming (see the header). g_disarmed: groups with a CQ that is not armed.
// g_sleeping: threads inside an ArmedSleep, plus one for hold_armed().
// Both seq_cst where they pair: on_event marks its group disarmed and then
// reads g_sleeping; a sleeper raises g_sleeping and then reads g_disarmed:
// at least one of them sees the other, so no sleep starts on a CQ that
// stays disarmed.
std::atomic<uint32_t> g_disarmed{0};
std::atomic<int> g_sleeping{0};
std::atomic<bool> g_held{false};
std::mutex g_hold_mu;  // (a leaf before the groups' locks: hold_armed only)
// ArmedSleeps this thread is inside: a fork from a signal handler that
// interrupted one leaves the child's count at the hold plus these, which
// the scopes' ends then take off.
thread_local int t_armed __attribute__((tls_model("initial-exec"))) = 0;
std::atomic<uint64_t> g_arms{0};    // ibv_req_notify_cq calls (the exit summary)
std::atomic<uint64_t> g_events{0};  // events read (on_event)
// CQs one trim destroys at most: the rest wait for the next tick, so joins
// (under g_mu, which trim holds) do not wait behind a hundred destroys.
constexpr int kTrimBatch = 8;

// Under g_mu and g->mu: a CQ for the (memberless) group `g`.
bool make_cq(Group* g, ibv_comp_channel* ch, uint32_t cap, uint32_t slots) {
  g->cap = cap;
  g->cqe = cap * slots;
  g->reserved = 0;
  g->cq = ibv_create_cq(g->ctx, static_cast<int>(g->cqe), g, ch, 0);
  if (g->cq == nullptr || ibv_req_notify_cq(g->cq, 0) != 0) {
    int e = errno ? errno : ENOMEM;
    if (g->cq) ibv_destroy_cq(g->cq);
    g->cq = nullptr;
    errno = e;
    return false;
  }
  g->armed.store(true, std::memory_order_relaxed);
  g_arms.fetch_add(1, std::memory_order_relaxed);
  g_cqs.fetch_add(1, std::memory_order_relaxed);
  return true;
}

int find(Group* g, uint32_t qp_num) {
  for (uint32_t i = 0; i < g->cap; ++i)
    if (g->m[i].c != nullptr && g->m[i].qp_num == qp_num && qp_num != 0) return int(i);
  return -1;
}

// Under g->mu: everything in the CQ to its boxes. Every member that got
// some is told, under cm_hub::mu() (the callbacks are read under it):
// `self` too, with `tell_self`, through its callback alone. Its caller may poll once and
// handle what it takes without announcing it (Connection::send's poll when
// the ring is full), while another thread sleeps on the same connection for
// that very data; with a CQ per connection, the CQ's event told that
// sleeper, but the shared CQ's event may now find the CQ empty.
bool drain_locked(Group* g, const Connection* self, bool tell_self) {
  uint64_t told[kMaxMembers / 64] = {};
  ibv_wc wc[16];
  int n;
  bool filed = false;
  do {
    n = ibv_poll_cq(g->cq, 16, wc);
    for (int i = 0; i < n; ++i) {
      int k = find(g, wc[i].qp_num);
      if (k < 0) continue;  // a member that left
      Member& m = g->m[k];
      if (m.count == m.slots) [[unlikely]] {
        // Cannot happen (a member reserves every WR it can post); dropping
        // would lose a completion, so say so.
        LOG_WARN("transport: completion box of qp %u full; completion dropped", m.qp_num);
        continue;
      }
      m.box[(m.head + m.count) % m.slots] = wc[i];
      ++m.count;
      filed = true;
      if (m.c != self || tell_self) told[k / 64] |= uint64_t{1} << (k % 64);
    }
  } while (n == 16);
  bool any = false;
  for (uint64_t w : told) any |= w != 0;
  if (!any) return filed;
  std::lock_guard lk(cm_hub::mu());
  for (uint32_t k = 0; k < g->cap; ++k)
    if (told[k / 64] & (uint64_t{1} << (k % 64))) g->m[k].c->deliver_cq_event(g->m[k].c != self);
  return filed;
}

// Under g->mu, g has a CQ: it is armed now (counted), or says why not once.
void arm_locked(Group* g) {
  g_arms.fetch_add(1, std::memory_order_relaxed);
  if (int e = ibv_req_notify_cq(g->cq, 0); e != 0) [[unlikely]] {
    // Never seen. It stays counted as disarmed: the next sleeper tries
    // again; sleepers meanwhile wake for their timers only.
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) LOG_WARN("transport: cannot arm a completion queue (%d)", e);
    return;
  }
  if (!g->armed.exchange(true, std::memory_order_acq_rel))
    g_disarmed.fetch_sub(1, std::memory_order_seq_cst);
}

// Under g->mu, g has a CQ: its arm was used up by an event.
void disarmed_locked(Group* g) {
  if (g->armed.exchange(false, std::memory_order_acq_rel))
    g_disarmed.fetch_add(1, std::memory_order_seq_cst);
}

uint32_t cap_for(uint32_t ngroups) {
  return std::min<uint32_t>(kMaxMembers, 4u << std::min<uint32_t>(ngroups, 4));
}
}  // namespace

Group* join(ibv_context* ctx, ibv_comp_channel* ch, uint32_t slots, Connection* c, ibv_wc* box,
            uint32_t* slot) {
  std::lock_guard lk(g_mu);
  uint32_t ng = g_ngroups.load(std::memory_order_relaxed);
  uint32_t on_ctx = 0;  // groups of ctx with a CQ
  Group* g = nullptr;
  Group* spare = nullptr;  // a trimmed group of ctx, to make a CQ for
  for (uint32_t i = 0; i < ng && g == nullptr; ++i) {
    Group* x = g_groups[i];
    if (x->ctx != ctx) continue;
    std::lock_guard gl(x->mu);
    if (x->cq == nullptr) {
      if (spare == nullptr) spare = x;
      continue;
    }
    ++on_ctx;
    if (x->n < x->cap && x->reserved + slots <= x->cqe) g = x;
  }
  if (g == nullptr) {
    if (spare == nullptr && ng == kMaxGroups) {
      errno = ENOMEM;
      return nullptr;
    }
    ibv_device_attr da{};
    uint32_t max_cqe = ibv_query_device(ctx, &da) == 0 && da.max_cqe > 0 ? uint32_t(da.max_cqe) : 65535;
    if (slots > max_cqe) {
      errno = EINVAL;
      return nullptr;
    }
    uint32_t cap = std::min(cap_for(on_ctx), max_cqe / slots);
    Group* x = spare;
    if (x == nullptr) {
      x = new (std::nothrow) Group;
      if (x == nullptr) {
        errno = ENOMEM;
        return nullptr;
      }
      x->ctx = ctx;
    }
    {
      std::lock_guard gl(x->mu);
      if (!make_cq(x, ch, cap, slots)) {
        if (x != spare) delete x;
        return nullptr;
      }
    }
    if (x != spare) {
      g_groups[ng] = x;
      g_ngroups.store(ng + 1, std::memory_order_release);
    }
    g = x;
  }
  std::lock_guard gl(g->mu);
  for (uint32_t i = 0; i < g->cap; ++i) {
    Member& m = g->m[i];
    if (m.slots != 0) continue;
    m = Member{c, 0, slots, box, 0, 0};
    if (g->n++ == 0 && g->empty_since_ns != 0) {
      g->empty_since_ns = 0;
      g_empty.fetch_sub(1, std::memory_order_relaxed);
    }
    g->reserved += slots;
    *slot = i;
    return g;
  }
  errno = ENOMEM;  // (unreachable: n < cap was checked under g_mu)
  return nullptr;
}

ibv_cq* cq(const Group* g) { return g->cq; }

void adopt(Group* g, uint32_t slot, Connection* c, ibv_wc* box) {
  std::lock_guard gl(g->mu);
  Member& m = g->m[slot];
  m.c = c;
  m.box = box;
  m.head = m.count = 0;
}

void set_qp(Group* g, uint32_t slot, uint32_t qp_num) {
  std::lock_guard gl(g->mu);
  g->m[slot].qp_num = qp_num;
}

void leave(Group* g, uint32_t slot, ibv_qp* qp) {
  std::lock_guard gl(g->mu);
  // The QP goes under the lock: a QP made meanwhile by another member may
  // get its number, and must not set it (set_qp) while we still hold it,
  // or its completions would be filed in our box.
  if (qp != nullptr) ibv_destroy_qp(qp);
  Member& m = g->m[slot];
  // What our QP left in the CQ is ours to drop (and a later QP with the
  // same number must not find it). Others' go to their boxes.
  drain_locked(g, m.c, false);
  g->reserved -= m.slots;
  m = Member{};
  if (--g->n == 0) {
    g->empty_since_ns = now_ns();
    g_empty.fetch_add(1, std::memory_order_relaxed);
  }
}

void trim(uint64_t now, bool all) {
  // (Every tick: no lock while no group is empty, which is the usual case.)
  if (g_empty.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard lk(g_mu);
  uint32_t ng = g_ngroups.load(std::memory_order_relaxed);
  int done = 0;
  for (uint32_t i = 0; i < ng && (all || done < kTrimBatch); ++i) {
    Group* g = g_groups[i];
    std::lock_guard gl(g->mu);
    if (g->cq == nullptr || g->n != 0) continue;
    // (A leave after our caller read the clock is younger than `now`.)
    if (!all && (g->empty_since_ns > now || now - g->empty_since_ns < kIdleNs)) continue;
    // An event the hub has read but not yet acknowledged makes this wait
    // for the acknowledgement, which the hub gives under cm_hub::mu(),
    // never under a group's lock; one still unread goes with the CQ. The
    // hub's on_event for it finds no CQ.
    if (int e = ibv_destroy_cq(g->cq); e != 0) {
      // (Never seen: a QP still on it. Kept, and counted as it is.)
      static std::atomic<bool> said{false};
      if (!said.exchange(true)) LOG_WARN("transport: cannot destroy an idle completion queue (%d)", e);
      continue;
    }
    g->cq = nullptr;
    if (!g->armed.load(std::memory_order_relaxed)) g_disarmed.fetch_sub(1, std::memory_order_seq_cst);
    g->armed.store(false, std::memory_order_relaxed);
    g->empty_since_ns = 0;
    g_empty.fetch_sub(1, std::memory_order_relaxed);
    g_cqs.fetch_sub(1, std::memory_order_relaxed);
    ++done;
  }
}

int poll(Group* g, uint32_t slot, ibv_wc* out, int max, bool tell_self) {
  std::lock_guard gl(g->mu);
  Member& m = g->m[slot];
  if (m.count == 0) drain_locked(g, m.c, tell_self);
  int n = 0;
  while (n < max && m.count > 0) {
    out[n++] = m.box[m.head];
    m.head = (m.head + 1) % m.slots;
    --m.count;
  }
  // (Our owner loops or comes back at its next look: no callback.)
  if (m.count > 0) m.c->mark_cq_backlog();
  return n;
}

void on_event(Group* g) {
  std::lock_guard gl(g->mu);
  if (g->cq == nullptr) return;  // trimmed since the hub read its event
  g_events.fetch_add(1, std::memory_order_relaxed);
  // The event used up the arm. Armed again before the drain only while a
  // thread sleeps on events (the header): otherwise whoever runs next polls.
  disarmed_locked(g);
  if (g_sleeping.load(std::memory_order_seq_cst) > 0) arm_locked(g);
  drain_locked(g, nullptr, false);
}

namespace {
// Arms and drains every disarmed group; whether any completion was filed.
bool arm_all() {
  bool got = false;
  uint32_t ng = g_ngroups.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < ng; ++i) {
    Group* g = g_groups[i];
    if (g->armed.load(std::memory_order_acquire)) continue;
    std::lock_guard gl(g->mu);
    if (g->cq == nullptr || g->armed.load(std::memory_order_relaxed)) continue;
    arm_locked(g);
    // Armed before the drain: one that landed before the arm is filed
    // here, one after raises an event.
    got |= drain_locked(g, nullptr, false);
  }
  return got;
}
}  // namespace

void poll_disarmed() {
  if (g_disarmed.load(std::memory_order_relaxed) == 0) return;
  uint32_t ng = g_ngroups.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < ng; ++i) {
    Group* g = g_groups[i];
    if (g->armed.load(std::memory_order_relaxed)) continue;
    // (A spin's look: a group busy with another thread is that thread's.)
    std::unique_lock gl(g->mu, std::try_to_lock);
    if (!gl.owns_lock() || g->cq == nullptr || g->armed.load(std::memory_order_relaxed)) continue;
    drain_locked(g, nullptr, false);
  }
}

ArmedSleep::ArmedSleep(bool on) : on_(on) {
  if (!on_) return;
  ++t_armed;
  g_sleeping.fetch_add(1, std::memory_order_seq_cst);
  if (g_disarmed.load(std::memory_order_seq_cst) != 0) drained_ = arm_all();
}

void ArmedSleep::end() {
  if (!on_) return;
  on_ = false;
  // (This order: a fork from a signal handler between the two leaves the
  // child's count one too high, which only arms more, never one too low.)
  g_sleeping.fetch_sub(1, std::memory_order_seq_cst);
  --t_armed;
}

void hold_armed() {
  if (g_held.load(std::memory_order_acquire)) return;
  // (Every caller returns with the hold in place: none before the arm.)
  std::lock_guard lk(g_hold_mu);
  if (g_held.load(std::memory_order_relaxed)) return;
  g_sleeping.fetch_add(1, std::memory_order_seq_cst);
  if (g_disarmed.load(std::memory_order_seq_cst) != 0) (void)arm_all();
  g_held.store(true, std::memory_order_release);
}

bool all_disarmed() {
  return g_disarmed.load(std::memory_order_relaxed) == g_cqs.load(std::memory_order_relaxed);
}

uint64_t arms() { return g_arms.load(std::memory_order_relaxed); }
uint64_t events() { return g_events.load(std::memory_order_relaxed); }

uint32_t groups() { return g_cqs.load(std::memory_order_relaxed); }

void after_fork_child() {
  // Only this thread exists; another may have held a lock at the fork. The
  // parent's groups stay allocated, untouched (their CQs are the parent's).
  new (&g_mu) std::mutex;
  g_ngroups.store(0, std::memory_order_relaxed);
  g_cqs.store(0, std::memory_order_relaxed);
  g_empty.store(0, std::memory_order_relaxed);
  g_disarmed.store(0, std::memory_order_relaxed);
  // Only this thread exists (another may have held g_hold_mu); a hold
  // stays, and so do this thread's own ArmedSleeps (a fork from a signal
  // handler inside one: its end takes it off).
  new (&g_hold_mu) std::mutex;
  g_sleeping.store((g_held.load(std::memory_order_relaxed) ? 1 : 0) + t_armed,
                   std::memory_order_relaxed);
}

}  // namespace rsock::transport::cq_group
