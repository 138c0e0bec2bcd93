// Hooks: readiness (poll, ppoll, select, pselect, epoll_*). While every
// tracked socket is still a kernel socket the kernel's answer is exact, so
// these pass through; they are the dispatch points for upgraded sockets.
#include <poll.h>
#include <sys/epoll.h>
#include <sys/select.h>

#include "preload/hook.h"

using rsock::preload::HookScope;
using rsock::preload::real;


RSOCK_HOOK int poll(struct pollfd* p, nfds_t n, int timeout) noexcept {
  HookScope h;
  return h.pass(real().poll(p, n, timeout));
}

RSOCK_HOOK int __poll_chk(struct pollfd* p, nfds_t n, int timeout, size_t plen) noexcept {
  HookScope h;
  return h.pass(real().__poll_chk(p, n, timeout, plen));
}

RSOCK_HOOK int ppoll(struct pollfd* p, nfds_t n, const struct timespec* t,
                     const sigset_t* s) noexcept {
  HookScope h;
  return h.pass(real().ppoll(p, n, t, s));
}

RSOCK_HOOK int __ppoll_chk(struct pollfd* p, nfds_t n, const struct timespec* t,
                           const sigset_t* s, size_t plen) noexcept {
  HookScope h;
  return h.pass(real().__ppoll_chk(p, n, t, s, plen));
}

RSOCK_HOOK int select(int n, fd_set* r, fd_set* w, fd_set* e, struct timeval* t) noexcept {
  HookScope h;
  return h.pass(real().select(n, r, w, e, t));
}

RSOCK_HOOK int pselect(int n, fd_set* r, fd_set* w, fd_set* e, const struct timespec* t,
                       const sigset_t* s) noexcept {
  HookScope h;
  return h.pass(real().pselect(n, r, w, e, t, s));
}

RSOCK_HOOK int epoll_create(int size) noexcept {
  HookScope h;
  int fd = real().epoll_create(size);
  if (fd >= 0) rsock::preload::forget(fd);
  return h.pass(fd);
}

RSOCK_HOOK int epoll_create1(int flags) noexcept {
  HookScope h;
  int fd = real().epoll_create1(flags);
  if (fd >= 0) rsock::preload::forget(fd);
  return h.pass(fd);
}

RSOCK_HOOK int epoll_ctl(int ep, int op, int fd, struct epoll_event* ev) noexcept {
  HookScope h;
  return h.pass(real().epoll_ctl(ep, op, fd, ev));
}

RSOCK_HOOK int epoll_wait(int ep, struct epoll_event* ev, int n, int timeout) noexcept {
  HookScope h;
  return h.pass(real().epoll_wait(ep, ev, n, timeout));
}

RSOCK_HOOK int epoll_pwait(int ep, struct epoll_event* ev, int n, int timeout,
                           const sigset_t* s) noexcept {
  HookScope h;
  return h.pass(real().epoll_pwait(ep, ev, n, timeout, s));
}

RSOCK_HOOK int epoll_pwait2(int ep, struct epoll_event* ev, int n, const struct timespec* t,
                            const sigset_t* s) noexcept {
  HookScope h;
  return h.pass(real().epoll_pwait2(ep, ev, n, t, s));
}
