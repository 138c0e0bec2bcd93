// What every hook needs: the real libc functions, the recursion guard, errno
// discipline and the export attribute.
//
// Shape of a hook (five lines, no logic of its own beyond dispatch):
//   RSOCK_HOOK ssize_t read(int fd, void* b, size_t n) noexcept {
//     HookScope h;
//     if (auto s = h.tracked(fd)) return h.io_rx(s, real().read(fd, b, n));
//     return real().read(fd, b, n);
//   }
#pragma once

#include <cerrno>

#include <signal.h>
#include <sys/uio.h>

#include <span>

#include "socket/fd_table.h"
#include "socket/signals.h"
#include "socket/stream.h"
#include "util/status.h"
#include "util/sys.h"

#define RSOCK_HOOK extern "C" __attribute__((visibility("default")))

namespace rsock::preload {

// Fills sys::libc with dlsym(RTLD_NEXT, ...) once. Safe to call from any
// hook at any time, also before our constructors have run.
void resolve_libc();
extern std::atomic<bool> g_resolved;

inline const sys::Libc& real() {
  if (!g_resolved.load(std::memory_order_acquire)) [[unlikely]]
    resolve_libc();
  return sys::libc;
}

// Depth of librsock's own code on this thread (socket/signals.h). While > 0
// every hook is a plain pass-through: calls that rdma-core or our own code
// make must never be interpreted as the application's. Leaving depth 0 runs
// the application's signal handlers that came meanwhile (socket/signals.h).
using socket::t_depth;

class HookScope {
 public:
  HookScope() : saved_errno_(errno) { ++t_depth; }
  ~HookScope() {
    const bool outer = --t_depth == 0;
    std::atomic_signal_fence(std::memory_order_seq_cst);  // (the trampoline reads t_depth)
    if (outer && socket::t_deferred.load(std::memory_order_relaxed) != 0) [[unlikely]]
      socket::run_deferred_signals();
  }
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;

  // The program's own call (not one made by librsock or a library it calls).
  bool outermost() const { return t_depth == 1; }

  // The tracked socket behind fd, or an empty ref (also when re-entered).
  socket::SocketRef tracked(int fd) const {
    if (t_depth > 1) return {};
    return socket::lookup(fd);
  }

  // Converts a Status into the libc convention: value, or -1 with errno set.
  // On success errno is restored, so nothing the library did leaks out.
  template <typename T>
  T finish(const Status<T>& st) {
    if (!st.ok()) {
      errno = st.error();
      return static_cast<T>(-1);
    }
    errno = saved_errno_;
    return *st;
  }
  int finish(const Status<void>& st) {
    errno = st.ok() ? saved_errno_ : st.error();
    return st.ok() ? 0 : -1;
  }
  // A kernel result passed through; errno is the kernel's on failure and ours
  // is put back on success.
  template <typename T>
  T pass(T r) {
    if (r >= 0) errno = saved_errno_;
    return r;
  }
  // I/O on a tracked socket that went to the kernel: count it.
  template <typename T>
  T io_rx(const socket::SocketRef& s, T r) {
    if (r > 0) s->on_tcp_rx(r);
    return pass(r);
  }
  template <typename T>
  T io_tx(const socket::SocketRef& s, T r) {
    if (r > 0) s->on_tcp_tx(r);
    return pass(r);
  }

 private:
  int saved_errno_;
};

// Around a call the outermost hook hands to the kernel and that may block
// (read, accept, poll, ...): the thread is at depth 0 for it. Nothing of
// librsock's is held there (at most the socket's reference), so an
// application handler that runs meanwhile is the program's own: its socket
// calls are interpreted, and one that siglongjmps out leaves the depth as
// the program's code needs it (socket/signals.h; only the reference leaks).
// A nested call (depth > 1) stays nested.
// Handlers queued earlier in the hook run first: the kernel call may block
// for long, and the kernel would have run them before it.
class KernelCall {
 public:
  KernelCall() : depth_(t_depth) {
    if (depth_ != 1) return;
    t_depth = 0;
    std::atomic_signal_fence(std::memory_order_seq_cst);
    if (socket::t_deferred.load(std::memory_order_relaxed) != 0) [[unlikely]]
      socket::run_deferred_signals();
  }
  ~KernelCall() { t_depth = depth_; }
  KernelCall(const KernelCall&) = delete;
  KernelCall& operator=(const KernelCall&) = delete;

 private:
  int depth_;
};
#define RSOCK_KERNEL(call) ({ ::rsock::preload::KernelCall kc_; call; })

// The stream that governs a tracked socket's I/O, or null (plain kernel TCP).
inline socket::Stream* governing(const socket::SocketRef& s) {
  socket::Stream* st = s->stream();
  return st && st->governs() ? st : nullptr;
}

// I/O through a stream. Returns false when the stream fell back to plain
// TCP meanwhile: the caller then does the call on the kernel as usual.
// EPIPE raises SIGPIPE unless MSG_NOSIGNAL, as the kernel would.
bool stream_recv(HookScope& h, const socket::SocketRef& s, std::span<const iovec> iov, int flags,
                 ssize_t* out);
bool stream_send(HookScope& h, const socket::SocketRef& s, std::span<const iovec> iov, int flags,
                 ssize_t* out);

// Sum of a msghdr's/mmsghdr's transferred bytes, for counters.
ssize_t mmsg_bytes(const struct mmsghdr* m, int n);

// Starts tracking a TCP socket that just appeared at `fd` (socket/accept).
// default_timeouts: see socket::Socket::default_timeouts().
void track_new(int fd, int domain, socket::Role role, bool nonblocking,
               bool default_timeouts = false);
// fd passing: TCP sockets that arrived with SCM_RIGHTS (recvmsg on a UNIX
// socket) join the fd table as plain TCP (the sender switched them back).
void adopt_received_fds(const struct msghdr* m);

// An fd the kernel just gave out that we do not track: forget whatever a
// missed close left in its slot (e.g. a raw syscall(SYS_close)).
inline void forget(int fd) {
  if (auto* t = socket::FdTable::get_if_exists()) t->remove(fd);
}

}  // namespace rsock::preload
