// Hooks: the read/write/send/recv family, including the iovec, msg, mmsg,
// sendfile and _FORTIFY_SOURCE (__*_chk) variants real binaries call.
// On a tracked socket the kernel still carries the bytes (TCP first); the
// hook counts them. Untracked fds cost one table load.
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "preload/hook.h"
#include "socket/rendezvous.h"
#include "socket/process.h"
#include "socket/stream.h"
#include "util/clock.h"
#include "util/profile.h"
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
  bool done;
  {
    profile::Scope timed(profile::Probe::kRecv);
    done = stream_io<false>(h, s, iov, flags, out);
  }
  if (done && *out == 0) profile::dump();  // (profiling builds only)
  return done;
}

bool stream_send(HookScope& h, const socket::SocketRef& s, std::span<const iovec> iov, int flags,
                 ssize_t* out) {
  profile::Scope timed(profile::Probe::kSend);
  return stream_io<true>(h, s, iov, flags, out);
}

// The stream's scratch buffer, or null with ENOMEM reported in *res.
static char* scratch_buf(HookScope& h, const socket::Stream::Scratch& sc, ssize_t* res) {
  if (sc.buf().empty()) {
    *res = h.finish(Status<ssize_t>(Err(ENOMEM)));
    return nullptr;
  }
  return reinterpret_cast<char*>(sc.buf().data());
}

// sendfile onto an upgraded socket: read the file into the stream's scratch
// buffer, then send. `off` null: the file position moves by exactly what was
// sent.
static bool stream_sendfile(HookScope& h, const socket::SocketRef& s, int in, off64_t* off,
                            size_t n, ssize_t* out) {
  socket::Stream* st = governing(s);
  if (!st) return false;
  socket::Stream::Scratch sc(*st);
  char* buf = scratch_buf(h, sc, out);
  if (!buf) return true;
  size_t want = std::min(n, sc.buf().size());
  ssize_t got = off ? pread64(in, buf, want, *off) : real().read(in, buf, want);
  if (got <= 0) {
    *out = got;  // errno from pread/read, 0 at end of file
    return true;
  }
  iovec v{buf, size_t(got)};
  ssize_t sent = 0;
  if (!stream_send(h, s, {&v, 1}, 0, &sent)) {
    // Fell back to TCP: the kernel's sendfile sends from the position we read from.
    if (!off) lseek64(in, -got, SEEK_CUR);
    return false;
  }
  int saved = errno;
  if (sent >= 0 && off) *off += sent;
  if (!off) lseek64(in, sent < 0 ? -got : sent - got, SEEK_CUR);  // give back the unsent rest
  errno = saved;
  *out = sent;
  return true;
}

// splice with an upgraded socket at one end. The kernel would move the TCP
// socket's own bytes, past librsock: the switch marker, or nothing at all
// while the data travels over RDMA. So the bytes go through the stream, by
// copy. Socket to pipe: peek what the stream has, write what the pipe takes,
// then consume exactly that. Pipe to socket: read from the pipe only what
// the stream takes now (bytes taken from a pipe cannot go back). tee and
// vmsplice accept pipes only, so they never see a socket: no hooks.
// The copy goes through the stream's scratch buffer (hooks keep their stack
// frames small), at most 64 KiB per call: splice may move less than asked.

static bool is_pipe(int fd) {
  struct stat sb;
  return fstat(fd, &sb) == 0 && S_ISFIFO(sb.st_mode);
}

// The pipe side may not block when SPLICE_F_NONBLOCK is set, whatever its
// O_NONBLOCK: look first (a pipe that polls writable takes PIPE_BUF bytes).
static bool pipe_ready(int fd, short ev) {
  pollfd p{fd, ev, 0};
  return real().poll(&p, 1, 0) == 1 && (p.revents & ev);
}

static bool stream_splice_out(HookScope& h, const socket::SocketRef& s, loff_t* off_in, int out,
                              loff_t* off_out, size_t n, unsigned flags, ssize_t* res) {
  socket::Stream* st = governing(s);
  if (!st) return false;
  if (off_in != nullptr || off_out != nullptr || !is_pipe(out)) return false;  // the kernel's error
  // Like the kernel's: the socket side blocks unless O_NONBLOCK;
  // SPLICE_F_NONBLOCK is about the pipe side.
  const bool nb = s->nonblocking();
  if (n == 0) {
    *res = 0;
    return true;
  }
  socket::Stream::Scratch sc(*st);
  char* buf = scratch_buf(h, sc, res);
  if (!buf) return true;
  size_t want = std::min(n, sc.buf().size());
  if (flags & SPLICE_F_NONBLOCK) {
    if (!pipe_ready(out, POLLOUT)) {
      *res = h.finish(Status<ssize_t>(Err(EAGAIN)));
      return true;
    }
    want = std::min<size_t>(want, PIPE_BUF);
  }
  iovec v{buf, want};
  auto r = st->recv({&v, 1}, MSG_PEEK, nb);
  if (!r && r.error() == socket::kRedoPlain) return false;
  if (!r || *r == 0) {
    *res = r ? 0 : h.finish(Status<ssize_t>(Err(r.error())));
    return true;
  }
  ssize_t w = real().write(out, buf, *r);
  if (w <= 0) {
    *res = h.pass(w);  // the pipe's errno
    return true;
  }
  iovec c{buf, size_t(w)};
  auto k = st->recv({&c, 1}, 0, true);  // the bytes just peeked: there
  socket::readiness_after_io(s.get());
  *res = k ? ssize_t(*k) : h.finish(Status<ssize_t>(Err(k.error())));
  return true;
}

static bool stream_splice_in(HookScope& h, int in, loff_t* off_in, const socket::SocketRef& s,
                             int out, loff_t* off_out, size_t n, unsigned flags, ssize_t* res) {
  socket::Stream* st = governing(s);
  if (!st) return false;
  if (off_in != nullptr || off_out != nullptr || !is_pipe(in)) return false;
  // Like the kernel's: the socket side blocks unless O_NONBLOCK;
  // SPLICE_F_NONBLOCK is about the pipe side.
  const bool nb = s->nonblocking();
  if (n == 0) {
    *res = 0;
    return true;
  }
  socket::Stream::Scratch sc(*st);
  char* buf = scratch_buf(h, sc, res);
  if (!buf) return true;
  size_t want = std::min(n, sc.buf().size());
  if (nb) {
    auto room = st->send_room();
    if (!room && room.error() == socket::kRedoPlain) return false;
    if (!room || *room == 0) {
      int e = room ? EAGAIN : room.error();
      if (e == EPIPE) pthread_kill(pthread_self(), SIGPIPE);  // as the kernel's splice
      *res = h.finish(Status<ssize_t>(Err(e)));
      return true;
    }
    want = std::min(want, *room);
  }
  if ((flags & SPLICE_F_NONBLOCK) && !pipe_ready(in, POLLIN)) {  // whatever the socket's mode
    *res = h.finish(Status<ssize_t>(Err(EAGAIN)));
    return true;
  }
  ssize_t got = real().read(in, buf, want);
  if (got <= 0) {
    *res = h.pass(got);  // the pipe's errno, or 0: no writer left
    return true;
  }
  // What was read must all go: a nonblocking send that takes less (another
  // writer took the room) is finished blocking; a stream that fell back to
  // TCP meanwhile gets the rest through the kernel.
  size_t sent = 0;
  bool first = true;
  int err = 0;
  while (sent < size_t(got)) {
    iovec v{buf + sent, size_t(got) - sent};
    auto r = st->send({&v, 1}, MSG_NOSIGNAL, nb && first);
    first = false;
    if (!r && r.error() == socket::kRedoPlain) {
      ssize_t k = real().send(out, buf + sent, size_t(got) - sent, MSG_NOSIGNAL);
      if (k > 0) {
        s->on_tcp_tx(k);
        sent += size_t(k);
        continue;
      }
      if (k < 0 && errno == EAGAIN) {
        pollfd p{out, POLLOUT, 0};
        real().poll(&p, 1, -1);
        continue;
      }
      err = k < 0 ? errno : EPIPE;
      break;
    }
    if (!r && r.error() == EAGAIN) continue;  // the first, nonblocking try
    if (!r) {
      err = r.error();
      break;
    }
    sent += *r;
  }
  socket::readiness_after_io(s.get());
  if (err == EPIPE) pthread_kill(pthread_self(), SIGPIPE);
  *res = sent > 0 ? h.finish(Status<ssize_t>(ssize_t(sent))) : h.finish(Status<ssize_t>(Err(err)));
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
      return h.io(s, RSOCK_KERNEL(real().call));           \
    }                                                      \
    return RSOCK_KERNEL(real().call);                      \
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
    return h.io_rx(s, RSOCK_KERNEL(real().recvmsg(fd, m, f)));
  }
  ssize_t r = RSOCK_KERNEL(real().recvmsg(fd, m, f));
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
  int r = RSOCK_KERNEL(real().recvmmsg(fd, m, n, f, t));
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
// socket it can use; one in the middle of its switch finishes it first
// (Stream::give_away). Unless a client's rendezvous was in flight, it is
// left shared (socket/holders.h, claim_passed), and the receiver upgrades it
// again once it is the only holder. Only messages with ancillary data pay
// for the look. `sent`: after the real call, whether it went out (false: no
// receiver will enlist).
template <typename F>
static void for_passed_sockets(HookScope& h, const struct msghdr* m, F&& f) {
  if (m == nullptr || m->msg_controllen == 0 || m->msg_control == nullptr) return;
  for (cmsghdr* c = CMSG_FIRSTHDR(m); c != nullptr; c = CMSG_NXTHDR(const_cast<msghdr*>(m), c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const int* fds = reinterpret_cast<const int*>(CMSG_DATA(c));
    for (size_t i = 0; i < n; i++) {
      int pfd;
      std::memcpy(&pfd, fds + i, sizeof pfd);
      if (auto s = h.tracked(pfd)) f(s);
    }
  }
}
template <typename F>
static void for_passed_streams(HookScope& h, const struct msghdr* m, F&& f) {
  for_passed_sockets(h, m, [&](const rsock::socket::SocketRef& s) {
    if (rsock::socket::Stream* st = s->stream()) f(s, st);
  });
}

static void hand_off_passed_fds(HookScope& h, const struct msghdr* m) {
  uint64_t deadline = 0;
  for_passed_sockets(h, m, [&](const rsock::socket::SocketRef& s) {
    // A listening socket: its receiver's connections are found through the
    // port's named table (listener_passing).
    if (s->role() == rsock::socket::Role::kListener) rsock::socket::listener_passing(s.get());
    s->set_default_timeouts(false);  // (the receiver's setsockopt is not seen here)
    rsock::socket::Stream* st = s->stream();
    if (st == nullptr || !st->governs()) return;
    if (deadline == 0)
      deadline = rsock::now_ns() +
                 uint64_t{rsock::socket::process_config().tunables.upgrade_timeout_ms} * 1000000;
    (void)st->give_away(deadline);
    rsock::socket::socket_passing(s.get());
  });
}

RSOCK_HOOK ssize_t sendmsg(int fd, const struct msghdr* m, int f) noexcept {
  HookScope h;
  if (auto s = h.tracked(fd)) {
    ssize_t out;
    if (stream_send(h, s, {m->msg_iov, m->msg_iovlen}, f, &out)) return out;
    return h.io_tx(s, RSOCK_KERNEL(real().sendmsg(fd, m, f)));
  }
  hand_off_passed_fds(h, m);
  ssize_t r = real().sendmsg(fd, m, f);
  const bool failed = r < 0;
  int e = errno;
  for_passed_streams(h, m, [&](const rsock::socket::SocketRef&, rsock::socket::Stream* st) {
    st->pass_done(failed);
  });
  errno = e;
  return r;
}
RSOCK_TX_HOOK(ssize_t, sendfile, (int o, int in, off_t* off, size_t n), o,
              rsock::preload::stream_sendfile(h, s, in, reinterpret_cast<off64_t*>(off), n, &out),
              sendfile(o, in, off, n))
RSOCK_TX_HOOK(ssize_t, sendfile64, (int o, int in, off64_t* off, size_t n), o,
              rsock::preload::stream_sendfile(h, s, in, off, n, &out), sendfile64(o, in, off, n))

RSOCK_HOOK ssize_t splice(int in, loff_t* oi, int out, loff_t* oo, size_t n, unsigned f) noexcept {
  HookScope h;
  ssize_t res = 0;
  if (auto s = h.tracked(in)) {
    if (rsock::preload::stream_splice_out(h, s, oi, out, oo, n, f, &res)) return res;
    return h.io_rx(s, real().splice(in, oi, out, oo, n, f));
  }
  if (auto s = h.tracked(out)) {
    if (rsock::preload::stream_splice_in(h, in, oi, s, out, oo, n, f, &res)) return res;
    return h.io_tx(s, real().splice(in, oi, out, oo, n, f));
  }
  return real().splice(in, oi, out, oo, n, f);
}

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
