// The shared-memory layout of a librsock stats segment, as read by rsock-stat.
//
//   /dev/shm/librsock/<uid>/<pid>      header + kInitialSlots slots
//   /dev/shm/librsock/<uid>/<pid>.<k>  extension k (k = 1..): header + slots
//
// Each file is a SegmentHeader followed by slot_count ConnSlots. Every field
// has a fixed width and offset (static_asserts below): the file is read by a
// different binary, possibly built from a different version, so any change
// to these structs must bump kLayoutVersion. docs/STATS.md describes it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace rsock::stats {

// "RSOCKST" + NUL, little-endian. Written last, with release order, once the
// rest of the header is valid: a reader that sees 0 skips a file in creation.
constexpr uint64_t kMagic = 0x0054534b434f5352ull;
// 2: fallback reason kForked; 3: kRejected (was kConnectFailed, with the
// peer's reason in SlotInfo::peer_reason), kNoResources, kMemlock, kConnectFailed;
// 4: kPathFailed, kHandedOff, kReleased (an upgraded connection switched back),
//    kFdLimit; SegmentHeader::release (the writer's librsock release)
// 5: kIoUring
// 6: kLossyPath
// 7: SegmentHeader::resources (pinned memory, kits kept for reuse)
// 8: kSlowPath
// 9: ConnSlot::upgrade_us / switch_us, SegmentHeader::switches
constexpr uint32_t kLayoutVersion = 9;
constexpr uint32_t kInitialSlots = 64;
constexpr uint32_t kMaxFiles = 20;  // main + 19 extensions, doubling: ~33M slots

enum class Transport : uint8_t { kTcp = 0, kRdma = 1 };
constexpr int kTransports = 2;

enum class ConnState : uint8_t {
  kFree = 0,
  kConnecting = 1,   // TCP connect or accept in progress
  kUpgrading = 2,    // TCP established, rdma_cm rendezvous in progress
  kEstablished = 3,  // carrying data (see transport)
  kClosing = 4,
};

enum class Direction : uint8_t { kClient = 0, kServer = 1 };

// Why a connection stayed on (or went back to) TCP.
enum class FallbackReason : uint8_t {
  kNone = 0,
  kPolicy = 1,          // config rule or default said tcp
  kPeerNotRsock = 2,    // peer has no librsock: no rendezvous request came, or
                        // nothing listens on its rdma_cm port
  kNoDevice = 3,        // no RDMA device / address not on an RDMA netdev
  kResolveFailed = 4,   // rdma_resolve_addr/route failed or timed out (only those)
  kRejected = 5,        // the peer's librsock rejected (SlotInfo::peer_reason: why)
  kTimeout = 6,         // whole upgrade, or the rdma_cm connect, timed out
  kNegativeCache = 7,   // peer failed recently; not retried yet
  kNoResources = 8,     // local PD/CQ/QP/fd creation failed
  kProtocol = 9,        // unexpected rendezvous message / version
  kUnsupported = 10,    // app used something RDMA path cannot do (e.g. MSG_OOB)
  kPeerClosed = 11,     // peer went away during the upgrade
  kForked = 12,         // fork() while the upgrade was pending: two processes own the fd
  kOther = 13,
  kMemlock = 14,        // the pinned-memory budget (RLIMIT_MEMLOCK) is used up
  kConnectFailed = 15,  // rdma_connect failed otherwise (unreachable, connect error)
  // An upgraded connection that switched back to TCP (the reverse switch):
  kPathFailed = 16,     // its RDMA path failed (QP error, retries exceeded, device gone)
  kHandedOff = 17,      // fork() or fd passing: another process may use it next
  kReleased = 18,       // asked to (RSOCK_REVERT), or to give its resources back
  kFdLimit = 19,        // librsock's half of RLIMIT_NOFILE is used up (2 fds per connection)
  kIoUring = 20,        // the process set up io_uring, whose I/O bypasses the hooks
  kLossyPath = 21,      // its RDMA port lost packets at a rate where RC does far worse
                        // than TCP (transport/path_quality.h): back to TCP, the peer
                        // stays on TCP for negative_cache_ttl_s
  kSlowPath = 22,       // its RDMA delivery rate to the peer host collapsed far below the
                        // best it had (path_quality::RateJudge): back to TCP, the same
};
constexpr int kFallbackReasons = 23;

const char* transport_name(Transport t);
const char* state_name(ConnState s);
const char* direction_name(Direction d);
const char* fallback_reason_name(FallbackReason r);
// SlotInfo::peer_reason (the values of transport's wire::RejectReason).
const char* peer_reason_name(uint8_t r);

// Byte/op counters, indexed by Transport. Relaxed atomics: each is written by
// the thread that does the I/O, read at any time by rsock-stat.
struct alignas(8) Traffic {
  std::atomic<uint64_t> tx_bytes[kTransports];
  std::atomic<uint64_t> rx_bytes[kTransports];
  std::atomic<uint64_t> tx_ops[kTransports];
  std::atomic<uint64_t> rx_ops[kTransports];
  std::atomic<uint64_t> credit_stalls;  // sends that waited for peer credits
};
static_assert(sizeof(Traffic) == 72);

// Per-process counters, in the main file's header.
struct ProcessCounters {
  std::atomic<uint64_t> conns_seen;        // open_conn calls
  std::atomic<uint64_t> conns_upgraded;    // reached Transport::kRdma
  std::atomic<uint64_t> conns_untracked;   // no slot could be had (segment could not grow)
  std::atomic<uint64_t> handshake_errors;  // rendezvous failures (also counted as fallbacks)
  std::atomic<uint64_t> fallbacks[kFallbackReasons];
  Traffic closed;                          // traffic of connections already closed
};
static_assert(sizeof(ProcessCounters) == 32 + 8 * kFallbackReasons + sizeof(Traffic));

// The process's RDMA resources now, in the main file's header: written by
// the progress thread at its ticks (gauges, relaxed atomics).
struct Resources {
  std::atomic<uint64_t> pinned_bytes;   // registered memory librsock holds (live rings and kept kits)
  std::atomic<uint64_t> pinned_budget;  // librsock's share of RLIMIT_MEMLOCK (UINT64_MAX: unlimited)
  std::atomic<uint64_t> kits_idle;      // closed connections' kits kept for the next ones
  std::atomic<uint64_t> kits_reused;    // connections that took a kept kit (a counter)
};
static_assert(sizeof(Resources) == 32);

// How long the process's switches onto RDMA took, in the main file's header
// (layout 9 on; relaxed atomics). A switch runs from the RDMA connection
// being up to the stream being on RDMA (offer, ready, both markers); the
// application's new writes wait in the stream meanwhile, so switch_us_max
// bounds the extra latency an upgrade added to a request. Re-upgrades (a
// connection back on RDMA after a reverse switch) count as switches too.
struct Switches {
  std::atomic<uint64_t> count;          // switches timed
  std::atomic<uint64_t> switch_us_sum;
  std::atomic<uint64_t> switch_us_max;
  std::atomic<uint64_t> upgrade_us_sum;  // socket start to first on RDMA, over first upgrades
};
static_assert(sizeof(Switches) == 32);

// Descriptive fields: updated together, rarely, under the slot's seqlock.
struct SlotInfo {
  int32_t fd;
  uint32_t qp_num;            // 0 until on RDMA
  uint8_t state;              // ConnState
  uint8_t transport;          // Transport
  uint8_t fallback_reason;    // FallbackReason
  uint8_t direction;          // Direction
  uint8_t family;             // 4 or 6 (0: unknown)
  uint8_t peer_reason;        // with kRejected: the peer's wire::RejectReason
  uint8_t pad0[2];
  uint8_t local_addr[16];     // IPv4 in the first 4 bytes
  uint8_t peer_addr[16];
  uint16_t local_port;        // host order
  uint16_t peer_port;
  uint32_t generation;        // bumped on every reuse of the slot
  uint64_t opened_unix_ms;
};
static_assert(sizeof(SlotInfo) == 64);

struct alignas(64) ConnSlot {
  std::atomic<uint32_t> seq;     // seqlock over `info` (odd while writing)
  std::atomic<uint32_t> in_use;  // 1 while a connection owns the slot
  SlotInfo info;
  Traffic traffic;
  // Gauges, overwritten by the transport as they change.
  std::atomic<uint32_t> send_ring_fill;  // bytes queued in the send ring
  std::atomic<uint32_t> recv_ring_fill;  // bytes waiting in the receive ring
  std::atomic<uint32_t> ring_bytes;      // capacity of each ring
  std::atomic<uint32_t> send_credits;    // credits we hold to send to the peer
  uint64_t free_next;                    // writer-private free list link (not for readers)
  // Timeline (layout 9), microseconds, 0 until known: upgrade_us from the
  // socket's start (connect or accept) to its first time on RDMA, at the
  // coarse clock's precision (a timer tick); switch_us the latest switch's
  // length (Switches above), exact.
  std::atomic<uint32_t> upgrade_us;
  std::atomic<uint32_t> switch_us;
  uint8_t reserved[32];

  // Data path (no locks, no syscalls).
  void add_tx(Transport t, uint64_t bytes) {
    traffic.tx_bytes[idx(t)].fetch_add(bytes, std::memory_order_relaxed);
    traffic.tx_ops[idx(t)].fetch_add(1, std::memory_order_relaxed);
  }
  void add_rx(Transport t, uint64_t bytes) {
    traffic.rx_bytes[idx(t)].fetch_add(bytes, std::memory_order_relaxed);
    traffic.rx_ops[idx(t)].fetch_add(1, std::memory_order_relaxed);
  }
  void add_credit_stall() { traffic.credit_stalls.fetch_add(1, std::memory_order_relaxed); }
  void set_ring_fill(uint32_t send, uint32_t recv) {
    send_ring_fill.store(send, std::memory_order_relaxed);
    recv_ring_fill.store(recv, std::memory_order_relaxed);
  }
  void set_credits(uint32_t credits) { send_credits.store(credits, std::memory_order_relaxed); }
  void set_ring_bytes(uint32_t capacity) { ring_bytes.store(capacity, std::memory_order_relaxed); }

 private:
  static int idx(Transport t) { return static_cast<int>(t) & 1; }
};
static_assert(sizeof(ConnSlot) == 256);
static_assert(offsetof(ConnSlot, info) == 8);
static_assert(offsetof(ConnSlot, traffic) == 72);

struct alignas(64) SegmentHeader {
  std::atomic<uint64_t> magic;             // kMagic once valid
  uint32_t layout_version;                 // kLayoutVersion
  uint32_t header_size;                    // sizeof(SegmentHeader)
  uint32_t slot_size;                      // sizeof(ConnSlot)
  uint32_t slot_count;                     // slots in this file
  uint32_t file_index;                     // 0: "<pid>", k: "<pid>.<k>"
  int32_t pid;
  uint32_t uid;
  uint32_t pad0;
  uint64_t start_time;                     // /proc/<pid>/stat field 22: beats pid reuse
  uint64_t start_unix_ms;
  char exe[64];                            // NUL-terminated executable name
  std::atomic<uint32_t> extension_count;   // main file: extensions published so far
  uint32_t pad1;
  ProcessCounters counters;                // main file only (zero in extensions)
  char release[16];                        // the librsock release that writes it ("0.2.0"), NUL-terminated
  Resources resources;                     // main file only (layout 7 on)
  Switches switches;                       // main file only (layout 9 on)
  uint8_t reserved[48];
};
static_assert(offsetof(SegmentHeader, layout_version) == 8);
static_assert(offsetof(SegmentHeader, counters) == 128);
static_assert(offsetof(SegmentHeader, resources) == 128 + sizeof(ProcessCounters) + 16);
static_assert(offsetof(SegmentHeader, switches) == offsetof(SegmentHeader, resources) + sizeof(Resources));
static_assert(sizeof(SegmentHeader) % 64 == 0);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

inline size_t file_bytes(uint32_t slot_count) {
  return sizeof(SegmentHeader) + static_cast<size_t>(slot_count) * sizeof(ConnSlot);
}
inline ConnSlot* slots_of(SegmentHeader* h) { return reinterpret_cast<ConnSlot*>(h + 1); }
inline const ConnSlot* slots_of(const SegmentHeader* h) {
  return reinterpret_cast<const ConnSlot*>(h + 1);
}

}  // namespace rsock::stats
