// Socket: librsock's state for one open file description of a TCP stream
// socket (AF_INET/AF_INET6, SOCK_STREAM). dup()ed fds and fork()ed children
// share it exactly as they share the kernel's file description.
//
// Ownership: the fd table holds one reference per fd that names the socket;
// a hook holds one for the duration of a call (SocketRef). The object returns
// to the pool when the last reference goes (see socket/fd_table.h for why the
// memory itself is type-stable).
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cstdint>

#include "util/stats.h"
#include "util/stats_layout.h"

namespace rsock::socket {

class Stream;
struct EpollWatch;

enum class Role : uint8_t {
  kUnknown,    // socket() done, neither listen() nor connect() yet
  kListener,   // listen() succeeded
  kClient,     // connect() issued
  kAccepted,   // returned by accept()/accept4()
};

// Bumped by every fork() before it forks (both processes keep the new value)
// and by every exec or posix_spawn hook (the new program inherits the
// sockets): what a process knew of a socket before is not known after it.
// (system() and popen() spawn past every hook; their programs rarely set
// socket timeouts on inherited fds.)
inline constinit std::atomic<uint32_t> g_fork_generation{0};
inline uint32_t fork_generation() { return g_fork_generation.load(std::memory_order_relaxed); }

class Socket {
 public:
  // Called by the pool on (re)use; a fresh socket holds one reference.
  void init(int domain, Role role, bool nonblocking);

  int domain() const { return domain_; }
  Role role() const { return role_.load(std::memory_order_relaxed); }
  void set_role(Role r) { role_.store(r, std::memory_order_relaxed); }
  bool nonblocking() const { return nonblocking_.load(std::memory_order_relaxed); }
  void set_nonblocking(bool on) { nonblocking_.store(on, std::memory_order_relaxed); }
  // SO_RCVTIMEO and SO_SNDTIMEO are known to be the kernel's default (none):
  // socket() made it here and no setsockopt of either went through our hook
  // since, or accept() made it from such a listener (the kernel copies a
  // listener's timeouts). Its stream then need not read them before its
  // first sleep (Stream::socket_timeout: a getsockopt per connection).
  // Known only in the process that saw it so: a fork (either side), an exec
  // or posix_spawn, or sending the socket away (SCM_RIGHTS) lets another
  // process set them unseen, so the mark holds the generation it was made in.
  bool default_timeouts() const {
    const uint32_t v = default_timeouts_.load(std::memory_order_seq_cst);
    return v != 0 && v == fork_generation() + 1;  // (not at the generation that wraps to 0)
  }
  void set_default_timeouts(bool on) {
    default_timeouts_.store(on ? fork_generation() + 1 : 0, std::memory_order_seq_cst);
  }

  // Accounting for bytes that went through the kernel socket, into the
  // socket's rsock-stat slot (none when stats are off or for listeners).
  // A successful transfer also proves a pending connect() has completed.
  void on_tcp_rx(int64_t n) {
    if (n <= 0 || !slot_) return;
    if (!established_.load(std::memory_order_relaxed)) [[unlikely]] mark_established();
    slot_->add_rx(stats::Transport::kTcp, static_cast<uint64_t>(n));
  }
  void on_tcp_tx(int64_t n) {
    if (n <= 0 || !slot_) return;
    if (!established_.load(std::memory_order_relaxed)) [[unlikely]] mark_established();
    slot_->add_tx(stats::Transport::kTcp, static_cast<uint64_t>(n));
  }

  // rsock-stat bookkeeping (socket/socket.cc). open_stats: a connection
  // exists at fd (accepted, or connect() issued); `local` and `peer` may be
  // null (read from the socket then), and are what the caller already read.
  void open_stats(int fd, stats::Direction dir, const sockaddr* local, const sockaddr* peer,
                  bool established);
  void mark_established();
  stats::ConnSlot* slot() const { return slot_; }
  // Why the connection stayed on TCP before it had a stream (negative
  // cache, memlock, fd limit, ...): counted for rsock-stat and kept for
  // getsockopt(SOL_RSOCK, RSOCK_FALLBACK_REASON).
  void note_fallback(stats::FallbackReason reason) {
    fallback_.store(reason, std::memory_order_relaxed);
    stats::set_fallback(slot_, reason);
  }
  stats::FallbackReason fallback() const { return fallback_.load(std::memory_order_relaxed); }

  // The upgrade state, once the connection was found eligible (else null).
  // Set once, before any other thread can see the socket in the fd table
  // (connect/accept), and owned until the socket is released.
  Stream* stream() const { return stream_.load(std::memory_order_acquire); }
  void set_stream(Stream* st) { stream_.store(st, std::memory_order_release); }

  // fds naming this socket (the fd table's view). When the last one goes
  // the connection is closed as far as the application is concerned
  // (socket_released), even if references (an epoll registration, a call
  // in progress) keep the object itself alive a little longer.
  void add_name() { names_.fetch_add(1, std::memory_order_acq_rel); }
  void drop_name();
  uint32_t names() const { return names_.load(std::memory_order_acquire); }

  // Reference counting (see fd_table.h). try_ref fails once the count is 0:
  // the object is then free or being recycled and must not be used.
  bool try_ref();
  void ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void unref();

  // User-space epoll registrations of this socket (socket/readiness.cc):
  // with more than one, a set cannot rely on seeing every wakeup itself
  // (another consumes it), so it re-evaluates the socket on every wait.
  std::atomic<int> epoll_users{0};
  // EpollSet registrations of any kind that name this socket (readiness.cc).
  std::atomic<int> epoll_regs{0};
  // Set by connect/accept/listen once the socket's stream is decided (it has
  // one now or never will): a socket without a stream then needs no epoll
  // registration of ours, and the epoll_ctl hook passes straight to the
  // kernel (pass-through cost), unless one exists from before.
  std::atomic<bool> upgrade_decided{false};
  // Arrived with SCM_RIGHTS: other processes may hold the same socket (Node's
  // cluster primary binds a socket and sends it to every worker, which
  // listen()s on it). A listener on such a socket meets the others in its
  // port's named table (listener_started's `shared`).
  std::atomic<bool> received{false};
  // Every user-space epoll registration of this socket (readiness.cc),
  // linked through EpollWatch::wnext under watch_lock (a spin lock, the
  // innermost of all). Its stream's wake() pushes each onto its set's ready
  // list (socket_push_watches), so a stream needs no fd of its own in the
  // sets' shadow instances. Kept here, not in the Stream: a registration
  // holds a reference to the socket, while the stream may be deleted by the
  // progress thread once the socket's last fd is closed. (Empty whenever
  // the socket is free: every registration unlinks itself before it drops
  // its reference; init() leaves it alone, a late push may hold the lock.)
  EpollWatch* watches = nullptr;
  std::atomic<bool> watch_lock{false};

 private:
  friend class SocketPool;
  std::atomic<uint32_t> refs_{0};
  std::atomic<uint32_t> names_{0};
  int domain_ = 0;
  std::atomic<Role> role_{Role::kUnknown};
  std::atomic<bool> nonblocking_{false};
  std::atomic<uint32_t> default_timeouts_{0};  // fork_generation() + 1 when known, else 0
  std::atomic<bool> established_{false};
  std::atomic<stats::FallbackReason> fallback_{stats::FallbackReason::kNone};
  int fd_ = -1;                       // first fd, for addresses and rsock-stat
  stats::ConnSlot* slot_ = nullptr;   // owned: closed with the last reference
  std::atomic<Stream*> stream_{nullptr};
  Socket* next_free_ = nullptr;  // pool free list link
};

// Whether (domain, type, protocol) from socket() is something librsock tracks:
// TCP stream sockets only; UDP, UNIX, raw, SCTP... go straight to the kernel.
bool is_tracked_kind(int domain, int type, int protocol);
// The same for an open fd (a socket we did not see created: inherited
// across exec, received with SCM_RIGHTS): its domain if it is one librsock
// tracks, 0 otherwise. One getsockopt for a non-socket or a non-IP socket,
// three for a TCP one.
int tracked_domain(int fd);

}  // namespace rsock::socket
