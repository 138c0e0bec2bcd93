// Hooks: the read/write/send/recv family, including the iovec, msg, mmsg,
// sendfile and _FORTIFY_SOURCE (__*_chk) variants real binaries call.
// On a tracked socket the kernel still carries the bytes (TCP first); the
// hook counts them. Untracked fds cost one table load.
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <pthread.h>
#include <unistd.h>

#include <cstring>

#include "preload/hook.h"
#include "socket/process.h"
#include "socket/stream.h"
#include "util/clock.h"
#include "socket/readiness.h"

using rsock::preload::HookScope;
using rsock::preload::real;


namespace rsock::preload {

ssize_t mmsg_bytes(const struct mmsghdr* m, int n) {
  ssize_t total = 0;
  for (int i = 0; i < n; i++) total += m[i].msg_len;
  return total;
}

// One body for both directions: the stream call differs, and a send that
// hits EPIPE raises SIGPIPE unless MSG_NOSIGNAL, as the kernel would.
template <bool kSend>
static bool stream_io(HookScope& h, const socket::SocketRef& s, std::span<const iovec> iov,
                      int flags, ssize_t* out) {
  socket::Stream* st = governing(s);
  if (!st) return false;
  if (iov.size() > UIO_MAXIOV) {
    *out = h.finish(Status<ssize_t>(Err(EMSGSIZE)));
    return true;
  }
  bool nonblock = s->nonblocking() || (flags & MSG_DONTWAIT);
  auto r = kSend ? st->send(iov, flags, nonblock) : st->recv(iov, flags, nonblock);
  if (!r && r.error() == socket::kRedoPlain) return false;
  socket::readiness_after_io(s.get());
  if (kSend && !r && r.error() == EPIPE && !(flags & MSG_NOSIGNAL))
    pthread_kill(pthread_self(), SIGPIPE);
  *out = r ? h.finish(Status<ssize_t>(ssize_t(*r))) : h.finish(Status<ssize_t>(Err(r.error())));
  return true;
}

bool stream_recv(HookScope& h, const socket::SocketRef& s, std::span<const iovec> iov, int flags,
                 ssize_t* out) {
  return stream_io<false>(h, s, iov, flags, out);
}

bool stream_send(HookScope& h, const socket::SocketRef& s, std::span<const iovec> iov, int flags,
                 ssize_t* out) {
  return stream_io<true>(h, s, iov, flags, out);
}

// sendfile onto an upgraded socket: read the file ourselves, then send.
// `off` null: the file position moves by exactly what was sent.
static bool stream_sendfile(HookScope& h, const socket::SocketRef& s, int in, off64_t* off,
                            size_t n, ssize_t* out) {
  if (!governing(s)) return false;
  char buf[64 * 1024];
  size_t want = n < sizeof buf ? n : sizeof buf;
  ssize_t got = off ? pread64(in, buf, want, *off) : real().read(in, buf, want);
  if (got <= 0) {
    *out = got;  // errno from pread/read, 0 at end of file
    return true;
  }
  iovec v{buf, size_t(got)};
  ssize_t sent = 0;
  if (!stream_send(h, s, {&v, 1}, 0, &sent)) return false;
  int saved = errno;
  if (sent >= 0 && off) *off += sent;
  if (!off) lseek64(in, sent < 0 ? -got : sent - got, SEEK_CUR);  // give back the unsent rest
  errno = saved;
  *out = sent;
  return true;
}

}  // namespace rsock::preload

using rsock::preload::stream_recv;
using rsock::preload::stream_send;

// A hook body: an upgraded socket goes through its stream (`via`, which may
// decline when the stream just fell back), a tracked one to the kernel with
// counting, anything else straight to the kernel.
#define RSOCK_IO_HOOK(ret, name, params, fd, io, via, call) \
  RSOCK_HOOK ret name params noexcept {                    \
    HookScope h;                                           \
    if (auto s = h.tracked(fd)) {                          \
      ssize_t out;                                         \
      if (via) return static_cast<ret>(out);               \
      return h.io(s, real().call);                         \
    }                                                      \
    return real().call;                                    \
  }
#define RX1(b, n, f) ({ iovec v_{b, n}; stream_recv(h, s, {&v_, 1}, f, &out); })
#define TX1(b, n, f) ({ iovec v_{const_cast<void*>(static_cast<const void*>(b)), n}; \
                        stream_send(h, s, {&v_, 1}, f, &out); })
// readv/writev: a bad count is the kernel's EINVAL (let it say so); the
// msg variants' EMSGSIZE comes from stream_recv/stream_send.
#define RXV(v, n, f) (n >= 0 && n <= UIO_MAXIOV && stream_recv(h, s, {v, size_t(n)}, f, &out))
#define TXV(v, n, f) (n >= 0 && n <= UIO_MAXIOV && stream_send(h, s, {v, size_t(n)}, f, &out))
#define RSOCK_RX_HOOK(ret, name, params, fd, via, call) RSOCK_IO_HOOK(ret, name, params, fd, io_rx, via, call)
#define RSOCK_TX_HOOK(ret, name, params, fd, via, call) RSOCK_IO_HOOK(ret, name, params, fd, io_tx, via, call)

// recvfrom/recvmsg on a connected TCP socket report no address, like Linux.
static void no_name(struct sockaddr* a, socklen_t* l) {
  if (a && l) *l = 0;
}
static bool recvmsg_via(HookScope& h, const rsock::socket::SocketRef& s, struct msghdr* m, int f,
                        ssize_t* out) {
  if (!rsock::preload::stream_recv(h, s, {m->msg_iov, m->msg_iovlen}, f, out)) return false;
  m->msg_namelen = 0;
  m->msg_controllen = 0;
  m->msg_flags = 0;
  return true;
}

// The __*_chk variants: an oversized length goes to libc, which aborts
// (__chk_fail) before touching anything.
RSOCK_RX_HOOK(ssize_t, read, (int fd, void* b, size_t n), fd, RX1(b, n, 0), read(fd, b, n))
RSOCK_RX_HOOK(ssize_t, __read_chk, (int fd, void* b, size_t n, size_t bl), fd,
              n <= bl && RX1(b, n, 0), __read_chk(fd, b, n, bl))
RSOCK_RX_HOOK(ssize_t, readv, (int fd, const struct iovec* v, int n), fd, RXV(v, n, 0),
              readv(fd, v, n))
RSOCK_RX_HOOK(ssize_t, recv, (int fd, void* b, size_t n, int f), fd, RX1(b, n, f),
              recv(fd, b, n, f))
RSOCK_RX_HOOK(ssize_t, __recv_chk, (int fd, void* b, size_t n, size_t bl, int f), fd,
              n <= bl && RX1(b, n, f), __recv_chk(fd, b, n, bl, f))
RSOCK_RX_HOOK(ssize_t, recvfrom,
              (int fd, void* b, size_t n, int f, struct sockaddr* a, socklen_t* l), fd,
              RX1(b, n, f) && (no_name(a, l), true), recvfrom(fd, b, n, f, a, l))
RSOCK_RX_HOOK(ssize_t, __recvfrom_chk,
              (int fd, void* b, size_t n, size_t bl, int f, struct sockaddr* a, socklen_t* l),
              fd, n <= bl && RX1(b, n, f) && (no_name(a, l), true),
              __recvfrom_chk(fd, b, n, bl, f, a, l))
RSOCK_HOOK ssize_t recvmsg(int fd, struct msghdr* m, int f) noexcept {
  HookScope h;
  if (auto s = h.tracked(fd)) {
    ssize_t out;
    if (recvmsg_via(h, s, m, f, &out)) return out;
    return h.io_rx(s, real().recvmsg(fd, m, f));
  }
  ssize_t r = real().recvmsg(fd, m, f);
  if (r >= 0 && m != nullptr && m->msg_controllen > 0 && h.outermost())
    rsock::preload::adopt_received_fds(m);
  return h.pass(r);
}

// Batched calls on an upgraded socket: the first message may block, the rest
// only take what is there (as the kernel does for TCP).
template <bool kRecv>
static bool mmsg_via(HookScope& h, const rsock::socket::SocketRef& s, struct mmsghdr* m,
                     unsigned n, int f, int* out) {
  if (!rsock::preload::governing(s)) return false;
  int done = 0;
  for (unsigned i = 0; i < n; i++) {
    ssize_t r = 0;
    auto& mh = m[i].msg_hdr;
    int fl = i ? (f | MSG_DONTWAIT) : f;
    bool ok = kRecv ? stream_recv(h, s, {mh.msg_iov, mh.msg_iovlen}, fl, &r)
                    : stream_send(h, s, {mh.msg_iov, mh.msg_iovlen}, fl, &r);
    if (!ok) return done ? (*out = done, true) : false;
    if (r < 0) break;
    m[i].msg_len = unsigned(r);
    done++;
    if (r == 0) break;
  }
  *out = done ? h.finish(rsock::Status<int>(done)) : -1;
  return true;
}

RSOCK_HOOK int recvmmsg(int fd, struct mmsghdr* m, unsigned n, int f, struct timespec* t) noexcept {
  HookScope h;
  if (auto s = h.tracked(fd)) {
    int out;
    if (mmsg_via<true>(h, s, m, n, f, &out)) return out;
  }
  int r = real().recvmmsg(fd, m, n, f, t);
  if (auto s = h.tracked(fd); s && r > 0) s->on_tcp_rx(rsock::preload::mmsg_bytes(m, r));
  return h.pass(r);
}

// Send side ------------------------------------------------------------------
RSOCK_TX_HOOK(ssize_t, write, (int fd, const void* b, size_t n), fd, TX1(b, n, 0),
              write(fd, b, n))
RSOCK_TX_HOOK(ssize_t, writev, (int fd, const struct iovec* v, int n), fd, TXV(v, n, 0),
              writev(fd, v, n))
RSOCK_TX_HOOK(ssize_t, send, (int fd, const void* b, size_t n, int f), fd, TX1(b, n, f),
              send(fd, b, n, f))
// A destination on a connected TCP socket is ignored by Linux too.
RSOCK_TX_HOOK(ssize_t, sendto,
              (int fd, const void* b, size_t n, int f, const struct sockaddr* a, socklen_t l),
              fd, TX1(b, n, f), sendto(fd, b, n, f, a, l))
// fd passing: an upgraded socket sent with SCM_RIGHTS switches back to TCP
// first (the reverse switch), so the receiving process gets a plain TCP
// socket it can use, and may upgrade again. Only messages with ancillary
// data pay for the look.
static void hand_off_passed_fds(HookScope& h, const struct msghdr* m) {
  if (m == nullptr || m->msg_controllen == 0 || m->msg_control == nullptr) return;
  uint64_t deadline = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(m); c != nullptr; c = CMSG_NXTHDR(const_cast<msghdr*>(m), c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const int* fds = reinterpret_cast<const int*>(CMSG_DATA(c));
    for (size_t i = 0; i < n; i++) {
      int pfd;
      std::memcpy(&pfd, fds + i, sizeof pfd);
      auto s = h.tracked(pfd);
      if (!s) continue;
      rsock::socket::Stream* st = s->stream();
      if (st == nullptr || (st->phase() != rsock::socket::Phase::kRdma &&
                            st->phase() != rsock::socket::Phase::kReverting))
        continue;
      if (deadline == 0)
        deadline = rsock::now_ns() +
                   uint64_t{rsock::socket::process_config().tunables.upgrade_timeout_ms} * 1000000;
      (void)st->hand_off(deadline);
    }
  }
}

RSOCK_HOOK ssize_t sendmsg(int fd, const struct msghdr* m, int f) noexcept {
  HookScope h;
  if (auto s = h.tracked(fd)) {
    ssize_t out;
    if (stream_send(h, s, {m->msg_iov, m->msg_iovlen}, f, &out)) return out;
    return h.io_tx(s, real().sendmsg(fd, m, f));
  }
  hand_off_passed_fds(h, m);
  return real().sendmsg(fd, m, f);
}
RSOCK_TX_HOOK(ssize_t, sendfile, (int o, int in, off_t* off, size_t n), o,
              rsock::preload::stream_sendfile(h, s, in, reinterpret_cast<off64_t*>(off), n, &out),
              sendfile(o, in, off, n))
RSOCK_TX_HOOK(ssize_t, sendfile64, (int o, int in, off64_t* off, size_t n), o,
              rsock::preload::stream_sendfile(h, s, in, off, n, &out), sendfile64(o, in, off, n))

RSOCK_HOOK int sendmmsg(int fd, struct mmsghdr* m, unsigned n, int f) noexcept {
  HookScope h;
  if (auto s = h.tracked(fd)) {
    int out;
    if (mmsg_via<false>(h, s, m, n, f, &out)) return out;
  } else if (m != nullptr) {
    for (unsigned i = 0; i < n; i++) hand_off_passed_fds(h, &m[i].msg_hdr);
  }
  int r = real().sendmmsg(fd, m, n, f);
  if (auto s = h.tracked(fd); s && r > 0) s->on_tcp_tx(rsock::preload::mmsg_bytes(m, r));
  return h.pass(r);
}
