// Socket: librsock's state for one open file description of a TCP stream
// socket (AF_INET/AF_INET6, SOCK_STREAM). dup()ed fds and fork()ed children
// share it exactly as they share the kernel's file description.
//
// Ownership: the fd table holds one reference per fd that names the socket;
// a hook holds one for the duration of a call (SocketRef). The object returns
// to the pool when the last reference goes (see socket/fd_table.h for why the
// memory itself is type-stable).
#pragma once

#include <atomic>
#include <cstdint>
#include <sys/socket.h>

namespace rsock::socket {

enum class Role : uint8_t {
  kUnknown,    // socket() done, neither listen() nor connect() yet
  kListener,   // listen() succeeded
  kClient,     // connect() issued
  kAccepted,   // returned by accept()/accept4()
};

// Byte and call counters of one socket, by path. Relaxed atomics: a socket
// may be used by several threads at once, readers only want totals.
struct IoCounters {
  std::atomic<uint64_t> tcp_rx_bytes{0}, tcp_tx_bytes{0};
  std::atomic<uint64_t> tcp_rx_ops{0}, tcp_tx_ops{0};
};

class Socket {
 public:
  // Called by the pool on (re)use; a fresh socket holds one reference.
  void init(int domain, Role role, bool nonblocking);

  int domain() const { return domain_; }
  Role role() const { return role_.load(std::memory_order_relaxed); }
  void set_role(Role r) { role_.store(r, std::memory_order_relaxed); }
  bool nonblocking() const { return nonblocking_.load(std::memory_order_relaxed); }
  void set_nonblocking(bool on) { nonblocking_.store(on, std::memory_order_relaxed); }

  // Accounting for bytes that went through the kernel socket.
  void on_tcp_rx(int64_t n) {
    if (n <= 0) return;
    io_.tcp_rx_bytes.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    io_.tcp_rx_ops.fetch_add(1, std::memory_order_relaxed);
  }
  void on_tcp_tx(int64_t n) {
    if (n <= 0) return;
    io_.tcp_tx_bytes.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    io_.tcp_tx_ops.fetch_add(1, std::memory_order_relaxed);
  }
  const IoCounters& io() const { return io_; }

  // Reference counting (see fd_table.h). try_ref fails once the count is 0:
  // the object is then free or being recycled and must not be used.
  bool try_ref();
  void ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void unref();

 private:
  friend class SocketPool;
  std::atomic<uint32_t> refs_{0};
  int domain_ = 0;
  std::atomic<Role> role_{Role::kUnknown};
  std::atomic<bool> nonblocking_{false};
  IoCounters io_;
  Socket* next_free_ = nullptr;  // pool free list link
};

// Whether (domain, type, protocol) from socket() is something librsock tracks:
// TCP stream sockets only; UDP, UNIX, raw, SCTP... go straight to the kernel.
bool is_tracked_kind(int domain, int type, int protocol);

}  // namespace rsock::socket
