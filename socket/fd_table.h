// The fd table: fd -> Socket*, read on every hooked call without locks.
//
// Layout: one flat array of atomic pointers indexed by fd, reserved with
// mmap(MAP_NORESERVE) for every fd the kernel could ever hand out
// (/proc/sys/fs/nr_open, so a later setrlimit() cannot outgrow it); only the
// pages of fds actually used get memory. An fd that is not a tracked TCP
// socket reads as nullptr, which is all that most hooks ever pay: one load.
//
// Lifetime without locks or RCU: Socket objects come from a pool whose memory
// is never returned (type-stable), so a reader racing with close() may load a
// pointer to an object that is being freed or even reused, but never to
// unmapped or foreign memory. get() takes a reference only if the count is
// non-zero, then re-reads the slot: if the fd still maps to the same object,
// the reference is good (a reused object at the same fd is the right object).
#pragma once

#include <atomic>
#include <cstddef>
#include <utility>

#include "socket/socket.h"

namespace rsock::socket {

// A counted reference held for the duration of one hooked call.
class SocketRef {
 public:
  SocketRef() = default;
  explicit SocketRef(Socket* s) : s_(s) {}  // adopts one reference
  SocketRef(SocketRef&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  SocketRef& operator=(SocketRef&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  SocketRef(const SocketRef&) = delete;
  SocketRef& operator=(const SocketRef&) = delete;
  ~SocketRef() { reset(); }

  explicit operator bool() const { return s_ != nullptr; }
  Socket* operator->() const { return s_; }
  Socket* get() const { return s_; }
  void reset() {
    if (s_) std::exchange(s_, nullptr)->unref();
  }

 private:
  Socket* s_ = nullptr;
};

class FdTable {
 public:
  // The process-wide table; nullptr until the first socket is tracked
  // (so untracked programs never pay for the mapping).
  static FdTable* get_if_exists() { return g_table.load(std::memory_order_acquire); }
  static FdTable* get_or_create();

  // Lock-free lookup. Empty ref: fd is not a tracked socket.
  SocketRef lookup(int fd) const;

  // Makes fd name `s` (taking a new reference); drops what fd named before.
  void install(int fd, Socket* s);
  // fd no longer names anything; returns the reference the table held.
  SocketRef remove(int fd);
  // Every fd in [lo, hi] (inclusive, clamped) is forgotten.
  void remove_range(unsigned lo, unsigned hi);
  // The lowest tracked fd in [lo, hi] (clamped), or -1.
  int next_tracked(unsigned lo, unsigned hi) const;
  // In a fork child: every tracked socket's watch_lock is free again (a
  // thread of the parent may have held one at the fork). Scans up to the
  // highest fd ever installed.
  void reset_watch_locks_after_fork();

  size_t capacity() const { return capacity_; }
  // The highest fd ever installed (-1: none): bounds a scan of the table.
  int max_fd() const { return max_fd_.load(std::memory_order_acquire); }

 private:
  FdTable(std::atomic<Socket*>* slots, size_t capacity) : slots_(slots), capacity_(capacity) {}
  static std::atomic<FdTable*> g_table;
  std::atomic<Socket*>* slots_;
  size_t capacity_;
  std::atomic<int> max_fd_{-1};  // the highest fd ever installed
};

// Convenience for hooks: lookup that costs one load when nothing is tracked.
inline SocketRef lookup(int fd) {
  FdTable* t = FdTable::get_if_exists();
  return t ? t->lookup(fd) : SocketRef();
}

// A new socket from the pool (holding one reference), or nullptr when out
// of memory (the caller then leaves the fd untracked: plain kernel socket).
Socket* new_socket(int domain, Role role, bool nonblocking);

// fork(), right around the real call: neither the pool lock nor a lock
// inside librdmacm/libibverbs (transport/fork_guard.h) may be held by
// another thread across it. The fork guard comes last: every librsock step
// of the fork that calls those libraries is done by then.
void before_fork();
void after_fork(bool child);

}  // namespace rsock::socket
