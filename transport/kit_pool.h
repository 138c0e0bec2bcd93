// The verbs resources of closed connections, kept for the next ones.
//
// A connection's kit (its PD and three registered rings) costs most of
// what creating its verbs resources costs: on rxe every object is a verbs
// command to the kernel and registering a ring pins and zeroes its pages
// (its CQ, once part of the kit, is shared now: cq_group.h). Measured in the TCG guest (scratch timing of
// the same calls, 200 kits, 64 KiB rings): PD 22 us, CQ 155-317 us, the
// three rings 616-950 us, the QP 316-563 us, INIT and the receives 44-53
// us; destroying them all 560-620 us. A program that opens and closes
// connections (an HTTP client without keep-alive, a churning connection
// pool, a benchmark) paid that per connection on both ends. A closing
// connection now destroys only its QP, leaves its CQ group and leaves the
// rest here; the next connection on the same device context with the same sizes
// takes it and creates only a QP, or not even that: the progress thread's
// tick gives a kept kit a fresh QP ahead of time (warm()), which the next
// connection takes as it is (RESET state, never connected, a new number),
// so the QP's creation (740-860 us per end on rxe, measured in the churn
// benchmark's setups) leaves the connection's setup path.
//
// Why not the QP too: a QP number that served a connection must not serve
// the same peer again before the IB CM's timewait for it ends (0.5 s and
// more): the peer's CM rejects the new connection as stale (tried: the
// reuse failed with ECONNREFUSED). A fresh QP has a fresh number.
//
// Isolation is unchanged (docs/TRANSPORT.md, "Isolation"): a kit keeps its
// own PD, so its ring's rkey is valid only on the one QP in that PD, the
// new connection's. The previous peer's QP was connected to a QP number
// that no longer exists.
//
// Bounds: at most `kit_pool` kits (config), never more than kMaxIdle, and
// under a finite memlock budget at most an eighth of it (pinned.h): the
// pool never holds what new connections need. A kit unused for kIdleNs is
// destroyed (trim(), from the progress thread's tick), so a program that
// stops connecting gives the memory back; a connection that does not fit
// the budget empties the pool first.
//
// Locking: the pool's mutex is a leaf. Kits are destroyed outside it.
#pragma once

#include <cstddef>
#include <cstdint>

struct ibv_context;
struct ibv_pd;
struct ibv_cq;
struct ibv_mr;
struct ibv_qp;

namespace rsock::transport::cq_group {
struct Group;
}

namespace rsock::transport::kit_pool {

constexpr int kMaxIdle = 16;
constexpr uint64_t kIdleNs = 5'000'000'000;

struct Kit {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_mr* rx_mr = nullptr;
  ibv_mr* tx_mr = nullptr;
  ibv_mr* rbuf_mr = nullptr;
  std::byte* rx_ring = nullptr;
  std::byte* tx_mem = nullptr;
  std::byte* rbufs = nullptr;
  size_t rx_map = 0, tx_map = 0, rbuf_map = 0;
  // What the kit was made for; a connection takes only an exact match.
  uint32_t ring_bytes = 0, sq_depth = 0, recv_slots = 0;
  uint64_t pinned = 0;        // taken from pinned::reserve
  bool maps = false;          // holds pinned::take_maps()
  uint64_t idle_since_ns = 0;
  // Made ahead by warm() while kept: a fresh RC QP on this kit's PD, in
  // RESET, never connected, with the inline size asked for
  // (qp_inline_wanted) and got (qp_inline); its completions go to a place
  // the kit holds in a CQ group (`grp`, `grp_slot`), which the connection
  // that takes the QP adopts (cq_group::adopt).
  ibv_qp* qp = nullptr;
  cq_group::Group* grp = nullptr;
  uint32_t grp_slot = 0;
  uint32_t qp_inline_wanted = 0, qp_inline = 0;
  bool warmed = false;  // warm() tried it since it was kept (a failure is not retried)
};

// A new RC QP on the kit's PD with `cq` for both queues, sized for the
// kit's queues, with inline data of `inline_wanted` bytes if the device
// allows (else none: `*inline_got` says what it got). Null with errno set
// on failure.
ibv_qp* new_qp(const Kit& k, ibv_cq* cq, uint32_t inline_wanted, uint32_t* inline_got);
// Destroys a QP made ahead (and gives its CQ group place back), if `k` has one.
void drop_qp(Kit* k);

// Moves a kit matching these into `out`; false if none.
bool take(ibv_context* ctx, uint32_t ring_bytes, uint32_t sq_depth, uint32_t recv_slots,
          Kit* out);
// Keeps `k` (its QP destroyed, its connection out of its CQ group), idle
// from now, if the pool has room for it within `max_idle` kits; false: the
// caller destroys it.
bool give(const Kit& k, uint32_t max_idle);
// Releases every resource of `k`, whether it was pooled or not.
void destroy(Kit* k);
// Destroys kits idle for kIdleNs (all of them with `all`). Cheap when empty.
void trim(uint64_t now_ns, bool all = false);
// Gives up to `max` kept kits that were not tried yet a QP made ahead
// (new_qp with `inline_wanted`, on a place in a CQ group of the kit's
// context), outside the pool's lock; a kit is out of the pool while its QP
// is made (a kit given back meanwhile may take its room: the pool keeps at
// most `max_idle`, as give() does, and destroys the other). While a kit is
// out, a connection that needs its pinned memory under a full budget
// cannot have it (make_kit's trim): it stays on TCP (memlock), as when the
// kit is in use. Cheap when the pool is empty. Returns how many QPs were made.
int warm(uint32_t inline_wanted, int max, uint32_t max_idle = kMaxIdle);
// Kits in the pool now, and kits taken from it since the process (image or
// fork child) started (for rsock-stat and tests).
int idle();
uint64_t reused();
// QPs made ahead that connections took (Connection::create_resources counts
// them with took_qp_ahead), since the process (image or fork child) started.
void took_qp_ahead();
uint64_t qps_ahead();
// In a fork child: the kits are the parent's; forget them unreleased.
void after_fork_child();

}  // namespace rsock::transport::kit_pool
