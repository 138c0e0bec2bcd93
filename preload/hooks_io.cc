// Hooks: the read/write/send/recv family, including the iovec, msg, mmsg,
// sendfile and _FORTIFY_SOURCE (__*_chk) variants real binaries call.
// On a tracked socket the kernel still carries the bytes (TCP first); the
// hook counts them. Untracked fds cost one table load.
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "preload/hook.h"

using rsock::preload::HookScope;
using rsock::preload::real;


namespace rsock::preload {
ssize_t mmsg_bytes(const struct mmsghdr* m, int n) {
  ssize_t total = 0;
  for (int i = 0; i < n; i++) total += m[i].msg_len;
  return total;
}
}  // namespace rsock::preload

// Receive side ---------------------------------------------------------------
#define RSOCK_RX_HOOK(ret, name, params, fd, call)                      \
  RSOCK_HOOK ret name params noexcept {                                 \
    HookScope h;                                                        \
    if (auto s = h.tracked(fd)) return h.io_rx(s, real().call);         \
    return real().call;                                                 \
  }
#define RSOCK_TX_HOOK(ret, name, params, fd, call)                      \
  RSOCK_HOOK ret name params noexcept {                                 \
    HookScope h;                                                        \
    if (auto s = h.tracked(fd)) return h.io_tx(s, real().call);         \
    return real().call;                                                 \
  }

RSOCK_RX_HOOK(ssize_t, read, (int fd, void* b, size_t n), fd, read(fd, b, n))
RSOCK_RX_HOOK(ssize_t, __read_chk, (int fd, void* b, size_t n, size_t bl), fd,
              __read_chk(fd, b, n, bl))
RSOCK_RX_HOOK(ssize_t, readv, (int fd, const struct iovec* v, int n), fd, readv(fd, v, n))
RSOCK_RX_HOOK(ssize_t, recv, (int fd, void* b, size_t n, int f), fd, recv(fd, b, n, f))
RSOCK_RX_HOOK(ssize_t, __recv_chk, (int fd, void* b, size_t n, size_t bl, int f), fd,
              __recv_chk(fd, b, n, bl, f))
RSOCK_RX_HOOK(ssize_t, recvfrom,
              (int fd, void* b, size_t n, int f, struct sockaddr* a, socklen_t* l), fd,
              recvfrom(fd, b, n, f, a, l))
RSOCK_RX_HOOK(ssize_t, __recvfrom_chk,
              (int fd, void* b, size_t n, size_t bl, int f, struct sockaddr* a, socklen_t* l),
              fd, __recvfrom_chk(fd, b, n, bl, f, a, l))
RSOCK_RX_HOOK(ssize_t, recvmsg, (int fd, struct msghdr* m, int f), fd, recvmsg(fd, m, f))

RSOCK_HOOK int recvmmsg(int fd, struct mmsghdr* m, unsigned n, int f, struct timespec* t) noexcept {
  HookScope h;
  int r = real().recvmmsg(fd, m, n, f, t);
  if (auto s = h.tracked(fd); s && r > 0) s->on_tcp_rx(rsock::preload::mmsg_bytes(m, r));
  return h.pass(r);
}

// Send side ------------------------------------------------------------------
RSOCK_TX_HOOK(ssize_t, write, (int fd, const void* b, size_t n), fd, write(fd, b, n))
RSOCK_TX_HOOK(ssize_t, writev, (int fd, const struct iovec* v, int n), fd, writev(fd, v, n))
RSOCK_TX_HOOK(ssize_t, send, (int fd, const void* b, size_t n, int f), fd, send(fd, b, n, f))
RSOCK_TX_HOOK(ssize_t, sendto,
              (int fd, const void* b, size_t n, int f, const struct sockaddr* a, socklen_t l),
              fd, sendto(fd, b, n, f, a, l))
RSOCK_TX_HOOK(ssize_t, sendmsg, (int fd, const struct msghdr* m, int f), fd, sendmsg(fd, m, f))
RSOCK_TX_HOOK(ssize_t, sendfile, (int out, int in, off_t* off, size_t n), out,
              sendfile(out, in, off, n))
RSOCK_TX_HOOK(ssize_t, sendfile64, (int out, int in, off64_t* off, size_t n), out,
              sendfile64(out, in, off, n))

RSOCK_HOOK int sendmmsg(int fd, struct mmsghdr* m, unsigned n, int f) noexcept {
  HookScope h;
  int r = real().sendmmsg(fd, m, n, f);
  if (auto s = h.tracked(fd); s && r > 0) s->on_tcp_tx(rsock::preload::mmsg_bytes(m, r));
  return h.pass(r);
}
