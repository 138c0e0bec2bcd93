// One rdma_cm event channel for every Connection of the process.
//
// A channel per connection cost one fd each (issue 11: a program under
// `ulimit -n 1024` ran out of fds after ~150 upgraded connections). rdma_cm
// events are rare (address/route resolved, established, rejected,
// disconnected), so one channel serves them all: whoever polls the hub reads
// every pending event and queues it on its Connection (id->context), which
// handles it in its next progress() and is poked through its notify callback
// so that a sleeping waiter looks again.
//
// Who polls: the socket layer's progress thread watches fd() and calls
// poll() (set_serviced(true)); without one (transport tests, benchmarks)
// every Connection::progress() polls the hub itself and Connection::wait()
// sleeps on fd() too.
//
// Locking: mu() is a leaf lock. It guards the channel reads, every
// Connection's queue of delivered events and the ids' context pointers, so
// a Connection that forgets its id under it is never handed an event after.
#pragma once

#include <mutex>

struct rdma_event_channel;
struct rdma_cm_id;

namespace rsock::transport::cm_hub {

// The process's channel (created on first use, nonblocking, fd in the owned
// band); nullptr with errno set if rdma_cm cannot open one.
rdma_event_channel* channel();
// Its fd, or -1 while there is none.
int fd();
// Reads every pending event and delivers it. Any thread; never blocks.
void poll();
void set_serviced(bool on);
bool serviced();
// Under mu(): events for `id` are acknowledged and dropped from now on.
void forget(rdma_cm_id* id);
std::mutex& mu();
// In a fork child: the inherited channel is the parent's (its events are
// the parent's); drop it unread. The next channel() opens a new one.
void after_fork_child();

}  // namespace rsock::transport::cm_hub
