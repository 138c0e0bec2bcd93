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
// Whether own_device_fds() ran in this process (or in the parent of a fork
// child): librdmacm then holds device contexts opened by that process, which
// a fork child cannot use (the kernel refuses their commands from another
// process), and librdmacm never opens them again.
bool device_contexts_open();

}  // namespace rsock::transport
