// rdma-core's file descriptors, moved out of the program's way like every
// fd librsock keeps (util/owned_fds.h). The event channels' and device
// contexts' fd fields are public members that rdma-core reads at every use
// (commands, event reads, mmap, destroy), so a moved number is used from then
// on; the kernel object behind it (the open file) is the same.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "util/owned_fds.h"

namespace rsock::transport {

inline void own_channel(rdma_event_channel* ch) { ch->fd = sys::own_fd(ch->fd); }
inline void own_channel(ibv_comp_channel* ch) { ch->fd = sys::own_fd(ch->fd); }
// Before rdma-core closes the channel (its close() must really close).
inline void disown_channel(rdma_event_channel* ch) { sys::disown_fd(ch->fd); }
inline void disown_channel(ibv_comp_channel* ch) { sys::disown_fd(ch->fd); }

// Once per process, before the first rdma_cm id: opens every device context
// rdma_cm will use (rdma_get_devices) and moves their command and async fds,
// which stay open for the life of the process.
void own_device_fds();

// From the application's own call (a hook), before the progress thread's
// first rendezvous in this process image: opens now what the progress
// thread would otherwise open at its first connection on each device with
// an active port: the process's own verbs context and its completion
// channel, the port counter files (path_quality.h; when `port_counters`),
// and librdmacm's one-time address-service probe (a socket it opens and
// closes at the first route resolution). An fd created in a background
// thread holds the lowest free number for a moment: a program that had just
// closed that number and reuses it would get something else
// (tests/conformance/test_fds.cc). From the program's own thread it cannot
// collide with the program's next call. Once per process image (again in a
// fork child); failures are left for the connection that needs the device.
void prepare_devices(bool port_counters);

// The verbs context this process opened itself for `dev` (opened on first
// use, its fds in the owned band); every PD, CQ, QP and MR of a Connection
// lives on one, never on librdmacm's id->verbs. librdmacm opens its contexts
// once per process and keeps them across fork, and the kernel refuses a fork
// child's write() commands on them ("changed security contexts after opening
// file descriptor"; rxe's post-send doorbell is one), while a context the
// child opened itself works. nullptr with errno set on failure.
ibv_context* own_context(ibv_device* dev);
// In a fork child: forget the parent's contexts (unused from now on; their
// fds stay open, closing them would tell the kernel nothing) so that
// own_context() opens the child's own.
void contexts_after_fork_child();
}  // namespace rsock::transport
