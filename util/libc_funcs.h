// The libc functions librsock interposes, as an X-macro:
//   X(return type, name, (parameters), (arguments))
// preload/ generates its hooks' "real" pointers from this list, util/sys.cc
// generates the table every lower layer calls through. One list, so a hook can
// never be added without its pass-through.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

// glibc declares bsd_signal() only for pre-2008 POSIX; programs still call it.
extern "C" sighandler_t bsd_signal(int sig, sighandler_t handler) noexcept;

// Functions with a fixed parameter list. fcntl/fcntl64/ioctl are variadic and
// handled by name in preload/hooks_fd.cc.
#define RSOCK_LIBC_FUNCS(X)                                                                 \
  X(int, socket, (int d, int t, int p), (d, t, p))                                          \
  X(int, socketpair, (int d, int t, int p, int* sv), (d, t, p, sv))                         \
  X(int, bind, (int fd, const struct sockaddr* a, socklen_t l), (fd, a, l))                 \
  X(int, listen, (int fd, int n), (fd, n))                                                  \
  X(int, accept, (int fd, struct sockaddr* a, socklen_t* l), (fd, a, l))                    \
  X(int, accept4, (int fd, struct sockaddr* a, socklen_t* l, int f), (fd, a, l, f))         \
  X(int, connect, (int fd, const struct sockaddr* a, socklen_t l), (fd, a, l))              \
  X(ssize_t, read, (int fd, void* b, size_t n), (fd, b, n))                                 \
  X(ssize_t, readv, (int fd, const struct iovec* v, int n), (fd, v, n))                     \
  X(ssize_t, recv, (int fd, void* b, size_t n, int f), (fd, b, n, f))                       \
  X(ssize_t, recvfrom, (int fd, void* b, size_t n, int f, struct sockaddr* a, socklen_t* l), \
    (fd, b, n, f, a, l))                                                                    \
  X(ssize_t, recvmsg, (int fd, struct msghdr* m, int f), (fd, m, f))                        \
  X(int, recvmmsg, (int fd, struct mmsghdr* m, unsigned n, int f, struct timespec* t),      \
    (fd, m, n, f, t))                                                                       \
  X(ssize_t, write, (int fd, const void* b, size_t n), (fd, b, n))                          \
  X(ssize_t, writev, (int fd, const struct iovec* v, int n), (fd, v, n))                    \
  X(ssize_t, send, (int fd, const void* b, size_t n, int f), (fd, b, n, f))                 \
  X(ssize_t, sendto,                                                                        \
    (int fd, const void* b, size_t n, int f, const struct sockaddr* a, socklen_t l),        \
    (fd, b, n, f, a, l))                                                                    \
  X(ssize_t, sendmsg, (int fd, const struct msghdr* m, int f), (fd, m, f))                  \
  X(int, sendmmsg, (int fd, struct mmsghdr* m, unsigned n, int f), (fd, m, n, f))           \
  X(ssize_t, sendfile, (int o, int i, off_t* off, size_t n), (o, i, off, n))                \
  X(ssize_t, sendfile64, (int o, int i, off64_t* off, size_t n), (o, i, off, n))            \
  X(ssize_t, splice, (int i, loff_t* oi, int o, loff_t* oo, size_t n, unsigned f),          \
    (i, oi, o, oo, n, f))                                                                   \
  X(int, close, (int fd), (fd))                                                             \
  X(int, close_range, (unsigned lo, unsigned hi, int f), (lo, hi, f))                       \
  X(int, shutdown, (int fd, int how), (fd, how))                                            \
  X(int, dup, (int fd), (fd))                                                               \
  X(int, dup2, (int fd, int nfd), (fd, nfd))                                                \
  X(int, dup3, (int fd, int nfd, int f), (fd, nfd, f))                                      \
  X(int, setsockopt, (int fd, int lv, int o, const void* v, socklen_t l), (fd, lv, o, v, l)) \
  X(int, getsockopt, (int fd, int lv, int o, void* v, socklen_t* l), (fd, lv, o, v, l))     \
  X(int, getsockname, (int fd, struct sockaddr* a, socklen_t* l), (fd, a, l))               \
  X(int, getpeername, (int fd, struct sockaddr* a, socklen_t* l), (fd, a, l))               \
  X(int, poll, (struct pollfd* p, nfds_t n, int t), (p, n, t))                              \
  X(int, ppoll, (struct pollfd* p, nfds_t n, const struct timespec* t, const sigset_t* s),  \
    (p, n, t, s))                                                                           \
  X(int, select, (int n, fd_set* r, fd_set* w, fd_set* e, struct timeval* t), (n, r, w, e, t)) \
  X(int, pselect,                                                                           \
    (int n, fd_set* r, fd_set* w, fd_set* e, const struct timespec* t, const sigset_t* s),  \
    (n, r, w, e, t, s))                                                                     \
  X(int, epoll_create, (int n), (n))                                                        \
  X(int, epoll_create1, (int f), (f))                                                       \
  X(int, epoll_ctl, (int ep, int op, int fd, struct epoll_event* e), (ep, op, fd, e))       \
  X(int, epoll_wait, (int ep, struct epoll_event* e, int n, int t), (ep, e, n, t))          \
  X(int, epoll_pwait, (int ep, struct epoll_event* e, int n, int t, const sigset_t* s),     \
    (ep, e, n, t, s))                                                                       \
  X(int, epoll_pwait2,                                                                      \
    (int ep, struct epoll_event* e, int n, const struct timespec* t, const sigset_t* s),    \
    (ep, e, n, t, s))                                                                       \
  X(pid_t, fork, (void), ())                                                                \
  X(void, _exit, (int s), (s))                                                              \
  X(void, _Exit, (int s), (s))                                                              \
  X(int, execve, (const char* p, char* const* a, char* const* e), (p, a, e))                \
  X(int, execv, (const char* p, char* const* a), (p, a))                                    \
  X(int, execvp, (const char* f, char* const* a), (f, a))                                   \
  X(int, execvpe, (const char* f, char* const* a, char* const* e), (f, a, e))               \
  X(int, fexecve, (int fd, char* const* a, char* const* e), (fd, a, e))                     \
  X(int, execveat, (int d, const char* p, char* const* a, char* const* e, int f),           \
    (d, p, a, e, f))                                                                        \
  X(int, posix_spawn,                                                                       \
    (pid_t* pid, const char* p, const posix_spawn_file_actions_t* fa,                       \
     const posix_spawnattr_t* at, char* const* a, char* const* e),                          \
    (pid, p, fa, at, a, e))                                                                 \
  X(int, posix_spawnp,                                                                      \
    (pid_t* pid, const char* f, const posix_spawn_file_actions_t* fa,                       \
     const posix_spawnattr_t* at, char* const* a, char* const* e),                          \
    (pid, f, fa, at, a, e))                                                                 \
  X(int, sigaction, (int s, const struct sigaction* a, struct sigaction* o), (s, a, o))      \
  X(sighandler_t, signal, (int s, sighandler_t h), (s, h))                                  \
  X(sighandler_t, bsd_signal, (int s, sighandler_t h), (s, h))                              \
  X(sighandler_t, sysv_signal, (int s, sighandler_t h), (s, h))                             \
  X(int, siginterrupt, (int s, int f), (s, f))                                              \
  X(ssize_t, __read_chk, (int fd, void* b, size_t n, size_t bl), (fd, b, n, bl))           \
  X(ssize_t, __recv_chk, (int fd, void* b, size_t n, size_t bl, int f), (fd, b, n, bl, f))  \
  X(ssize_t, __recvfrom_chk,                                                                \
    (int fd, void* b, size_t n, size_t bl, int f, struct sockaddr* a, socklen_t* l),        \
    (fd, b, n, bl, f, a, l))                                                                \
  X(int, __poll_chk, (struct pollfd* p, nfds_t n, int t, size_t pl), (p, n, t, pl))         \
  X(int, __ppoll_chk,                                                                       \
    (struct pollfd* p, nfds_t n, const struct timespec* t, const sigset_t* s, size_t pl),   \
    (p, n, t, s, pl))

// The variadic ones, resolved alongside: X(name, type of the pointer)
using RsockFcntlFn = int (*)(int, int, ...);
using RsockIoctlFn = int (*)(int, unsigned long, ...);
using RsockSyscallFn = long (*)(long, ...);
// execl/execlp/execle are hooked for the switch back before exec; their hooks
// build the argument vector and call execv/execvp/execve, so these pointers
// are resolved (and exported) but not called.
using RsockExeclFn = int (*)(const char*, const char*, ...);
#define RSOCK_LIBC_VARIADIC(X) \
  X(fcntl, RsockFcntlFn)       \
  X(fcntl64, RsockFcntlFn)     \
  X(ioctl, RsockIoctlFn)       \
  X(syscall, RsockSyscallFn)   \
  X(execl, RsockExeclFn)       \
  X(execlp, RsockExeclFn)      \
  X(execle, RsockExeclFn)

// Not libc: liburing's ring setup, hooked so that a program that sets up
// io_uring keeps its connections on kernel TCP (its I/O would bypass the
// hooks; socket/rendezvous.h progress_io_uring_started). liburing may be
// loaded after librsock, or never: preload/hooks_uring.cc resolves these on
// each call. Exported like the libc hooks (tests/unit/check_exports.sh).
struct io_uring;
struct io_uring_params;
#define RSOCK_LIBURING_FUNCS(X)                                                             \
  X(int, io_uring_queue_init, (unsigned n, struct io_uring* r, unsigned f), (n, r, f))      \
  X(int, io_uring_queue_init_params, (unsigned n, struct io_uring* r, struct io_uring_params* p), \
    (n, r, p))                                                                              \
  X(int, io_uring_setup, (unsigned n, struct io_uring_params* p), (n, p))
