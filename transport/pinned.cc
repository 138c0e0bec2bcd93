#include "transport/pinned.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>

#include <algorithm>
#include <atomic>
#include <bit>

#include "transport/wire.h"

namespace rsock::transport::pinned {

namespace {

constexpr uint64_t kNotRead = UINT64_MAX - 1;
std::atomic<uint64_t> g_budget{kNotRead};
std::atomic<uint64_t> g_in_use{0};

bool has_ipc_lock() {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct d[2]{};
  if (syscall(SYS_capget, &h, d) != 0) return false;
  return d[CAP_IPC_LOCK / 32].effective & (1u << (CAP_IPC_LOCK % 32));
}

uint64_t budget_of(uint64_t limit) {
  if (limit == kUnlimited) return kUnlimited;
  return limit / 4 * 3;  // a quarter stays the program's own
}

uint64_t page_round(uint64_t n) { return (n + 4095) & ~uint64_t{4095}; }

constexpr uint64_t kMinRing = 16 * 1024;  // the smallest ring a budget sizes

// Takes `bytes` if in_use stays at or below `cap`.
bool reserve_up_to(uint64_t bytes, uint64_t cap) {
  uint64_t cur = g_in_use.load(std::memory_order_relaxed);
  do {
    if (cur > cap || bytes > cap - cur) return false;
  } while (!g_in_use.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  return true;
}

}  // namespace

uint64_t budget() {
  uint64_t b = g_budget.load(std::memory_order_acquire);
  if (b != kNotRead) return b;
  rlimit rl{};
  uint64_t limit = kUnlimited;
  if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && !has_ipc_lock())
    limit = rl.rlim_cur;
  b = budget_of(limit);
  g_budget.store(b, std::memory_order_release);
  return b;
}

uint64_t in_use() { return g_in_use.load(std::memory_order_relaxed); }

bool reserve(uint64_t bytes) { return reserve_up_to(bytes, budget()); }

bool reserve_spare(uint64_t bytes) {
  uint64_t b = budget();
  return reserve_up_to(bytes, b == kUnlimited ? b : b - b / 4);
}

uint32_t initial_ring_bytes(const config::Tunables& tun) {
  return std::min(ring_bytes_for(tun.ring_bytes), tun.ring_min_bytes);
}

uint32_t grown_ring_bytes(const config::Tunables& tun) {
  uint64_t b = budget();
  if (b == kUnlimited) return tun.ring_bytes;
  uint64_t ring = std::max<uint64_t>(kMinRing, std::bit_floor(std::max<uint64_t>(b / 16, 1)));
  return uint32_t(std::min<uint64_t>(tun.ring_bytes, ring));
}

void release(uint64_t bytes) { g_in_use.fetch_sub(bytes, std::memory_order_relaxed); }

uint64_t connection_bytes(uint32_t ring_bytes, uint32_t sq_depth, uint32_t recv_slots) {
  return page_round(ring_bytes) + page_round(uint64_t{ring_bytes} + uint64_t{sq_depth} * wire::kRecvBufBytes) +
         page_round(uint64_t{recv_slots} * wire::kRecvBufBytes);
}

bool fits(const config::Tunables& tun) {
  uint64_t b = budget();
  if (b == kUnlimited) return true;
  // A pre-check: the real reservation happens when the connection registers
  // its memory (the queue sizes are the tunables', before the transport's
  // clamping, which the config ranges make a no-op).
  uint64_t need = connection_bytes(initial_ring_bytes(tun), tun.send_queue_depth, tun.recv_slots);
  uint64_t cur = in_use();
  return cur <= b && need <= b - cur;
}

uint32_t ring_bytes_for(uint32_t configured) {
  uint64_t b = budget();
  if (b == kUnlimited) return configured;
  uint64_t per_conn = b / 256 / 2;  // two rings per connection
  uint64_t ring = per_conn >= kMinRing ? std::bit_floor(per_conn) : kMinRing;
  return uint32_t(std::min<uint64_t>(configured, ring));
}

void set_limit_for_tests(uint64_t limit) { g_budget.store(budget_of(limit), std::memory_order_release); }

namespace {
std::atomic<uint64_t> g_maps_budget{kNotRead};  // in connections
std::atomic<uint64_t> g_maps_in_use{0};

uint64_t maps_budget() {
  uint64_t b = g_maps_budget.load(std::memory_order_relaxed);
  if (b != kNotRead) return b;
  uint64_t max = 65530;
  if (FILE* f = fopen("/proc/sys/vm/max_map_count", "re")) {
    unsigned long long v = 0;
    if (fscanf(f, "%llu", &v) == 1 && v > 0) max = v;
    fclose(f);
  }
  b = (max - max / 8) / kMapsPerConnection;
  g_maps_budget.store(b, std::memory_order_relaxed);
  return b;
}
}  // namespace

bool take_maps() {
  uint64_t cap = maps_budget();
  uint64_t cur = g_maps_in_use.load(std::memory_order_relaxed);
  do {
    if (cur + 1 > cap) return false;
  } while (!g_maps_in_use.compare_exchange_weak(cur, cur + 1, std::memory_order_relaxed));
  return true;
}

void give_maps() { g_maps_in_use.fetch_sub(1, std::memory_order_relaxed); }

bool maps_fit() { return g_maps_in_use.load(std::memory_order_relaxed) < maps_budget(); }

void set_max_map_count_for_tests(uint64_t max_map_count) {
  g_maps_budget.store(max_map_count ? (max_map_count - max_map_count / 8) / kMapsPerConnection
                                    : kNotRead,
                      std::memory_order_relaxed);
}

}  // namespace rsock::transport::pinned
