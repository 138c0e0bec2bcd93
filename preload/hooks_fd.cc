// Hooks: fd lifetime and flags (close, close_range, dup*, fcntl*, ioctl) and
// fork. They keep the fd table an exact image of which fds name which socket.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>

#include "preload/hook.h"
#include "socket/process.h"
#include "socket/readiness.h"
#include "socket/signals.h"
#include "socket/rendezvous.h"
#include "util/owned_fds.h"
#include "util/stats.h"

using rsock::preload::HookScope;
using rsock::preload::real;

namespace rsock::preload {

// fd `nfd` now names whatever `fd` names (dup family); r is the syscall result.
static int after_dup(HookScope& h, int fd, int r) {
  if (r < 0) return r;
  if (auto* t = socket::FdTable::get_if_exists()) {
    auto s = t->lookup(fd);
    // Only when the table would change, ask whether this is a vfork child
    // (its own fd table, our parent's memory: socket::in_vfork_child).
    if ((s || t->lookup(r)) && !socket::in_vfork_child()) {
      if (s) t->install(r, s.get());
      else t->remove(r);
    }
  }
  return h.pass(r);
}

// fcntl and fcntl64 share one body: only the libc entry point differs.
static int fcntl_common(RsockFcntlFn fn, int fd, int cmd, void* arg) {
  HookScope h;
  int r = RSOCK_KERNEL(fn(fd, cmd, arg));  // (F_SETLKW may wait for long)
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
  // A vfork child closes its own copy of the fds; the table is its parent's.
  // (Asked only for fds we track: in_vfork_child is a syscall.)
  bool not_vfork = false;  // (asked once: fd_closing need not ask again)
  if (auto* t = rsock::socket::FdTable::get_if_exists();
      t && (t->lookup(fd) || rsock::socket::is_epoll_instance(fd))) {
    if (rsock::socket::in_vfork_child()) return h.pass(real().close(fd));
    not_vfork = true;
  }
  // A number the program never got from the kernel (librsock's own, at the
  // top of the fd space): a daemon closing "all other fds" must not take our
  // connections down. For the program it is closed.
  if (h.outermost() && rsock::sys::owned_fd(fd)) return h.finish(rsock::Status<void>(rsock::Ok()));
  // Forget first: once the kernel frees the number, another thread's socket()
  // may reuse it and install its own entry, which we must not then erase.
  if (auto* t = rsock::socket::FdTable::get_if_exists()) {
    rsock::socket::fd_closing(fd, not_vfork);  // a connection's stream keeps the socket open
    t->remove(fd);
    rsock::socket::epoll_fd_closed(fd);  // if it was an epoll instance
  }
  return h.pass(real().close(fd));
}

RSOCK_HOOK int close_range(unsigned lo, unsigned hi, int flags) noexcept {
  HookScope h;
  if (rsock::socket::FdTable::get_if_exists() && rsock::socket::in_vfork_child())
    return h.pass(real().close_range(lo, hi, flags));
  int r = 0;
  if (!(flags & CLOSE_RANGE_CLOEXEC) && lo <= hi) rsock::socket::fds_closing(lo, hi);
  if (h.outermost() && rsock::sys::owned_fd_count() > 0 && lo <= hi) {
    // Around librsock's own fds (see close()): the ranges between them.
    unsigned from = lo;
    for (int fd = rsock::sys::next_owned_fd(int(std::min<unsigned>(lo, INT32_MAX)));
         fd >= 0 && unsigned(fd) <= hi; fd = rsock::sys::next_owned_fd(fd + 1)) {
      if (unsigned(fd) > from && (r = real().close_range(from, unsigned(fd) - 1, flags)) != 0)
        return h.pass(r);
      from = unsigned(fd) + 1;
    }
    r = from <= hi ? real().close_range(from, hi, flags) : 0;
  } else {
    r = real().close_range(lo, hi, flags);
  }
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
  rsock::socket::fd_closing(nfd);  // the kernel closes what nfd named
  return rsock::preload::after_dup(h, fd, real().dup2(fd, nfd));
}

RSOCK_HOOK int dup3(int fd, int nfd, int flags) noexcept {
  HookScope h;
  if (fd != nfd) rsock::socket::fd_closing(nfd);  // (dup3 fails EINVAL when equal)
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
  int r = RSOCK_KERNEL(real().ioctl(fd, req, arg));
  if (r == 0 && req == FIONBIO && arg)
    if (auto s = h.tracked(fd)) s->set_nonblocking(*static_cast<const int*>(arg) != 0);
  return h.pass(r);
}

// libuv (so Node, and every program built on it) closes its fds with
// syscall(SYS_close, fd), not close(): unseen, such a close left the fd
// table naming a dead socket, and a connection passed to a worker counted
// its sender as a holder forever. So raw closes take the close path too;
// every other number goes straight through. (Like glibc's own syscall(),
// this reads six arguments whatever the call has: registers or stack
// words the callee ignores.)
RSOCK_HOOK long syscall(long nr, ...) noexcept {
  va_list ap;
  va_start(ap, nr);
  long a[6];
  for (long& x : a) x = va_arg(ap, long);
  va_end(ap);
  if (nr == SYS_close) return close(int(a[0]));
  if (nr == SYS_close_range) return close_range(unsigned(a[0]), unsigned(a[1]), int(a[2]));
  return real().syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
}

// _exit skips atexit, and with it progress_at_exit: bytes only librsock
// holds (written during a switch, or on RDMA and not yet delivered) would die
// with the process, where the kernel delivers a closed socket's bytes after
// _exit. A forked worker that writes, closes and calls _exit lost its last
// reply that way. So _exit hands them to the kernel first, exactly as
// exit() does, unless nothing could be held (no stream), it runs in a vfork
// child (the parent's state) or in a signal handler (no lock may be
// waited for there).
static void flush_before_exit() {
  if (!rsock::socket::streams_exist() || rsock::preload::t_depth != 0 || rsock::socket::in_signal_handler() ||
      rsock::socket::in_vfork_child())
    return;
  ++rsock::preload::t_depth;
  rsock::socket::progress_at_exit();
  --rsock::preload::t_depth;
}
RSOCK_HOOK void _exit(int status) noexcept {
  flush_before_exit();
  real()._exit(status);
  __builtin_unreachable();
}
RSOCK_HOOK void _Exit(int status) noexcept {
  flush_before_exit();
  real()._Exit(status);
  __builtin_unreachable();
}

RSOCK_HOOK pid_t fork(void) noexcept {
  HookScope h;
  rsock::socket::progress_before_fork();
  rsock::socket::before_fork();
  pid_t pid = real().fork();
  rsock::socket::after_fork(pid == 0);
  if (pid == 0) {
    rsock::socket::forget_deferred_signals();  // the parent runs them
    rsock::socket::note_state_owner();
    rsock::stats::after_fork_child();  // the child publishes its own file
    rsock::socket::progress_after_fork_child();
  } else {
    rsock::socket::progress_after_fork_parent(pid < 0);
  }
  return h.pass(pid);
}

// exec and posix_spawn: the new program image has none of librsock's state,
// so upgraded connections switch back to TCP first, as for fork (see
// progress_before_exec). glibc's own exec family and posix_spawn call its
// internal __execve, past any hook: each public entry point is hooked.
// (system() and popen() spawn through glibc-internal calls: not covered; the
// shell they start does not use the program's sockets.)
// A vfork child (Python's subprocess, for one) execs with its parent's
// memory: the connections are the parent's, which goes on with them, and
// the child's verbs commands would be refused anyway. (posix_spawn's
// internal child execs past every hook; its hook runs in the parent.)
// The hook's scope ends before the exec itself: an exec that succeeds never
// returns to end it, and in a vfork child the thread-local depth is the
// parent's, which would then take every later call for a nested one.
static void before_exec(bool replaces = true) {
  HookScope h;
  int saved = errno;
  // The new program may set timeouts on sockets it inherits, unseen here:
  // what this process knew of them is void (Socket::default_timeouts). (A
  // vfork child's bump is its parent's too: they share this memory.)
  rsock::socket::g_fork_generation.fetch_add(1, std::memory_order_relaxed);
  if (h.outermost() && rsock::socket::tracking_enabled() && !rsock::socket::in_vfork_child())
    rsock::socket::progress_before_exec(replaces);
  errno = saved;
}

// An exec that returns failed: this image goes on (see progress_exec_failed).
static int after_exec(int r) {
  HookScope h;
  int saved = errno;
  if (h.outermost() && rsock::socket::tracking_enabled() && !rsock::socket::in_vfork_child())
    rsock::socket::progress_exec_failed();
  errno = saved;
  return r;
}

#define RSOCK_EXEC_HOOK(name, params, args) \
  RSOCK_HOOK int name params noexcept {     \
    before_exec();                          \
    return after_exec(real().name args);    \
  }
#define RSOCK_SPAWN_HOOK(name, params, args)     \
  RSOCK_HOOK int name params noexcept {          \
    before_exec(/*replaces=*/false);             \
    return real().name args;                     \
  }
RSOCK_EXEC_HOOK(execve, (const char* p, char* const a[], char* const e[]), (p, a, e))
RSOCK_EXEC_HOOK(execv, (const char* p, char* const a[]), (p, a))
RSOCK_EXEC_HOOK(execvp, (const char* f, char* const a[]), (f, a))
RSOCK_EXEC_HOOK(execvpe, (const char* f, char* const a[], char* const e[]), (f, a, e))
RSOCK_EXEC_HOOK(fexecve, (int fd, char* const a[], char* const e[]), (fd, a, e))
RSOCK_EXEC_HOOK(execveat, (int d, const char* p, char* const a[], char* const e[], int f),
                (d, p, a, e, f))
RSOCK_SPAWN_HOOK(posix_spawn,
                (pid_t* pid, const char* p, const posix_spawn_file_actions_t* fa,
                 const posix_spawnattr_t* at, char* const a[], char* const e[]),
                (pid, p, fa, at, a, e))
RSOCK_SPAWN_HOOK(posix_spawnp,
                (pid_t* pid, const char* f, const posix_spawn_file_actions_t* fa,
                 const posix_spawnattr_t* at, char* const a[], char* const e[]),
                (pid, f, fa, at, a, e))

// execl(path, arg0, ..., NULL) is execv(path, argv), as in glibc: the
// arguments are counted, then copied into a vector on the stack.
#define RSOCK_EXECL_ARGV(last)                                     \
  va_list ap;                                                      \
  va_start(ap, last);                                              \
  size_t n = 1;                                                    \
  while (va_arg(ap, const char*) != nullptr) n++;                  \
  va_end(ap);                                                      \
  const char* argv[n + 1];                                         \
  argv[0] = last;                                                  \
  va_start(ap, last);                                              \
  for (size_t i = 1; i <= n; i++) argv[i] = va_arg(ap, const char*);

RSOCK_HOOK int execl(const char* p, const char* arg, ...) noexcept {
  RSOCK_EXECL_ARGV(arg)
  va_end(ap);
  before_exec();
  return after_exec(real().execv(p, const_cast<char* const*>(argv)));
}
RSOCK_HOOK int execlp(const char* f, const char* arg, ...) noexcept {
  RSOCK_EXECL_ARGV(arg)
  va_end(ap);
  before_exec();
  return after_exec(real().execvp(f, const_cast<char* const*>(argv)));
}
RSOCK_HOOK int execle(const char* p, const char* arg, ...) noexcept {
  RSOCK_EXECL_ARGV(arg)
  char* const* env = va_arg(ap, char* const*);  // after the NULL
  va_end(ap);
  before_exec();
  return after_exec(real().execve(p, const_cast<char* const*>(argv), env));
}

// Handlers go in through librsock's trampoline (socket/signals.h), so that
// an emulated blocking call notices every handler that runs during it and
// returns EINTR or restarts exactly like the kernel's. glibc's signal(),
// sysv_signal() and siginterrupt() call sigaction internally, past this
// hook, so they are re-implemented here with glibc's flags.
namespace rsock::preload {

static int install(int sig, const struct sigaction* act, struct sigaction* old) {
  if (t_depth > 1 || !socket::tracking_enabled()) return real().sigaction(sig, act, old);
  return socket::signal_action(sig, act, old);
}

// Signals siginterrupt() made interrupting: signal() leaves SA_RESTART off
// for them (glibc keeps the same set, _sigintr).
static std::atomic<uint64_t> g_sigintr{0};

static uint64_t sig_bit(int sig) { return sig >= 1 && sig <= 64 ? uint64_t{1} << (sig - 1) : 0; }

static sighandler_t set_handler(HookScope& h, int sig, sighandler_t fn, int flags, bool mask_self) {
  if (fn == SIG_ERR || sig < 1 || sig >= NSIG) {
    errno = EINVAL;
    return SIG_ERR;
  }
  struct sigaction sa {}, old{};
  sa.sa_handler = fn;
  sigemptyset(&sa.sa_mask);
  if (mask_self) sigaddset(&sa.sa_mask, sig);
  sa.sa_flags = flags;
  if (install(sig, &sa, &old) < 0) return SIG_ERR;
  h.pass(0);  // errno as the caller left it
  return old.sa_handler;
}

static sighandler_t set_bsd_handler(HookScope& h, int sig, sighandler_t fn) {
  bool intr = g_sigintr.load() & sig_bit(sig);
  return set_handler(h, sig, fn, intr ? 0 : SA_RESTART, true);
}

}  // namespace rsock::preload

RSOCK_HOOK int sigaction(int sig, const struct sigaction* act, struct sigaction* old) noexcept {
  HookScope h;
  return h.pass(rsock::preload::install(sig, act, old));
}

// BSD semantics, as glibc: the handler's own signal masked, SA_RESTART
// unless siginterrupt() said otherwise.
RSOCK_HOOK sighandler_t signal(int sig, sighandler_t handler) noexcept {
  HookScope h;
  return rsock::preload::set_bsd_handler(h, sig, handler);
}

RSOCK_HOOK sighandler_t bsd_signal(int sig, sighandler_t handler) noexcept {
  HookScope h;
  return rsock::preload::set_bsd_handler(h, sig, handler);
}

// System V semantics, as glibc: one-shot, not masked, interrupting.
RSOCK_HOOK sighandler_t sysv_signal(int sig, sighandler_t handler) noexcept {
  HookScope h;
  return rsock::preload::set_handler(h, sig, handler, SA_RESETHAND | SA_NODEFER, false);
}

RSOCK_HOOK int siginterrupt(int sig, int flag) noexcept {
  HookScope h;
  struct sigaction sa;
  if (rsock::preload::install(sig, nullptr, &sa) < 0) return -1;
  uint64_t bit = rsock::preload::sig_bit(sig);
  if (flag) {
    rsock::preload::g_sigintr.fetch_or(bit);
    sa.sa_flags &= ~SA_RESTART;
  } else {
    rsock::preload::g_sigintr.fetch_and(~bit);
    sa.sa_flags |= SA_RESTART;
  }
  return h.pass(rsock::preload::install(sig, &sa, nullptr));
}
