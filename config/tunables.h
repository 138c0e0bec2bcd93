// Tunables: every number librsock uses that a user may want to change.
// Defaults live here (and only here); config/ fills a Tunables from the config
// file and RSOCK_<KEY> environment variables; transport/ and socket/ read it.
// docs/config.md documents each key.
#pragma once

#include <cstdint>

namespace rsock::config {

struct Tunables {
  // Transport (rdma) ----------------------------------------------------------
  // Each of a connection's send and receive rings, at most: rings start at
  // ring_min_bytes, move to ring_bytes once the peer keeps using the whole
  // window (a stream), and back after ring_idle_ms without data, like TCP's
  // autotuned buffers (docs/TRANSPORT.md, "Rings that grow").
  uint32_t ring_bytes = 512 * 1024;
  uint32_t ring_min_bytes = 64 * 1024;
  uint32_t ring_idle_ms = 5000;       // 0 = a grown ring never shrinks
  uint32_t inline_threshold = 64;     // writes up to this size are posted inline
  uint32_t spin_us = 20;              // busy-poll the CQ this long before sleeping
  // ... and up to this long while most of the thread's recent waits ended
  // sooner (util/adaptive_spin.h): the CPU a wait may burn to save a sleep
  // and its wakeup. At or below spin_us the spin is always spin_us. (At
  // most one thread per CPU spins at a time: SpinPlace.)
  uint32_t spin_max_us = 200;
  uint32_t resolve_timeout_ms = 500;  // rdma_resolve_addr / rdma_resolve_route bound
  uint32_t connect_timeout_ms = 1000; // rdma_connect until ESTABLISHED
  uint32_t keepalive_ms = 500;        // liveness probe period on an idle connection
  // A signalled WR outstanding this long with no send completion at all means
  // the device stopped working the queue (rxe after a link flap leaves the QP
  // in RTS with its requester parked for good): the path is treated as failed.
  uint32_t stall_timeout_ms = 5000;
  // A port whose sequence errors (packets lost on the wire, as the device
  // counts them) reach this many per million packets is lossy: RC's
  // go-back-N then does far worse than TCP, so its busy connections switch
  // back and their peers stay on TCP for negative_cache_ttl_s. 0 = never.
  // (rxe between two guests: 0 on a clean wire, about 4600 with 2 % loss.)
  uint32_t lossy_path_ppm = 1000;
  // A path (our connections to one peer host) whose RDMA delivery rate,
  // while the path is the limit, falls this many times below the best it
  // had (two 0.5 s windows of busy time in a row) has collapsed: its busy connections
  // switch back and the host stays on TCP for negative_cache_ttl_s.
  // 0 = never. (pair.slow: RoCE throttled to 4 Mbit/s, about 25 times
  // below its best; to 8 Mbit/s, about 12 times.)
  uint32_t slow_path_ratio = 8;
  uint32_t send_queue_depth = 128;    // send WRs per QP (data chunks, credits, control)
  uint32_t recv_slots = 64;           // receive WRs per QP; announced to the peer (4..1024)
  // Closed connections' verbs resources (PD, registered rings) kept
  // for the next connections, at most this many per process
  // (transport/kit_pool.h); 0 = destroy them at close.
  uint32_t kit_pool = 16;
  // Upgrade (socket layer) ----------------------------------------------------
  uint32_t upgrade_timeout_ms = 2000; // whole TCP->RDMA rendezvous, then stay on TCP
  // A client starts its rendezvous this long after connect(), or once 64 KiB
  // moved on TCP: one-request connections then never pay for one.
  uint32_t upgrade_delay_ms = 10;
  uint32_t negative_cache_ttl_s = 60; // how long a peer that refused stays on TCP
  uint32_t port_offset = 0;           // rdma_cm port = TCP port + offset (mod 65536)
  // fork(): switch upgraded connections back to TCP first, so that parent or
  // child can go on using them (off: they stay on RDMA in the parent, and
  // fail with ECONNRESET in the child, which suits programs that fork only
  // to snapshot or to exec something unrelated).
  bool fork_hand_off = true;
  // A connection that switched back to TCP because its RDMA path failed, or
  // because its peer switched back, tries RDMA again (docs/DESIGN.md,
  // "Upgrading again"). Off: it stays on TCP, as before.
  bool reupgrade = true;
  // Closed connections' kept kits (kit_pool above) get their next QP made
  // ahead by the progress thread, off the next connection's setup path
  // (transport/kit_pool.h, warm).
  bool kit_qp_ahead = true;
  // On: completion queues raise events only while a thread sleeps on
  // them; a busy thread polls them instead (transport/cq_group.h,
  // "Arming"). Off: armed after every event, a channel read and a re-arm
  // per event (docs/PERFORMANCE.md, "CQs armed only for sleeps").
  bool cq_lazy_arm = true;
  // Observability -------------------------------------------------------------
  bool stats = true;                  // publish counters for rsock-stat
  // Internal invariants checked at run time (abort with a message when one
  // breaks): on in debug builds, RSOCK_DEBUG_CHECKS=1 in release builds.
#ifdef NDEBUG
  bool debug_checks = false;
#else
  bool debug_checks = true;
#endif
};

}  // namespace rsock::config
