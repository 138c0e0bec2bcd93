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
