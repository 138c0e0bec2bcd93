// poll/select/epoll over any mix of kernel fds and upgraded sockets.
//
// An upgraded socket's readiness lives in user space (its staging buffer,
// its RDMA rings): the kernel TCP socket is idle. Waiters therefore sleep on
// the socket's own fds (its wake eventfd, its RDMA connection's event fd and,
// while part of its data is still on TCP, the TCP socket) and recompute
// readiness in user space when woken. No thread sits between the RDMA
// completion and the application: the completion wakes the waiter directly.
//
// epoll: an epoll instance that ever held a tracked socket gets an EpollSet
// (socket/readiness.cc) recording every tracked registration. Registrations
// of upgraded sockets live in user space (the kernel instance holds their
// wake fds instead, under an internal cookie, in a private shadow instance);
// the others stay in the kernel and are handed back to it if an upgrade falls
// back to TCP. An eventfd in the kernel instance is kept readable while
// user-space events are due, so polling an epoll fd or nesting it in another
// epoll sees exact readiness (readiness.cc, EpollSet).
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <time.h>

#include <atomic>

#include "util/status.h"

namespace rsock::socket {

class Socket;

// Err(kRedoPlain) when no fd in the set is an upgraded socket: the caller
// then uses the kernel's call unchanged.
Status<int> poll_emulated(pollfd* fds, nfds_t n, const timespec* timeout, const sigset_t* mask);
Status<int> select_emulated(int nfds, fd_set* r, fd_set* w, fd_set* e, timespec* timeout,
                            const sigset_t* mask);

// epoll_ctl on a tracked socket fd; the kernel call has NOT been made yet.
Status<int> epoll_ctl_tracked(int epfd, int op, int fd, epoll_event* ev);
// epoll_wait family; Err(kRedoPlain) when epfd has no user-space registrations
// (the caller calls the kernel, then epoll_filter_internal()).
Status<int> epoll_wait_emulated(int epfd, epoll_event* ev, int max, const timespec* timeout,
                                const sigset_t* mask);
// Drops librsock's own wake events from a kernel epoll_wait result.
int epoll_filter_internal(int epfd, epoll_event* ev, int n);
// An epoll fd or a socket fd was closed.
void epoll_fd_closed(int fd);
// Whether `fd` is an epoll instance we emulate (one lookup, no syscall).
bool is_epoll_instance(int fd);

// epoll_create/epoll_create1 returned epfd (its EpollSet exists from then on,
// so that nesting it is noticed even before it holds a tracked socket).
void epoll_created(int epfd);
// An EPOLL_CTL_ADD the kernel accepted for epfd without us (a plain fd): its
// kernel instance holds registrations of the application's from now on.
void epoll_kernel_added(int epfd);
// Before fork(): the sets so far share their kernel instances with the child.
void epoll_before_fork();
// fd is being polled, or added to another epoll instance: if it is an epoll
// instance, its readiness must be kept exact from now on (see EpollSet).
void epoll_observed(int fd);
// Stream I/O on s may have changed readiness that watched sets publish.
void readiness_after_io(const Socket* s);

// A socket just started an upgrade: move its kernel epoll registrations to
// user space.
void epoll_take_over(int fd);

// A registration's readiness may have changed: put it on its set's ready
// list. Lock-free; a syscall only to wake a thread asleep in that set (or
// its monitor).
struct EpollWatch;
void epoll_watch_fired(EpollWatch* w);
// Every user-space epoll registration of s: epoll_watch_fired (under
// s->watch_lock), if `owner` is null or still names s then (a stream's
// pointer to its socket, cleared by socket_clear_owner when the socket's
// last fd closes). Any thread, any lock held.
void socket_push_watches(Socket* s, const std::atomic<Socket*>* owner = nullptr);
// Under s->watch_lock: *owner = nullptr (no push through it after this).
void socket_clear_owner(Socket* s, std::atomic<Socket*>* owner);

}  // namespace rsock::socket
