// Hooks: socket lifecycle, addresses and options. Everything runs on the real
// kernel socket (TCP first); these hooks only keep the fd table in step.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cstring>
#include <fcntl.h>

#include "preload/hook.h"
#include "preload/librsock.h"
#include "socket/process.h"
#include "socket/readiness.h"
#include "socket/rendezvous.h"
#include "util/stats.h"

using rsock::preload::HookScope;
using rsock::preload::real;
using rsock::preload::track_new;
using rsock::socket::Role;

namespace rsock::preload {

void track_new(int fd, int domain, Role role, bool nonblocking, bool default_timeouts) {
  if (!socket::tracking_enabled()) return;  // invalid config: hands off
  socket::FdTable* t = socket::FdTable::get_or_create();
  if (!t) return;  // no memory for the table: the socket stays plain TCP
  socket::SocketRef s(socket::new_socket(domain, role, nonblocking));
  if (!s) {
    t->remove(fd);
    return;
  }
  s->set_default_timeouts(default_timeouts);
  t->install(fd, s.get());
}

// Listening sockets inherited across exec (or created before we were loaded)
// are adopted at their first accept, so their connections are tracked too.
static socket::SocketRef adopt_listener(int fd) {
  int domain = socket::tracked_domain(fd);
  if (domain == 0) return {};
  track_new(fd, domain, Role::kListener, false);
  return socket::lookup(fd);
}

void adopt_received_fds(const struct msghdr* m) {
  if (m == nullptr || m->msg_controllen == 0 || m->msg_control == nullptr) return;
  for (cmsghdr* c = CMSG_FIRSTHDR(m); c != nullptr; c = CMSG_NXTHDR(const_cast<msghdr*>(m), c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; i++) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      int domain = socket::tracked_domain(fd), listening = 0;
      socklen_t len = sizeof listening;
      if (domain == 0 ||
          real().getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0) {
        forget(fd);  // a stale slot from a close we could not see
        continue;
      }
      int fl = real().fcntl(fd, F_GETFL);
      const bool nonblocking = fl >= 0 && (fl & O_NONBLOCK);
      if (listening) {
        // A listener another process holds too (a master handing its
        // listeners over): serve its rdma_cm side through the port's named
        // table, as listen() on it would.
        track_new(fd, domain, Role::kListener, nonblocking);
        if (auto s = socket::lookup(fd)) {
          s->received.store(true, std::memory_order_relaxed);
          socket::listener_started(s.get(), fd, /*shared=*/true);
          s->upgrade_decided.store(true, std::memory_order_release);
        }
        continue;
      }
      sockaddr_storage peer{};
      socklen_t pl = sizeof peer;
      if (real().getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0) {
        // Not connected: a bound socket the receiver will listen() on (Node's
        // cluster in its shared-handle mode) or connect() with.
        track_new(fd, domain, Role::kUnknown, nonblocking);
        if (auto s = socket::lookup(fd)) s->received.store(true, std::memory_order_relaxed);
        continue;
      }
      track_new(fd, domain, Role::kAccepted, nonblocking);
      if (auto s = socket::lookup(fd)) {
        s->open_stats(fd, stats::Direction::kServer, nullptr, nullptr, true);
        socket::adopt_passed(s.get(), fd);  // its sender may have left it to upgrade here
      }
    }
  }
}

static int accept_common(HookScope& h, int fd, int r, int flags) {
  if (r < 0) return r;
  socket::SocketRef l = h.tracked(fd);
  if (!l && t_depth == 1) l = adopt_listener(fd);
  if (l) {
    track_new(r, l->domain(), Role::kAccepted, flags & SOCK_NONBLOCK, l->default_timeouts());
    if (auto s = socket::lookup(r)) {
      // Both addresses once, for the stats and the upgrade (each syscall
      // costs tens of microseconds in the TCG guests). (Not the peer's from
      // the program's accept() buffer: its length read before the call would
      // turn the kernel's EFAULT for a bad pointer into a crash, and another
      // thread of the program may reuse the buffer before we read it.)
      sockaddr_storage local{}, peer{};
      socklen_t ll = sizeof local, pl = sizeof peer;
      const bool known = real().getsockname(r, reinterpret_cast<sockaddr*>(&local), &ll) == 0 &&
                         real().getpeername(r, reinterpret_cast<sockaddr*>(&peer), &pl) == 0;
      s->open_stats(r, stats::Direction::kServer, known ? reinterpret_cast<sockaddr*>(&local) : nullptr,
                    known ? reinterpret_cast<sockaddr*>(&peer) : nullptr, true);
      socket::start_server_upgrade(l.get(), s.get(), r, known ? &local : nullptr,
                                   known ? &peer : nullptr);
      s->upgrade_decided.store(true, std::memory_order_release);
    }
  } else {
    forget(r);
  }
  return h.pass(r);
}

// getsockopt(SOL_RSOCK, RSOCK_TRANSPORT) of a tracked socket (preload/librsock.h).
// SO_RCVTIMEO / SO_SNDTIMEO in either of their kernel forms (32- and 64-bit
// time; glibc picks one by its time_t size).
static bool is_timeout_opt(int opt) {
  if (opt == SO_RCVTIMEO || opt == SO_SNDTIMEO) return true;
#if defined(SO_RCVTIMEO_OLD) && defined(SO_RCVTIMEO_NEW)
  if (opt == SO_RCVTIMEO_OLD || opt == SO_RCVTIMEO_NEW || opt == SO_SNDTIMEO_OLD ||
      opt == SO_SNDTIMEO_NEW)
    return true;
#endif
  return false;
}

static Status<void> transport_of(const socket::SocketRef& s, void* val, socklen_t* len) {
  if (!val || !len) return Err(EFAULT);
  if (*len < sizeof(int)) return Err(EINVAL);
  int t = RSOCK_TRANSPORT_TCP;
  if (socket::Stream* st = s->stream()) {
    switch (st->phase()) {
      case socket::Phase::kPending:
      case socket::Phase::kSwitching: t = RSOCK_TRANSPORT_UPGRADING; break;
      case socket::Phase::kRdma: t = RSOCK_TRANSPORT_RDMA; break;
      case socket::Phase::kBroken: t = RSOCK_TRANSPORT_BROKEN; break;
      case socket::Phase::kReverting: t = RSOCK_TRANSPORT_REVERTING; break;
      case socket::Phase::kPlain: break;
    }
  }
  *static_cast<int*>(val) = t;
  *len = sizeof(int);
  return {};
}

// getsockopt(SOL_RSOCK, RSOCK_FALLBACK_REASON) of a tracked socket.
static Status<void> fallback_of(const socket::SocketRef& s, void* val, socklen_t* len) {
  if (!val || !len) return Err(EFAULT);
  if (*len < sizeof(int)) return Err(EINVAL);
  int code = static_cast<int>(s->fallback());
  if (socket::Stream* st = s->stream())
    if (uint16_t c = st->fallback_code()) code = c;
  *static_cast<int*>(val) = code;
  *len = sizeof(int);
  return {};
}

// getsockopt(SOL_RSOCK, RSOCK_BYTES) of a tracked socket: its stats slot's counters.
static Status<void> bytes_of(const socket::SocketRef& s, void* val, socklen_t* len) {
  if (!val || !len) return Err(EFAULT);
  if (*len < sizeof(rsock_bytes)) return Err(EINVAL);
  const stats::ConnSlot* c = s->slot();
  if (c == nullptr) return Err(ENOPROTOOPT);
  constexpr int kTcp = int(stats::Transport::kTcp), kRdma = int(stats::Transport::kRdma);
  rsock_bytes b{c->traffic.tx_bytes[kTcp].load(std::memory_order_relaxed),
                c->traffic.rx_bytes[kTcp].load(std::memory_order_relaxed),
                c->traffic.tx_bytes[kRdma].load(std::memory_order_relaxed),
                c->traffic.rx_bytes[kRdma].load(std::memory_order_relaxed)};
  std::memcpy(val, &b, sizeof b);
  *len = sizeof b;
  return {};
}

}  // namespace rsock::preload

RSOCK_HOOK int socket(int domain, int type, int protocol) noexcept {
  HookScope h;
  int fd = real().socket(domain, type, protocol);
  if (fd < 0) return fd;
  // Sockets librsock's own code opens (depth > 1) are never the application's.
  if (rsock::preload::t_depth == 1 && rsock::socket::is_tracked_kind(domain, type, protocol))
    track_new(fd, domain, Role::kUnknown, type & SOCK_NONBLOCK, /*default_timeouts=*/true);
  else
    rsock::preload::forget(fd);
  return h.pass(fd);
}

RSOCK_HOOK int socketpair(int domain, int type, int protocol, int sv[2]) noexcept {
  HookScope h;
  int r = real().socketpair(domain, type, protocol, sv);
  if (r == 0) rsock::preload::forget(sv[0]), rsock::preload::forget(sv[1]);
  return h.pass(r);
}

RSOCK_HOOK int bind(int fd, const struct sockaddr* addr, socklen_t len) noexcept {
  HookScope h;
  return h.pass(real().bind(fd, addr, len));
}

RSOCK_HOOK int listen(int fd, int backlog) noexcept {
  HookScope h;
  int r = real().listen(fd, backlog);
  if (auto s = h.tracked(fd); s && r == 0) {
    s->set_role(Role::kListener);
    rsock::socket::listener_started(s.get(), fd, s->received.load(std::memory_order_relaxed));
    s->upgrade_decided.store(true, std::memory_order_release);
  }
  return h.pass(r);
}

RSOCK_HOOK int accept(int fd, struct sockaddr* addr, socklen_t* len) noexcept {
  HookScope h;
  rsock::socket::listener_in_use(fd);  // before it blocks: see rendezvous.h
  return rsock::preload::accept_common(h, fd, RSOCK_KERNEL(real().accept(fd, addr, len)), 0);
}

RSOCK_HOOK int accept4(int fd, struct sockaddr* addr, socklen_t* len, int flags) noexcept {
  HookScope h;
  rsock::socket::listener_in_use(fd);
  return rsock::preload::accept_common(h, fd, RSOCK_KERNEL(real().accept4(fd, addr, len, flags)), flags);
}

RSOCK_HOOK int connect(int fd, const struct sockaddr* addr, socklen_t len) noexcept {
  HookScope h;
  auto s = h.tracked(fd);
  int r = RSOCK_KERNEL(real().connect(fd, addr, len));
  if (s && (r == 0 || errno == EINPROGRESS)) {
    int saved = errno;
    s->set_role(Role::kClient);
    // The local address once, for the stats and the upgrade (a blocking
    // connect is established: the peer is `addr`).
    sockaddr_storage local{};
    socklen_t ll = sizeof local;
    bool have_local = real().getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) == 0;
    s->open_stats(fd, rsock::stats::Direction::kClient,
                  have_local ? reinterpret_cast<sockaddr*>(&local) : nullptr, addr, r == 0);
    if (rsock::socket::start_client_upgrade(s.get(), fd, addr, have_local ? &local : nullptr))
      rsock::socket::epoll_take_over(fd);  // registered before connect()
    s->upgrade_decided.store(true, std::memory_order_release);
    errno = saved;  // EINPROGRESS must reach the application
  }
  return h.pass(r);
}

RSOCK_HOOK int shutdown(int fd, int how) noexcept {
  HookScope h;
  if (auto s = h.tracked(fd)) {
    if (auto* st = rsock::preload::governing(s)) {
      auto r = st->shutdown(how);
      if (r.ok() || r.error() != rsock::socket::kRedoPlain) return h.finish(r);
    }
  }
  return h.pass(real().shutdown(fd, how));
}

// TCP_NODELAY of a socket with a stream, set or read while no switch
// record's push toggles it (Stream::push_tcp).
namespace {
template <class Call>
int nodelay_call(HookScope& h, int fd, Call call) {
  auto s = h.tracked(fd);
  auto* st = s ? s->stream() : nullptr;
  if (st == nullptr) return h.pass(call());
  const bool taken = st->lock_nodelay();
  int r = call();
  st->unlock_nodelay(taken);
  return h.pass(r);
}
}  // namespace

RSOCK_HOOK int setsockopt(int fd, int level, int opt, const void* val, socklen_t len) noexcept {
  HookScope h;
  if (level == SOL_RSOCK && (opt == RSOCK_REVERT || opt == RSOCK_DEBUG_FAIL_PATH)) {
    if (auto s = h.tracked(fd)) {
      if (auto* st = s->stream()) {
        if (opt == RSOCK_REVERT) st->revert(rsock::socket::RevertMode::kKeep,
                                            rsock::stats::FallbackReason::kReleased);
        else st->debug_fail_path();
      }
      return h.finish(rsock::Status<void>{});
    }
  }
  if (level == IPPROTO_TCP && opt == TCP_NODELAY) return nodelay_call(h, fd, [&] {
    return real().setsockopt(fd, level, opt, val, len);
  });
  // Not known from now on (before the kernel call: an accept() meanwhile
  // must not take the listener's timeouts as none).
  const bool timeo = level == SOL_SOCKET && rsock::preload::is_timeout_opt(opt);
  rsock::socket::SocketRef s;
  if (timeo && (s = h.tracked(fd))) s->set_default_timeouts(false);
  int r = real().setsockopt(fd, level, opt, val, len);
  // An upgraded socket's blocking calls keep its timeouts (Stream::socket_timeout).
  if (s) {
    std::atomic_thread_fence(std::memory_order_seq_cst);  // (see publish_stream)
    if (auto* st = s->stream(); st && r == 0) st->timeouts_changed();
  }
  return h.pass(r);
}

RSOCK_HOOK int getsockopt(int fd, int level, int opt, void* val, socklen_t* len) noexcept {
  HookScope h;
  if (level == SOL_RSOCK && opt == RSOCK_TRANSPORT)
    if (auto s = h.tracked(fd)) return h.finish(rsock::preload::transport_of(s, val, len));
  if (level == SOL_RSOCK && opt == RSOCK_FALLBACK_REASON)
    if (auto s = h.tracked(fd)) return h.finish(rsock::preload::fallback_of(s, val, len));
  if (level == SOL_RSOCK && opt == RSOCK_BYTES)
    if (auto s = h.tracked(fd)) return h.finish(rsock::preload::bytes_of(s, val, len));
  // SO_ERROR of an upgraded socket: a reset that came over RDMA.
  if (level == SOL_SOCKET && opt == SO_ERROR && val && len && *len >= sizeof(int)) {
    if (auto s = h.tracked(fd)) {
      if (auto* st = rsock::preload::governing(s)) {
        if (int e = st->take_error()) {
          *static_cast<int*>(val) = e > 0 ? e : 0;
          *len = sizeof(int);
          return h.pass(0);
        }
      }
    }
  }
  if (level == IPPROTO_TCP && opt == TCP_NODELAY) return nodelay_call(h, fd, [&] {
    return real().getsockopt(fd, level, opt, val, len);
  });
  return h.pass(real().getsockopt(fd, level, opt, val, len));
}

RSOCK_HOOK int getsockname(int fd, struct sockaddr* addr, socklen_t* len) noexcept {
  HookScope h;
  return h.pass(real().getsockname(fd, addr, len));
}

RSOCK_HOOK int getpeername(int fd, struct sockaddr* addr, socklen_t* len) noexcept {
  HookScope h;
  return h.pass(real().getpeername(fd, addr, len));
}
