// Listening sockets inherited across exec (docs/DESIGN.md, "Listeners
// inherited across exec"). A program started with a listening socket it did
// not create (systemd's socket activation, a supervisor or master that forks
// and execs its workers, a server that re-execs itself) never calls listen()
// under us, so no rdma_cm listener would ever serve it. At image start each
// such socket is tracked as a listener and its rdma_cm side started, as
// listen() would. At once, not at the program's first accept: a program
// started for its first connection (socket activation) or slow to start
// (an interpreter: about 1 s in the TCG guest) would otherwise leave the
// requests of the connections queued meanwhile without a listener, and
// their clients would take this server for one without librsock.
#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "socket/fd_table.h"
#include "socket/rendezvous.h"
#include "socket/socket.h"
#include "util/log.h"
#include "util/sys.h"

namespace rsock::socket {

namespace {

// A TCP socket in the listening state: its domain, 0 otherwise. (The first
// getsockopt fails with ENOTSOCK for a non-socket: one syscall per fd that
// is not a listening socket.)
int listening_tcp(int fd) {
  int listening = 0;
  socklen_t len = sizeof listening;
  if (sys::libc.getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening)
    return 0;
  return tracked_domain(fd);
}

void adopt_one(int fd) {
  int domain = listening_tcp(fd);
  if (domain == 0) return;
  FdTable* t = FdTable::get_or_create();
  if (!t || t->lookup(fd)) return;
  int fl = sys::libc.fcntl(fd, F_GETFL);
  SocketRef s(new_socket(domain, Role::kListener, fl >= 0 && (fl & O_NONBLOCK)));
  if (!s) return;
  t->install(fd, s.get());
  LOG_INFO("fd %d: a TCP listening socket inherited across exec; serving its rdma_cm side as "
           "listen() would", fd);
  listener_started(s.get(), fd, /*across_exec=*/true);
  s->upgrade_decided.store(true, std::memory_order_release);
}

}  // namespace

void adopt_inherited_listeners() {
  // The fds open at image start, from /proc/self/fd (raw syscalls: no
  // allocation, nothing hooked; the directory's own fd is skipped). Four
  // syscalls plus a getsockopt per inherited fd (usually three: stdin,
  // stdout, stderr). No /proc: nothing is adopted.
  int dir = int(syscall(SYS_openat, AT_FDCWD, "/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir < 0) return;
  alignas(8) char buf[1024];
  for (;;) {
    long n = syscall(SYS_getdents64, dir, buf, sizeof buf);
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      auto* d = reinterpret_cast<struct dirent64*>(buf + off);
      off += d->d_reclen;
      int fd = 0;
      bool num = d->d_name[0] != '\0';
      for (const char* c = d->d_name; *c && num; c++) {
        num = *c >= '0' && *c <= '9';
        fd = fd * 10 + (*c - '0');
      }
      if (num && fd != dir) adopt_one(fd);
    }
  }
  syscall(SYS_close, dir);
}

}  // namespace rsock::socket
