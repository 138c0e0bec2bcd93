// Hooks: readiness (poll, ppoll, select, pselect, epoll_*). Sets without an
// upgraded socket go to the kernel unchanged; the others are emulated by
// socket/readiness.cc over the streams' own fds.
#include <poll.h>
#include <sys/epoll.h>
#include <sys/select.h>

#include "preload/hook.h"
#include "socket/readiness.h"
#include "socket/rendezvous.h"

using rsock::preload::HookScope;
using rsock::preload::real;
using rsock::socket::kRedoPlain;

namespace {

// Only worth a look when some socket has an upgrade at all.
bool any_upgrades() { return rsock::socket::streams_exist(); }

timespec ms_to_ts(int ms) { return {ms / 1000, long(ms % 1000) * 1000000}; }

}  // namespace

#define RSOCK_TRY_EMULATED(h, expr)                                \
  if (rsock::preload::t_depth == 1 && any_upgrades()) {            \
    auto r_ = (expr);                                              \
    if (r_.ok() || r_.error() != kRedoPlain) return (h).finish(r_); \
  }

RSOCK_HOOK int poll(struct pollfd* p, nfds_t n, int timeout) noexcept {
  HookScope h;
  timespec ts = ms_to_ts(timeout);
  RSOCK_TRY_EMULATED(h, rsock::socket::poll_emulated(p, n, timeout < 0 ? nullptr : &ts, nullptr));
  return h.pass(RSOCK_KERNEL(real().poll(p, n, timeout)));
}

RSOCK_HOOK int __poll_chk(struct pollfd* p, nfds_t n, int timeout, size_t plen) noexcept {
  HookScope h;
  if (n <= plen / sizeof(*p)) {
    timespec ts = ms_to_ts(timeout);
    RSOCK_TRY_EMULATED(h, rsock::socket::poll_emulated(p, n, timeout < 0 ? nullptr : &ts, nullptr));
  }
  return h.pass(RSOCK_KERNEL(real().__poll_chk(p, n, timeout, plen)));
}

RSOCK_HOOK int ppoll(struct pollfd* p, nfds_t n, const struct timespec* t,
                     const sigset_t* s) noexcept {
  HookScope h;
  RSOCK_TRY_EMULATED(h, rsock::socket::poll_emulated(p, n, t, s));
  return h.pass(RSOCK_KERNEL(real().ppoll(p, n, t, s)));
}

RSOCK_HOOK int __ppoll_chk(struct pollfd* p, nfds_t n, const struct timespec* t,
                           const sigset_t* s, size_t plen) noexcept {
  HookScope h;
  if (n <= plen / sizeof(*p)) RSOCK_TRY_EMULATED(h, rsock::socket::poll_emulated(p, n, t, s));
  return h.pass(RSOCK_KERNEL(real().__ppoll_chk(p, n, t, s, plen)));
}

RSOCK_HOOK int select(int n, fd_set* r, fd_set* w, fd_set* e, struct timeval* t) noexcept {
  HookScope h;
  if (rsock::preload::t_depth == 1 && any_upgrades()) {
    timespec ts{}, *tp = nullptr;
    if (t) {
      ts = {t->tv_sec, t->tv_usec * 1000};
      tp = &ts;
    }
    auto res = rsock::socket::select_emulated(n, r, w, e, tp, nullptr);
    if (res.ok() || res.error() != kRedoPlain) {
      if (t) *t = {tp->tv_sec, tp->tv_nsec / 1000};  // Linux reports the time left
      return h.finish(res);
    }
  }
  return h.pass(RSOCK_KERNEL(real().select(n, r, w, e, t)));
}

RSOCK_HOOK int pselect(int n, fd_set* r, fd_set* w, fd_set* e, const struct timespec* t,
                       const sigset_t* s) noexcept {
  HookScope h;
  if (rsock::preload::t_depth == 1 && any_upgrades()) {
    timespec ts{}, *tp = nullptr;
    if (t) {
      ts = *t;
      tp = &ts;  // pselect leaves the caller's timeout alone
    }
    auto res = rsock::socket::select_emulated(n, r, w, e, tp, s);
    if (res.ok() || res.error() != kRedoPlain) return h.finish(res);
  }
  return h.pass(RSOCK_KERNEL(real().pselect(n, r, w, e, t, s)));
}

RSOCK_HOOK int epoll_create(int size) noexcept {
  HookScope h;
  int fd = real().epoll_create(size);
  if (fd >= 0) rsock::preload::forget(fd);
  if (fd >= 0) rsock::socket::epoll_created(fd);
  return h.pass(fd);
}

RSOCK_HOOK int epoll_create1(int flags) noexcept {
  HookScope h;
  int fd = real().epoll_create1(flags);
  if (fd >= 0) rsock::preload::forget(fd);
  if (fd >= 0) rsock::socket::epoll_created(fd);
  return h.pass(fd);
}

RSOCK_HOOK int epoll_ctl(int ep, int op, int fd, struct epoll_event* ev) noexcept {
  HookScope h;
  if (op == EPOLL_CTL_ADD) rsock::socket::listener_in_use(fd);  // a worker's event loop
  if (auto s = h.tracked(fd)) {
    // A socket that will never have a stream and has no registration of ours
    // is the kernel's alone (the common case without RDMA: no per-call work).
    bool plain_for_good = s->upgrade_decided.load(std::memory_order_acquire) && !s->stream() &&
                          s->epoll_regs.load(std::memory_order_acquire) == 0;
    if (!plain_for_good) {
      auto r = rsock::socket::epoll_ctl_tracked(ep, op, fd, ev);
      if (r.ok() || r.error() != kRedoPlain) return h.finish(r);
    }
  } else if (op != EPOLL_CTL_DEL && rsock::preload::t_depth == 1) {
    rsock::socket::epoll_observed(fd);  // an epoll instance nested in another
  }
  int r = real().epoll_ctl(ep, op, fd, ev);
  if (r == 0 && op == EPOLL_CTL_ADD) rsock::socket::epoll_kernel_added(ep);
  return h.pass(r);
}

namespace {

int epoll_common(HookScope& h, int ep, struct epoll_event* ev, int n, const timespec* t,
                 const sigset_t* s, int (*kernel)(int, struct epoll_event*, int, const timespec*,
                                                  const sigset_t*, int), int ms) {
  if (rsock::preload::t_depth == 1 && any_upgrades()) {
    auto r = rsock::socket::epoll_wait_emulated(ep, ev, n, t, s);
    if (r.ok() || r.error() != kRedoPlain) return h.finish(r);
  }
  int r = RSOCK_KERNEL(kernel(ep, ev, n, t, s, ms));
  if (r > 0) r = rsock::socket::epoll_filter_internal(ep, ev, r);
  return h.pass(r);
}

int kernel_wait(int ep, struct epoll_event* ev, int n, const timespec*, const sigset_t* s, int ms) {
  return s ? real().epoll_pwait(ep, ev, n, ms, s) : real().epoll_wait(ep, ev, n, ms);
}

int kernel_wait2(int ep, struct epoll_event* ev, int n, const timespec* t, const sigset_t* s, int) {
  return real().epoll_pwait2(ep, ev, n, t, s);
}

}  // namespace

RSOCK_HOOK int epoll_wait(int ep, struct epoll_event* ev, int n, int timeout) noexcept {
  HookScope h;
  timespec ts = ms_to_ts(timeout);
  return epoll_common(h, ep, ev, n, timeout < 0 ? nullptr : &ts, nullptr, kernel_wait, timeout);
}

RSOCK_HOOK int epoll_pwait(int ep, struct epoll_event* ev, int n, int timeout,
                           const sigset_t* s) noexcept {
  HookScope h;
  timespec ts = ms_to_ts(timeout);
  return epoll_common(h, ep, ev, n, timeout < 0 ? nullptr : &ts, s,
                      [](int e, struct epoll_event* v, int k, const timespec*, const sigset_t* m,
                         int ms) { return real().epoll_pwait(e, v, k, ms, m); },
                      timeout);
}

RSOCK_HOOK int epoll_pwait2(int ep, struct epoll_event* ev, int n, const struct timespec* t,
                            const sigset_t* s) noexcept {
  HookScope h;
  return epoll_common(h, ep, ev, n, t, s, kernel_wait2, 0);
}
