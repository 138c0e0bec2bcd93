// The process's budget of pinned (registered) memory.
//
// Every upgraded connection registers its rings with the RDMA device, and
// the kernel counts registered pages against RLIMIT_MEMLOCK (8 MiB for an
// ordinary user on Debian) unless the process has CAP_IPC_LOCK. Without a
// budget the first few connections pin it all, the next ones fail deep in
// rdma_cm setup, and the program's own mlock() may fail too. So librsock
// keeps its own account: three quarters of the soft limit (the rest stays
// the program's), sized rings so that a few hundred connections fit, and a
// connection that would exceed it stays on TCP (fallback reason `memlock`).
#pragma once

#include <cstdint>

#include "config/tunables.h"

namespace rsock::transport::pinned {

constexpr uint64_t kUnlimited = UINT64_MAX;

// librsock's share of RLIMIT_MEMLOCK (kUnlimited when the limit is infinite
// or the process has CAP_IPC_LOCK). Read once, at the first use.
uint64_t budget();
uint64_t in_use();
// Takes `bytes` from the budget; false (and nothing taken) when it does not fit.
bool reserve(uint64_t bytes);
void release(uint64_t bytes);
// Whether a new connection with these tunables would fit now.
bool fits(const config::Tunables& tun);
// The ring size a new connection uses: the configured one, or under a
// finite budget the largest power of two (at least 16 KiB) that lets 256
// connections fit, whichever is smaller.
uint32_t ring_bytes_for(uint32_t configured);
// Takes `bytes` only if a quarter of the budget stays free afterwards: a
// ring that grows must leave room for new connections' first rings.
bool reserve_spare(uint64_t bytes);
// The ring size a new connection starts with: ring_min_bytes, within
// ring_bytes_for(ring_bytes).
uint32_t initial_ring_bytes(const config::Tunables& tun);
// The size a ring grows to when its connection streams: ring_bytes, or
// under a finite budget at most a sixteenth of it (so that a handful of
// streaming connections cannot take the room of hundreds of idle ones).
uint32_t grown_ring_bytes(const config::Tunables& tun);
// Pinned bytes of one connection with rings of `ring_bytes` (both rings plus
// its send and receive buffers, page-rounded), as Connection registers them.
uint64_t connection_bytes(uint32_t ring_bytes, uint32_t sq_depth, uint32_t recv_slots);

// Memory mappings. The kernel allows a process vm.max_map_count of them
// (65530 by default), and a connection costs several: on rxe its send and
// receive queues are two mappings of the device file, plus its rings and
// its share of a CQ shared by up to 64 (cq_group.h; 4 for the first group:
// so 4 is what is counted; measured 4.0 per upgraded socket with a CQ each,
// bench/footprint). A program with
// thousands of connections that ran out of them would fail its own next
// mmap (a 128 KiB malloc), so librsock takes at most seven eighths of the
// limit: past that, new connections stay on TCP (no_resources).
constexpr uint32_t kMapsPerConnection = 4;
// Takes one connection's mappings; false (nothing taken) past the budget.
bool take_maps();
void give_maps();
bool maps_fit();  // whether take_maps() would succeed now
// Tests: use `max_map_count` instead of the kernel's (0: read it again).
void set_max_map_count_for_tests(uint64_t max_map_count);

// Tests: forget the budget read so far and use `limit` as RLIMIT_MEMLOCK
// (kUnlimited for none); in_use() is kept.
void set_limit_for_tests(uint64_t limit);

}  // namespace rsock::transport::pinned
