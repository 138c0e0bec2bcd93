// One epoll instance for the TCP sockets of every Stream whose data may
// still come over TCP (rendezvous, switch, reverse switch, waiting to
// upgrade again), for the epoll emulation (readiness.cc).
//
// Why not the stream's own TCP fd in every epoll set's shadow instance: that
// fd is the application's (issue 11: a private dup per upgraded socket cost
// one fd each), and an epoll entry is keyed by fd number and file. When the
// application closes its number, the stream keeps the file open through a
// dup taken at that moment (Stream::retire_fd), so the kernel would not drop
// the shadows' entries, and a later EPOLL_CTL_DEL of that number would meet
// whatever file the number names by then: the entry would stay, naming a
// registration that is freed. Here each stream has at most one entry, which
// the stream itself adds, moves to its dup when the number is closed, and
// deletes, all under its own lock.
//
// Who polls: every epoll set with a user-space registration on TCP holds
// fd() in its shadow (level-triggered); whoever wakes on it calls poll(),
// which hands each event to its Stream (tcp_event): new send room counted,
// new generation, and a push of the socket's epoll registrations, which
// every set holding one of them sees. Blocking calls and the poll/select
// emulation sleep on the TCP fd itself (a poll() registers nothing that
// outlives it).
//
// Locking: transport::cm_hub::mu(), the leaf lock of the hubs: the epoll
// reads and the dispatch run under it, and a stream deletes its entry under
// it, so no event is handed to a stream after that.
#pragma once

#include <cstdint>

namespace rsock::socket {
class Stream;
}

namespace rsock::socket::tcp_hub {

// Its fd, or -1 while no stream was added.
int fd();
// Adds `tcp_fd` for `st` (edge-triggered in, out, hangup); false on failure.
// Under cm_hub::mu() (the caller holds it).
bool add_locked(int tcp_fd, Stream* st);
// Deletes the entry of `tcp_fd` (which must still name the same file).
void del_locked(int tcp_fd);
// Reads the pending events (one batch) and hands them to their streams.
// Any thread; never blocks.
void poll();
// In a fork child: the instance is shared with the parent (entries are the
// parent's); forget it. The next add opens a new one.
void after_fork_child();

}  // namespace rsock::socket::tcp_hub
