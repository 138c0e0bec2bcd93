#include "util/sys.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/ioctl.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

// glibc's fortify entry points have no public prototypes without _FORTIFY_SOURCE.
extern "C" {
ssize_t __read_chk(int, void*, size_t, size_t);
ssize_t __recv_chk(int, void*, size_t, size_t, int);
ssize_t __recvfrom_chk(int, void*, size_t, size_t, int, struct sockaddr*, socklen_t*);
int __poll_chk(struct pollfd*, nfds_t, int, size_t);
int __ppoll_chk(struct pollfd*, nfds_t, const struct timespec*, const sigset_t*, size_t);
}

namespace rsock::sys {

// Constant-initialised: valid before any constructor runs. In librsock.so
// preload/ overwrites every entry with the next definition (libc's).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"  // siginterrupt: we hook it
Libc libc = {
#define RSOCK_X(ret, name, params, args) &::name,
    RSOCK_LIBC_FUNCS(RSOCK_X)
#undef RSOCK_X
#define RSOCK_XV(name, type) &::name,
    RSOCK_LIBC_VARIADIC(RSOCK_XV)
#undef RSOCK_XV
};
#pragma GCC diagnostic pop

void push_unsent(int tcp_fd) {
  int was = 0;
  socklen_t len = sizeof was;
  if (libc.getsockopt(tcp_fd, IPPROTO_TCP, TCP_NODELAY, &was, &len) != 0) return;
  // Set even when it is on already: that push also sends what TCP_CORK holds.
  int v = 1;
  if (libc.setsockopt(tcp_fd, IPPROTO_TCP, TCP_NODELAY, &v, sizeof v) != 0 || was != 0) return;
  v = 0;
  (void)libc.setsockopt(tcp_fd, IPPROTO_TCP, TCP_NODELAY, &v, sizeof v);
}

}  // namespace rsock::sys
