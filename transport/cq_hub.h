// One completion channel per device context for every Connection of the
// process.
//
// A channel per connection cost one fd each (issue 11: the fds of upgraded
// sockets count against the program's RLIMIT_NOFILE). Every CQ of a device
// context raises its events on that context's one channel; the channels sit
// behind one fd, the hub's fd(). Whoever polls the hub
// reads every pending event and hands it to the CQ's group (cq_group.h; the
// CQ's cq_context), which re-arms the CQ while a thread sleeps (cq_group.h,
// "Arming"), files its completions with their connections and calls the
// notify callback of each, so that a waiter looks again.
//
// Who polls: whoever sleeps on a connection includes fd() in its sleep
// (Connection::fd(); the socket layer's blocking waits, poll/select
// emulation and every epoll set's shadow instance), and whoever wakes on it
// polls the hub, or marks it for the next Connection::progress() to poll
// (note_readable). So a completion wakes
// the application thread that sleeps on it directly, as a channel per
// connection did, with no thread hop (measured in the VM: a hop through the
// progress thread made a 64 B round trip 8x longer).
// One sleeping thread at a time watches the hub (begin_sleep): a
// completion would otherwise wake every thread of the process asleep on an
// upgraded socket (memcslap, 10 threads: 2.3 sleeps and 4.7 reads per
// request). The others sleep on their own wake fds, which the completion
// reaches through its stream (whoever reads the hub pokes the stream's
// sleepers). When the watcher leaves its sleep with others still asleep,
// it pokes one of them, which then watches: see begin_sleep.
// Locking: the channel reads and acks are done under cm_hub::mu(), a leaf;
// the group's work after them outside it (a group's lock comes first).
#pragma once

#include <poll.h>

#include <mutex>

struct ibv_context;
struct ibv_comp_channel;
struct ibv_cq;

namespace rsock::transport::cq_hub {

// The channel of `ctx` (created on first use, nonblocking, fd in the owned
// band, added to the hub's epoll); nullptr with errno set on failure.
ibv_comp_channel* channel(ibv_context* ctx);
// What to sleep on: the only channel's fd, or, once there are several, an
// epoll instance holding them all; -1 before the first channel. It changes
// when a second device context gets its channel: read it at every sleep.
int fd();
// Reads one pending completion event per channel (more leave fd() readable)
// and hands it to its CQ's group (cq_group::on_event: re-arm if a thread
// sleeps, drain, notify the connections that got completions). Any thread, holding no group's
// lock and not cm_hub::mu(); never blocks.
void poll();
// A sleeper that leaves the read to the next Connection::progress() (to put
// no syscall between its wakeup and the data) says fd() woke it; progress()
// reads the hub only then. A stale mark costs one read that finds nothing; a
// missed one an event left in the channel, which keeps fd() readable and
// wakes the next sleeper at once.
void note_readable();
bool noted();
// note_readable() if fd() is among `fds` and the sleep on them found it readable.
void note_if_woken(const ::pollfd* fds, int n);
// The watcher's sleep on `fds` (the hub at fds[hub]) ended for the hub
// alone while other threads sleep without it: reads the hub, which passes
// their completions on, clears its revents and says true; the caller then
// sleeps on, still the watcher, unless its own streams changed. Leaving
// would hand the watch (end_sleep) to another sleeper, a wakeup with nothing
// to do, only for the caller to take it back at its next sleep. False (and
// nothing read) otherwise: alone, a watcher leaves the read to the next
// Connection::progress(), off its wakeup's path.
bool relay(::pollfd* fds, ::nfds_t n, ::nfds_t hub);
// A thread about to sleep on upgraded sockets, with `wake_fd` in its sleep
// (its eventfd, which those sockets' completions poke: it must be in every
// one's sleepers). True: the caller watches the hub, i.e. puts fd() in this
// sleep (nobody else does). False: another thread watches; the caller
// sleeps without fd() and is poked when needed. Every begin_sleep is
// followed by one end_sleep on the same thread, after the sleep (on every
// path); a thread is in one sleep at a time.
//
// Why nothing is lost: a thread asleep without fd() is in the list, and
// while it is there either a watcher exists (it reads the hub, whose events
// poke their streams' sleepers, and it passes the watch on as it leaves),
// or the last thread to leave found no watcher and poked the list's first
// thread: that one wakes, leaves (poking the next first, if there still is
// no watcher) and, if it sleeps again, becomes the watcher. No thread joins
// the list while there is no watcher (it becomes the watcher instead).
bool begin_sleep(int wake_fd);
// Returns, for a watcher, whether others slept on it: a watcher that fd()
// woke then reads the hub at once (poll()), rather than leaving the read to
// its next progress(), so that their completions are not held up.
bool end_sleep();

// In a fork child: the channels are the parent's (their CQs are the
// parent's); forget them unread. The next channel() opens new ones.
void after_fork_child();

}  // namespace rsock::transport::cq_hub
