// Stream lifecycle and the switch protocol (socket/upgrade_wire.h).
#include "socket/stream.h"

#include "socket/backlog.h"

#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <utility>

#include "socket/process.h"
#include "socket/readiness.h"
#include "socket/rendezvous.h"
#include "socket/tcp_hub.h"
#include "transport/cm_hub.h"
#include "util/log.h"
#include "util/owned_fds.h"
#include "util/stats.h"
#include "util/clock.h"
#include "util/sys.h"
#include "transport/fork_guard.h"

namespace rsock::socket {

namespace {

// The most of the application's writes a running switch holds (holds()):
// enough for the requests and replies programs write right after connect
// or accept, which a kernel socket takes at once.
constexpr size_t kMaxHeldBytes = 64 * 1024;

// A test knob: on when the variable is "1" (read once, by its caller).
bool knob(const char* name) {
  const char* e = getenv(name);
  return e != nullptr && e[0] == '1';
}

// RSOCK_DEBUG_BREAK_SWITCH=1 (tests only): every switch's RDMA connection
// fails right after this end sent READY, before any marker.
bool debug_break_switch() {
  static const bool on = knob("RSOCK_DEBUG_BREAK_SWITCH");
  return on;
}

// RSOCK_DEBUG_REVERT_AT_SWITCH=1 (tests only): a server switches back the
// moment its switch ends (as a fork right then does), and a client reads
// the server's marker only once its RDMA connection died, so that the
// server's record always meets a client still switching
// (upgrade.switch.i_peer_reverts_at_switch; Stream::maybe_join_revert).
bool debug_revert_at_switch() {
  static const bool on = knob("RSOCK_DEBUG_REVERT_AT_SWITCH");
  return on;
}

// RSOCK_DEBUG_EXIT_AT_READY=1 (tests only): a client process ends (exit_group)
// the moment a switch of its gets the server's READY, before its marker: as
// a client that exits right after its reply while its rendezvous runs
// (redis-cli), which the server sees as both paths ending at the client's
// offer (multiproc.exit_mid_switch).
bool debug_exit_at_ready() {
  static const bool on = knob("RSOCK_DEBUG_EXIT_AT_READY");
  return on;
}

// rdma_cm events reach a connection through the shared channel (cm_hub):
// its waiters look again.
void notify_stream(void* st) { static_cast<Stream*>(st)->wake(); }
// A completion event (cq_hub): see Stream::completion_event.
void notify_completion(void* st) { static_cast<Stream*>(st)->completion_event(); }

// Upgrading again (below).
// The client's attempts, each after the previous one failed (a path that
// is still down: a link flap outlasts the first ones).
constexpr uint64_t kReupDelaysNs[] = {500'000'000, 2'000'000'000, 8'000'000'000,
                                      30'000'000'000};
constexpr int kReupTries = int(sizeof kReupDelaysNs / sizeof kReupDelaysNs[0]);

// How long one attempt may take (the client's rendezvous bound).
uint64_t reup_attempt_ns() {
  const auto& t = process_config().tunables;
  return uint64_t{std::max(t.upgrade_timeout_ms, t.connect_timeout_ms)} * 1000000;
}

// How often a stream held by other processes too looks for holders that
// died without closing (Stream::advance_locked).
constexpr uint64_t kReapGapNs = 100'000'000;
constexpr uint64_t kSoleLookNs = 10'000'000;

// How long a server waits for the client's attempts (every one of them).
uint64_t reup_window_ns() {
  uint64_t w = 0;
  for (uint64_t d : kReupDelaysNs) w += d + reup_attempt_ns();
  return w;
}


// Cookies come from the kernel's random pool 64 at a time: a getrandom per
// connection was one more syscall in every connect() and accept() (each
// costs tens of microseconds in the TCG guests). The batch is the process's;
// a fork child starts a fresh one (thread_wake_after_fork_child), so parent
// and child never hand out the same cookie.
constexpr int kCookieBatch = 64;
std::mutex g_cookie_mu;
uint64_t g_cookies[kCookieBatch];
int g_cookies_left = 0;

uint64_t random_cookie() {
  std::lock_guard lk(g_cookie_mu);
  for (;;) {
    if (g_cookies_left == 0) {
      if (getrandom(g_cookies, sizeof g_cookies, 0) == sizeof g_cookies) {
        g_cookies_left = kCookieBatch;
      } else {
        g_cookies[0] = now_ns() * 0x9e3779b97f4a7c15ull;
        g_cookies_left = 1;
      }
    }
    uint64_t c = g_cookies[--g_cookies_left];
    g_cookies[g_cookies_left] = 0;  // handed out once
    if (c != 0) return c;
  }
}

}  // namespace

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kPending: return "pending";
    case Phase::kSwitching: return "switching";
    case Phase::kRdma: return "rdma";
    case Phase::kPlain: return "tcp";
    case Phase::kBroken: return "broken";
    case Phase::kReverting: return "reverting";
  }
  return "?";
}

std::atomic<int> g_streams_alive{0};

bool rdma_available() {
  static const bool kAvailable = [] {
    int n = 0;
    ibv_device** list = transport::guarded::ibv_get_device_list(&n);
    if (list) transport::guarded::ibv_free_device_list(list);
    return n > 0;
  }();
  return kAvailable;
}

Stream::Stream(int tcp_fd, bool client, const sockaddr_storage& local,
               const sockaddr_storage& peer, stats::ConnSlot* slot)
    : tcp_fd_(tcp_fd), tcp_fd_pub_(tcp_fd), client_(client), local_(local), peer_(peer),
      slot_(slot) {
  g_streams_alive.fetch_add(1, std::memory_order_relaxed);
  my_cookie_ = random_cookie();
  born_ns_ = coarse_now_ns();  // (deadlines, logs: a tick's precision will do, and no syscall)
  const auto& t = process_config().tunables;
  // A client's rendezvous starts up to upgrade_delay_ms late: both ends
  // wait that much longer for it (the server's window counting only
  // upgrade_timeout_ms from accept was 10 ms+ shorter than its client's).
  deadline_ns_ = born_ns_ + (uint64_t{t.upgrade_timeout_ms} + t.upgrade_delay_ms) * 1000000;
  stats::set_state(slot_, stats::ConnState::kUpgrading);
}

Stream::~Stream() {
  g_streams_alive.fetch_sub(1, std::memory_order_relaxed);
  conn_.reset();
  if (slot_)
    LOG_DEBUG("fd %d: stream finished: rdma tx/rx %llu/%llu bytes", tcp_fd_,
              (unsigned long long)slot_->traffic.tx_bytes[1].load(),
              (unsigned long long)slot_->traffic.rx_bytes[1].load());
  stats::close_conn(slot_);
  Backlog::release(std::exchange(backlog_, nullptr));
  unwatch_tcp_locked();  // (nobody else can reach the stream now)
  // Our dup, if the application closed its number: the kernel's FIN (or
  // RST) now. Never the application's own number (a stream deleted while
  // the application holds it: one that failed to start).
  if (tcp_owned_.load(std::memory_order_relaxed)) sys::close_owned(tcp_fd_);
  if (scratch_) munmap(scratch_, kScratchSize);
}

Stream::Scratch::Scratch(Stream& s) : s_(s) {
  s_.scratch_mu_.lock();
  ++t_held_locks;
  if (!s_.scratch_) {
    void* m = mmap(nullptr, kScratchSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) s_.scratch_ = static_cast<std::byte*>(m);
  }
  if (s_.scratch_) buf_ = {s_.scratch_, kScratchSize};
}



namespace {
// Thread wake fds are never closed while the process may still poke them: a
// poker loads a sleeper's fd, the sleeper wakes, its thread exits; were the
// fd closed then, the application could get its number and the late poke
// would write 8 bytes into the application's file. An exiting thread
// parks its fd here for the next thread instead (a pool as large as the
// most threads that ever slept at once; a stale poke in a parked fd is
// read at its next owner's first sleep). Lock-free: threads exit anywhere.
constexpr int kParkedWakeFds = 256;
// Slots hold fd + 1, so that zero-initialised storage reads as empty
// (thread exits can come before our dynamic initialisers run).
std::atomic<int> g_parked_wake[kParkedWakeFds];
int take_parked() {
  for (auto& slot : g_parked_wake) {
    int v = slot.load(std::memory_order_relaxed);
    if (v != 0 && slot.compare_exchange_strong(v, 0, std::memory_order_acq_rel)) return v - 1;
  }
  return -1;
}
struct ThreadWake {
  int fd = -1;
  ~ThreadWake() {
    if (fd < 0) return;
    for (auto& slot : g_parked_wake) {
      int empty = 0;
      if (slot.compare_exchange_strong(empty, fd + 1, std::memory_order_acq_rel)) {
        fd = -1;
        return;
      }
    }
    sys::close_owned(std::exchange(fd, -1));  // more than kParkedWakeFds parked: rare
  }
};
thread_local ThreadWake t_wake __attribute__((tls_model("initial-exec")));
}  // namespace

int thread_wake_fd() {
  if (t_wake.fd < 0) t_wake.fd = take_parked();
  if (t_wake.fd < 0) t_wake.fd = sys::own_fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  return t_wake.fd;
}

void drain_thread_wake() {
  uint64_t v;
  if (t_wake.fd >= 0) (void)!sys::libc.read(t_wake.fd, &v, sizeof v);
}

void thread_wake_after_fork_child() {
  new (&g_cookie_mu) std::mutex;  // (another thread may have held it at the fork)
  g_cookies_left = 0;
  // (Only the forking thread exists here: nothing pokes.)
  if (t_wake.fd >= 0) sys::close_owned(std::exchange(t_wake.fd, -1));
  for (auto& slot : g_parked_wake)
    if (int v = slot.exchange(0, std::memory_order_relaxed); v != 0) sys::close_owned(v - 1);
}

bool Stream::add_sleeper(int fd) {
  if (fd < 0) return false;
  for (auto& slot : sleeper_fds_) {
    int free_slot = -1;
    if (slot.compare_exchange_strong(free_slot, fd, std::memory_order_seq_cst)) return true;
  }
  return false;
}

void Stream::remove_sleeper(int fd) {
  for (auto& slot : sleeper_fds_) {
    int mine = fd;
    if (slot.compare_exchange_strong(mine, -1, std::memory_order_acq_rel)) return;
  }
}

void Stream::poke_sleepers() {
  uint64_t one = 1;
  for (auto& slot : sleeper_fds_)
    if (int fd = slot.load(std::memory_order_seq_cst); fd >= 0)
      (void)!sys::libc.write(fd, &one, sizeof one);
}

void Stream::wake() {
  gen_.fetch_add(1, std::memory_order_seq_cst);
  poke_sleepers();
  push_watches();
}

void Stream::push_watches() {
  // Every epoll registration of the socket: its set looks again.
  if (Socket* s = owner_.load(std::memory_order_acquire)) socket_push_watches(s, &owner_);
}

void Stream::release_owner() {
  Socket* s = owner_.load(std::memory_order_acquire);
  if (!s) return;
  socket_push_watches(s, &owner_);  // the sets drop them (names() == 0)
  socket_clear_owner(s, &owner_);
}

void Stream::set_phase(Phase p) {
  Phase was = phase_.exchange(p, std::memory_order_acq_rel);
  if (p == Phase::kRdma) rdma_ever_ = true;
  if (p == Phase::kPlain) governs_.store(false, std::memory_order_release);
  if ((p == Phase::kPlain || p == Phase::kBroken) && holders_) {
    // From here on this process's bytes on the socket go uncounted: no
    // holder may upgrade it again from the slot's positions.
    holders::poison(holders_);
    shared_.store(false, std::memory_order_release);
  }
  if (p == Phase::kPending && was != Phase::kPending && !client_) server_awaits_request();
  // On RDMA the TCP socket stays silent (the progress thread's idle watch
  // covers it); plain or broken, the emulation no longer looks at it.
  if (p == Phase::kRdma || p == Phase::kPlain || p == Phase::kBroken) unwatch_tcp_locked();
  if (p != was) want_loop();  // what the progress thread must do for it changed
}

bool Stream::tcp_hub_wanted() const {
  Phase p = phase();
  return (p == Phase::kPending || p == Phase::kSwitching || p == Phase::kReverting) &&
         !orphaned_ && tcp_fd_ >= 0;
}

void Stream::watch_tcp() {
  if (hub_fd_.load(std::memory_order_acquire) >= 0) return;
  std::lock_guard lk(mu_);
  if (hub_fd_.load(std::memory_order_relaxed) >= 0 || !tcp_hub_wanted()) return;
  std::lock_guard hl(transport::cm_hub::mu());
  if (tcp_hub::add_locked(tcp_fd_, this)) hub_fd_.store(tcp_fd_, std::memory_order_release);
}

void Stream::unwatch_tcp_locked() {
  int fd = hub_fd_.load(std::memory_order_relaxed);
  if (fd < 0) return;
  std::lock_guard hl(transport::cm_hub::mu());
  tcp_hub::del_locked(fd);
  hub_fd_.store(-1, std::memory_order_release);
}

// Under cm_hub::mu() (no blocking lock): the waiters look again, whichever
// thread read the hub (its epoll sets through the pushes; a blocking sleeper
// polls the TCP fd itself). New send room on TCP counts for edge-triggered
// EPOLLOUT as room on RDMA does.
void Stream::tcp_event(uint32_t events) {
  if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) tx_gen_.fetch_add(1, std::memory_order_acq_rel);
  announce();
}

bool Stream::retire_fd(int fd, bool last) {
  std::lock_guard lk(mu_);
  if (tcp_owned_.load(std::memory_order_relaxed) || tcp_fd_ != fd || fd < 0) return false;
  Phase p = phase();
  // A client whose rendezvous has not started (upgrade_delay_ms, a
  // connection of one request and one reply) has moved every byte on TCP
  // and never will move one elsewhere: as plain. (A dup kept its FIN back
  // until the progress thread's next look, and cost a syscall or two.) So
  // has a server whose client's request has not come (conn_ is set when it
  // is accepted): a request that comes after the close finds the stream
  // closed, as it would with the dup (orphan() abandons a pending
  // rendezvous). Not a server stream shared with another process (fork, fd
  // passing): the slot's other holders go on with it. A dup cost the
  // accepting side of a short connection 4 syscalls and held its FIN back.
  const bool unstarted = last && p == Phase::kPending && !conn_ && !reup_ && !held_pending() &&
                         (client_ || (!shared_.load(std::memory_order_relaxed) && !holders_ &&
                                      !plain_when_drained_));
  if (unstarted) drop_start_request();
  if (((p == Phase::kPlain || unstarted) && !closed_second_) || p == Phase::kBroken) {
    // Nothing of ours is left to deliver: the kernel ends the connection
    // with the application's close, as it would without librsock (and an
    // epoll registration of fd ends with it, which a dup would keep alive).
    unwatch_tcp_locked();
    set_tcp_fd(-1, false);
    return true;
  }
  int d = sys::dup_owned(fd);
  if (d < 0) {
    // No fd left even for this: once the application's close returns, the
    // kernel ends the connection; the stream goes on without a TCP socket.
    LOG_WARN("fd %d: no fd for librsock's reference to the connection (%s): the kernel closes "
             "it with the application's close", fd, strerror(errno));
    unwatch_tcp_locked();
    set_tcp_fd(-1, false);
    return true;
  }
  if (int h = hub_fd_.load(std::memory_order_relaxed); h >= 0) {
    std::lock_guard hl(transport::cm_hub::mu());
    tcp_hub::del_locked(h);
    hub_fd_.store(tcp_hub::add_locked(d, this) ? d : -1, std::memory_order_release);
  }
  set_tcp_fd(d, true);
  return true;
}

unsigned long long Stream::us_since_start() const { return (now_ns() - born_ns_) / 1000; }

// Progress thread. It never waits for the stream's lock here: an
// application that writes in a loop re-takes it at once, and a blocking lock
// waited up to 700 ms in the VM. The start stays due instead, and whichever
// comes first, the application's next call (advance_locked) or the next
// tick, makes it.
void Stream::start_client() {
  std::unique_lock lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) {
    request_start(1);
    return;
  }
  start_client_locked();
}

// Under mu_ (it may drop it to fall back, as advance_locked does).
void Stream::start_client_locked() {
  reup_at_ns_.store(0, std::memory_order_release);
  // Fell back (fork), closed, or shared with another process (fd passing,
  // which waits to be its only holder) meanwhile: the progress thread takes
  // the request and makes the start without the registry's lock.
  if (phase() != Phase::kPending || orphaned_ || conn_ || shared_by_fork()) return;
  if (reup_) {
    reup_waiting_.store(false, std::memory_order_release);
    deadline_ns_ = now_ns() + reup_attempt_ns();
  }
  uint16_t port = ntohs(reinterpret_cast<const sockaddr_in*>(&peer_)->sin_port);  // same offset in v6
  connect_locked(static_cast<uint16_t>(port + process_config().tunables.port_offset));
}

// Under mu_: the rendezvous request to rdma_cm port `rport` of the TCP peer's
// address (the listener's, or where its redirect pointed).
void Stream::connect_locked(uint16_t rport) {
  attempt_ns_ = now_ns();
  wire::RendezvousRequest req{};
  req.magic = wire::kRendezvousMagic;
  req.version = wire::kRendezvousMinVersion;
  req.max_version = wire::kRendezvousVersion;
  req.client_port = reinterpret_cast<const sockaddr_in*>(&local_)->sin_port;  // same offset in v6
  req.server_port = reinterpret_cast<const sockaddr_in*>(&peer_)->sin_port;
  // (An adopted client that was on RDMA since counts those bytes too: again.)
  req.flags = reup_ ? wire::kRequestAgain : adopted_ ? wire::kRequestKernel : 0;
  req.cookie = my_cookie_;
  sockaddr_storage dst = cm_address(peer_);
  reinterpret_cast<sockaddr_in*>(&dst)->sin_port = htons(rport);
  // Bind the rdma_cm source to the TCP source address: the server checks that
  // both come from the same IP.
  sockaddr_storage src = cm_address(local_);
  reinterpret_cast<sockaddr_in*>(&src)->sin_port = 0;
  auto c = transport::Connection::connect(
      reinterpret_cast<const sockaddr*>(&dst), reinterpret_cast<const sockaddr*>(&src),
      std::as_bytes(std::span(&req, 1)), process_config().tunables);
  if (!c) {
    // No rdma_cm id or address: the device or route is not there.
    auto reason = c.error() == ENODEV ? stats::FallbackReason::kNoDevice
                                      : stats::FallbackReason::kResolveFailed;
    if (reup_ && retry_reupgrade(reason)) return;
    mu_.unlock();
    fall_back(reason);
    mu_.lock();
    return;
  }
  conn_ = std::move(*c);
  conn_->set_notify(notify_stream, this, notify_completion);
  want_loop();
  LOG_DEBUG("fd %d: rendezvous started %llu us after connect(), TCP bytes out/in %llu/%llu", tcp_fd_,
            us_since_start(), (unsigned long long)tcp_tx_,
            (unsigned long long)tcp_rx_);
}

bool Stream::attach_accepted(std::unique_ptr<transport::Connection> conn, uint64_t peer_cookie,
                             uint8_t version) {
  std::unique_lock lk(mu_);
  // The accept ran outside the registry's lock (socket/progress.cc,
  // finish_accepts): the application may have closed the socket, or its
  // stream fallen back (deadline, fork), meanwhile. The connection is
  // destroyed after the lock, as its destructor makes verbs calls.
  // (Or handed on meanwhile: shared with a process it was passed to.)
  if (orphaned_ || phase() != Phase::kPending || conn_ || shared_by_fork() ||
      plain_when_drained_) {
    lk.unlock();
    conn.reset();
    return false;
  }
  reup_waiting_.store(false, std::memory_order_release);
  version_ = version;
  conn_ = std::move(conn);
  conn_->set_notify(notify_stream, this, notify_completion);
  peer_cookie_ = peer_cookie;
  want_loop();  // its rendezvous needs the thread's ticks now
  LOG_DEBUG("fd %d: rendezvous request accepted %llu us after accept(), TCP bytes out/in %llu/%llu",
            tcp_fd_, us_since_start(), (unsigned long long)tcp_tx_,
            (unsigned long long)tcp_rx_);
  return true;
}

std::pair<stats::FallbackReason, bool> setup_fallback(const transport::Connection& c) {
  using F = transport::Connection::SetupFailure;
  using R = stats::FallbackReason;
  switch (c.setup_failure()) {
    case F::kResolve: return {R::kResolveFailed, true};
    case F::kMemlock: warn_memlock(); return {R::kMemlock, false};
    case F::kResources: return {R::kNoResources, false};
    case F::kNoListener: return {R::kPeerNotRsock, true};
    case F::kRejected:
      // The peer ran out of memory or pinned budget: try it again next time.
      // A peer that found our path lossy: the caller caches the whole host.
      if (c.reject_reason() == transport::RejectReason::kLossyPath) return {R::kLossyPath, true};
      return {R::kRejected, c.reject_reason() != transport::RejectReason::kNoResources};
    case F::kTimeout: return {R::kTimeout, true};
    case F::kNone:
    case F::kConnect: break;
  }
  return {R::kConnectFailed, true};
}

void warn_memlock() {
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  uint64_t b = transport::pinned::budget();
  log::write_line(log::Level::kWarn,
                  "the pinned-memory limit is reached (librsock uses up to %llu KiB, 3/4 of "
                  "RLIMIT_MEMLOCK): new connections stay on TCP. Raise it with `ulimit -l` "
                  "(or LimitMEMLOCK= for a systemd service, memlock in "
                  "/etc/security/limits.conf)",
                  (unsigned long long)(b / 1024));
}

void warn_maps() {
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  log::write_line(log::Level::kWarn,
                  "librsock holds as many upgraded connections as the memory-mapping limit "
                  "allows (%u mappings each, 7/8 of vm.max_map_count): new connections stay on "
                  "TCP. Raise it with `sysctl vm.max_map_count=...`",
                  transport::pinned::kMapsPerConnection);
}

void Stream::note_fallback(stats::FallbackReason reason, uint8_t peer_reason) {
  fallback_code_.store(uint16_t(uint16_t(reason) | uint16_t(peer_reason) << 8),
                       std::memory_order_relaxed);
  stats::set_fallback(slot_, reason, peer_reason);
}

void Stream::fall_back(stats::FallbackReason reason, uint8_t peer_reason) {
  bool again;
  {
    std::lock_guard lk(mu_);
    if (phase() != Phase::kPending) return;  // too late: bytes are committed
    again = reup_;
    stay_on_tcp_locked();
  }
  if (again) {
    // Upgrading again did not work out: the connection stays on TCP with
    // the reason it left RDMA for (no second fallback counted).
    stats::set_state(slot_, stats::ConnState::kEstablished);
    // (info: once per connection, and what a log says about a connection
    // that came back to TCP and did not go up again.)
    LOG_INFO("fd %d: not upgrading again (%s); staying on TCP", tcp_fd_,
             stats::fallback_reason_name(reason));
  } else {
    note_fallback(reason, peer_reason);
    LOG_DEBUG("fd %d: staying on TCP (%s)", tcp_fd_, stats::fallback_reason_name(reason));
  }
  wake();
}

void Stream::accept_failed(stats::FallbackReason reason, bool peer_gone) {
  {
    std::lock_guard lk(mu_);
    if (phase() != Phase::kPending || conn_) return;
    // Upgrading again, the request may be a stale one: the client gave up
    // on it (its bound ran out while this process was stopped, as a fork
    // child is while its parent holds the request) and tries again. Its
    // next request must find this stream still waiting, not refused.
    if (peer_gone && reup_ && !client_ && retry_reupgrade(reason)) return;
  }
  fall_back(reason);
}

void Stream::break_connection(int err, const char* why) {
  LOG_WARN("upgrade of connection (fd %d) failed after the switch began: %s; resetting", tcp_fd_,
           why);
  err_ = err;
  set_phase(Phase::kBroken);
  // An RST tells the peer at once; nothing more is delivered either way.
  linger lg{1, 0};
  sys::libc.setsockopt(tcp_fd_, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  sys::libc.shutdown(tcp_fd_, SHUT_RDWR);
  if (conn_) (void)conn_->close();
  stats::count_handshake_error();
}

// ---------------------------------------------------------------------------
// The reverse switch: RDMA back to TCP (upgrade_wire.h, section 4).
//
// Each side stops RDMA, writes its DOWN record {resume, sent} into the idle
// TCP stream and reads the peer's. Then it resends, on TCP, its bytes from
// the peer's `resume` on (the backlog, from the send ring: it holds every
// byte the peer has not reported consumed), and the connection is plain TCP
// again. Nothing the peer sent after `resume` over RDMA is used: it comes
// again on TCP. So no byte is lost, duplicated or reordered whatever the
// RDMA path did, and the only requirement is a working TCP connection.

namespace {
// A peer that never answers (its host is gone, TCP itself is dying) ends
// the connection after this long instead of leaving it hanging. Longer than
// a link flap that TCP rides out.
constexpr uint64_t kRevertTimeoutNs = 30ull * 1000000000;
}  // namespace

// A fixed-size record in the TCP stream (the switch marker, the reverse
// switch's record), moved without blocking across calls: *done counts the
// bytes so far. kClosed: the peer's end is gone before the first byte (EOF
// while reading, an error while writing); kBroken: inside the record.
Stream::RecordIo Stream::read_record(void* rec, size_t size, size_t* done) {
  auto* p = static_cast<char*>(rec);
  while (*done < size) {
    ssize_t r = sys::libc.recv(tcp_fd_, p + *done, size - *done, MSG_DONTWAIT);
    if (r > 0) {
      *done += size_t(r);
      continue;
    }
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return RecordIo::kAgain;
    return r == 0 && *done == 0 ? RecordIo::kClosed : RecordIo::kBroken;
  }
  return RecordIo::kDone;
}

Stream::RecordIo Stream::write_record(const void* rec, size_t size, size_t* done) {
  auto* p = static_cast<const char*>(rec);
  const size_t before = *done;
  while (*done < size) {
    ssize_t r = sys::libc.send(tcp_fd_, p + *done, size - *done, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r > 0) {
      *done += size_t(r);
      continue;
    }
    // A link that is down right now (a flap, the very case the reverse
    // switch is for) is not a peer that went away: TCP retries, so do we.
    if (r < 0 && (errno == EAGAIN || errno == EINTR || errno == ENETUNREACH ||
                  errno == EHOSTUNREACH || errno == ENETDOWN || errno == ENOBUFS))
      return RecordIo::kAgain;
    return *done == 0 ? RecordIo::kClosed : RecordIo::kBroken;
  }
  if (*done != before) push_tcp();  // (once, as the record's last bytes go)
  return RecordIo::kDone;
}

// A switch record must leave at once. On a socket without TCP_NODELAY,
// Nagle keeps a small segment while an earlier small one is unacknowledged,
// and the peer delays that ACK (40 ms or more) when the reply that would
// carry it waits for this very switch (its writes are held meanwhile).
// Measured: redis-benchmark's connections (Nagle on) had their markers
// verified by the server 40 ms after the write, 4 of 10 connections in a
// burst. Setting TCP_NODELAY sends what the kernel holds (there is no flag
// for one send); clearing it again keeps the application's setting.
void Stream::push_tcp() {
  const bool taken = lock_nodelay();
  sys::push_unsent(tcp_fd_);
  unlock_nodelay(taken);
}

bool Stream::revert_locked(RevertMode mode, stats::FallbackReason why, bool report,
                           bool may_return) {
  if (phase() != Phase::kRdma || !conn_ || tcp_fd_ < 0) return false;
  // A 0.1.0 peer knows no reverse switch: it would take our record for
  // bytes from a stranger and reset the connection.
  if (version_ < wire::kRevertVersion) return false;
  reup_allowed_ = may_return && mode == RevertMode::kKeep;
  // The peer's bytes we keep end at `resume`; the peer resends the rest.
  uint64_t rx_rdma = conn_->rx_position();
  if (mode == RevertMode::kKeep && conn_->readable() > 0) {
    size_t n = conn_->readable(), old = staging_.size();
    staging_.resize(old + n);
    iovec v{staging_.data() + old, n};
    auto r = conn_->recv({&v, 1}, /*peek=*/true);
    size_t got = r ? *r : 0;
    staging_.resize(old + got);
    rx_rdma += got;
  }
  uint64_t resume = rx_limit_ + rx_rdma;
  // Hand-off with bytes of the peer's TCP phase still staged (drained to
  // reach its marker, never read): they must not stay in this process's
  // memory. A peer of rendezvous 4 takes them back after our record and
  // sends them again (staging is read before any RDMA byte, so these are
  // exactly the bytes before rx_limit_). Older peers cannot: they stay here.
  size_t unread = staging_.size() - staging_off_;
  if (mode == RevertMode::kHandOff && unread > 0 && version_ >= wire::kReturnVersion &&
      rx_rdma == 0 && unread <= rx_limit_ && unread <= wire::kMaxReturnBytes) {
    resume -= unread;
    return_out_.swap(staging_);  // no copy: the staged bytes are ours to write now
    return_out_off_ = staging_off_;
    staging_off_ = 0;
    staging_.clear();
  } else {
    return_out_.clear();
    return_out_off_ = 0;
  }
  tx_sent_abs_ = tcp_tx_ + conn_->tx_position();
  // A failed or bad path is said in the record (version 5): the peer
  // reports the path too, not a hand-off.
  const bool path_bad = version_ >= wire::kPathRecordVersion &&
                        (why == stats::FallbackReason::kPathFailed ||
                         why == stats::FallbackReason::kLossyPath ||
                         why == stats::FallbackReason::kSlowPath);
  down_out_ = {path_bad ? wire::kDownPathMagic : wire::kDownMagic, peer_cookie_, resume,
               tx_sent_abs_};
  down_out_off_ = down_in_got_ = 0;
  down_done_ = down_parsed_ = false;
  return_in_need_ = return_in_got_ = 0;
  // Our record reaches the kernel before the QP dies: a peer that notices
  // the dead QP first finds the record on TCP (failure_reason) and counts a
  // hand-off, not a failed path. (An error here is met again below.)
  (void)write_record(&down_out_, sizeof down_out_, &down_out_off_);
  conn_->abort();  // nothing more goes out on RDMA; its send ring stays readable
  set_phase(Phase::kReverting);
  deadline_ns_ = now_ns() + kRevertTimeoutNs;
  if (report) {
    note_fallback(why);
    LOG_INFO("fd %d: RDMA -> TCP (%s): sent %llu, resume the peer's bytes at %llu", tcp_fd_,
             stats::fallback_reason_name(why), (unsigned long long)tx_sent_abs_,
             (unsigned long long)down_out_.resume);
  } else {
    LOG_DEBUG("fd %d: RDMA -> TCP at exit: sent %llu, resume the peer's bytes at %llu", tcp_fd_,
              (unsigned long long)tx_sent_abs_, (unsigned long long)down_out_.resume);
  }
  (void)advance_revert();  // our record goes out at once
  return true;
}

// The peer's TCP socket is gone (EOF or an error where its record should
// be): nothing more can reach it. What we hold is delivered, then the
// kernel reports the rest (EOF, EPIPE, ECONNRESET) itself.
void Stream::finish_revert_peer_gone(const char* why) {
  LOG_INFO("fd %d: the peer's TCP end is gone during the switch back (%s): ending as TCP would",
           tcp_fd_, why);
  conn_.reset();
  down_done_ = true;
  down_out_off_ = sizeof down_out_;
  return_out_.clear();  // nobody is left to send them again
  return_out_off_ = 0;
  held_.clear();  // nor to read these
  held_off_ = 0;
  offer_sent_ = offer_rcvd_ = verified_ = false;
  if (staging_.size() > staging_off_) plain_when_drained_ = true;
  else set_phase(Phase::kPlain);
}

bool Stream::advance_revert() {
  const auto before = switch_state();
  const Phase p0 = phase();
  switch (write_record(&down_out_, sizeof down_out_, &down_out_off_)) {
    case RecordIo::kDone:
    case RecordIo::kAgain: break;
    case RecordIo::kClosed:
      finish_revert_peer_gone(strerror(errno));
      return true;
    case RecordIo::kBroken:
      break_connection(ECONNRESET, "TCP failed inside the reverse switch record");
      return true;
  }
  if (down_out_off_ == sizeof down_out_ && return_out_off_ < return_out_.size()) {
    // Our returned bytes follow our record at once: the peer reads exactly
    // as many as its tcp_tx_ minus our resume.
    switch (write_record(return_out_.data(), return_out_.size(), &return_out_off_)) {
      case RecordIo::kDone:
        return_out_.clear();
        return_out_.shrink_to_fit();
        return_out_off_ = 0;
        break;
      case RecordIo::kAgain: break;
      case RecordIo::kClosed:
      case RecordIo::kBroken:
        break_connection(ECONNRESET, "TCP failed while returning the peer's unread bytes");
        return true;
    }
  }
  if (!down_done_ && !down_parsed_) {
    switch (read_record(&down_in_, sizeof down_in_, &down_in_got_)) {
      case RecordIo::kDone:
      case RecordIo::kAgain: break;
      case RecordIo::kClosed:
        tcp_eof_ = true;
        finish_revert_peer_gone("EOF");
        return true;
      case RecordIo::kBroken:
        // A reset before any byte of the peer's record, after its FIN came
        // on RDMA: the peer had finished and closed its socket while our
        // record (written at our exit, say) sat unread in it, so its kernel
        // answered with a reset instead of the FIN it would have sent. The
        // reset is our record's doing: end as TCP would have, at EOF
        // (footprint.many saw this warning at the server's exit). Not if
        // the peer closed abortively (its RESET control is queued: the
        // application gets ECONNRESET, as over TCP), nor if our record
        // asked it to send bytes again (a hand-off leaves unread ones in
        // our ring to it): those are lost, which EOF would hide.
        if (down_in_got_ == 0 && errno == ECONNRESET && conn_->fin_received() &&
            down_out_.resume == rx_limit_ + conn_->rx_position() + conn_->readable() &&
            !conn_->control_queued(uint8_t(wire::Control::kReset))) {
          tcp_eof_ = true;
          finish_revert_peer_gone("reset after its FIN");
          return true;
        }
        break_connection(ECONNRESET, "TCP failed inside the peer's reverse switch record");
        return true;
    }
    if (down_in_got_ < sizeof down_in_) {
      if (now_ns() > deadline_ns_) {
        break_connection(ECONNRESET, "the peer did not answer the switch back to TCP");
        return true;
      }
      return switch_state() != before;
    }
    // The peer's record: it must come from the peer that owns this stream,
    // and ask only for bytes we still hold, or (rendezvous 4) for bytes of
    // our TCP phase it returns right after the record: then it cannot have
    // consumed any of our RDMA bytes.
    const uint64_t lo = tcp_tx_ + conn_->retained_from();
    uint64_t returned = 0;
    if (down_in_.resume < lo && version_ >= wire::kReturnVersion && conn_->retained_from() == 0 &&
        tcp_tx_ - down_in_.resume <= wire::kMaxReturnBytes)
      returned = tcp_tx_ - down_in_.resume;
    if (!wire::down_magic(&down_in_.magic, sizeof down_in_.magic, version_) ||
        down_in_.cookie != my_cookie_ ||
        (down_in_.resume < lo && returned == 0) || down_in_.resume > tx_sent_abs_) {
      break_connection(ECONNRESET, "bad reverse switch record from the peer");
      return true;
    }
    if (size_t n = tx_sent_abs_ - down_in_.resume; n > 0) {
      backlog_ = Backlog::create(n);
      if (backlog_ == nullptr) {
        break_connection(ENOMEM, "no memory for the bytes to resend");
        return true;
      }
      // The returned bytes go first (read below), then the send ring's.
      uint64_t from = down_in_.resume + returned;
      conn_->copy_sent(from - tcp_tx_, backlog_->data() + returned, n - returned);
      if (slot_) slot_->add_tx(stats::Transport::kTcp, n);
    }
    return_in_need_ = returned;
    return_in_got_ = 0;
    down_parsed_ = true;
  }
  if (!down_done_ && down_parsed_) {
    if (return_in_got_ < return_in_need_) {
      switch (read_record(backlog_->data(), return_in_need_, &return_in_got_)) {
        case RecordIo::kDone:
        case RecordIo::kAgain: break;
        case RecordIo::kClosed:
        case RecordIo::kBroken:
          break_connection(ECONNRESET, "TCP failed inside the bytes the peer returned");
          return true;
      }
      if (return_in_got_ < return_in_need_) {
        if (now_ns() > deadline_ns_) {
          break_connection(ECONNRESET, "the peer did not return its unread bytes");
          return true;
        }
        return switch_state() != before;
      }
    }
    conn_.reset();  // aborted: destroyed at once
    down_done_ = true;
    // Both directions are on TCP again, from here on exactly like before the
    // first switch.
    offer_sent_ = offer_rcvd_ = verified_ = false;
    offer_queued_ = ready_queued_ = ready_rcvd_ = ready_sent_ = false;
    tcp_tx_ = tx_sent_abs_;
    tcp_rx_ = down_out_.resume;
  }
  // The backlog follows our record and returned bytes, and is complete only
  // once the peer's returned bytes are in (down_done_).
  if (backlog_ != nullptr && down_done_ && down_out_off_ == sizeof down_out_ &&
      return_out_off_ == return_out_.size()) {
    int err = 0;
    if (backlog_->flush(tcp_fd_, &err)) Backlog::release(std::exchange(backlog_, nullptr));
  }
  if (held_pending()) (void)flush_held();  // after the backlog (it checks)
  if (down_done_ && !revert_out_pending()) {
    // The FIN (shutdown(SHUT_WR) while on RDMA) follows the last byte again.
    if (wr_shut_) sys::libc.shutdown(tcp_fd_, SHUT_WR);
    LOG_DEBUG("fd %d: back on TCP", tcp_fd_);
    if (may_reupgrade()) begin_reupgrade();
    else if (share_after_revert_ && reupgradable() && staging_.size() == staging_off_ &&
             (holders_ || pass_after_revert_ || (holders_ = claim_holders())))
      enter_shared();  // (a socket being passed: give_away claims its slot)
    else if (staging_.size() > staging_off_) plain_when_drained_ = true;
    else set_phase(Phase::kPlain);
  }
  return phase() != p0 || switch_state() != before;
}

// ---------------------------------------------------------------------------
// Upgrading again after a reverse switch (docs/DESIGN.md). Once both
// directions are back on TCP, tcp_tx_ and tcp_rx_ are the stream positions
// again (advance_revert), exactly as before the first switch, so a new
// rendezvous and forward switch work unchanged: the stream stays governed
// (kPending, no connection), the client tries again after kReupDelaysNs,
// and the server waits for its request as long as those attempts can take.

// Under mu_, at the end of a reverse switch.
bool Stream::may_reupgrade() const {
  return reup_allowed_ && !rdma_dead_ && reupgradable();
}

bool Stream::reupgradable() const {
  return process_config().tunables.reupgrade && !orphaned_ && !wr_shut_ && !rd_shut_ &&
         !fin_deferred_ && !tcp_eof_ && err_ == 0 && tcp_fd_ >= 0 && !io_uring_started() &&
         !(client_ && negative_cache_hit(peer_));
}

// Under mu_.
void Stream::prepare_reupgrade() {
  reup_ = true;
  reup_allowed_ = false;
  my_cookie_ = random_cookie();  // a new rendezvous proves itself anew
  peer_cookie_ = 0;
  redirected_ = false;
  out_marker_off_ = in_marker_got_ = 0;
  held_.clear();
  held_off_ = held_cap_ = 0;
  set_phase(Phase::kPending);  // still governing: every TCP byte is counted
  stats::set_state(slot_, stats::ConnState::kUpgrading);
}

// Under mu_.
void Stream::schedule_reupgrade(uint64_t delay_ns) {
  uint64_t now = now_ns();
  const uint64_t attempt_ns = reup_attempt_ns();
  if (client_) {
    reup_tries_ = 0;
    reup_at_ns_.store(now + delay_ns, std::memory_order_release);
    deadline_ns_ = now + delay_ns + attempt_ns;
  } else {
    // Long enough for every attempt of the client's.
    deadline_ns_ = now + reup_window_ns();
  }
  reup_waiting_.store(true, std::memory_order_release);
  want_loop();  // its timer
}

// Under mu_.
void Stream::begin_reupgrade() {
  prepare_reupgrade();
  schedule_reupgrade(kReupDelaysNs[0]);
  LOG_DEBUG("fd %d: back on TCP; will try RDMA again (%s)", tcp_fd_,
            client_ ? "client" : "server, waiting for the client's request");
}

// ---------------------------------------------------------------------------
// Upgrading again in the new owner (docs/DESIGN.md). fork() leaves a
// connection that was on RDMA (handed off) or still waiting for its
// rendezvous as a TCP socket in two processes. Each counts its TCP bytes
// into a shared slot (socket/holders.h) and waits, governed, in kPending;
// the process left as the only holder takes the positions from the slot and
// upgrades again: the client with a new rendezvous at once, the server by
// waiting for the client's (its own listener, or a claim in the listening
// socket's share table, published by the progress thread).

void Stream::share_after_hand_off() {
  std::lock_guard lk(mu_);
  if (phase() == Phase::kRdma) share_after_revert_ = true;
}

bool Stream::share_at_fork() {
  std::lock_guard lk(mu_);
  added_at_fork_ = false;
  Phase p = phase();
  bool waiting = p == Phase::kPending && !conn_ && !plain_when_drained_;
  bool handed = p == Phase::kReverting && down_done_ && return_out_off_ == return_out_.size();
  // (Bytes staged or held live in this process's memory only: a copy in
  // the child would deliver or send them twice.)
  if (!(waiting || handed) || !reupgradable() || held_pending() ||
      staging_.size() > staging_off_) {
    share_after_revert_ = false;
    return false;
  }
  if (!holders_) {
    holders_ = claim_holders();
    if (!holders_) {  // all taken: both processes keep it on TCP, uncounted
      share_after_revert_ = false;
      return false;
    }
  }
  holders::add(holders_);  // the child
  added_at_fork_ = true;
  // Not the only holder any more: a claim not yet published must not be.
  claim_wanted_.store(false, std::memory_order_relaxed);
  if (waiting && !reup_) {
    // Its first rendezvous waits now: a fallback until it is on RDMA.
    note_fallback(stats::FallbackReason::kForked);
    count_next_upgrade_ = true;
  }
  drop_start_request();  // a client's first attempt waits as well
  if (handed) share_after_revert_ = true;
  else if (!shared_.load(std::memory_order_relaxed)) enter_shared();
  return true;
}

void Stream::fork_done(bool failed) {
  std::lock_guard lk(mu_);
  if (!std::exchange(added_at_fork_, false)) return;
  if (failed && holders_) holders::release(holders_);  // no child holds it
}

// Under mu_.
void Stream::enter_shared() {
  prepare_reupgrade();
  share_after_revert_ = false;
  rdma_dead_ = false;
  reup_at_ns_.store(0, std::memory_order_release);
  deadline_ns_ = now_ns() + reup_window_ns();  // the others close within it, or it stays on TCP
  shared_.store(true, std::memory_order_release);
  reup_waiting_.store(true, std::memory_order_release);
  want_loop();
  LOG_DEBUG("fd %d: held by another process too; waiting to be its only holder", tcp_fd_);
}

// Under mu_: the other holders closed their copies.
void Stream::become_sole() {
  shared_.store(false, std::memory_order_release);
  timeouts_changed();  // (another holder may have set them, unseen here)
  bool poisoned = holders::poisoned(holders_);
  // Every holder counted into the slot: these are the stream positions.
  tcp_tx_ = holders_->tx.load(std::memory_order_acquire);
  tcp_rx_ = holders_->rx.load(std::memory_order_acquire);
  release_holders_locked();
  if (poisoned || !reupgradable()) {
    abandon_reupgrade();
    return;
  }
  LOG_DEBUG("fd %d: the only holder now, at stream bytes out/in %llu/%llu; upgrading again",
            tcp_fd_, (unsigned long long)tcp_tx_, (unsigned long long)tcp_rx_);
  schedule_reupgrade(0);
  if (!client_) {
    sole_after_share_ = true;
    claim_wanted_.store(true, std::memory_order_release);
    server_awaits_request();
    want_loop();
  }
}

// Under mu_.
void Stream::release_holders_locked() {
  if (holders_) holders::release(std::exchange(holders_, nullptr));
  shared_.store(false, std::memory_order_release);
  share_after_revert_ = false;
}

void Stream::release_holders() {
  std::lock_guard lk(mu_);
  release_holders_locked();
}

void Stream::release_for_exec() {
  std::lock_guard lk(mu_);
  exec_released_ = holders_;
  release_holders_locked();
}

void Stream::exec_failed() {
  std::lock_guard lk(mu_);
  if (std::exchange(exec_passed_, false) && exec_released_) {
    // The new image never came: the count it was given is this one's again,
    // and it may well be the only holder (become_sole).
    holders_ = std::exchange(exec_released_, nullptr);
    holders::unmark_exec(holders_);
    holders::enlist(holders_);
    return;
  }
  // (The slot may be another connection's by now: poisoning it only keeps
  // that one on TCP.)
  if (exec_released_) holders::poison(std::exchange(exec_released_, nullptr));
}

// Under mu_: a client's first rendezvous failed for want of a listener.
// A server started for this very connection opens one a moment later:
// socket activation (Accept=no), or an inetd-style service (Accept=yes,
// inetd, socat EXEC:...,nofork) whose instance adopts the connection at its
// start. So it is made once more, at half the window; a plain peer costs
// one failed attempt more. The port's first strike is taken now, so that
// connections opened meanwhile wait it out, and the retry's failure does
// not lengthen it. A redirect whose target had gone (an instance that
// published its side listener, then exec'd in place: its new image
// publishes anew) is followed by a new request to the listener's holder
// soon. True if the retry is scheduled.
bool Stream::late_retry(stats::FallbackReason reason) {
  using R = stats::FallbackReason;
  const bool moved = redirected_ && (reason == R::kPeerNotRsock || reason == R::kRejected);
  if (!client_ || reup_ || late_retried_ || orphaned_ || !(moved || reason == R::kPeerNotRsock))
    return false;
  const uint64_t window = uint64_t{process_config().tunables.upgrade_timeout_ms} * 1000000;
  const uint64_t now = coarse_now_ns();
  const uint64_t at = moved ? now + kMovedRetryNs : born_ns_ + window / 2;
  if (at <= now || (moved && at + window / 4 > deadline_ns_)) return false;
  late_retried_ = true;
  if (!moved) negative_cache_add(peer_, false, true, attempt_ns_);
  redirected_ = false;  // (to the listener's holder again)
  conn_.reset();
  request_start(at);
  LOG_DEBUG("fd %d: %s; once more in %llu ms", tcp_fd_,
            moved ? "the redirect's target is gone" : "no rdma_cm listener at the peer",
            (unsigned long long)((at - now) / 1000000));
  return true;
}

// Under mu_: an attempt failed.
bool Stream::retry_reupgrade(stats::FallbackReason reason) {
  using R = stats::FallbackReason;
  // The application shut its direction down while this attempt ran: no
  // switch can follow its FIN, which would otherwise wait through every
  // later attempt (up to about 40 s). TCP from here on, FIN now.
  if (fin_deferred_) return false;
  if (!client_) {
    // The server's side of an attempt (an accepted request) failed, as the
    // first after a flap may (its REP or RTU lost): the client tries again,
    // so wait for its next request for the rest of the window.
    if (orphaned_ || now_ns() > deadline_ns_) return false;
    conn_.reset();
    reup_waiting_.store(true, std::memory_order_release);
    // The match dropped its claim (a fork child's, in the listening
    // socket's share table): made again, or the owner has nowhere to send
    // the client's next request (make_reachable).
    if (sole_after_share_) claim_wanted_.store(true, std::memory_order_release);
    server_awaits_request();
    want_loop();
    LOG_DEBUG("fd %d: upgrading again failed (%s); waiting for the client's next attempt",
              tcp_fd_, stats::fallback_reason_name(reason));
    return true;
  }
  // Only a path that may come back is worth another attempt: the peer's own
  // refusal, or a peer without a listener now, is its answer.
  // A redirect's target that refuses or has no listener moved on: the
  // process that held the socket there exec'd (its new image publishes a
  // listener of its own) or handed it on; the owner redirects the next
  // attempt anew. (Found by the conformance case of cat exec'd on a
  // connection: the fork child published a side listener, then exec'd.)
  bool moved = redirected_ && (reason == R::kPeerNotRsock || reason == R::kRejected);
  // A peer out of room says "no resources"; so does a listener's owner whose
  // hold on this request ran out before the connection's holder there (a
  // fork child left as its only holder) made itself reachable.
  bool busy = reason == R::kRejected && conn_ &&
              conn_->reject_reason() == transport::RejectReason::kNoResources;
  bool transient = reason == R::kResolveFailed || reason == R::kTimeout ||
                   reason == R::kConnectFailed || reason == R::kNoDevice ||
                   reason == R::kNoResources || reason == R::kMemlock || moved || busy;
  if (!transient || ++reup_tries_ >= kReupTries || orphaned_) return false;
  conn_.reset();
  redirected_ = false;  // the next attempt goes to the listener's owner again
  uint64_t now = now_ns();
  reup_at_ns_.store(now + kReupDelaysNs[reup_tries_], std::memory_order_release);
  deadline_ns_ = now + kReupDelaysNs[reup_tries_] + reup_attempt_ns();
  reup_waiting_.store(true, std::memory_order_release);
  want_loop();  // its timer
  LOG_DEBUG("fd %d: upgrading again failed (%s); next attempt in %llu ms", tcp_fd_,
            stats::fallback_reason_name(reason),
            (unsigned long long)(kReupDelaysNs[reup_tries_] / 1000000));
  return true;
}

// Under mu_: a pending stream gives its rendezvous up (or its wait to
// upgrade again) and leaves the socket to the kernel.
void Stream::stay_on_tcp_locked() {
  reup_at_ns_.store(0, std::memory_order_release);
  reup_waiting_.store(false, std::memory_order_release);
  want_loop();
  conn_.reset();
  deferred_fin();
  // Bytes read ahead are delivered through the stream before the kernel
  // takes over again (and held ones, of an abandoned switch, sent).
  if (staging_.size() > staging_off_ || held_pending()) plain_when_drained_ = true;
  else set_phase(Phase::kPlain);
}

// Under mu_.
void Stream::abandon_reupgrade() {
  stay_on_tcp_locked();
  stats::set_state(slot_, stats::ConnState::kEstablished);  // its fallback reason stays
  LOG_DEBUG("fd %d: not upgrading again; staying on TCP", tcp_fd_);
}

bool Stream::revert(RevertMode mode, stats::FallbackReason why) {
  bool started, waiting;
  {
    std::lock_guard lk(mu_);
    started = revert_locked(mode, why);
    // Asked to stay on TCP (RSOCK_REVERT) while it waits to upgrade again:
    // it stays (quietly: it is on TCP already).
    waiting = !started && reup_ && phase() == Phase::kPending;
  }
  if (waiting) fall_back(why);
  wake();  // bumps the generation too
  return started;
}

bool Stream::look_port(PortLook* out) {
  std::unique_lock lk(mu_, std::try_to_lock);
  if (!lk.owns_lock() || phase() != Phase::kRdma || !conn_) return false;
  const char* dev = conn_->device_name();
  if (dev == nullptr) return false;
  std::snprintf(out->device, sizeof out->device, "%s", dev);
  out->port = conn_->port_num();
  out->moved = conn_->tx_position() + conn_->rx_arrived();
  out->acked = conn_->tx_acked();
  out->in_flight = conn_->tx_position() - conn_->tx_acked();
  out->window = conn_->send_window();
  return true;
}

bool Stream::try_revert(RevertMode mode, stats::FallbackReason why) {
  bool started;
  {
    std::unique_lock lk(mu_, std::try_to_lock);
    if (!lk.owns_lock()) return false;
    started = revert_locked(mode, why);
  }
  wake();
  return started;
}

void Stream::debug_fail_path() {
  {
    std::lock_guard lk(mu_);
    if (phase() != Phase::kRdma || !conn_) return;
    (void)conn_->debug_break_silently();
  }
  advance();  // notices the failure like any later call would
}

void Stream::start_hand_off(bool at_exit, stats::FallbackReason why) {
  std::lock_guard lk(mu_);
  // At exit, a connection whose FINs crossed on RDMA and whose bytes the
  // peer all consumed (a closed one lingering until its RDMA close ends, a
  // server exiting right after its last client left) has nothing to hand
  // off. Its record would also reach a peer that may have closed its TCP
  // socket meanwhile: the peer's kernel answers with a reset, which broke
  // the peer's end of our own switch back and was logged as a warning
  // (footprint.many, one run in three). Our exit closes the socket with a
  // FIN, and the peer sees our QP go with both directions over: a quiet
  // release (Stream::advance_locked).
  if (at_exit && phase() == Phase::kRdma && conn_ && conn_->finished_both_ways() &&
      !held_pending()) {
    LOG_DEBUG("fd %d: on RDMA at exit with both directions over: no switch back", tcp_fd_);
    return;
  }
  (void)revert_locked(RevertMode::kHandOff, why, !at_exit);
}

bool Stream::hand_off(uint64_t deadline_ns, stats::FallbackReason why) {
  std::unique_lock lk(mu_);
  if (phase() == Phase::kRdma) revert_locked(RevertMode::kHandOff, why);
  while (phase() == Phase::kReverting && !revert_settled()) {
    (void)advance_revert();
    if (phase() != Phase::kReverting || revert_settled()) break;
    if (now_ns() > deadline_ns) break;
    pollfd pf{tcp_fd_, short((down_done_ ? 0 : POLLIN) | (revert_out_pending() ? POLLOUT : 0)), 0};
    lk.unlock();
    sys::libc.poll(&pf, 1, 5);
    lk.lock();
  }
  Phase p = phase();
  // (Held bytes live in this process only: they must be in the kernel.)
  bool ok = !held_pending() &&
            (p == Phase::kPlain || p == Phase::kBroken || p == Phase::kPending ||
             (p == Phase::kReverting && down_done_ && return_out_off_ == return_out_.size()));
  lk.unlock();
  wake();
  return ok;
}

void Stream::settle_switch(uint64_t deadline_ns) {
  while (phase() == Phase::kSwitching && now_ns() < deadline_ns) {
    advance(true);
    if (phase() != Phase::kSwitching) break;
    sys::libc.poll(nullptr, 0, 1);  // the peer's READY or marker is a round trip away
  }
}

bool Stream::give_away(uint64_t deadline_ns) {
  // The receiver may upgrade the connection again (docs/DESIGN.md,
  // "Upgrading again in the receiver"), unless a client's rendezvous is in
  // flight: whichever process keeps the socket could not finish it.
  // (conn_ is read under mu_: the progress thread may drop it meanwhile.)
  // (A server's request the progress thread matched and is accepting, its
  // connection not attached yet, counts: passed meanwhile, the stream would
  // refuse the connection its client already sees accepted.)
  auto in_rendezvous = [this] {
    std::lock_guard lk(mu_);
    return phase() == Phase::kPending &&
           (conn_ != nullptr || (!client_ && accepting.load(std::memory_order_acquire)));
  };
  bool share = process_config().tunables.reupgrade && !(client_ && in_rendezvous());
  if (!share) fall_back(stats::FallbackReason::kHandedOff);  // acts on a pending upgrade only
  // A server whose client's request it accepted is one round trip from
  // switching: settled, then handed off like any connection on RDMA.
  while (!client_ && in_rendezvous() && now_ns() < deadline_ns) {
    advance(true);
    if (in_rendezvous()) sys::libc.poll(nullptr, 0, 1);
  }
  settle_switch(deadline_ns);
  if (in_rendezvous()) fall_back(stats::FallbackReason::kHandedOff);
  Phase p = phase();
  if (p == Phase::kRdma || p == Phase::kReverting) {
    if (share) {
      std::lock_guard lk(mu_);
      pass_after_revert_ = share_after_revert_ = true;
    }
    if (!hand_off(deadline_ns)) return false;
  }
  std::unique_lock lk(mu_);
  // An abandoned switch's held bytes: into the kernel socket before the
  // connection is shared (they live in this process's memory only).
  while (held_pending() && !flush_held() && now_ns() < deadline_ns) {
    pollfd pf{tcp_fd_, POLLOUT, 0};
    lk.unlock();
    sys::libc.poll(&pf, 1, 5);
    lk.lock();
  }
  if (held_pending()) return false;
  pass_after_revert_ = false;
  if (share && !share_for_pass_locked()) {
    lk.unlock();
    fall_back(stats::FallbackReason::kHandedOff);  // acts on a pending one only
  }
  return true;
}

// Under mu_: the socket goes to another process (SCM_RIGHTS), which is to
// hold it too. As at fork (share_at_fork), but the slot is one the receiver
// can find by the socket's inode (holders::claim_passed); the receiver
// enlists when its recvmsg takes the socket in (adopt_passed).
bool Stream::share_for_pass_locked() {
  Phase p = phase();
  if (p != Phase::kPending || conn_ || plain_when_drained_ || !reupgradable() ||
      staging_.size() > staging_off_)
    return false;
  if (!holders_ && !(holders_ = claim_holders())) return false;
  // (A slot of the fork-only mapping, which a receiver cannot find: the
  // connection stays on TCP.)
  if (!holders::is_passed(holders_)) return false;
  holders::add(holders_);  // the receiver, in flight
  passes_in_flight_++;
  claim_wanted_.store(false, std::memory_order_relaxed);
  if (!reup_) {
    // Its first rendezvous waits now: a fallback until it is on RDMA.
    note_fallback(stats::FallbackReason::kHandedOff);
    count_next_upgrade_ = true;
  }
  drop_start_request();
  if (!shared_.load(std::memory_order_relaxed)) enter_shared();
  return true;
}

// Under mu_: why the RDMA connection failed. A peer that hands the
// connection off (fork, exec, fd passing, its exit) stops RDMA abruptly and
// then writes its record into TCP: when that record is already there, the
// failure was its switch back (released), not the path's (path_failed),
// which rsock-stat users would otherwise chase. (When the QP error comes
// first, it still reads as path_failed.)
stats::FallbackReason Stream::failure_reason() const {
  stats::FallbackReason r = peer_record_reason();
  return r == stats::FallbackReason::kNone ? stats::FallbackReason::kPathFailed : r;
}

// Under mu_: the peer's reverse-switch record waiting on TCP, peeked: its
// reason (path_failed when it says its path failed, rendezvous 5; released
// otherwise), or kNone when no whole record magic is there.
stats::FallbackReason Stream::peer_record_reason() const {
  uint64_t magic = 0;
  bool path = false;
  if (tcp_fd_ < 0 ||
      sys::libc.recv(tcp_fd_, &magic, sizeof magic, MSG_PEEK | MSG_DONTWAIT) != ssize_t(sizeof magic) ||
      !wire::down_magic(&magic, sizeof magic, version_, &path))
    return stats::FallbackReason::kNone;
  return path ? stats::FallbackReason::kPathFailed : stats::FallbackReason::kReleased;
}

// Under mu_: a slot at the stream's positions. In the per-user table, found
// by the socket's inode, so that whoever holds the socket next can find it:
// a receiver of fd passing, or the image a fork child execs (inetd style);
// in the fork-only mapping if that table cannot be had.
holders::Slot* Stream::claim_holders() {
  struct stat sb{};
  if (tcp_fd_ >= 0 && fstat(tcp_fd_, &sb) == 0)
    if (holders::Slot* h = holders::claim_passed(uint64_t(sb.st_ino), client_, tcp_tx_, tcp_rx_))
      return h;
  return holders::claim(tcp_tx_, tcp_rx_);
}

bool Stream::pass_to_exec(const int* fds, int n) {
  std::lock_guard lk(mu_);
  pass_after_revert_ = false;
  if (held_pending() || !share_for_pass_locked()) return false;
  // This image's hold ends with the exec; the count share_for_pass_locked
  // added is the new image's (the same pid: it enlists at its start).
  holders::release(holders_);
  holders::mark_exec(holders_, fds, n);
  exec_released_ = std::exchange(holders_, nullptr);
  exec_passed_ = true;
  passes_in_flight_ = 0;
  return true;
}

void Stream::prepare_pass() {
  std::lock_guard lk(mu_);
  if (phase() == Phase::kRdma) pass_after_revert_ = share_after_revert_ = true;
}

void Stream::pass_done(bool failed) {
  std::lock_guard lk(mu_);
  if (passes_in_flight_ == 0) return;
  passes_in_flight_--;
  if (failed && holders_) holders::drop(holders_);  // no receiver holds it
}

void Stream::adopt_passed(holders::Slot* h) {
  std::lock_guard lk(mu_);
  rdma_ever_ = true;  // (the sender's history is not in the slot)
  holders_ = h;
  holders::enlist(h);
  count_next_upgrade_ = true;
  enter_shared();
}

void Stream::adopt_inherited(uint64_t tx, uint64_t rx) {
  std::lock_guard lk(mu_);
  tcp_tx_ = tx;
  tcp_rx_ = rx;
  adopted_ = true;
}

bool Stream::counts_tcp_only() {
  std::lock_guard lk(mu_);
  return !rdma_ever_ && phase() == Phase::kPending && !conn_;
}

bool Stream::adopted_first_wait() {
  std::lock_guard lk(mu_);
  return adopted_ && !reup_ && phase() == Phase::kPending && !conn_ && !holders_;
}

bool Stream::advance(bool block) {
  if (block) {
    mu_.lock();
  } else if (!mu_.try_lock()) {
    return false;
  }
  bool changed = advance_locked();
  if (changed) gen_.fetch_add(1, std::memory_order_acq_rel);
  mu_.unlock();
  if (changed) wake();
  return changed;
}

void Stream::advance_inline(bool full) {
  if (advance_locked(full)) announce();
}

// A change in passing (no wake() for it): only the waiters that need it are
// poked. Needs no lock (the pushes take the socket's watch_lock).
void Stream::announce() {
  // seq_cst pairs with sleep_begin(): either this sees the sleeper and
  // pokes it, or the sleeper sees the new generation and does not sleep.
  gen_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) poke_sleepers();
  // Epoll registrations learn of it through their sets' ready lists.
  push_watches();
}

// Under cm_hub::mu(), which allows no blocking lock: a completion event of
// our connection, read by whichever thread woke on the completion hub. Most
// of the time that thread is the one waiting here, and it looks at this
// stream next anyway, so only the waiters that need it are poked.
void Stream::completion_event() { announce(); }


uint64_t Stream::idle_due_ns(uint64_t now) {
  std::unique_lock lk(mu_, std::try_to_lock);
  if (!lk.owns_lock() || phase() != Phase::kPending || conn_ || held_pending() ||
      plain_when_drained_ || orphaned_)
    return 0;
  uint64_t due = deadline_ns_;
  if (uint64_t at = start_at_ns_.load(std::memory_order_acquire); at != 0) {
    if (at <= now) return 0;
    due = std::min(due, at);
  }
  // (Whether the other holders are gone is read from shared memory: nobody
  // tells us. Every 10 ms, as a fork's parent usually closes its copy at
  // once and the child should not wait long to upgrade again.)
  if (holders_ && shared_.load(std::memory_order_relaxed)) due = std::min(due, now + kSoleLookNs);
  return due > now ? due : 0;
}

// One step of everything that can progress without blocking. Returns true on
// a change waiters care about (phase, new data, new room, error).
bool Stream::advance_locked(bool full) {
  Phase p = phase();
  if (p == Phase::kPlain || p == Phase::kBroken) return false;
  if (p == Phase::kReverting) return advance_revert();
  if (!conn_) {
    if (held_pending()) {  // an abandoned switch's, on TCP now
      size_t before = held_.size() - held_off_;
      if (flush_held() || held_.size() - held_off_ != before) return true;
    }
    if (plain_when_drained_) return false;
    // (Every I/O call of a pending stream gets here: the coarse clock, as
    // CLOCK_MONOTONIC is a syscall in VMs without a vDSO clock source. Its
    // lag, a tick, only makes a start or a deadline that much later.)
    const uint64_t now = coarse_now_ns();
    if (p == Phase::kPending && holders_ && shared_.load(std::memory_order_relaxed)) {
      // (A holder gone without closing is looked for every 100 ms at most.)
      bool sole = holders::sole(holders_);
      if (!sole && now >= reap_at_ns_) {
        reap_at_ns_ = now + kReapGapNs;
        sole = holders::reap(holders_, now);
      }
      if (sole || holders::poisoned(holders_)) {
        become_sole();
        return true;
      }
    }
    // A deferred start that became due (the connection streams, or
    // upgrade_delay_ms passed) is made here when the application's thread
    // gets here first: the progress thread's blocking lock of a stream whose
    // application writes in a loop waited up to 700 ms in the VM, and a bulk
    // stream then moved 20 MB on TCP before its switch instead of 1-2 MB.
    if (p == Phase::kPending && client_ && take_start_request(now)) {
      start_client_locked();
      return true;
    }
    if (p == Phase::kPending && now > deadline_ns_ && !orphaned_) {
      mu_.unlock();
      fall_back(stats::FallbackReason::kPeerNotRsock);
      mu_.lock();
      return true;
    }
    return false;
  }
  // Events the hubs delivered need the full progress (completions filed for
  // us by another's poll, rdma_cm events); otherwise, on RDMA, the
  // completion queue alone (no syscall).
  bool deep = full || p != Phase::kRdma || conn_->cm_pending() || conn_->cq_event_pending();
  // What waiters care about: a change in any of these must wake them (the
  // progress thread may have taken the completion event they sleep on).
  size_t before_r = conn_->readable(), before_w = conn_->writable();
  bool before_eof = conn_->eof();
  int before_err = conn_->error();
  // A busy-poll's usual turn on RDMA: with no event delivered and nothing
  // that a step retries (a control message to send or read, held bytes, a
  // peer that left its direction open), only the CQ can bring a change. If
  // it holds nothing, the checks below cannot find any, and they cost about
  // half of the step (TCG guest: 1.5 of 2.7-3.5 us, measured with finer
  // probes than bench/connect/profile.sh's; docs/PERFORMANCE.md).
  // (The stream's own fields, switch_state(), are no poll's to change.)
  bool polled = false;
  Status<void> st = Ok();
  if (!deep && conn_->established() && !rdma_dead_ && !offer_queued_ && !ready_queued_ &&
      !held_pending() && !conn_->controls_queued() && !conn_->peer_left_open()) {
    bool took = false;
    st = conn_->poll_completions(&took);
    if (st && !took) return false;
    polled = true;
  }
  const Phase p0 = p;
  const auto before_sw = switch_state();
  if (!polled) st = deep ? conn_->progress() : conn_->poll_completions();
  if (!st) {
    if (p == Phase::kPending && client_ && !redirected_ &&
        conn_->reject_reason() == transport::RejectReason::kRedirect && conn_->redirect_port()) {
      // The listener's process did not accept this connection; one that
      // inherited the listening socket did, and listens on this port
      // (socket/listen_share.h). Once only.
      redirected_ = true;
      uint16_t port = conn_->redirect_port();
      conn_.reset();
      // The redirect proves a live librsock peer that knows this connection:
      // the second rendezvous gets a whole window of its own. (It often
      // comes late: the worker that accepted sets up its own rdma_cm
      // listener and verbs state on its first accept, after fork. With the
      // rest of the first window, multiproc.prefork's first connections
      // timed out on a loaded guest in about one run of three.)
      deadline_ns_ = now_ns() + uint64_t{process_config().tunables.upgrade_timeout_ms} * 1000000;
      LOG_DEBUG("fd %d: rendezvous redirected to rdma_cm port %u", tcp_fd_, port);
      connect_locked(port);
      return true;
    }
    if (p == Phase::kPending) {
      auto [reason, cache] = setup_fallback(*conn_);
      if (reup_ && retry_reupgrade(reason)) return true;
      if (reason == stats::FallbackReason::kTimeout) log_rendezvous_timeout();
      uint8_t peer_reason = static_cast<uint8_t>(conn_->reject_reason());
      if (late_retry(reason)) return true;
      // (A late retry that found no listener again: the first attempt took
      // the strike.)
      if (caches_failure(reason, cache) &&
          !(late_retried_ && reason == stats::FallbackReason::kPeerNotRsock))
        negative_cache_add(peer_, reason == stats::FallbackReason::kLossyPath,
                           reason == stats::FallbackReason::kPeerNotRsock, attempt_ns_);
      mu_.unlock();
      fall_back(reason, peer_reason);
      mu_.lock();
      return true;
    }
    if (p == Phase::kRdma) {
      // A RESET the peer sent before it went is an abortive close, as on
      // TCP. Anything else (retries exceeded, a DREQ without FIN, the device
      // gone) is the RDMA path failing while TCP may be fine: switch back.
      handle_controls();
      if (phase() == Phase::kBroken) return true;
      // Both directions finished already (the peer's process went after
      // the last byte): switching back moves nothing and is no path
      // failure to report. (10,000 connections to a server that exits
      // once each is closed showed 1561 of them as path_failed.)
      bool quiet = conn_->finished_both_ways();
      if (revert_locked(RevertMode::kKeep, quiet ? stats::FallbackReason::kReleased
                                                 : failure_reason(),
                        !quiet, /*may_return=*/!quiet))
        return true;
    }
    if (p != Phase::kSwitching) {
      if (!err_) err_ = st.error();
      return true;
    }
    rdma_failed_during_switch();
    if (phase() != Phase::kSwitching) return true;
    // Still switching on a dead RDMA connection (the peer's offer came in,
    // or our marker started): the switch's TCP side goes on below, where
    // drain_tcp reads the peer's bytes up to its offer and then its marker
    // (EOF after it) or, when it reopened its direction instead, its data.
    // Returning here left that read to nobody: the reader waited for ever.
  }
  if (p == Phase::kPending) {
    if (!conn_->established()) {
      if (now_ns() > deadline_ns_) {
        if (reup_ && retry_reupgrade(stats::FallbackReason::kTimeout)) return true;
        log_rendezvous_timeout();
        // (A late retry that timed out: a server still starting; its first
        // attempt took the strike.)
        if (caches_failure(stats::FallbackReason::kTimeout, true) && !late_retried_)
          negative_cache_add(peer_);
        mu_.unlock();
        fall_back(stats::FallbackReason::kTimeout);
        mu_.lock();
        return true;
      }
      return false;
    }
    if (client_) {
      // The server's cookie comes back in the accept's payload.
      auto pl = conn_->peer_payload();
      wire::RendezvousReply rep{};
      if (pl.size() < sizeof rep) {
        mu_.unlock();
        fall_back(stats::FallbackReason::kProtocol);
        mu_.lock();
        return true;
      }
      std::memcpy(&rep, pl.data(), sizeof rep);
      if (rep.magic != wire::kRendezvousMagic || rep.version < wire::kRendezvousMinVersion ||
          rep.version > wire::kRendezvousVersion ||
          rep.cookie == 0) {
        mu_.unlock();
        fall_back(stats::FallbackReason::kProtocol);
        mu_.lock();
        return true;
      }
      peer_cookie_ = rep.cookie;
      version_ = rep.version;
      if (adopted_ && !reup_ && version_ < wire::kKernelFlagVersion) {
        // Positions from our kernel's counters, and a server that cannot
        // tell whether its own count more: no exact switch. TCP for good.
        mu_.unlock();
        fall_back(stats::FallbackReason::kUnsupported);
        mu_.lock();
        return true;
      }
      // The peer runs librsock: a first strike its port took (a server
      // started for a connection, an inetd service's instances that come
      // and go, each binding the port anew) is over, so that the next
      // connection with no listener takes a short strike again, not the
      // whole TTL.
      if (late_retried_) negative_cache_forget(peer_);
    }
    enter_switching();
    p = phase();
  }
  // The step above drained the CQ (progress() always, poll_completions()
  // once established): reading the controls with a second poll found
  // nothing new but cost 0.95 of a 2.7-3.5 us step in the TCG guest
  // (finer probes than bench/connect/profile.sh's; docs/PERFORMANCE.md).
  if (!rdma_dead_) handle_controls(/*cq_drained=*/deep || conn_->established());
  if (phase() == Phase::kSwitching && ready_sent_ && !rdma_dead_ && out_marker_off_ == 0 &&
      debug_break_switch()) {
    // Tests: the path fails right after our READY, before any marker, and
    // we notice at once (upgrade.switch.h_rdma_fails_mid_switch).
    (void)conn_->debug_break_silently();
    rdma_failed_during_switch();
  }
  if (phase() == Phase::kSwitching && out_marker_off_ == 0 && !ready_sent_ &&
      now_ns() > deadline_ns_) {
    // A silent peer (or a forger that never finishes): our TCP direction is
    // still clean and the peer was never told to write its marker, so what
    // comes next on TCP is data: stay on TCP rather than wait forever. (Once
    // READY went out, a real peer may be writing its marker: then we wait.)
    revert_to_tcp(stats::FallbackReason::kTimeout, "the switch timed out");
    return true;
  }
  if (phase() == Phase::kSwitching) {
    // (The test's client waits only for a QP that died: one the server
    // closed after its FIN on RDMA is met on RDMA, peer_left_open below.)
    if (!(debug_revert_at_switch() && client_ && !rdma_dead_ &&
          out_marker_off_ == sizeof out_marker_ && !conn_->eof()))
      drain_tcp();
    // The peer's marker first, then ours: the server writes its marker only
    // once the client's is verified, so the step that verifies it writes
    // ours at once. (Written first, it waited for the next step: 4-9 ms in
    // the TCG guest under a redis benchmark's load, with the progress
    // thread busy setting up other connections and the client's writes
    // held meanwhile. A client's marker never depends on the drain: the
    // server's comes only after it.)
    if (phase() == Phase::kSwitching && !rdma_dead_) write_marker();
    if (maybe_join_revert()) return true;
    if (phase() == Phase::kSwitching && rdma_dead_ && !verified_ && !tcp_eof_ &&
        out_marker_off_ == sizeof out_marker_ && now_ns() > deadline_ns_) {
      // Neither the peer's marker nor its EOF came after our QP died.
      break_connection(ECONNRESET, "the peer's switch marker never came after its QP died");
      return true;
    }
    if (phase() == Phase::kSwitching && !rdma_dead_ && verified_ &&
        out_marker_off_ == sizeof out_marker_) {
      set_phase(Phase::kRdma);
      (void)flush_held();  // what the application wrote meanwhile goes first
      deferred_fin();
      // With the switch's length (exact) and, the first time, how long
      // after the socket's start (coarse, as born_ns_), for rsock-stat.
      stats::set_upgraded(slot_, conn_->qp_num(), /*again=*/reup_ && !count_next_upgrade_,
                          (now_ns() - switch_ns_) / 1000, (coarse_now_ns() - born_ns_) / 1000);
      count_next_upgrade_ = false;
      if (reup_)
        LOG_INFO("fd %d: back on RDMA (qp %u) at stream bytes out/in %llu/%llu", tcp_fd_,
                 conn_->qp_num(), (unsigned long long)tcp_tx_, (unsigned long long)tcp_rx_);
      LOG_DEBUG("fd %d: on RDMA (qp %u) %llu us after the socket's start, after %llu/%llu TCP bytes "
                "out/in", tcp_fd_, conn_->qp_num(), us_since_start(),
                (unsigned long long)tcp_tx_, (unsigned long long)tcp_rx_);
      // io_uring was set up while this switch ran (progress_io_uring_started
      // hands off only connections already on RDMA): straight back.
      if (io_uring_started()) (void)revert_locked(RevertMode::kHandOff, stats::FallbackReason::kIoUring);
      else if (!client_ && debug_revert_at_switch())
        (void)revert_locked(RevertMode::kKeep, stats::FallbackReason::kReleased, true,
                            /*may_return=*/false);
    }
  }
  if (!conn_ || phase() == Phase::kReverting) return true;  // back to TCP just now
  if (phase() == Phase::kRdma && conn_->peer_left_open() && !wr_shut_ &&
      revert_locked(RevertMode::kKeep, stats::FallbackReason::kReleased)) {
    // The peer stopped RDMA after its FIN without closing (it switched
    // back): our direction goes on over TCP.
    return true;
  }
  if (held_pending() && phase() == Phase::kRdma) (void)flush_held();  // rest of the switch's
  if (full && slot_ && phase() == Phase::kRdma) {
    // Gauges for rsock-stat: refreshed off the hot path (waits, progress ticks).
    auto g = conn_->gauges();
    slot_->set_ring_bytes(g.ring_bytes);
    slot_->set_ring_fill(g.send_ring_used, g.recv_ring_used);
    slot_->set_credits(g.credit_bytes);
  }
  if (conn_->writable() > before_w) tx_gen_.fetch_add(1, std::memory_order_acq_rel);
  // Exact: a step that changed nothing must not count as a change. Waiters
  // re-look after any change they did not see (sleep_begin), so "always
  // changed while switching" made every blocked reader and poller spin
  // through the switch instead of sleeping.
  return p0 != phase() || conn_->readable() != before_r || conn_->writable() != before_w ||
         conn_->eof() != before_eof || conn_->error() != before_err ||
         switch_state() != before_sw;
}

// Under mu_: the switch's RDMA connection died after our whole marker went
// into TCP, and the peer's marker is verified: the peer finished its side
// and switched back at once (fork hands the connection off before it
// returns, and so does an fd pass; or its path failed), or its process
// went. Its record (or its EOF) follows its marker, so join its reverse
// switch as if we had reached RDMA, with none of our bytes on it. Before,
// this read as the peer gone: our writes failed with EPIPE, and the peer,
// waiting for our record, reset the connection after 30 s (a
// ForkingTCPServer's client, about one run in fifteen of
// multiproc.forking_server). True if the phase changed.
bool Stream::maybe_join_revert() {
  if (!join_pending()) return false;
  rdma_dead_ = false;
  set_phase(Phase::kRdma);
  if (revert_locked(RevertMode::kKeep, failure_reason())) return true;
  set_phase(Phase::kSwitching);
  rdma_dead_ = true;
  return false;
}

// The RDMA connection died before the switch completed (typically: the peer
// closed its socket in the middle). The TCP stream is still exact up to where
// each side stopped, so end it as TCP would: if neither our marker has started
// nor the peer has offered, this is a clean fallback; otherwise the peer's
// bytes up to its offer are still delivered, followed by EOF, and our own
// writes continue on TCP only if our marker has not started.
void Stream::rdma_failed_during_switch() {
  rdma_dead_ = true;
  // Our whole marker is out: the peer's marker (and its record, if it
  // switched back) or its EOF settles this (maybe_join_revert, drain_tcp),
  // within the reverse switch's bound.
  if (out_marker_off_ == sizeof out_marker_) deadline_ns_ = now_ns() + kRevertTimeoutNs;
  if (out_marker_off_ == 0) {
    offer_sent_ = false;  // our TCP direction reopens: held bytes first
    (void)flush_held();
    deferred_fin();
  }
  if (out_marker_off_ == 0 && !offer_rcvd_ && reup_ && !held_pending() && !fin_deferred_) {
    // Upgrading again, and nothing of the switch is in the TCP stream yet:
    // another attempt may work (the first after a flap often fails).
    offer_queued_ = ready_rcvd_ = ready_queued_ = ready_sent_ = verified_ = false;
    rdma_dead_ = false;
    held_cap_ = 0;
    set_phase(Phase::kPending);
    if (retry_reupgrade(stats::FallbackReason::kTimeout)) return;
    abandon_reupgrade();
    return;
  }
  if (out_marker_off_ == 0 && !offer_rcvd_) {
    LOG_DEBUG("fd %d: staying on TCP (the RDMA connection failed during the switch: %s)", tcp_fd_,
              strerror(conn_ && conn_->error() ? conn_->error() : ECONNRESET));
    if (held_pending()) {
      conn_.reset();  // governs until they are out (advance_locked), then plain
      plain_when_drained_ = true;
      set_phase(Phase::kPending);
    } else {
      set_phase(Phase::kPlain);
    }
    if (reup_) stats::set_state(slot_, stats::ConnState::kEstablished);  // its reason stays
    else note_fallback(stats::FallbackReason::kPeerClosed);
  }
}

// Back to TCP in the middle of the switch. Safe as long as we have not
// written our marker: nothing of ours is in the TCP stream but application
// bytes, so the peer (if it is real) reads what we send next as data where
// it expected our marker and, being the server, stays on TCP too; or, being
// the client, never gets a marker from us. Whatever we already drained or
// took for the peer's marker is application data: it goes to staging.
// Used when a forged request won the rendezvous (the marker does not match,
// the OFFER is behind, an unexpected message), when the switch times out or
// its path fails, and (peer_closed: no warning, no handshake error) when
// the peer left in the middle of it.
void Stream::revert_to_tcp(stats::FallbackReason reason, const char* why) {
  const bool peer_left = reason == stats::FallbackReason::kPeerClosed;
  if (peer_left) LOG_DEBUG("fd %d: RDMA upgrade abandoned (%s); staying on TCP", tcp_fd_, why);
  else LOG_WARN("fd %d: RDMA upgrade abandoned (%s); staying on TCP", tcp_fd_, why);
  auto* b = reinterpret_cast<const std::byte*>(&in_marker_);
  staging_.insert(staging_.end(), b, b + in_marker_got_);
  in_marker_got_ = 0;
  offer_rcvd_ = offer_sent_ = ready_rcvd_ = verified_ = ready_sent_ = false;
  offer_queued_ = ready_queued_ = false;
  conn_.reset();
  if (!peer_left) stats::count_handshake_error();
  note_fallback(reason);
  (void)flush_held();  // our direction is on TCP again: what was held goes first
  deferred_fin();
  if (staging_.size() > staging_off_ || held_pending()) {
    set_phase(Phase::kPending);  // governs until staging is read, no conn: no retry
    plain_when_drained_ = true;
  } else {
    set_phase(Phase::kPlain);
  }
}

// Once per connection, and it says which step hung (the peer, its
// listener's redirect, or rdma_cm itself).
// Under mu_: whether a failed rendezvous keeps the peer off RDMA for a
// while (the negative cache). `cache`: what the failure itself says (only
// the peer's own answer counts; a local shortage, memlock or resources,
// says nothing about the peer).
bool Stream::caches_failure(stats::FallbackReason reason, bool cache) const {
  // A peer that was on RDMA with us is no stranger: only a lossy path
  // counts against it when it does not take us back.
  if (reup_) return reason == stats::FallbackReason::kLossyPath;
  // Nor does a redirected request that then timed out: the peer proved it
  // runs librsock and knows the connection, its worker was just slow (a
  // loaded preforking server): the next connections try again.
  if (redirected_ && reason == stats::FallbackReason::kTimeout) return false;
  return cache;
}

void Stream::log_rendezvous_timeout() const {
  LOG_INFO("fd %d: RDMA rendezvous timed out (%s%s, %llu ms after the socket's start); "
           "staying on TCP", tcp_fd_, conn_->stage(), redirected_ ? ", redirected" : "",
           us_since_start() / 1000);
}

void Stream::enter_switching() {
  set_phase(Phase::kSwitching);
  switch_ns_ = now_ns();
  deadline_ns_ = switch_ns_ + uint64_t{process_config().tunables.upgrade_timeout_ms} * 1000000;
  stats::set_state(slot_, stats::ConnState::kUpgrading);
  // Every TCP write holds mu_, so tcp_tx_ is exactly where our TCP bytes end.
  offer_sent_ = true;
  out_marker_ = {wire::kMarkerMagic, peer_cookie_, tcp_tx_};
  offer_queued_ = true;
  // What the switch may hold of the application's writes (holds()): no more
  // than the kernel socket would take now, with room to spare, so that an
  // abandoned switch can hand them to it; nor than the RDMA send ring takes
  // at once when the switch ends.
  held_cap_ = std::min<size_t>({kMaxHeldBytes, tcp_send_space() / 2, conn_->writable() / 2});
  LOG_DEBUG("fd %d: RDMA connection up %llu us after the socket's start, switching at TCP bytes out/in "
            "%llu/%llu", tcp_fd_, us_since_start(),
            (unsigned long long)tcp_tx_, (unsigned long long)tcp_rx_);
}

void Stream::handle_controls(bool cq_drained) {
  if (offer_queued_) {
    uint64_t n = out_marker_.offset;
    if (conn_->send_control(uint8_t(wire::Control::kOffer), std::as_bytes(std::span(&n, 1))))
      offer_queued_ = false;
  }
  for (;;) {
    auto m = conn_->recv_control(/*poll=*/!cq_drained);
    if (!m) break;
    if (m->type == uint8_t(wire::Control::kOffer) && m->len == sizeof(uint64_t) && !offer_rcvd_) {
      std::memcpy(&rx_limit_, m->data, sizeof rx_limit_);
      if (rx_limit_ < tcp_rx_) {
        if (out_marker_off_ == 0)
          revert_to_tcp(stats::FallbackReason::kProtocol, "peer's switch offset is behind our data");
        else
          break_connection(ECONNRESET, "peer's switch offset is behind what we received");
        return;
      }
      // We hold mu_, and every TCP read of ours does too: from here on no
      // read can pass the limit, so the peer may send its marker.
      offer_rcvd_ = true;
      ready_queued_ = true;
      LOG_DEBUG("fd %d: switch: the peer's offer (%llu) in, %llu us after the socket's start",
                tcp_fd_, (unsigned long long)rx_limit_, us_since_start());
    } else if (m->type == uint8_t(wire::Control::kReady) && m->len == 0 && offer_sent_) {
      ready_rcvd_ = true;
      LOG_DEBUG("fd %d: switch: the peer is ready, %llu us after the socket's start", tcp_fd_,
                us_since_start());
      // (The syscall itself: _exit would be our own hook, which parks the
      // progress thread, maybe this very thread.)
      if (client_ && debug_exit_at_ready()) syscall(SYS_exit_group, 0);
    } else if (m->type == uint8_t(wire::Control::kReset) && m->len == 0) {
      err_ = ECONNRESET;
      set_phase(Phase::kBroken);
      staging_.clear();
      return;
    } else {
      if (out_marker_off_ == 0) revert_to_tcp(stats::FallbackReason::kProtocol, "unexpected switch message");
      else break_connection(ECONNRESET, "unexpected switch message");
      return;
    }
  }
  if (ready_queued_ && conn_->send_control(uint8_t(wire::Control::kReady), {})) {
    ready_queued_ = false;
    ready_sent_ = true;
  }
}

// The client writes its marker as soon as the server is READY; the server
// writes its own only after it has verified the client's. So a forged
// request that won the rendezvous can never make the server inject a byte
// into the real TCP stream: on a mismatch the server just stays on TCP.
void Stream::write_marker() {
  if (!ready_rcvd_ || out_marker_off_ == sizeof out_marker_) return;
  if (!client_ && !verified_) return;
  RecordIo io = write_record(&out_marker_, sizeof out_marker_, &out_marker_off_);
  if (io == RecordIo::kDone)
    LOG_DEBUG("fd %d: switch: our marker written, %llu us after the socket's start", tcp_fd_,
              us_since_start());
  // kAgain: the progress thread retries.
  if (io == RecordIo::kClosed || io == RecordIo::kBroken)
    break_connection(ECONNRESET, "cannot write the switch marker");
}

// Reads the peer's remaining TCP bytes (up to its offer) into staging, then
// its marker, so verification never waits for the application to read.
void Stream::drain_tcp() {
  if (!offer_rcvd_ || verified_) return;
  while (tcp_rx_ < rx_limit_) {
    size_t want = std::min<uint64_t>(rx_limit_ - tcp_rx_, 64 * 1024);
    size_t old = staging_.size();
    staging_.resize(old + want);
    ssize_t r = sys::libc.recv(tcp_fd_, staging_.data() + old, want, MSG_DONTWAIT);
    staging_.resize(old + (r > 0 ? size_t(r) : 0));
    if (r > 0) {
      tcp_rx_ += uint64_t(r);
      if (slot_) slot_->add_rx(stats::Transport::kTcp, uint64_t(r));
      continue;
    }
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
    break_connection(ECONNRESET, r == 0 ? "peer closed TCP during the switch" : "TCP error");
    return;
  }
  switch (read_record(&in_marker_, sizeof in_marker_, &in_marker_got_)) {
    case RecordIo::kDone: break;
    case RecordIo::kAgain: return;
    case RecordIo::kClosed:
      // The peer closed right at its offer (it went away mid-switch): a
      // clean end of stream after the bytes we already hold.
      tcp_eof_ = true;
      // With our RDMA connection dead and our direction on TCP already, the
      // switch is over: TCP from here on (the kernel keeps reading EOF), not
      // a stream left switching on a dead connection until its close. When
      // the peer's rdma_cm ended the RDMA connection, both paths ended
      // together: the peer went away (a client that exits right after its
      // reply, as redis-cli does, while its rendezvous runs), not a failed
      // path, and nothing a log warning should report. A connection that
      // failed here with no word from the peer, while the peer shut its
      // direction down right at its offer after its last byte, is a failed
      // path still (upgrade.switch.h_rdma_fails_mid_switch, whose server
      // ends its 4 MiB that way: path_failed, not peer_closed).
      if (rdma_dead_ && out_marker_off_ == 0) {
        const bool left = conn_ && conn_->peer_disconnected();
        using stats::FallbackReason;
        revert_to_tcp(left ? FallbackReason::kPeerClosed : FallbackReason::kPathFailed,
                      left ? "the peer closed during the switch"
                           : "the RDMA connection failed during the switch");
      }
      return;
    case RecordIo::kBroken:
      break_connection(ECONNRESET, "peer closed TCP inside its switch marker");
      return;
  }
  if (in_marker_.magic != wire::kMarkerMagic || in_marker_.cookie != my_cookie_ ||
      in_marker_.offset != rx_limit_) {
    if (rdma_dead_ && out_marker_off_ == 0) {
      // The RDMA connection failed mid-switch and the peer, its marker not
      // started either, reopened its direction: what follows its offer is
      // its data, and ours is on TCP already (rdma_failed_during_switch).
      revert_to_tcp(stats::FallbackReason::kPathFailed, "the RDMA connection failed during the switch");
      return;
    }
    if (!client_ && out_marker_off_ == 0) {
      revert_to_tcp(stats::FallbackReason::kProtocol, "the request did not come from the TCP peer");
      return;
    }
    break_connection(ECONNRESET, "switch marker does not match");
    return;
  }
  verified_ = true;
  LOG_DEBUG("fd %d: switch: the peer's marker verified, %llu us after the socket's start", tcp_fd_,
            us_since_start());
}

uint64_t Stream::rx_arrived() {
  std::lock_guard lk(mu_);
  if (phase() == Phase::kReverting && !down_done_) return down_out_.resume;
  uint64_t pos = tcp_rx_;
  if ((tcp_rx_open() || !verified_) && tcp_fd_ >= 0) {
    int k = 0;
    if (sys::libc.ioctl(tcp_fd_, FIONREAD, &k) == 0 && k > 0) {
      uint64_t q = uint64_t(k);
      // Past the peer's offer only its marker follows: not application data.
      if (!tcp_rx_open()) q = std::min<uint64_t>(q, rx_limit_ > tcp_rx_ ? rx_limit_ - tcp_rx_ : 0);
      pos += q;
    }
  }
  if (verified_ && conn_ && !rdma_dead_) pos += conn_->counters().bytes_received + conn_->readable();
  return pos;
}

bool Stream::check_idle_tcp() {
  {
    std::lock_guard lk(mu_);
    if (phase() != Phase::kRdma || tcp_fd_ < 0) return false;
    uint64_t magic = 0;
    ssize_t r = sys::libc.recv(tcp_fd_, &magic, sizeof magic, MSG_PEEK | MSG_DONTWAIT);
    if (r < 0 && errno == EAGAIN) return true;
    if (r <= 0) return false;  // EOF or error: the peer's teardown, RDMA has the rest
    bool path = false;
    if (r == sizeof magic && wire::down_magic(&magic, sizeof magic, version_, &path)) {
      // The peer switches back to TCP: join it (its record is read there;
      // wake() below announces the change), for its reason.
      if (!revert_locked(RevertMode::kKeep,
                         path ? stats::FallbackReason::kPathFailed : stats::FallbackReason::kReleased,
                         true, /*may_return=*/true))
        break_connection(ECONNRESET, "the peer switched back to TCP and this end cannot");
    } else if (r < ssize_t(sizeof magic) && wire::down_magic(&magic, size_t(r), version_)) {
      return true;  // the start of a record: look again when the rest is in
    } else {
      // What came, for the report: a peer without librsock's state writes
      // application bytes; anything else here would be a protocol bug.
      unsigned char b[8];
      std::memcpy(b, &magic, sizeof b);
      LOG_WARN("fd %d (%s, version %u): %zd bytes on TCP while on RDMA, starting %02x %02x %02x "
               "%02x %02x %02x %02x %02x; TCP %llu out / %llu in before the switch",
               tcp_fd_, client_ ? "client" : "server", unsigned(version_), r, b[0], b[1], b[2],
               b[3], b[4], b[5], b[6], b[7], (unsigned long long)tcp_tx_,
               (unsigned long long)tcp_rx_);
      if (conn_ && !rdma_dead_) (void)conn_->send_control(uint8_t(wire::Control::kReset), {});
      break_connection(ECONNRESET,
                       "bytes arrived on TCP after the switch (a process without librsock's "
                       "state, e.g. after exec, wrote to the connection)");
    }
  }
  wake();
  return false;
}

void Stream::detach_after_fork() {
  new (&mu_) std::mutex();                   // may have been held at fork
  // The tcp_hub instance is the parent's (tcp_hub::after_fork_child): its
  // entry is never deleted from here.
  hub_fd_.store(-1, std::memory_order_relaxed);
  // Parent threads asleep on it at fork: their wake fds are not ours to poke.
  for (auto& slot : sleeper_fds_) slot.store(-1, std::memory_order_relaxed);
  sleepers_.store(0, std::memory_order_relaxed);
  // Nor is the progress thread's idle-TCP watch ours (a new registry here).
  tcp_watched = tcp_watch_armed = false;
  (void)conn_.release();                     // the parent's; never touched here
  // The child's counters are its own: an upgrade here is its first.
  count_next_upgrade_ = true;
  // Counted as a holder by this fork (share_at_fork), or not at all: then
  // the slot is the parent's alone (a close here must not drop its count).
  if (holders_) {
    if (std::exchange(added_at_fork_, false)) holders::enlist(holders_);
    else holders_ = nullptr;
  }
  // (The parent's request to be made reachable: found in one run of five
  // of multiproc.socat_fork, where a child that socat forks to exec
  // published a claim for its parent's connection, then exec'd, and the
  // client was redirected to a listener that no longer existed.)
  claim_wanted_.store(false, std::memory_order_relaxed);
  awaiting = false;  // the parent's list
  if (phase() == Phase::kPending) {
    if (!shared_.load(std::memory_order_relaxed)) set_phase(Phase::kPlain);
  } else if (phase() == Phase::kReverting && down_done_ && return_out_off_ == return_out_.size()) {
    // Handed off before fork (progress_before_fork): nothing of it is in
    // RDMA state any more; the backlog, if any, is shared with the parent.
  } else if (phase() != Phase::kPlain) {
    err_ = ECONNRESET;
    set_phase(Phase::kBroken);
  }
}

// The application closed its last fd of an upgraded connection: FIN after
// the last byte, or with SO_LINGER {1, 0} a RESET, like the kernel's RST.
void Stream::begin_close() {
  if (close_started_ || !conn_) return;
  close_started_ = true;

  linger lg{};
  socklen_t len = sizeof lg;
  bool abortive = sys::libc.getsockopt(tcp_fd_, SOL_SOCKET, SO_LINGER, &lg, &len) == 0 &&
                  lg.l_onoff && lg.l_linger == 0;
  // Closing with unread data resets a TCP connection too (RFC 2525).
  bool unread = staging_.size() > staging_off_ || conn_->readable() > 0;
  if (abortive || unread) (void)conn_->send_control(uint8_t(wire::Control::kReset), {});
  (void)conn_->close();
  closed_second_ = conn_->fin_after_peer();
}

bool Stream::orphan() {
  std::lock_guard lk(mu_);
  orphaned_ = true;
  // This process holds the socket no more (before anything below goes
  // plain: the others may still count on the slot).
  release_holders_locked();
  // (socket_released called release_owner() first: no epoll registration is
  // pushed from now on, and nobody waits in an epoll set for it.)
  if (!tcp_owned_.load(std::memory_order_relaxed) && tcp_fd_ >= 0) {
    // The number was closed where no hook saw it (a raw syscall): it may
    // name another file by now, so it is not used again.
    LOG_WARN("fd %d: closed without librsock's close hook; the connection's TCP socket is lost "
             "to it", tcp_fd_);
    // (No DEL of its tcp_hub entry: by that number it could hit another
    // file's.)
    hub_fd_.store(-1, std::memory_order_release);
    set_tcp_fd(-1, false);
  }
  unwatch_tcp_locked();
  linger lg{};
  socklen_t len = sizeof lg;
  // (tcp_fd_ -1: retire_fd left the close to the kernel, RST included.)
  if (phase() != Phase::kPlain && phase() != Phase::kRdma && tcp_fd_ >= 0 &&
      sys::libc.getsockopt(tcp_fd_, SOL_SOCKET, SO_LINGER, &lg, &len) == 0 && lg.l_onoff &&
      lg.l_linger == 0) {
    // Abortive close before the switch finished: RST now, on both paths.
    if (conn_ && conn_->established())
      (void)conn_->send_control(uint8_t(wire::Control::kReset), {});
    if (conn_) (void)conn_->close();
    set_phase(Phase::kBroken);
    // The last reference (retire_fd took it): the kernel sends the RST.
    if (tcp_owned_.load(std::memory_order_relaxed)) sys::close_owned(tcp_fd_);
    set_tcp_fd(-1, false);
    wake();
    return false;
  }
  if (phase() == Phase::kRdma && (!held_pending() || flush_held())) begin_close();
  // Like a kernel FIN_WAIT, bounded. (The coarse clock: never a syscall, and
  // at most a tick early on a 10 s bound.)
  linger_deadline_ns_ = coarse_now_ns() + 10000ull * 1000000;
  if (phase() == Phase::kPending && !(held_pending() && !flush_held())) {
    // Nothing moved yet: abandon the rendezvous, the kernel ends the stream.
    // (The connection is destroyed by the progress thread: never block close().)
    if (conn_) (void)conn_->close();
    if (fin_deferred_ && tcp_fd_ >= 0) sys::libc.shutdown(tcp_fd_, SHUT_WR);
    set_phase(Phase::kPlain);
  }
  // A thread still blocked on the stream looks again (epoll registrations
  // had their last push in release_owner()).
  wake();
  return phase() == Phase::kPlain && !conn_ && tcp_fd_ < 0 && !closed_second_;
}

// Anything readable on the idle TCP stream of a closed upgraded connection
// (the peer's FIN, an error, or a stray byte, which ends it too) lets ours
// close; only "nothing yet" keeps it waiting.
bool Stream::tcp_peer_closed() {
  char b;
  return sys::libc.recv(tcp_fd_, &b, 1, MSG_PEEK | MSG_DONTWAIT) >= 0 ||
         (errno != EAGAIN && errno != EINTR);
}

bool Stream::linger_done() {
  std::lock_guard lk(mu_);
  // The peer sent its FIN first (ours, by close or shutdown, came after
  // it): like a kernel socket leaving CLOSE_WAIT, ours sends its TCP FIN
  // only after the peer's, so that TIME_WAIT stays with the side that
  // closed first, as without librsock. (A server closing second took
  // TIME_WAIT otherwise and, without SO_REUSEADDR, could not bind its port
  // again for a minute: sockperf's server did.) Bounded by the linger.
  auto tcp_may_close = [this] {
    return !closed_second_ || tcp_peer_closed() || now_ns() > linger_deadline_ns_;
  };
  if (phase() == Phase::kSwitching) advance_locked();  // finish the switch, then close
  if (phase() == Phase::kReverting) {
    // Finish the reverse switch: the backlog is the application's data.
    advance_revert();
    if (phase() == Phase::kReverting && !revert_settled()) return now_ns() > linger_deadline_ns_;
    return tcp_may_close();
  }
  Phase p = phase();
  // Held bytes (written while the switch ran) are the application's data.
  if (held_pending() && p != Phase::kBroken && !flush_held())
    return now_ns() > linger_deadline_ns_;
  if (p == Phase::kBroken || rdma_dead_) return true;
  if (p == Phase::kPlain || !conn_) return tcp_may_close();
  if (p == Phase::kRdma) {
    begin_close();
    // The peer switches back (its process exits, or hands the connection
    // off): join it at once, rather than make it wait out its bound.
    if (stats::FallbackReason why = peer_record_reason();
        why != stats::FallbackReason::kNone && revert_locked(RevertMode::kKeep, why)) {
      linger_deadline_ns_ = deadline_ns_;  // the reverse switch's own bound
      return false;
    }
    // (A failure may also show only as the connection's error state.)
    bool failed = !conn_->progress() || conn_->error() != 0;
    if (!failed && conn_->closed()) return tcp_may_close();
    if (!failed && now_ns() <= linger_deadline_ns_) return false;
    // The RDMA path failed (a link flap: the peer's NIC never acknowledged
    // our last writes), or the close did not finish in time, while the
    // peer has not consumed all we sent: dropping the connection now would
    // lose those bytes, which kernel TCP would still deliver after close().
    // Switch back instead and let TCP carry them (the backlog), then close.
    if (conn_->retained_from() < conn_->tx_position() &&
        revert_locked(RevertMode::kKeep, failed ? failure_reason()
                                                : stats::FallbackReason::kReleased)) {
      linger_deadline_ns_ = deadline_ns_;
      return false;
    }
    return tcp_may_close();  // failed with nothing left to deliver
  }
  return now_ns() > linger_deadline_ns_;
}

}  // namespace rsock::socket
