#include "socket/socket.h"

#include <netinet/in.h>
#include <sys/mman.h>

#include <atomic>
#include <new>
#include <utility>

#include "socket/fd_table.h"
#include "socket/rendezvous.h"
#include "util/adaptive_spin.h"
#include "util/spin_lock.h"
#include "util/stats.h"
#include "util/sys.h"
#include "transport/fork_guard.h"

namespace rsock::socket {

bool is_tracked_kind(int domain, int type, int protocol) {
  if (domain != AF_INET && domain != AF_INET6) return false;
  if ((type & ~(SOCK_NONBLOCK | SOCK_CLOEXEC)) != SOCK_STREAM) return false;
  return protocol == 0 || protocol == IPPROTO_TCP;
}

int tracked_domain(int fd) {
  int domain = 0, type = 0, proto = 0;
  socklen_t len = sizeof domain;
  if (sys::libc.getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 ||
      (domain != AF_INET && domain != AF_INET6))
    return 0;
  len = sizeof type;
  if (sys::libc.getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) return 0;
  len = sizeof proto;
  if (sys::libc.getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &len) != 0) return 0;
  return is_tracked_kind(domain, type, proto) ? domain : 0;
}

void Socket::init(int domain, Role role, bool nonblocking) {
  domain_ = domain;
  role_.store(role, std::memory_order_relaxed);
  nonblocking_.store(nonblocking, std::memory_order_relaxed);
  default_timeouts_.store(0, std::memory_order_relaxed);
  established_.store(false, std::memory_order_relaxed);
  fallback_.store(stats::FallbackReason::kNone, std::memory_order_relaxed);
  fd_ = -1;
  names_.store(0, std::memory_order_relaxed);
  slot_ = nullptr;
  stream_.store(nullptr, std::memory_order_relaxed);
  epoll_users.store(0, std::memory_order_relaxed);
  epoll_regs.store(0, std::memory_order_relaxed);
  upgrade_decided.store(false, std::memory_order_relaxed);
  received.store(false, std::memory_order_relaxed);
  // Publishing the count last: a stale reader's try_ref() can only succeed
  // once the object is fully initialised.
  refs_.store(1, std::memory_order_release);
}

bool Socket::try_ref() {
  uint32_t n = refs_.load(std::memory_order_acquire);
  while (n != 0) {
    if (refs_.compare_exchange_weak(n, n + 1, std::memory_order_acq_rel)) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------
// The pool. Objects are carved out of mmap()ed chunks that are never unmapped
// (type-stable memory, see fd_table.h). Release is a lock-free push, so close()
// stays async-signal-safe; allocation pops under a spin lock, which rules out
// the ABA problem of concurrent pops.
// ---------------------------------------------------------------------------
class SocketPool {
 public:
  Socket* pop() {
    lock();
    Socket* s = head_.load(std::memory_order_acquire);
    while (s && !head_.compare_exchange_weak(s, s->next_free_, std::memory_order_acq_rel)) {
    }
    if (!s) s = grow_locked();
    unlock();
    return s;
  }
  void push(Socket* s) {
    Socket* h = head_.load(std::memory_order_relaxed);
    do {
      s->next_free_ = h;
    } while (!head_.compare_exchange_weak(h, s, std::memory_order_release));
  }
  void lock() { spin_lock(lock_); }
  void unlock() { spin_unlock(lock_); }

 private:
  // Returns one new object and pushes the rest of a fresh chunk.
  Socket* grow_locked() {
    constexpr size_t kChunk = 64 * 1024;
    void* mem = mmap(nullptr, kChunk, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return nullptr;
    auto* objs = static_cast<Socket*>(mem);
    size_t n = kChunk / sizeof(Socket);
    for (size_t i = 0; i < n; i++) new (&objs[i]) Socket();
    for (size_t i = 1; i < n; i++) push(&objs[i]);
    return &objs[0];
  }
  std::atomic<Socket*> head_{nullptr};
  std::atomic<bool> lock_{false};
};

static constinit SocketPool g_pool;

void Socket::open_stats(int fd, stats::Direction dir, const sockaddr* local, const sockaddr* peer,
                        bool established) {
  fd_ = fd;
  if (slot_) return;  // connect() called again on the same socket
  // The kernel binds the local address at connect(), also one still in
  // progress: show it from the start, not 0.0.0.0:0 until established.
  sockaddr_storage own{};
  socklen_t llen = sizeof own;
  if (!local && !established && sys::libc.getsockname(fd, reinterpret_cast<sockaddr*>(&own), &llen) == 0)
    local = reinterpret_cast<sockaddr*>(&own);
  slot_ = stats::open_conn(fd, dir, local, peer);
  // Established with both addresses given (connect, accept read them once
  // for the stats and the upgrade): nothing left to read.
  const bool known = local && peer && (peer->sa_family == AF_INET || peer->sa_family == AF_INET6);
  if (established && known) {
    if (!established_.exchange(true, std::memory_order_relaxed) && slot_)
      stats::set_state(slot_, stats::ConnState::kEstablished);
  } else if (established) {
    mark_established();
  } else {
    stats::set_state(slot_, stats::ConnState::kConnecting);
  }
}

// Both addresses are known once the connection exists; until RDMA upgrades
// exist (issue 4) an established socket is carried by TCP.
void Socket::mark_established() {
  if (established_.exchange(true, std::memory_order_relaxed) || !slot_) return;
  sockaddr_storage local{}, peer{};
  socklen_t llen = sizeof local, plen = sizeof peer;
  bool ok = sys::libc.getsockname(fd_, reinterpret_cast<sockaddr*>(&local), &llen) == 0 &&
            sys::libc.getpeername(fd_, reinterpret_cast<sockaddr*>(&peer), &plen) == 0;
  if (ok) stats::set_addresses(slot_, reinterpret_cast<sockaddr*>(&local),
                               reinterpret_cast<sockaddr*>(&peer));
  stats::set_state(slot_, stats::ConnState::kEstablished);
}

void Socket::drop_name() {
  if (names_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  // Last fd closed: the connection is gone for the application. An RDMA
  // stream still has to deliver what was written: the progress thread
  // finishes it, and reports in the stats slot until then.
  socket_released(this);
}

void Socket::unref() {
  if (refs_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (stream()) slot_ = nullptr;  // the stream owns and closes the slot
  else if (slot_) stats::close_conn(std::exchange(slot_, nullptr));
  g_pool.push(this);
}

Socket* new_socket(int domain, Role role, bool nonblocking) {
  Socket* s = g_pool.pop();
  if (s) s->init(domain, role, nonblocking);
  return s;
}

void before_fork() {
  g_fork_generation.fetch_add(1, std::memory_order_relaxed);  // (both sides keep it)
  g_pool.lock();
  transport::fork_guard::lock_for_fork();
}

void after_fork(bool child) {
  if (child) {
    transport::fork_guard::reinit_child();
    SpinPlace::after_fork_child();
    // A parent thread may have held a socket's watch_lock at the fork.
    if (FdTable* t = FdTable::get_if_exists()) t->reset_watch_locks_after_fork();
  } else {
    transport::fork_guard::unlock_parent();
  }
  g_pool.unlock();
}

}  // namespace rsock::socket
