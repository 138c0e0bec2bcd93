// Live counters for rsock-stat: the writer side, used by the library.
//
// Each process publishes one shared-memory segment (util/stats_layout.h).
// Wiring (preload/socket layers):
//   startup:    stats::init({.enabled = cfg.tunables.stats, .exe = name});
//   fork child: stats::after_fork_child();   (from the fork hook, in the child)
//   per socket: slot_ = stats::open_conn(fd, Direction::kClient, &local, &peer);
//               ... if (slot_) slot_->add_tx(Transport::kRdma, n);   (data path: ConnSlot's
//                   inline members are lock-free relaxed atomics; slot_ is null when untracked)
//               stats::set_state(slot_, ConnState::kUpgrading);
//               stats::set_upgraded(slot_, qp_num, again, switch_us, upgrade_us);  or
//               stats::set_fallback(slot_, reason);
//               stats::close_conn(slot_);
// Every free function below accepts a null slot (ConnSlot's members need a
// real one), and all are no-ops before init() or when stats are disabled.
#pragma once

#include <sys/socket.h>

#include <string>
#include <string_view>

#include "util/stats_layout.h"
#include "util/status.h"

namespace rsock::stats {

struct Options {
  bool enabled = true;
  std::string_view exe;                   // shown by rsock-stat (basename of the executable)
  std::string_view dir;                   // default: $RSOCK_STATS_DIR or /dev/shm/librsock
  uint32_t initial_slots = kInitialSlots; // slots in the main file; extensions double
  bool unlink_at_exit = true;             // remove our files from an atexit handler
};

// Creates <dir>/<uid>/<pid> and removes stale files of dead processes. On
// failure stats stay disabled (the library works the same without them).
Status<void> init(const Options& options);

// Removes this process's files and unmaps them. Slots handed out become
// invalid: call only at exit (init() registers it with atexit by default).
void shutdown();

// In a fork child: publish our own <pid> file with a copy of the parent's
// slots (same addresses, so ConnSlot pointers the child inherited stay valid)
// and zeroed counters. Call before the child does any I/O.
void after_fork_child();

// The process counters, or nullptr when stats are disabled.
ProcessCounters* process();
// The resource gauges (stats_layout.h Resources), or nullptr likewise.
Resources* resources();
// The switch timings (stats_layout.h Switches), or nullptr likewise.
Switches* switches();
bool enabled();

// Claims a slot for a new connection (nullptr if stats are off, or if no slot
// can be had: counted in conns_untracked). Takes a lock: not for the data path.
ConnSlot* open_conn(int fd, Direction dir, const sockaddr* local, const sockaddr* peer);
// Adds the slot's traffic to the process totals and frees it.
void close_conn(ConnSlot* slot);

// Descriptive updates (seqlock writers; rare events).
void set_state(ConnSlot* slot, ConnState state);
void set_fd(ConnSlot* slot, int fd);
// A received or exec-inherited socket is opened as kServer before its
// holder slot says which end it is.
void set_direction(ConnSlot* slot, Direction dir);
void set_addresses(ConnSlot* slot, const sockaddr* local, const sockaddr* peer);
// Now on RDMA: transport = kRdma, state = kEstablished; counts conns_upgraded.
// `again`: the connection was on RDMA before (it switched back and upgraded
// again): not counted as another upgraded connection. The switch took
// switch_us (RDMA connection up to on RDMA) and, unless `again`, came
// upgrade_us after the socket's start: into the process's sums, and the
// slot's (microseconds, at least 1, clamped to 32 bits there). Timed before
// counted, so no snapshot shows an upgrade without its switch.
void set_upgraded(ConnSlot* slot, uint32_t qp_num, bool again, uint64_t switch_us, uint64_t upgrade_us);
// Staying on (or back to) TCP: transport = kTcp, state = kEstablished; counts
// fallbacks[reason] (slot may be null: counted all the same).
// peer_reason: with kRejected, the peer's wire::RejectReason (shown by rsock-stat).
void set_fallback(ConnSlot* slot, FallbackReason reason, uint8_t peer_reason = 0);
void count_handshake_error();

// Where segments live: $RSOCK_STATS_DIR or /dev/shm/librsock.
std::string default_root_dir();

}  // namespace rsock::stats
