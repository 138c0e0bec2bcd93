// fork_guard: fork() never copies a librdmacm or libibverbs lock that
// another thread holds.
//
// Both libraries keep process-global mutexes (librdmacm's id table and
// device list, libibverbs' device list) and have no fork handlers. A child
// forked while some thread was inside one of those calls inherits the mutex
// locked by a thread that does not exist there, and hangs in its first
// rdma_cm call (its first upgrade). librsock's progress thread is parked
// before fork (socket/progress.cc, g_loop_mu); application threads call
// into the libraries too (a rendezvous that falls back destroys its id, a
// reverse switch destroys the connection, a connection's progress resolves
// routes). So every such call runs under a shared lock (the wrappers in
// namespace `guarded`), and fork() takes it exclusively as its last step
// before the real fork: it waits for calls in flight (microseconds) and
// holds off new ones until both processes are past the fork.
//
// Lock order (docs/DESIGN.md): innermost. Nothing else is taken while the
// shared lock is held (the region is the library call alone), so the
// forking thread may hold any of librsock's locks while it waits.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <utility>

namespace rsock::transport::fork_guard {

// An application or progress thread inside a library call (recursive: a
// reader-preferring lock, so a nested region never waits for a queued fork).
class Shared {
 public:
  Shared();
  ~Shared();
  Shared(const Shared&) = delete;
  Shared& operator=(const Shared&) = delete;
};

void lock_for_fork();   // exclusive, right before the real fork()
void unlock_parent();   // in the parent after fork()
void reinit_child();    // in the child: the lock is fresh, nobody holds it

}  // namespace rsock::transport::fork_guard

namespace rsock::transport::guarded {

// The library calls that may take a process-global lock, each under the
// shared lock; same names, same arguments, errno as the call left it.
#define RSOCK_FORK_GUARDED(name)                          \
  template <class... A>                                    \
  inline auto name(A&&... a) {                             \
    fork_guard::Shared g;                                  \
    return ::name(std::forward<A>(a)...);                  \
  }
RSOCK_FORK_GUARDED(rdma_create_event_channel)
RSOCK_FORK_GUARDED(rdma_destroy_event_channel)
RSOCK_FORK_GUARDED(rdma_create_id)
RSOCK_FORK_GUARDED(rdma_destroy_id)
RSOCK_FORK_GUARDED(rdma_get_cm_event)
RSOCK_FORK_GUARDED(rdma_resolve_addr)
RSOCK_FORK_GUARDED(rdma_resolve_route)
RSOCK_FORK_GUARDED(rdma_connect)
RSOCK_FORK_GUARDED(rdma_accept)
RSOCK_FORK_GUARDED(rdma_reject)
RSOCK_FORK_GUARDED(rdma_establish)
RSOCK_FORK_GUARDED(rdma_notify)
RSOCK_FORK_GUARDED(rdma_disconnect)
RSOCK_FORK_GUARDED(rdma_bind_addr)
RSOCK_FORK_GUARDED(rdma_listen)
RSOCK_FORK_GUARDED(rdma_migrate_id)
RSOCK_FORK_GUARDED(rdma_get_devices)
RSOCK_FORK_GUARDED(rdma_getaddrinfo)
RSOCK_FORK_GUARDED(rdma_free_devices)
RSOCK_FORK_GUARDED(ibv_get_device_list)
RSOCK_FORK_GUARDED(ibv_free_device_list)
RSOCK_FORK_GUARDED(ibv_open_device)
#undef RSOCK_FORK_GUARDED

}  // namespace rsock::transport::guarded
