// Hooks: fd lifetime and flags (close, close_range, dup*, fcntl*, ioctl) and
// fork. They keep the fd table an exact image of which fds name which socket.
#include <fcntl.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <signal.h>

#include <cstdarg>

#include "preload/hook.h"
#include "socket/readiness.h"
#include "socket/signals.h"
#include "socket/rendezvous.h"
#include "util/stats.h"

using rsock::preload::HookScope;
using rsock::preload::real;

namespace rsock::preload {

// fd `nfd` now names whatever `fd` names (dup family); r is the syscall result.
static int after_dup(HookScope& h, int fd, int r) {
  if (r < 0) return r;
  if (auto* t = socket::FdTable::get_if_exists()) {
    if (auto s = t->lookup(fd)) t->install(r, s.get());
    else t->remove(r);
  }
  return h.pass(r);
}

// fcntl and fcntl64 share one body: only the libc entry point differs.
static int fcntl_common(RsockFcntlFn fn, int fd, int cmd, void* arg) {
  HookScope h;
  int r = fn(fd, cmd, arg);
  if (r < 0) return r;
  switch (cmd) {
    case F_DUPFD:
    case F_DUPFD_CLOEXEC:
      return after_dup(h, fd, r);
    case F_SETFL:
      if (auto s = h.tracked(fd))
        s->set_nonblocking(static_cast<int>(reinterpret_cast<intptr_t>(arg)) & O_NONBLOCK);
      break;
    default:
      break;
  }
  return h.pass(r);
}

}  // namespace rsock::preload

RSOCK_HOOK int close(int fd) noexcept {
  HookScope h;
  // Forget first: once the kernel frees the number, another thread's socket()
  // may reuse it and install its own entry, which we must not then erase.
  if (auto* t = rsock::socket::FdTable::get_if_exists()) {
    t->remove(fd);
    rsock::socket::epoll_fd_closed(fd);  // if it was an epoll instance
  }
  return h.pass(real().close(fd));
}

RSOCK_HOOK int close_range(unsigned lo, unsigned hi, int flags) noexcept {
  HookScope h;
  int r = real().close_range(lo, hi, flags);
  // CLOSE_RANGE_CLOEXEC only marks the fds; they stay open until exec.
  if (r == 0 && !(flags & CLOSE_RANGE_CLOEXEC))
    if (auto* t = rsock::socket::FdTable::get_if_exists()) t->remove_range(lo, hi);
  return h.pass(r);
}

RSOCK_HOOK int dup(int fd) noexcept {
  HookScope h;
  return rsock::preload::after_dup(h, fd, real().dup(fd));
}

RSOCK_HOOK int dup2(int fd, int nfd) noexcept {
  HookScope h;
  if (fd == nfd) return h.pass(real().dup2(fd, nfd));  // no-op apart from EBADF
  return rsock::preload::after_dup(h, fd, real().dup2(fd, nfd));
}

RSOCK_HOOK int dup3(int fd, int nfd, int flags) noexcept {
  HookScope h;
  return rsock::preload::after_dup(h, fd, real().dup3(fd, nfd, flags));
}

// fcntl's third argument is an int, a pointer or absent depending on cmd;
// like glibc we read it as a pointer-sized value and hand it on unchanged.
RSOCK_HOOK int fcntl(int fd, int cmd, ...) noexcept {
  va_list ap;
  va_start(ap, cmd);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  return rsock::preload::fcntl_common(real().fcntl, fd, cmd, arg);
}

RSOCK_HOOK int fcntl64(int fd, int cmd, ...) noexcept {
  va_list ap;
  va_start(ap, cmd);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  return rsock::preload::fcntl_common(real().fcntl64, fd, cmd, arg);
}

RSOCK_HOOK int ioctl(int fd, unsigned long req, ...) noexcept {
  va_list ap;
  va_start(ap, req);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  HookScope h;
  if (req == FIONREAD && arg) {
    if (auto s = h.tracked(fd)) {
      if (auto* st = rsock::preload::governing(s)) {
        auto n = st->fionread();
        if (n) {
          *static_cast<int*>(arg) = *n;
          return h.pass(0);
        }
        if (n.error() != rsock::socket::kRedoPlain) return h.finish(rsock::Status<void>(rsock::Err(n.error())));
      }
    }
  }
  int r = real().ioctl(fd, req, arg);
  if (r == 0 && req == FIONBIO && arg)
    if (auto s = h.tracked(fd)) s->set_nonblocking(*static_cast<const int*>(arg) != 0);
  return h.pass(r);
}

RSOCK_HOOK pid_t fork(void) noexcept {
  HookScope h;
  rsock::socket::progress_before_fork();
  rsock::socket::before_fork();
  pid_t pid = real().fork();
  rsock::socket::after_fork();
  if (pid == 0) {
    rsock::stats::after_fork_child();  // the child publishes its own file
    rsock::socket::progress_after_fork_child();
  } else {
    rsock::socket::progress_after_fork_parent();
  }
  return h.pass(pid);
}

// Signal dispositions are recorded so that emulated blocking socket calls
// restart (SA_RESTART) or fail with EINTR exactly like the kernel's.
RSOCK_HOOK int sigaction(int sig, const struct sigaction* act, struct sigaction* old) noexcept {
  HookScope h;
  int r = real().sigaction(sig, act, old);
  if (r == 0 && act) rsock::socket::signal_handler_set(sig, *act);
  return h.pass(r);
}

// glibc's signal() has BSD semantics: SA_RESTART.
RSOCK_HOOK sighandler_t signal(int sig, sighandler_t handler) noexcept {
  HookScope h;
  sighandler_t r = real().signal(sig, handler);
  if (r != SIG_ERR) rsock::socket::signal_handler_set_bsd(sig, handler, true);
  return r;
}

RSOCK_HOOK sighandler_t sysv_signal(int sig, sighandler_t handler) noexcept {
  HookScope h;
  sighandler_t r = real().sysv_signal(sig, handler);
  if (r != SIG_ERR) rsock::socket::signal_handler_set_bsd(sig, handler, false);
  return r;
}
