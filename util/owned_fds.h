// librsock's own file descriptors, out of the application's way.
//
// The kernel hands out the lowest free fd number. Every fd librsock keeps
// open (a connection's event channels, timers, eventfds, epoll sets, the
// device's command fd) would take a number the program would otherwise have
// got, so its next socket() or open() would return a different number than
// without the library: programs that size tables by fd number, compare fd
// numbers in tests, or use select() then behave differently. So each such fd
// is moved right after creation to the top of the fd space: below
// min(RLIMIT_NOFILE soft limit, kTop), filled downwards in bands of 64
// (F_DUPFD_CLOEXEC returns the lowest free number at or above its argument,
// atomically, so a number the program holds is never taken). Only when the
// upper half of the range is full does a fd stay where it was created.
//
// Owned fds are recorded in a bitmap: the close()/close_range() hooks leave
// them open when the program closes numbers it never opened (daemons close
// "every other fd" after start-up), and a library that closes an owned fd
// itself calls disown() first.
#pragma once

namespace rsock::sys {

// Moves fd to the top of the fd space and records it as owned. Returns the
// number to use from now on (fd itself if it could not move); fd < 0 is
// returned unchanged.
int own_fd(int fd);
// A duplicate of fd (close-on-exec) at the top of the fd space, owned; -1
// on failure. One syscall where own_fd(dup(fd)) would take three.
int dup_owned(int fd);
// The lowest owned fd >= from, or -1 (a word-wise scan of the bitmap).
int next_owned_fd(int from);
// The fd is about to be closed by librsock or a library it calls.
void disown_fd(int fd);
// Whether fd is one of librsock's own (lock-free; false for fd < 0).
bool owned_fd(int fd);
// disown_fd() + close().
void close_owned(int fd);
// How many fds librsock owns now.
int owned_fd_count();
// Whether librsock may own n more fds: it keeps to the upper half of the fd
// space below min(RLIMIT_NOFILE, kOwnedFdTop), so the program always has
// the lower half for itself (one getrlimit).
bool owned_fd_room(int n);

// Above this, the kernel's per-process fd table would grow (8 bytes per
// number) only to keep our fds far from the program's.
constexpr int kOwnedFdTop = 65536;

}  // namespace rsock::sys
