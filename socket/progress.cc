// The per-process progress thread and the rendezvous registries.
//
// The thread drives what the application may not: rdma_cm handshakes, the
// switch, keepalives of idle connections, incoming connect requests, and the
// orderly close of streams whose application fds are gone. It never carries
// application data: readers and writers drive their own stream inline and
// sleep on its fds, so no data waits for a thread hop.
//
// It ticks every kBusyTickMs while any stream is still switching and every
// kIdleTickMs otherwise; listener fds and a command eventfd wake it early.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include <boost/intrusive/list.hpp>
#include <boost/intrusive/set.hpp>

#include "socket/fd_table.h"
#include "socket/listen_share.h"
#include "socket/process.h"
#include "socket/readiness.h"
#include "socket/rendezvous.h"
#include "socket/stream.h"
#include "socket/tcp_hub.h"
#include "transport/cm_hub.h"
#include "transport/cq_group.h"
#include "transport/cq_hub.h"
#include "transport/fds.h"
#include "transport/listener.h"
#include "transport/kit_pool.h"
#include "transport/path_quality.h"
#include "util/log.h"
#include "util/no_destroy.h"
#include "util/owned_fds.h"
#include "util/stats.h"
#include "util/clock.h"
#include "util/sys.h"

namespace rsock::socket {

namespace {

constexpr int kBusyTickMs = 1;
constexpr int kIdleTickMs = 50;
constexpr uint64_t kSweepNs = 1'000'000'000;  // every stream gets a look this often
constexpr uint64_t kTcpTag = uint64_t{1} << 40;  // epoll data: kTcpTag | fd
constexpr uint64_t kHubTag = uint64_t{1} << 41;  // the shared rdma_cm channel
constexpr uint64_t kOwnerTag = uint64_t{1} << 42;  // kOwnerTag | pidfd of a listener's owner
// An idle-TCP watch's data also holds its stream's registry index (bits 43
// and up), so its event finds the stream without a walk over all of them.
constexpr int kTcpIndexShift = 43;
constexpr size_t kTcpIndexLimit = size_t{1} << (64 - kTcpIndexShift);
// A child that lost the race for an exited owner's port looks again after
// this (the winner names itself in the share right after its bind), doubling
// up to kTakeOverGapMaxNs while the port stays taken by someone else.
constexpr uint64_t kTakeOverGapNs = 20'000'000, kTakeOverGapMaxNs = 1'000'000'000;
// An upgraded connection keeps this many fds of its own: none. The TCP
// socket is the application's fd until the application closes it, epoll
// sets are woken through their own poke fd (Socket::watches), and a
// blocking call or the poll/select emulation sleeps on its thread's wake
// eventfd (thread_wake_fd: one per sleeping thread, none per socket). So
// the check is only that librsock is below its half of the fd limit.
constexpr int kFdsPerStream = 0;

// How often the thread looks at an upgraded stream: often enough for its
// keepalive (sent after a keepalive period without traffic; the period
// grows with the number of connections, transport::keepalive_period_ns).
uint64_t rdma_tick_ns() {
  uint64_t ka = transport::keepalive_period_ns(process_config().tunables.keepalive_ms);
  return ka ? std::max<uint64_t>(uint64_t{kIdleTickMs} * 1000000, ka / 2) : 1000000000;
}


uint16_t port_of(const sockaddr_storage& a) {
  return ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port);  // same offset in v6
}

// A listener's address that serves every local address (0.0.0.0, ::).
bool is_wildcard(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET)
    return reinterpret_cast<const sockaddr_in*>(&a)->sin_addr.s_addr == htonl(INADDR_ANY);
  if (a.ss_family == AF_INET6)
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr);
  return false;
}

// IPs equal (IPv4-mapped IPv6 compares as IPv4).
bool same_ip(const sockaddr* a, const sockaddr* b) {
  auto v4 = [](const sockaddr* s, in_addr* out) {
    if (s->sa_family == AF_INET) {
      *out = reinterpret_cast<const sockaddr_in*>(s)->sin_addr;
      return true;
    }
    auto* s6 = reinterpret_cast<const sockaddr_in6*>(s);
    if (s->sa_family == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr)) {
      std::memcpy(out, &s6->sin6_addr.s6_addr[12], 4);
      return true;
    }
    return false;
  };
  in_addr x{}, y{};
  bool ax = v4(a, &x), by = v4(b, &y);
  if (ax || by) return ax && by && x.s_addr == y.s_addr;
  if (a->sa_family != AF_INET6 || b->sa_family != AF_INET6) return false;
  return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                     &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, 16) == 0;
}

bool is_loopback(const sockaddr* a) {
  if (a->sa_family == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr) >> 24) == 127;
  if (a->sa_family == AF_INET6) {
    auto& in6 = reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&in6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&in6) && in6.s6_addr[12] == 127;
  }
  return false;
}

// An rdma_cm listener outlives its TCP listening socket by upgrade_timeout_ms
// (socket == nullptr, closed_until_ns set): connections accepted just before
// the close (a server that accepts once and closes its listener, a test
// harness) still get their rendezvous answered.
//
// A side listener (side = true, socket == nullptr, tcp_port 0) is a fork
// child's own rdma_cm listener on an ephemeral port, for the connections it
// accepts on a listening socket it inherited (socket/listen_share.h); it
// lives as long as the process.
struct ListenerEntry {
  Socket* socket;
  uint16_t tcp_port;
  std::unique_ptr<transport::Listener> listener;
  sockaddr_storage addr{};       // the TCP listener's bound address
  uint64_t closed_until_ns = 0;  // 0 while the TCP listener is open
  listen_share::Table* share = nullptr;  // shared with fork children (never unmapped)
  bool side = false;
  bool v6only = false;  // the TCP listener's IPV6_V6ONLY, for a child that takes over
  // The port's named table (listen_share::open_group), opened once `share`
  // is marked: a process exec'd with the socket publishes there.
  listen_share::Table* named = nullptr;
  // Another listening socket of this process on the same address and port
  // (SO_REUSEPORT): no rdma_cm listener of its own (the port has one), the
  // requests of its connections arrive at the first socket's, whose share it
  // uses. Dropped when the socket closes.
  bool alias = false;
  // Its channel may hold events: set when the thread's epoll reports the
  // channel (and by the once-a-second sweep), cleared by the read that
  // empties it.
  bool readable = true;
};

// A listening socket this fork child inherited: its rdma_cm listener is the
// parent's, and `share` the table the two have in common. Once the child
// uses it (accept, epoll), it watches the owner (a pidfd in the thread's
// epoll set); when the owner exits, the child binds the listener's port
// itself and becomes the owner (take_over), or, if a sibling was first,
// watches that one.
struct InheritedListener {
  Socket* socket;
  listen_share::Table* share;
  uint16_t tcp_port = 0;
  sockaddr_storage addr{};
  bool v6only = false;
  bool watched = false;      // the child used it: its owner is looked after
  int owner_fd = -1;         // pidfd of the owner, in g_epfd (kOwnerTag)
  int32_t owner_pid = 0;     // the owner watched, or found gone
  uint64_t retry_ns = 0;     // gone, port still taken: try again then
  uint64_t retry_gap_ns = 0;
  listen_share::Table* named = nullptr;  // the port's named table, once an exec needed it
  // The event channel a takeover's rdma_cm listener will use, opened by the
  // application's thread when it starts to watch (the takeover runs in the
  // progress thread, which must not create an fd: docs/DESIGN.md, "Library
  // fds").
  rdma_event_channel* spare = nullptr;
};

// A connection this child accepted on an inherited listener and published
// in the share, until its request arrives or it stops waiting.
struct ShareClaim {
  Stream* stream;
  listen_share::Table* share;
  int slot;
};

// A request matched to its stream under g_mu, accepted after it
// (finish_accepts): the accept creates the QP and its queues, up to about a
// millisecond of verbs calls on rxe, and the application's accept() and
// connect() wait for g_mu.
struct Accepting {
  transport::IncomingRequest req;
  transport::Listener* via;  // (destroyed only at the top of a turn: Registry::dropped)
  Stream* st;                // (only this thread deletes streams)
  wire::RendezvousReply rep;
  uint64_t peer_cookie;      // the request's
};

void accept_matched(Accepting& a);

struct PendingRequest {
  transport::IncomingRequest req;
  uint64_t expires_ns;
  transport::Listener* via;       // the listener it arrived on
  listen_share::Table* share;     // that listener's share, if any
};

struct NegativeEntry {
  sockaddr_storage peer;
  uint64_t expires_ns;
  bool whole_host;  // any port of peer's address (a lossy path)
  // Kept (not skipped) until then, so that a failure after a short first
  // strike counts as the second (negative_cache_add's first_short).
  uint64_t remember_ns;
  uint64_t added_ns;
};

struct Watch {
  int fd;
  void (*fn)(void*);
  void* arg;
};

namespace bi = boost::intrusive;
// The thread's schedule (Stream::loop_hook): streams it looks at every
// tick, and streams it looks at only when their time comes, by time.
using ActiveList = bi::list<Stream, bi::member_hook<Stream, Stream::LoopHook, &Stream::loop_hook>,
                            bi::constant_time_size<false>>;
struct DueFirst {
  bool operator()(const Stream& a, const Stream& b) const { return a.loop_due_ns < b.loop_due_ns; }
};
using TimerSet = bi::multiset<Stream, bi::member_hook<Stream, Stream::TimerHook, &Stream::timer_hook>,
                              bi::constant_time_size<false>, bi::compare<DueFirst>>;

// The registries, on the heap so that a fork child can drop the parent's
// without running any destructor (they reference the parent's RDMA state).
struct Registry {
  std::mutex mu;
  std::vector<Stream*> streams;       // governing or lingering streams
  std::vector<Socket*> stream_owner;  // parallel: owning socket, nullptr once orphaned
  std::vector<ListenerEntry> listeners;
  // In a fork child: listening sockets whose rdma_cm listener stayed with
  // the parent.
  std::vector<InheritedListener> inherited_listeners;
  std::vector<ShareClaim> claims;
  // Server streams pending without a connection, which a request may be
  // for (try_match): a request costs what waits, not every stream of the
  // process (setup of n connections was O(n^2)). Entered at accept, and by
  // a scan after a stream starts waiting again (g_awaiting_epoch); left
  // when matched, settled otherwise or released.
  std::vector<Stream*> awaiting;
  uint64_t awaiting_epoch = 0;  // g_awaiting_epoch at the last scan
  std::vector<PendingRequest> requests;
  std::vector<Watch> watches;
  int epfd = -1, cmd_fd = -1;
  bool started = false;
  // The thread's schedule (docs/DESIGN.md, "The registry at scale"): it
  // looks at the streams on `active` every tick and at those in `timers`
  // when their time comes; `wanted` is the lock-free stack of streams that
  // asked for a look (Stream::want_loop), moved onto `active` every tick.
  ActiveList active;
  // The turn's streams, moved off `active` under the lock and driven
  // without it (thread_main); empty between turns.
  ActiveList turn;
  // rdma_cm listeners dropped from `listeners` (drop_listener), destroyed
  // at the top of the thread's next turn: an accept of the turn in flight
  // without the lock (Accepting::via) may still use one.
  std::vector<std::unique_ptr<transport::Listener>> dropped;
  // Requests try_match paired with a stream, accepted without the lock
  // (finish_accepts); empty between turns.
  std::vector<Accepting> accepting;
  TimerSet timers;
  std::atomic<Stream*> wanted{nullptr};
  uint64_t sweep_ns = 0;  // next look at every stream (a safety net)
};
// Created on first use: hooks may run before our dynamic initialisers.
std::atomic<Registry*> g_reg_ptr{nullptr};
// Held by the progress thread whenever it is awake (everything but its
// epoll_wait), and by fork() around the fork, so that the child never
// inherits a lock the thread held in the middle of a call: librdmacm's (the
// hub's rdma_get_cm_event), the allocator's, one of ours. A child that did
// hung in its first rdma_cm call or allocation (measured: a preforked worker
// stuck in its first thread's start under ASan, its connection never served).
// Outermost: taken with no other lock held. Never destroyed (hooks may run
// during exit).
std::mutex g_loop_mu;
bool g_hub_serviced_before_fork = false;
// Parks the progress thread (it holds g_loop_mu while awake) for work that
// must not run beside its turn: fork, exec, exit, io_uring. While it is
// parked, the connections that work settles read the rdma_cm hub
// themselves. Returns the hub's state for unpark_progress.
bool park_progress() {
  g_loop_mu.lock();
  const bool serviced = transport::cm_hub::serviced();
  transport::cm_hub::set_serviced(false);
  return serviced;
}
void unpark_progress(bool serviced) {
  transport::cm_hub::set_serviced(serviced);
  g_loop_mu.unlock();
}
std::atomic<bool> g_thread_up{false};  // the progress thread reached thread_main
// Inherited listeners (with a share) whose owner nobody watches yet: the
// accept and epoll_ctl hooks look for them only while this is nonzero.
std::atomic<int> g_unwatched_inherited{0};
// Bumped by server_awaits_request(): Registry::awaiting needs a scan.
std::atomic<uint64_t> g_awaiting_epoch{0};
Registry* reg() {
  Registry* r = g_reg_ptr.load(std::memory_order_acquire);
  if (r) return r;
  auto* fresh = new Registry();
  if (g_reg_ptr.compare_exchange_strong(r, fresh)) return fresh;
  delete fresh;
  return r;
}
#define g_mu (reg()->mu)
#define g_streams (reg()->streams)
#define g_stream_owner (reg()->stream_owner)
#define g_listeners (reg()->listeners)
#define g_requests (reg()->requests)
#define g_inherited_listeners (reg()->inherited_listeners)
#define g_claims (reg()->claims)
#define g_awaiting (reg()->awaiting)
#define g_active (reg()->active)
#define g_turn (reg()->turn)
#define g_accepting (reg()->accepting)
#define g_dropped (reg()->dropped)
#define g_timers (reg()->timers)
#define g_watches (reg()->watches)
#define g_epfd (reg()->epfd)
#define g_cmd_fd (reg()->cmd_fd)
#define g_started (reg()->started)

void poke() {
  uint64_t one = 1;
  if (g_cmd_fd >= 0) (void)!sys::libc.write(g_cmd_fd, &one, sizeof one);
}

void* thread_main(void*);
void make_reachable(Stream* st, uint64_t now);

// Under g_mu.
bool ensure_thread() {
  if (g_started) return true;
  g_epfd = sys::own_fd(sys::libc.epoll_create1(EPOLL_CLOEXEC));
  g_cmd_fd = sys::own_fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (g_epfd < 0 || g_cmd_fd < 0) return false;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = g_cmd_fd;
  sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_ADD, g_cmd_fd, &ev);
  // The process's one rdma_cm event channel for connections: this thread
  // reads it and hands each event to its connection (transport/cm_hub.h).
  if (transport::cm_hub::channel() != nullptr) {
    ev.data.u64 = kHubTag;
    if (sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_ADD, transport::cm_hub::fd(), &ev) == 0)
      transport::cm_hub::set_serviced(true);
    // Here, in the application's thread, rather than in the progress
    // thread's first rendezvous: fds a background thread creates take the
    // lowest free number for a moment (transport/fds.h).
    transport::prepare_devices(process_config().tunables.lossy_path_ppm != 0);
  }

  // The thread must not keep a process alive nor receive its signals.
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_t tid;
  int rc = pthread_create(&tid, &attr, thread_main, nullptr);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  pthread_attr_destroy(&attr);
  if (rc != 0) return false;
  pthread_setname_np(tid, "rsock-progress");
  g_started = true;
  // Until the new thread runs its own code it is in the thread library's (or
  // a sanitizer's) start-up, which allocates: a fork() now (a preforking
  // server forks right after listen()) would hand the child an allocator
  // lock that nobody there releases. From thread_main on, g_loop_mu covers it.
  while (!g_thread_up.load(std::memory_order_acquire)) g_thread_up.wait(false);
  return true;
}

// The rendezvous request a connect request carries; false if too short.
bool request_of(const transport::IncomingRequest& req, wire::RendezvousRequest* rq) {
  auto pl = req.payload();
  if (pl.size() < sizeof *rq) return false;
  std::memcpy(rq, pl.data(), sizeof *rq);
  return true;
}

// Under g_mu: the claim of `st` (if any) is done with.
void drop_claim(Stream* st) {
  for (size_t i = 0; i < g_claims.size(); i++) {
    if (g_claims[i].stream != st) continue;
    listen_share::clear(g_claims[i].share, g_claims[i].slot);
    g_claims.erase(g_claims.begin() + long(i));
    return;
  }
}

// Under g_mu: the entry of the listener `l` (it may be gone: nullptr).
ListenerEntry* entry_of(const transport::Listener* l) {
  for (auto& e : g_listeners)
    if (e.listener.get() == l) return &e;
  return nullptr;
}

// Under g_mu: Registry::awaiting.
bool awaits_request(Stream* st) {
  // (One that another process holds too cannot take a request: it waits to
  // be the only holder, then its request is made reachable.)
  return !st->client() && st->phase() == Phase::kPending && !st->has_conn() &&
         !st->accepting.load(std::memory_order_acquire) && !st->shared_by_fork();
}
void add_awaiting(Stream* st) {
  if (st->awaiting || !awaits_request(st)) return;
  st->awaiting = true;
  g_awaiting.push_back(st);
}
void drop_awaiting(size_t i) {
  g_awaiting[i]->awaiting = false;
  g_awaiting[i] = g_awaiting.back();
  g_awaiting.pop_back();
}

// Under g_mu: pairs a connect request, which arrived on `via`, with an
// accepted, pending server stream.
bool try_match(transport::IncomingRequest& req, transport::Listener* via) {
  wire::RendezvousRequest rq{};
  if (!request_of(req, &rq)) return false;
  ListenerEntry* l = entry_of(via);
  // A listener serves its own TCP port; a side listener any the child accepted on.
  if (l == nullptr || (!l->side && l->tcp_port != ntohs(rq.server_port))) return false;
  if (uint64_t e = g_awaiting_epoch.load(std::memory_order_acquire); e != reg()->awaiting_epoch) {
    reg()->awaiting_epoch = e;
    for (size_t i = 0; i < g_streams.size(); i++)
      if (g_stream_owner[i]) add_awaiting(g_streams[i]);
  }
  for (size_t i = 0; i < g_awaiting.size();) {
    Stream* st = g_awaiting[i];
    if (!awaits_request(st)) {
      drop_awaiting(i);
      continue;
    }
    const auto& peer = st->peer();
    const auto& local = st->local();
    // The ports, and the rdma_cm peer must be the TCP peer's host.
    if (reinterpret_cast<const sockaddr_in*>(&peer)->sin_port != rq.client_port ||
        reinterpret_cast<const sockaddr_in*>(&local)->sin_port != rq.server_port ||
        !same_ip(req.peer_addr(), reinterpret_cast<const sockaddr*>(&peer))) {
      i++;
      continue;
    }
    drop_awaiting(i);
    drop_claim(st);
    if ((rq.flags & wire::kRequestAgain) && st->adopted_first_wait()) {
      // The client counts bytes that went over RDMA (it was upgraded
      // before, somewhere), our positions only what the kernel moved: no
      // exact switch. TCP for good, on both ends (a refusal ends the
      // client's attempts).
      l->listener->reject(std::move(req), transport::RejectReason::kRefused);
      st->fall_back(stats::FallbackReason::kUnsupported);
      return true;
    }
    if ((rq.flags & wire::kRequestKernel) && !st->counts_tcp_only()) {
      // The other way round: the client's kernel counted only TCP bytes,
      // ours may count more (RDMA here, or passed in). TCP for good.
      l->listener->reject(std::move(req), transport::RejectReason::kRefused);
      st->fall_back(stats::FallbackReason::kUnsupported);
      return true;
    }
    const uint8_t version = wire::negotiate(rq);
    wire::RendezvousReply rep{wire::kRendezvousMagic, version, {}, st->cookie()};
    Accepting a{std::move(req), l->listener.get(), st, rep, rq.cookie};
    try {
      g_accepting.push_back(std::move(a));  // (a stays whole if this throws)
      // Not matched again before its accept (a rescan of the registry
      // would find it still waiting, with no connection yet), and waited
      // for by a give_away (fd passing) meanwhile.
      st->accepting.store(true, std::memory_order_release);
    } catch (const std::bad_alloc&) {
      accept_matched(a);
    }
    return true;
  }
  return false;
}

// The accept of a request try_match paired with `st`: outside g_mu
// (finish_accepts), unless the list had no room.
void accept_matched(Accepting& a) {
  auto c = a.via->accept(std::move(a.req), std::as_bytes(std::span(&a.rep, 1)));
  Stream* st = a.st;
  if (!c) {
    // Rejected with kNoResources. This connection stays on TCP now,
    // rather than wait out upgrade_timeout_ms for a retry that a first
    // rendezvous never makes. (A client upgrading again does retry on
    // that answer, to no avail here: bounded, docs/DESIGN.md.)
    stats::count_handshake_error();
    int e = c.error();
    if (e == ENOBUFS) warn_memlock();
    // A failed rdma_accept (EINVAL, ECONNRESET...) means the client's
    // request went away meanwhile (its program closed the socket).
    bool ours = e == ENOMEM || e == EMFILE || e == ENFILE || e == EAGAIN || e == ENODEV;
    st->accept_failed(e == ENOBUFS ? stats::FallbackReason::kMemlock
                      : ours       ? stats::FallbackReason::kNoResources
                                   : stats::FallbackReason::kPeerClosed,
                      /*peer_gone=*/e != ENOBUFS && !ours);
  } else if (st->attach_accepted(std::move(*c), a.peer_cookie, a.rep.version)) {
    poke();
  }  // (else: closed or fallen back meanwhile, the stream refused it; the
     // connection went, and the client, which sees it end, stays on TCP)
  // Once the stream has its connection or has fallen back.
  st->accepting.store(false, std::memory_order_release);
}

void drive(Stream* st, uint64_t now);

bool switch_running(const Stream& st) {
  const Phase p = st.phase();
  return p == Phase::kSwitching || p == Phase::kReverting;
}

// The turn's switches go first, and again between its long steps. A
// switch's step is short (a look at the CQ, a TCP drain, a marker) and the
// application's writes wait in the held buffer until the switch is done,
// while an accept or a pending stream's step (rings, QP, rdma_connect) took
// 8-36 ms each on rxe under a redis-benchmark burst: a switch waited for
// whole turns of them, 117 ms in one (docs/PERFORMANCE.md). Again after each
// long step means once the coarse clock moved (a 1-4 ms tick; it costs no
// syscall), so a turn of many quick steps does not drive its switches
// n times.
class SwitchesFirst {
 public:
  explicit SwitchesFirst(uint64_t now) : now_(now) {}
  void pass() {
    for (Stream& st : g_turn)
      if (switch_running(st)) drive(&st, now_);
    tick_ = coarse_now_ns();
  }
  void between() {
    if (coarse_now_ns() != tick_) pass();
  }

 private:
  uint64_t now_;
  uint64_t tick_ = 0;
};

// After the locked part of a turn: the accepts try_match deferred. (The
// list is this thread's alone: no lock.)
void finish_accepts(SwitchesFirst& switches) {
  for (auto& a : g_accepting) {
    accept_matched(a);
    switches.between();
  }
  g_accepting.clear();
}

// Once this process passed a server connection to another (SCM_RIGHTS) or
// received one: the per-user table through which a receiver that became
// its only holder asks the listener's owner to redirect (open_passed).
std::atomic<listen_share::Table*> g_passed_share{nullptr};

// Under g_mu: a request none of our streams matches may be for a connection
// a fork child accepted on the shared listening socket, or one passed to
// another process, or one a process exec'd with the socket accepted (the
// port's named table): redirect it there.
bool try_redirect(transport::IncomingRequest& req, transport::Listener* via,
                  listen_share::Table* share, uint64_t now) {
  wire::RendezvousRequest rq{};
  if (share == nullptr || !request_of(req, &rq)) return false;
  if ((rq.max_version ? rq.max_version : rq.version) < wire::kRedirectVersion) return false;
  uint16_t port = listen_share::lookup(share, req.peer_addr(), rq.client_port, rq.server_port, now);
  if (port == 0) return false;
  via->redirect(std::move(req), port);
  return true;
}

// Under g_mu: the named table of l's port once a process exec'd with the
// listening socket (it marked l's share; it cannot reach the anonymous one),
// nullptr before. Opened at the first request that needs it, owned as ours.
listen_share::Table* named_share(ListenerEntry& l) {
  if (l.named || !listen_share::exec_marked(l.share)) return l.named;
  l.named = listen_share::open_group(reinterpret_cast<const sockaddr*>(&l.addr), l.tcp_port);
  listen_share::set_owner(l.named, int32_t(getpid()));
  return l.named;
}

bool try_redirect_named(transport::IncomingRequest& req, transport::Listener* via, uint64_t now) {
  ListenerEntry* l = entry_of(via);
  listen_share::Table* t = l ? named_share(*l) : nullptr;
  return t != nullptr && try_redirect(req, via, t, now);
}

void service_listeners(uint64_t now) {
  uint64_t ttl = uint64_t{process_config().tunables.upgrade_timeout_ms} * 1000000;
  for (auto& l : g_listeners) {
    // Read only when its channel polled readable (level-triggered: what a
    // read leaves is reported again); every read of an empty channel is a
    // syscall, and this ran at every turn of the thread.
    if (!l.listener || !l.readable) continue;
    l.readable = false;
    for (;;) {
      auto r = l.listener->next_request();
      if (!r) break;
      wire::RendezvousRequest rq{};
      if (!request_of(*r, &rq)) {
        l.listener->reject(std::move(*r), transport::RejectReason::kBadVersion);
        continue;
      }
      if (rq.magic != wire::kRendezvousMagic || wire::negotiate(rq) == 0) {
        l.listener->reject(std::move(*r), transport::RejectReason::kBadVersion);
        continue;
      }
      // A host whose path we found lossy stays on TCP for a while; its
      // client caches us in turn (RejectReason::kLossyPath).
      if (negative_cache_host(r->peer_addr())) {
        l.listener->reject(std::move(*r), transport::RejectReason::kLossyPath);
        continue;
      }
      // It may arrive before the application accepts the TCP connection;
      // unless we are out of fds, when its connection cannot have a stream:
      // "no resources" keeps the client from blaming (caching) this peer.
      if (try_match(*r, l.listener.get())) continue;
      if (try_redirect(*r, l.listener.get(), l.share, now) ||
          try_redirect(*r, l.listener.get(), g_passed_share.load(std::memory_order_acquire), now) ||
          try_redirect_named(*r, l.listener.get(), now))
        continue;
      if (!sys::owned_fd_room(kFdsPerStream) || !transport::pinned::maps_fit()) {
        l.listener->reject(std::move(*r), transport::RejectReason::kNoResources);
        continue;
      }
      g_requests.push_back({std::move(*r), now + ttl, l.listener.get(), l.share});
    }
  }
  for (size_t i = 0; i < g_requests.size();) {
    auto& pr = g_requests[i];
    if (!pr.req.valid() || try_match(pr.req, pr.via) ||
        try_redirect(pr.req, pr.via, pr.share, now) ||
        try_redirect(pr.req, pr.via, g_passed_share.load(std::memory_order_acquire), now) ||
        try_redirect_named(pr.req, pr.via, now)) {
      g_requests.erase(g_requests.begin() + long(i));
    } else if (now > g_requests[i].expires_ns) {
      // Unknown connection: dropping the request rejects it (kRefused). On
      // a port held for adopted connections it is one whose instance never
      // published (not adoptable, out of room): "no resources", which its
      // client does not cache against every instance of the service.
      // So is a request to upgrade again: its connection was on RDMA with
      // this service, and the process holding it now (a fork child left as
      // the only holder) may not have made itself reachable yet (stopped,
      // or slow on a loaded machine). "No resources" lets its client try
      // again on its schedule; a refusal would keep it on TCP for good.
      wire::RendezvousRequest rq{};
      const bool again = request_of(pr.req, &rq) && (rq.flags & wire::kRequestAgain);
      if (ListenerEntry* l = entry_of(pr.via);
          again || (l && !l->socket && !l->side && l->closed_until_ns == 0))
        pr.via->reject(std::move(pr.req), transport::RejectReason::kNoResources);
      g_requests.erase(g_requests.begin() + long(i));
    } else {
      i++;
    }
  }
}

// Under g_mu: one-shot watch of an upgraded stream's idle TCP socket.
void watch_idle_tcp(Stream* st, int op) {
  st->tcp_watched = true;
  st->tcp_watch_armed = true;
  if (st->tcp_fd() < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLONESHOT;
  const uint64_t index = st->reg_index < kTcpIndexLimit ? st->reg_index : 0;
  ev.data.u64 = kTcpTag | index << kTcpIndexShift | uint32_t(st->tcp_fd());
  sys::libc.epoll_ctl(g_epfd, op, st->tcp_fd(), &ev);
}

// Under g_mu: the idle TCP socket of some upgraded stream is readable. The
// event's index is a hint: the stream must still be there with that fd
// watched (an entry can outlive its stream: the kernel keys it by the file,
// which a dup of the application's may keep open). A stream moved since its
// watch was armed is found by a walk.
void idle_tcp_event(uint64_t tag) {
  const int fd = int(uint32_t(tag));
  const size_t hint = size_t(tag >> kTcpIndexShift);
  auto watching = [fd](const Stream* st) { return st->tcp_fd() == fd && st->tcp_watched; };
  Stream* st = hint < g_streams.size() && watching(g_streams[hint]) ? g_streams[hint] : nullptr;
  for (size_t i = 0; st == nullptr && i < g_streams.size(); i++)
    if (watching(g_streams[i])) st = g_streams[i];
  if (st == nullptr) return;
  if (st->check_idle_tcp()) watch_idle_tcp(st, EPOLL_CTL_MOD);
  else st->tcp_watch_armed = false;  // one-shot: disarmed until on RDMA again
}

// Under g_mu.
void drop_listener(size_t i) {
  // Requests held for it go first (they belong to its channel).
  std::erase_if(g_requests,
                [&](const PendingRequest& r) { return r.via == g_listeners[i].listener.get(); });
  if (g_listeners[i].listener)
    sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_DEL, g_listeners[i].listener->fd(), nullptr);
  // Children and group members that watch us take the port over now.
  auto* share = g_listeners[i].share;
  if (share && !g_listeners[i].alias && listen_share::owner(share) == int32_t(getpid()))
    listen_share::set_owner(share, 0);
  auto* named = g_listeners[i].named;
  if (named && listen_share::owner(named) == int32_t(getpid())) listen_share::set_owner(named, 0);
  if (g_listeners[i].listener) {
    try {
      g_dropped.push_back(std::move(g_listeners[i].listener));
    } catch (const std::bad_alloc&) {
      (void)g_listeners[i].listener.release();  // leaked rather than freed under an accept
    }
  }
  g_listeners.erase(g_listeners.begin() + long(i));
}

// Under g_mu: listeners whose TCP socket closed and whose grace ran out.
void expire_listeners(uint64_t now) {
  for (size_t i = 0; i < g_listeners.size();) {
    auto& e = g_listeners[i];
    if (e.closed_until_ns && now > e.closed_until_ns) drop_listener(i);
    else i++;
  }
}

// Under g_mu: an rdma_cm listener on `local`'s address and rdma_cm port
// `rport` (0: the kernel picks), read by the progress thread.
Status<std::unique_ptr<transport::Listener>> open_cm_listener(const sockaddr_storage& local,
                                                              uint16_t rport, bool v6only,
                                                              rdma_event_channel** spare = nullptr) {
  sockaddr_storage raddr = cm_address(local);
  reinterpret_cast<sockaddr_in*>(&raddr)->sin_port = htons(rport);
  auto l = transport::Listener::listen(reinterpret_cast<sockaddr*>(&raddr),
                                       process_config().tunables, 1024, v6only, spare);
  if (!l) return l;
  if (!ensure_thread()) return Err(EAGAIN);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = (*l)->fd();
  sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_ADD, (*l)->fd(), &ev);
  return l;
}

// The rdma_cm port that serves TCP port `tcp_port`.
uint16_t cm_port_of(uint16_t tcp_port) {
  return static_cast<uint16_t>(tcp_port + process_config().tunables.port_offset);
}

// ---- an exited listener owner: a preforked worker takes over -----------------

// Under g_mu: stop watching il's owner.
void unwatch_owner(InheritedListener& il) {
  if (il.owner_fd < 0) return;
  sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_DEL, il.owner_fd, nullptr);
  sys::close_owned(il.owner_fd);
  il.owner_fd = -1;
}

bool try_take_over(size_t i, uint64_t now);

// Under g_mu: watches the process that serves g_inherited_listeners[i]'s
// rdma_cm listener, or takes over at once if it is gone. May erase entry i.
void watch_owner(size_t i, uint64_t now) {
  auto& il = g_inherited_listeners[i];
  if (!ensure_thread()) return;
  unwatch_owner(il);
  il.retry_ns = il.retry_gap_ns = 0;
  il.owner_pid = listen_share::owner(il.share);
  // pidfd_open (Linux 5.3): readable once the process has exited, zombie or not.
  int pfd = il.owner_pid > 0 ? int(syscall(SYS_pidfd_open, il.owner_pid, 0)) : -1;
  LOG_DEBUG("TCP port %u: watching the owner of its rdma_cm listener, pid %d (%s)",
            unsigned(il.tcp_port), int(il.owner_pid), pfd >= 0 ? "alive" : strerror(errno));
  if (pfd < 0) {
    // ESRCH: reaped. EINVAL: reaped too, its pid still naming a process
    // group (a master that made itself one, as daemons do).
    if (il.owner_pid <= 0 || errno == ESRCH || errno == EINVAL) (void)try_take_over(i, now);
    return;  // (ENOSYS: an old kernel; the owner is not watched)
  }
  il.owner_fd = sys::own_fd(pfd);
  if (il.owner_fd < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kOwnerTag | uint32_t(il.owner_fd);
  sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_ADD, il.owner_fd, &ev);
}

// Under g_mu: the owner of g_inherited_listeners[i] exited. The first child
// to bind the listener's rdma_cm port becomes the owner: it matches its own
// connections' requests there and redirects its siblings' through the same
// share, as the exited owner did. A sibling that loses the race watches the
// winner. True if entry i was erased (this process is the owner now, or,
// for a port of adopted connections, gave up).
bool try_take_over(size_t i, uint64_t now) {
  auto& il = g_inherited_listeners[i];
  int32_t cur = listen_share::owner(il.share);
  if (cur > 0 && cur != il.owner_pid && cur != getpid()) {
    watch_owner(i, now);  // a sibling took over: watch it
    return false;
  }
  auto l = open_cm_listener(il.addr, cm_port_of(il.tcp_port), il.v6only, &il.spare);
  if (!l) {
    LOG_DEBUG("TCP port %u: its owner (pid %d) exited; cannot take its rdma_cm listener over "
              "yet: %s", unsigned(il.tcp_port), int(il.owner_pid), strerror(l.error()));
    // Taken (a sibling's bind, before it names itself), or no resources.
    if (il.socket == nullptr && il.retry_gap_ns == kTakeOverGapMaxNs) {
      // A port watched for adopted connections, taken by a process that
      // never names itself in the table (a preloaded listener of its own,
      // not ours to join): after about 2 s of tries, no more binds for the
      // rest of this process's life.
      unwatch_owner(il);
      transport::Listener::free_spare(std::exchange(il.spare, nullptr));
      g_inherited_listeners.erase(g_inherited_listeners.begin() + long(i));
      return true;
    }
    il.retry_gap_ns = il.retry_gap_ns ? std::min(il.retry_gap_ns * 2, kTakeOverGapMaxNs)
                                      : kTakeOverGapNs;
    il.retry_ns = now + il.retry_gap_ns;
    return false;
  }
  listen_share::set_owner(il.share, int32_t(getpid()));
  LOG_INFO("TCP port %u: took over its rdma_cm listener (its owner, pid %d, exited or closed it)",
           unsigned(il.tcp_port), int(il.owner_pid));
  ListenerEntry e{il.socket, il.tcp_port, std::move(*l), il.addr, 0, il.share};
  e.v6only = il.v6only;
  g_listeners.push_back(std::move(e));
  unwatch_owner(il);
  g_inherited_listeners.erase(g_inherited_listeners.begin() + long(i));
  return true;
}

// Under g_mu: the owner whose pidfd is `fd` exited.
void owner_exited(int fd, uint64_t now) {
  for (size_t i = 0; i < g_inherited_listeners.size(); i++) {
    auto& il = g_inherited_listeners[i];
    if (il.owner_fd != fd) continue;
    unwatch_owner(il);
    (void)try_take_over(i, now);
    return;
  }
}

// Choosing the better path (transport/path_quality.h): every kLossCheckNs,
// the counters of each port that upgraded streams run on. A port found
// lossy sends its busy streams (those that moved bytes since the last look)
// back to TCP for kLossyHoldNs (a stream whose lock was taken is tried at
// the next look), and their peer hosts into the negative cache, whole host.
// Idle streams stay: loss costs them nothing until they send, and then the
// next look finds them busy. The ports are per process: each process reads
// the counters itself (four `pread`s of files it keeps open, per port and
// look, only while it has a stream on RDMA). The look runs often because a
// lossy RC path moves little: every look missed is time at a fraction of
// TCP's rate. 2 % loss between two rxe guests, 64 MiB each way: 6.5 s
// with a look every 250 ms, 5.8 s every 100 ms (kernel TCP 5.0 s; three
// runs each, docs/PERFORMANCE.md). The look walks every stream, so with
// more than kLossCheckFastMax of them it comes every kLossCheckNs instead.
constexpr uint64_t kLossCheckFastNs = 100'000'000;
constexpr uint64_t kLossCheckNs = 250'000'000;
constexpr size_t kLossCheckFastMax = 1000;
constexpr uint64_t kLossyHoldNs = 2'000'000'000;
struct PortWatch {
  char device[64];
  uint8_t port;
  transport::path_quality::PortJudge judge;
  uint64_t lossy_until_ns = 0;
  bool seen = false;
};
// (Never destroyed: the progress thread may still tick during exit.)
constinit util::NoDestroy<std::vector<PortWatch>> g_ports_storage;
std::vector<PortWatch>& g_ports = g_ports_storage.value;
uint64_t g_next_loss_check_ns = 0;

PortWatch* port_watch(const Stream::PortLook& look) {
  for (auto& p : g_ports)
    if (p.port == look.port && std::strcmp(p.device, look.device) == 0) return &p;
  PortWatch& p = g_ports.emplace_back();
  std::memcpy(p.device, look.device, sizeof p.device);
  p.port = look.port;
  return &p;
}

// The throughput collapse (path_quality::RateJudge): one judge per peer
// host our streams run on RDMA to, fed at the same looks as the ports. A
// host whose judge says collapsed sends its busy streams back to TCP
// (slow_path) and goes into the negative cache, whole host, like a lossy
// port's peers. A host's best rate outlives its streams for the judge's
// kBestTtlNs (a connection that upgrades again to a still-slow path is
// judged at once), at most kMaxHostWatches of them. A peer on our own
// address is not judged: between two processes of one host (rxe's
// loopback) there is no wire that TCP could use better, and the rate
// follows the CPU, which TCP shares.
bool rate_judged(const Stream& st) {
  return !same_ip(reinterpret_cast<const sockaddr*>(&st.local()),
                  reinterpret_cast<const sockaddr*>(&st.peer()));
}
constexpr size_t kMaxHostWatches = 256;
struct HostWatch {
  sockaddr_storage host;
  transport::path_quality::RateJudge judge;
  uint64_t seen_ns = 0;
  uint64_t acked = 0;     // this look: bytes acknowledged by its streams
  bool busy = false;      // ... one of them was path-limited all along
  bool looked = false;    // ... one of them was looked at
  // Until then its busy streams switch back: the verdict holds for
  // kLossyHoldNs like a lossy port's, so that a stream whose lock was taken
  // at the verdict's look (its application in the middle of a send)
  // switches back at a later one. (A verdict for one look only left such a
  // stream on the slow path until its peer's RC retries ran out.)
  uint64_t collapsed_until_ns = 0;
};
constinit util::NoDestroy<std::vector<HostWatch>> g_hosts_storage;
std::vector<HostWatch>& g_hosts = g_hosts_storage.value;

HostWatch* host_watch(const sockaddr_storage& peer, uint64_t now) {
  for (auto& h : g_hosts)
    if (same_ip(reinterpret_cast<const sockaddr*>(&h.host), reinterpret_cast<const sockaddr*>(&peer)))
      return &h;
  if (g_hosts.size() >= kMaxHostWatches) {
    auto oldest = std::min_element(g_hosts.begin(), g_hosts.end(),
                                   [](const HostWatch& a, const HostWatch& b) { return a.seen_ns < b.seen_ns; });
    g_hosts.erase(oldest);
  }
  HostWatch& h = g_hosts.emplace_back();
  h.host = peer;
  h.seen_ns = now;
  return &h;
}

void host_name(const HostWatch& h, char (&ip)[INET6_ADDRSTRLEN]) {
  std::strcpy(ip, "?");
  const auto* sa = reinterpret_cast<const sockaddr*>(&h.host);
  if (sa->sa_family == AF_INET)
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, ip, sizeof ip);
  else if (sa->sa_family == AF_INET6)
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, ip, sizeof ip);
}

void log_collapse(const HostWatch& h) {
  char ip[INET6_ADDRSTRLEN];
  host_name(h, ip);
  LOG_WARN("RDMA to %s delivers %llu KiB/s, its best was %llu KiB/s (slow_path_ratio %u): its busy "
           "connections go back to TCP, the host stays on TCP for %u s",
           ip, (unsigned long long)(h.judge.last_bytes_per_sec() >> 10),
           (unsigned long long)(h.judge.best_bytes_per_sec() >> 10),
           process_config().tunables.slow_path_ratio, process_config().tunables.negative_cache_ttl_s);
}

// Under g_mu (check_paths): one look at every stream on RDMA: its port for
// the loss judgement, its acknowledged bytes for its host's rate. Whether
// any stream was looked at.
bool look_at_streams(uint64_t now, bool rates) {
  for (auto& p : g_ports) p.seen = false;
  for (auto& h : g_hosts) h.acked = 0, h.busy = h.looked = false;
  bool any = false;
  // A stream whose lock is taken right now (its application is in the
  // middle of I/O) keeps the port it had: under load the port's judgement
  // must not start over at every look, or a lossy port is never judged.
  // Busy: it moved bytes since the last look, or its lock is taken now.
  for (size_t i = 0; i < g_streams.size(); i++) {
    Stream* st = g_streams[i];
    if (!g_stream_owner[i] || st->phase() != Phase::kRdma) {
      st->loss_look_valid = false;
      continue;
    }
    Stream::PortLook look;
    st->loss_busy = true;
    if (st->look_port(&look)) {
      st->loss_busy = look.moved != st->moved_at_loss_check;
      st->moved_at_loss_check = look.moved;
      if (rates && rate_judged(*st)) {
        HostWatch* h = host_watch(st->peer(), now);
        h->seen_ns = now;
        h->looked = true;
        // Against the previous look of the same connection (loss_look).
        const Stream::PortLook& prev = st->loss_look;
        if (st->loss_look_valid && look.acked >= prev.acked) {
          using transport::path_quality::RateJudge;
          h->acked += look.acked - prev.acked;
          h->busy |= RateJudge::path_limited(look.in_flight, look.window) &&
                     RateJudge::path_limited(prev.in_flight, prev.window);
        }
      }
      st->loss_look = look;
      st->loss_look_valid = true;
    }
    if (!st->loss_look_valid) continue;
    port_watch(st->loss_look)->seen = true;
    any = true;
  }
  std::erase_if(g_ports, [](const PortWatch& p) { return !p.seen; });  // a new judgement later
  return any;
}

// Under g_mu (check_paths): each host looked at gets this look's bytes.
// Whether one collapsed within kLossyHoldNs (it is in the negative cache
// then).
bool judge_hosts(uint64_t now, uint32_t ratio) {
  bool any = false;
  for (auto& h : g_hosts) {
    any |= h.collapsed_until_ns > now;
    if (!h.looked) continue;
    auto v = h.judge.feed(h.acked, h.busy, now, ratio);
    if (v == transport::path_quality::RateJudge::Verdict::kNoData) continue;
    if (log::level() >= log::Level::kDebug) {
      char ip[INET6_ADDRSTRLEN];
      host_name(h, ip);
      LOG_DEBUG("RDMA to %s: %llu KiB/s while the path was the limit (best %llu KiB/s)", ip,
                (unsigned long long)(h.judge.last_bytes_per_sec() >> 10),
                (unsigned long long)(h.judge.best_bytes_per_sec() >> 10));
    }
    if (v != transport::path_quality::RateJudge::Verdict::kCollapsed) continue;
    any = true;
    if (h.collapsed_until_ns <= now) log_collapse(h);
    h.collapsed_until_ns = now + kLossyHoldNs;
    // The host, whether or not a stream can switch back now (one that is
    // already switching back for another reason must not upgrade again
    // onto this path).
    negative_cache_add(h.host, /*whole_host=*/true);
  }
  return any;
}

// Under g_mu (check_paths): each port seen gets its counters read.
void judge_ports(uint64_t now, uint32_t ppm) {
  for (auto& p : g_ports) {
    auto v = p.judge.feed(transport::path_quality::read(p.device, p.port), now, ppm);
    if (v != transport::path_quality::PortJudge::Verdict::kLossy) continue;
    if (p.lossy_until_ns <= now)
      LOG_WARN("%s port %u loses packets: %llu sequence errors in %llu packets (lossy_path_ppm "
               "%u); its busy connections go back to TCP, their peers stay on TCP for %u s",
               p.device, unsigned(p.port), (unsigned long long)p.judge.last_errors(),
               (unsigned long long)p.judge.last_packets(), ppm,
               process_config().tunables.negative_cache_ttl_s);
    p.lossy_until_ns = now + kLossyHoldNs;
  }
}

// Under g_mu (check_paths): the busy streams on a lossy port or to a
// collapsed host switch back (a collapsed host is cached already; a lossy
// port's peers are cached here).
void revert_on_bad_paths(uint64_t now, bool collapsed) {
  for (size_t i = 0; i < g_streams.size(); i++) {
    Stream* st = g_streams[i];
    if (!g_stream_owner[i] || st->phase() != Phase::kRdma || !st->loss_look_valid) continue;
    if (!st->loss_busy) continue;
    stats::FallbackReason why = stats::FallbackReason::kNone;
    if (port_watch(st->loss_look)->lossy_until_ns > now)
      why = stats::FallbackReason::kLossyPath;
    else if (collapsed && rate_judged(*st) && host_watch(st->peer(), now)->collapsed_until_ns > now)
      why = stats::FallbackReason::kSlowPath;
    if (why != stats::FallbackReason::kNone && st->try_revert(RevertMode::kKeep, why) &&
        why == stats::FallbackReason::kLossyPath)
      negative_cache_add(st->peer(), /*whole_host=*/true);
  }
}

// Under g_mu, every tick.
void check_paths(uint64_t now) {
  const auto& tun = process_config().tunables;
  const bool rates = tun.slow_path_ratio != 0, losses = tun.lossy_path_ppm != 0;
  if ((!rates && !losses) || now < g_next_loss_check_ns) return;
  g_next_loss_check_ns = now + (g_streams.size() <= kLossCheckFastMax ? kLossCheckFastNs : kLossCheckNs);
  if (!look_at_streams(now, rates)) return;
  bool collapsed = rates && judge_hosts(now, tun.slow_path_ratio);
  if (losses) judge_ports(now, tun.lossy_path_ppm);
  revert_on_bad_paths(now, collapsed);
}

// Under g_mu, every tick: retries of takeovers whose port was taken, and
// owners that gave the listener up alive (closed their socket: the table's
// owner changed or was cleared, drop_listener).
void retry_take_overs(uint64_t now) {
  for (size_t i = 0; i < g_inherited_listeners.size();) {
    auto& il = g_inherited_listeners[i];
    bool gave_up = il.owner_fd >= 0 && listen_share::owner(il.share) != il.owner_pid;
    if (gave_up) {
      unwatch_owner(il);
      if (try_take_over(i, now)) continue;
    } else if (il.retry_ns != 0 && now >= il.retry_ns && try_take_over(i, now)) {
      continue;
    }
    i++;
  }
}

// Under g_mu: the stream gets a look every tick from now on.
void activate(Stream* st) {
  if (st->loop_hook.is_linked()) return;
  if (st->timer_hook.is_linked()) st->timer_hook.unlink();
  g_active.push_back(*st);
}

// Under g_mu: the streams that asked for a look since the last tick
// (Stream::want_loop). One that is not (or no longer) in this registry is
// skipped: a fork child's detached stream, one of the parent's.
void take_wanted() {
  Stream* st = reg()->wanted.exchange(nullptr, std::memory_order_acquire);
  while (st) {
    Stream* next = st->wanted_next;
    st->loop_wanted.store(false, std::memory_order_release);
    if (st->reg_index < g_streams.size() && g_streams[st->reg_index] == st) activate(st);
    st = next;
  }
}

// Under g_mu: the timers that came due go to the active list.
void wake_due(uint64_t now) {
  while (!g_timers.empty() && g_timers.begin()->loop_due_ns <= now) {
    Stream& st = *g_timers.begin();
    g_timers.erase(g_timers.begin());
    g_active.push_back(st);
  }
}

// Under g_mu, after its look: a stream that needs no look every tick leaves
// the active list, for the timer set if a time of its own comes. On RDMA:
// its keepalive's. Pending without a rendezvous: its own (`idle_due`: its
// deferred start, its deadline, a look at its holders). Waiting to upgrade
// again: its attempt's, and no later than the idle tick (its holders, its
// deadline). Plain or broken: nothing
// until it closes (socket_released activates it).
void park(Stream* st, Phase p, uint64_t now, uint64_t idle_due = 0) {
  uint64_t due = 0;
  if (p == Phase::kRdma) {
    due = st->next_tick_ns;
  } else if (p == Phase::kPending && idle_due != 0) {
    due = idle_due;
  } else if (p == Phase::kPending) {
    due = now + uint64_t{kIdleTickMs} * 1000000;
    if (uint64_t r = st->reupgrade_at_ns(); r != 0) due = std::min(due, r);
  }
  st->loop_hook.unlink();
  if (due == 0) return;
  st->loop_due_ns = due;
  g_timers.insert(*st);
}

// Under g_mu: how long the thread may sleep (ms): until the next timer, at
// most the tick.
int wait_ms(bool busy, uint64_t now) {
  int ms = busy ? kBusyTickMs : kIdleTickMs;
  if (!g_timers.empty()) {
    uint64_t due = g_timers.begin()->loop_due_ns;
    uint64_t left = due > now ? (due - now + 999999) / 1000000 : 0;
    ms = int(std::min<uint64_t>(uint64_t(ms), left));
  }
  return ms;
}

// rsock-stat's view of the process's RDMA resources (util/stats_layout.h
// Resources), at every tick: four relaxed stores.
void publish_resources() {
  stats::Resources* r = stats::resources();
  if (r == nullptr) return;
  r->pinned_bytes.store(transport::pinned::in_use(), std::memory_order_relaxed);
  r->pinned_budget.store(transport::pinned::budget(), std::memory_order_relaxed);
  r->kits_idle.store(uint64_t(transport::kit_pool::idle()), std::memory_order_relaxed);
  r->kits_reused.store(transport::kit_pool::reused(), std::memory_order_relaxed);
}

// Outside g_mu, by the progress thread: one turn's step of a stream the
// application still owns (it may close it meanwhile: settle() sees that).
void drive(Stream* st, uint64_t now) {
  if (st->take_start_request(now) || st->reupgrade_due(now)) st->start_client();
  // An upgraded stream needs the thread only for its keepalive (its
  // reader or poller handles the rest): a look every keepalive_ms/2,
  // not every tick. Measured with 2000 upgraded sockets in the VM,
  // driving each one every 50 ms took 74% of the process's CPU and
  // made one epoll round trip 48x slower than without librsock.
  const Phase p = st->phase();
  if (p != Phase::kRdma || now >= st->next_tick_ns) {
    if (p == Phase::kRdma) st->next_tick_ns = now + rdma_tick_ns();
    (void)st->advance(/*block=*/false);
  }
}

// Under g_mu, after drive(): the stream's bookkeeping, and whether it goes
// on the active list or parks. Returns whether it needs the busy tick.
bool settle(Stream* st, uint64_t now) {
  // Closed during drive(): finished (and deleted) at the next turn.
  if (!g_stream_owner[st->reg_index]) {
    g_active.push_back(*st);
    return true;
  }
  if (st->take_claim_request()) make_reachable(st, now);
  const Phase p = st->phase();
  if (p != Phase::kPending && !g_claims.empty()) drop_claim(st);
  // (Armed again after a reverse switch and a new upgrade.)
  if (p == Phase::kRdma && !st->tcp_watch_armed)
    watch_idle_tcp(st, st->tcp_watched ? EPOLL_CTL_MOD : EPOLL_CTL_ADD);
  // A stream waiting to upgrade again waits for seconds: its timer
  // and a listener's fd wake the thread, the idle tick suffices. One
  // pending without a rendezvous waits for a time of its own (or for
  // a request, which activates it).
  const bool waits = p == Phase::kPending && !st->waits_to_reupgrade();
  const uint64_t idle_due = waits ? st->idle_due_ns(now) : 0;
  const bool ticks = (waits && idle_due == 0) || switch_running(*st);
  if (!ticks && (st->start_at_ns() == 0 || idle_due != 0) && !st->claim_requested())
    park(st, p, now, idle_due);
  else
    g_active.push_back(*st);
  return ticks;
}

void* thread_main(void*) {
  epoll_event evs[16];
  // Before g_loop_mu: ensure_thread waits for this under g_mu, and fork()
  // takes g_loop_mu before g_mu.
  g_thread_up.store(true, std::memory_order_release);
  g_thread_up.notify_all();
  std::unique_lock awake(g_loop_mu);
  for (;;) {
    bool busy = false;
    int timeout;
    // One clock read per turn: a syscall in VMs whose clock source the vDSO
    // cannot read (four per turn were most of the thread's syscalls). The
    // turn's work is short; a due time it passes is met one turn later.
    const uint64_t now = now_ns();
    {
      std::lock_guard lk(g_mu);
      g_dropped.clear();  // (no accept in flight: finish_accepts emptied the list)
      service_listeners(now);
      expire_listeners(now);
      // (Not busy for it: a retry is 20 ms to 1 s away, the idle tick is 50.)
      if (!g_inherited_listeners.empty()) retry_take_overs(now);
      check_paths(now);
      take_wanted();
      wake_due(now);
      if (now >= reg()->sweep_ns) {
        // Every stream once a second, whatever its schedule says: a look
        // that nothing asked for costs little, and bounds what a missed
        // want_loop() could delay.
        reg()->sweep_ns = now + kSweepNs;
        for (Stream* st : g_streams) activate(st);
        for (auto& l : g_listeners) l.readable = true;
      }
      for (auto it = g_active.begin(); it != g_active.end();) {
        Stream* st = &*it;
        ++it;  // (st may be deleted or moved below)
        const size_t i = st->reg_index;
        if (!g_stream_owner[i]) {
          if (st->linger_done()) {
            if (st->tcp_watched && st->tcp_fd() >= 0)
              sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_DEL, st->tcp_fd(), nullptr);
            drop_claim(st);
            // The last one takes its place: no O(n) erase per stream when
            // thousands close.
            g_streams[i] = g_streams.back();
            g_stream_owner[i] = g_stream_owner.back();
            g_streams[i]->reg_index = i;
            g_streams.pop_back();
            g_stream_owner.pop_back();
            // Its armed watch names its old index: a close of thousands
            // would otherwise walk them all once per idle-TCP event.
            if (Stream* moved = g_streams.size() > i ? g_streams[i] : nullptr;
                moved && moved->tcp_watch_armed && moved->tcp_fd() >= 0)
              watch_idle_tcp(moved, EPOLL_CTL_MOD);
            // Never deleted while on the wanted stack (take_wanted skips
            // what is no longer registered).
            if (st->loop_wanted.load(std::memory_order_acquire)) take_wanted();
            delete st;  // (unlinks itself from the active list)
            continue;
          }
          busy = true;
          continue;
        }
        // Driven after the lock (drive()): a rendezvous's steps are verbs and
        // rdma_cm calls, up to a millisecond each on rxe, and the
        // application's connect() and accept() wait for g_mu (measured: 29
        // connect()s of a burst took 73-240 ms under the whole-turn lock,
        // 19-31 ms without; docs/PERFORMANCE.md).
        st->loop_hook.unlink();
        g_turn.push_back(*st);
      }
    }
    // What it took from the registry stays valid until it takes g_mu
    // again: only this thread deletes streams, a listener dropped meanwhile
    // is destroyed at the next turn (Registry::dropped), and fork, exec and
    // exit wait for g_loop_mu, which it holds (ParkedProgress).
    SwitchesFirst switches(now);
    switches.pass();
    finish_accepts(switches);
    // (A stream whose switch ended in the first pass is driven once more
    // here: a step with nothing to do.)
    for (Stream& st : g_turn) {
      if (switch_running(st)) continue;
      drive(&st, now);
      switches.between();
    }
    {
      std::lock_guard lk(g_mu);
      while (!g_turn.empty()) {
        Stream* st = &g_turn.front();
        g_turn.pop_front();
        busy = settle(st, now) || busy;
      }
      busy = busy || !g_requests.empty() ||
             std::any_of(g_listeners.begin(), g_listeners.end(),
                         [](const ListenerEntry& e) { return e.closed_until_ns != 0; });
      timeout = wait_ms(busy, now);
    }
    // Closed connections' kits unused for a while give their pinned memory
    // back (transport/kit_pool.h); outside g_mu, as they are verbs calls.
    transport::kit_pool::trim(now);
    // Kept kits get their next QP (two per tick: one costs up to about
    // 0.9 ms on rxe), so that the connections that take them skip it.
    if (const auto& t = process_config().tunables; t.kit_qp_ahead)
      transport::kit_pool::warm(transport::Connection::inline_wanted(t), 2, t.kit_pool);
    transport::cq_group::trim(now);  // (CQs of groups left empty, likewise)
    publish_resources();
    awake.unlock();
    int n = sys::libc.epoll_wait(g_epfd, evs, 16, timeout);
    awake.lock();
    Watch fire[16];
    int nfire = 0;
    bool hub_ready = false;
    {
      std::lock_guard lk(g_mu);
      for (int i = 0; i < n; i++) {
        uint64_t tag = evs[i].data.u64;
        if (tag == kHubTag) {
          hub_ready = true;
          continue;
        }
        if (tag & kOwnerTag) {
          owner_exited(int(uint32_t(tag)), now_ns());
          continue;
        }
        if (tag & kTcpTag) {
          idle_tcp_event(tag);
          continue;
        }
        if (tag == uint64_t(uint32_t(g_cmd_fd))) {
          uint64_t v;
          (void)!sys::libc.read(g_cmd_fd, &v, sizeof v);
          continue;
        }
        bool listener = false;
        for (auto& l : g_listeners)
          if (l.listener && tag == uint64_t(uint32_t(l.listener->fd()))) listener = l.readable = true;
        if (listener) continue;
        for (auto& w : g_watches)
          if (tag == uint64_t(uint32_t(w.fd)) && nfire < 16) fire[nfire++] = w;
      }
    }
    // Outside g_mu: the hub pokes streams (no locks), a watcher takes its own
    // locks (readiness.cc). The streams whose events came in are driven at
    // the top of the loop.
    if (hub_ready) transport::cm_hub::poll();
    for (int i = 0; i < nfire; i++) fire[i].fn(fire[i].arg);
  }
  return nullptr;
}

bool eligible(config::Direction dir, const sockaddr* addr) {
  if (!rdma_available() || is_loopback(addr)) return false;
  return process_config().decide(dir, addr) == config::Action::kRdma;
}

// librsock keeps to half of the program's fd limit (util/owned_fds.h): past
// it a connection stays on TCP, so the program never meets EMFILE because
// of us while it uses less than the other half.
// Room for one more connection's memory mappings (transport/pinned.h).
bool maps_room(Socket* s) {
  if (transport::pinned::maps_fit()) return true;
  warn_maps();
  s->note_fallback(stats::FallbackReason::kNoResources);
  return false;
}

bool fd_room(Socket* s) {
  if (sys::owned_fd_room(kFdsPerStream)) return true;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    log::write_line(log::Level::kWarn,
                    "half of the fd limit (RLIMIT_NOFILE) is in use by librsock: new "
                    "connections stay on TCP. Raise it with "
                    "`ulimit -n` (or LimitNOFILE= for a systemd service)");
  s->note_fallback(stats::FallbackReason::kFdLimit);
  return false;
}

// `at`: stream positions {tx, rx} to start from (a connection adopted from
// the kernel), set before the registry can see the stream.
Stream* new_stream(Socket* s, int fd, bool client, const sockaddr_storage& local,
                   const sockaddr_storage& peer, const uint64_t* at = nullptr) {
  // The stream uses the application's fd until the application closes it
  // (fd_closing): a dup of our own per connection would cost the program one
  // fd of its RLIMIT_NOFILE each.
  auto* st = new (std::nothrow) Stream(fd, client, local, peer, s->slot());
  if (!st) return nullptr;
  if (at) st->adopt_inherited(at[0], at[1]);
  if (s->default_timeouts()) st->timeouts_none();
  st->set_owner(s);
  std::lock_guard lk(g_mu);
  if (!ensure_thread()) {
    delete st;
    return nullptr;
  }
  st->reg_index = g_streams.size();
  // (An allocation that fails here must not throw into the program: its
  // connection stays on TCP.)
  try {
    g_streams.push_back(st);
    try {
      g_stream_owner.push_back(s);
    } catch (const std::bad_alloc&) {
      g_streams.pop_back();
      throw;
    }
  } catch (const std::bad_alloc&) {
    delete st;
    return nullptr;
  }
  g_active.push_back(*st);  // a new stream ticks until it has settled
  return st;
}

}  // namespace

sockaddr_storage cm_address(const sockaddr_storage& a) {
  auto* s6 = reinterpret_cast<const sockaddr_in6*>(&a);
  if (a.ss_family != AF_INET6 || !IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr)) return a;
  sockaddr_storage out{};
  auto* s4 = reinterpret_cast<sockaddr_in*>(&out);
  s4->sin_family = AF_INET;
  s4->sin_port = s6->sin6_port;
  std::memcpy(&s4->sin_addr, &s6->sin6_addr.s6_addr[12], 4);
  return out;
}

// (Never destroyed: connect() may run in another thread during exit.)
constinit util::NoDestroy<std::vector<NegativeEntry>> g_negative_storage;
std::vector<NegativeEntry>& g_negative = g_negative_storage.value;

// The negative cache has its own lock: streams record failures while holding
// their own lock, which must never wait for the registry's.
std::mutex g_neg_mu;

void server_awaits_request() { g_awaiting_epoch.fetch_add(1, std::memory_order_acq_rel); }

bool negative_cache_hit(const sockaddr_storage& peer) {
  std::lock_guard lk(g_neg_mu);
  if (g_negative.empty()) return false;  // (no clock read: a syscall in some VMs)
  uint64_t now = now_ns();
  for (auto& e : g_negative)
    if (e.expires_ns > now && (e.whole_host || port_of(e.peer) == port_of(peer)) &&
        same_ip(reinterpret_cast<const sockaddr*>(&e.peer), reinterpret_cast<const sockaddr*>(&peer)))
      return true;
  return false;
}

bool negative_cache_host(const sockaddr* addr) {
  std::lock_guard lk(g_neg_mu);
  if (g_negative.empty()) return false;
  uint64_t now = now_ns();
  for (auto& e : g_negative)
    if (e.whole_host && e.expires_ns > now &&
        same_ip(reinterpret_cast<const sockaddr*>(&e.peer), addr))
      return true;
  return false;
}

void negative_cache_forget(const sockaddr_storage& peer) {
  std::lock_guard lk(g_neg_mu);
  std::erase_if(g_negative, [&](const NegativeEntry& e) {
    return !e.whole_host && port_of(e.peer) == port_of(peer) &&
           same_ip(reinterpret_cast<const sockaddr*>(&e.peer), reinterpret_cast<const sockaddr*>(&peer));
  });
}

void negative_cache_add(const sockaddr_storage& peer, bool whole_host, bool first_short,
                        uint64_t attempt_ns) {
  const uint64_t ttl = uint64_t{process_config().tunables.negative_cache_ttl_s} * 1000000000;
  std::lock_guard lk(g_neg_mu);
  uint64_t now = now_ns();
  std::erase_if(g_negative, [&](const NegativeEntry& e) { return e.remember_ns <= now; });
  for (auto& e : g_negative) {
    if (e.whole_host != whole_host || port_of(e.peer) != port_of(peer) ||
        !same_ip(reinterpret_cast<const sockaddr*>(&e.peer), reinterpret_cast<const sockaddr*>(&peer)))
      continue;
    // Failed again after the first strike: the whole TTL. (Not an attempt
    // that was under way before it: eight connections opened at once to a
    // service that is starting fail together, and count once.)
    if (first_short && attempt_ns < e.added_ns) return;
    e.expires_ns = std::max(e.expires_ns, now + ttl);
    e.remember_ns = std::max(e.remember_ns, e.expires_ns + ttl);
    return;
  }
  uint64_t exp = now + (first_short ? std::min(ttl, kFirstStrikeNs) : ttl);
  if (g_negative.size() < 4096) g_negative.push_back({peer, exp, whole_host, exp + ttl, now});
}

// s's stream from now on. new_stream took the timeouts as none if s's mark
// said so; a setsockopt of another thread since stored its clearing of the
// mark, then looks for the stream, while we store the stream, then look at
// the mark: the fence (and the hook's) makes one of the two see the other.
static void publish_stream(Socket* s, Stream* st) {
  s->set_stream(st);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!s->default_timeouts()) st->timeouts_changed();
}

Stream* start_client_upgrade(Socket* s, int fd, const sockaddr* peer_addr,
                             const sockaddr_storage* local_addr, const uint64_t* at) {
  if (s->stream() || !eligible(config::Direction::kClient, peer_addr)) return nullptr;
  sockaddr_storage local{}, peer{};
  socklen_t ll = sizeof local;
  if (local_addr) local = *local_addr;
  else if (sys::libc.getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) return nullptr;
  std::memcpy(&peer, peer_addr, std::min<size_t>(sizeof peer, peer_addr->sa_family == AF_INET
                                                                    ? sizeof(sockaddr_in)
                                                                    : sizeof(sockaddr_in6)));
  if (io_uring_started()) {
    s->note_fallback(stats::FallbackReason::kIoUring);
    return nullptr;
  }
  if (negative_cache_hit(peer)) {
    s->note_fallback(stats::FallbackReason::kNegativeCache);
    return nullptr;
  }
  // No rendezvous that would end in the pinned-memory budget or in the
  // program's fds anyway (the peer then sees no request and stays on TCP
  // after upgrade_timeout_ms).
  if (!fd_room(s)) return nullptr;
  if (!transport::pinned::fits(process_config().tunables)) {
    warn_memlock();
    s->note_fallback(stats::FallbackReason::kMemlock);
    return nullptr;
  }
  if (!maps_room(s)) return nullptr;
  Stream* st = new_stream(s, fd, true, local, peer, at);
  if (!st) return nullptr;
  publish_stream(s, st);
  // No poke for a deferred start: the thread looks at active streams at
  // least every idle tick (50 ms), and the application's own next call
  // makes a start that is due (advance_locked). A poke per connect() woke
  // the thread to contend for the registry's lock in the middle of the
  // application's connection setup. An idle connection may so start up to
  // a tick late; none with upgrade_delay_ms = 0 does. (An inherited one
  // starts at once: the process that connected spent part of its server's
  // window already.)
  const uint32_t delay_ms = at ? 0 : process_config().tunables.upgrade_delay_ms;
  st->request_start(coarse_now_ns() + uint64_t{delay_ms} * 1000000);
  if (delay_ms == 0) {
    std::lock_guard lk(g_mu);
    poke();
  }
  return st;
}

namespace {
// Under g_mu: this fork child's own rdma_cm listener on the address of
// `local`, on a port the kernel picks (created on first use); its port, or
// 0 if it cannot have one.
uint16_t side_listener_port(const sockaddr_storage& local) {
  for (auto& e : g_listeners)
    if (e.side && same_ip(reinterpret_cast<const sockaddr*>(&e.addr),
                          reinterpret_cast<const sockaddr*>(&local)))
      return e.listener->port();
  auto l = open_cm_listener(local, 0, false);
  if (!l) {
    LOG_INFO("no rdma_cm listener of our own for an inherited listening socket (%s): its "
             "connections stay on TCP", strerror(l.error()));
    return 0;
  }
  uint16_t port = (*l)->port();
  ListenerEntry e{nullptr, 0, std::move(*l), local, 0};
  e.side = true;
  g_listeners.push_back(std::move(e));
  return port;
}

// Under g_mu: a server stream that fork left to this process alone waits
// for the client's next request (Stream::become_sole). The request arrives
// at the rdma_cm listener of the listening socket's owner: if that is this
// process, it matches as any; if another (the parent that accepted, forked
// and closed), that one redirects it here through the share table, to a
// side listener of ours, as for a preforked worker's connection.
void make_reachable(Stream* st, uint64_t now) {
  uint16_t port = port_of(st->local());
  for (auto& e : g_listeners) {
    // (A wildcard listener, 0.0.0.0 or ::, serves every local address.)
    if (e.side || !(e.listener || e.alias) || e.tcp_port != port ||
        !(is_wildcard(e.addr) || same_ip(reinterpret_cast<const sockaddr*>(&e.addr),
                                         reinterpret_cast<const sockaddr*>(&st->local()))))
      continue;
    add_awaiting(st);
    return;
  }
  listen_share::Table* share = st->listen_table();
  uint16_t side_port = share ? side_listener_port(st->local()) : 0;
  int slot = -1;
  if (side_port != 0) {
    const auto& peer = st->peer();
    slot = listen_share::publish(share, reinterpret_cast<const sockaddr*>(&peer),
                                 reinterpret_cast<const sockaddr_in*>(&peer)->sin_port,
                                 reinterpret_cast<const sockaddr_in*>(&st->local())->sin_port,
                                 side_port, now, st->deadline_ns() > now ? st->deadline_ns() - now : 0);
  }
  if (slot < 0) {
    st->fall_back(stats::FallbackReason::kForked);  // quiet: it waited to upgrade again
    return;
  }
  LOG_DEBUG("fd %d: the only holder now; the listener's owner redirects its request to rdma_cm "
            "port %u", st->tcp_fd(), unsigned(side_port));
  g_claims.push_back({st, share, slot});
  add_awaiting(st);
}
}  // namespace

Stream* start_server_upgrade(Socket* listener, Socket* s, int fd, const sockaddr_storage* local_addr,
                             const sockaddr_storage* peer_addr) {
  // Set when `listener` was inherited from the process that owns its
  // rdma_cm listener: the table through which that process redirects.
  listen_share::Table* share = nullptr;
  listen_share::Table* own_share = nullptr;  // ours, when we own the listener
  {
    std::lock_guard lk(g_mu);
    auto own = std::find_if(g_listeners.begin(), g_listeners.end(),
                            [&](const ListenerEntry& e) {
                              return e.socket == listener && (e.listener || e.alias);
                            });
    bool has = own != g_listeners.end();
    if (has) {
      own_share = own->share;
    } else {
      auto it = std::find_if(g_inherited_listeners.begin(), g_inherited_listeners.end(),
                             [&](const InheritedListener& i) { return i.socket == listener; });
      if (it == g_inherited_listeners.end()) return nullptr;
      if (it->share == nullptr) {
        s->note_fallback(stats::FallbackReason::kForked);
        return nullptr;
      }
      if (listen_share::exec_marked(it->share)) {
        // The owner exec'd with the socket (in place, or a child of it):
        // its new image serves the port through the port's named table,
        // which names the same pid. From now on that is this worker's
        // table: it publishes there and watches the owner it names.
        if (!it->named)
          it->named = listen_share::open_group(reinterpret_cast<const sockaddr*>(&it->addr),
                                               it->tcp_port);
        if (it->named) it->share = it->named;
      }
      share = it->share;
    }
  }
  sockaddr_storage local{}, peer{};
  socklen_t ll = sizeof local, pl = sizeof peer;
  if (local_addr && peer_addr) {
    local = *local_addr;
    peer = *peer_addr;
  } else if (sys::libc.getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0 ||
             sys::libc.getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0) {
    return nullptr;
  }
  if (!eligible(config::Direction::kServer, reinterpret_cast<sockaddr*>(&local))) return nullptr;
  if (io_uring_started()) {  // the client's request is rejected: no stream matches it
    s->note_fallback(stats::FallbackReason::kIoUring);
    return nullptr;
  }
  // A host whose path we found lossy: its request is rejected (kLossyPath).
  if (negative_cache_host(reinterpret_cast<const sockaddr*>(&peer))) {
    s->note_fallback(stats::FallbackReason::kNegativeCache);
    return nullptr;
  }
  // Either way its request is rejected with kNoResources.
  if (!fd_room(s) || !maps_room(s)) return nullptr;
  uint16_t side_port = 0;
  if (share) {
    std::lock_guard lk(g_mu);
    side_port = side_listener_port(local);
    if (side_port == 0) {
      s->note_fallback(stats::FallbackReason::kForked);
      return nullptr;
    }
  }
  Stream* st = new_stream(s, fd, false, local, peer);
  if (!st) return nullptr;
  st->set_listen_table(share ? share : own_share);
  publish_stream(s, st);
  std::lock_guard lk(g_mu);
  add_awaiting(st);
  if (share) {
    // The owner of the listener redirects the client's request to us.
    uint64_t ttl = uint64_t{process_config().tunables.upgrade_timeout_ms} * 1000000;
    int slot = listen_share::publish(share, reinterpret_cast<const sockaddr*>(&peer),
                                     reinterpret_cast<const sockaddr_in*>(&peer)->sin_port,
                                     reinterpret_cast<const sockaddr_in*>(&local)->sin_port,
                                     side_port, now_ns(), ttl);
    if (slot < 0) st->fall_back(stats::FallbackReason::kNoResources);  // table full
    else g_claims.push_back({st, share, slot});
  }
  // (No poke: a request that is already waiting for this connection keeps
  // the thread on its busy tick, 1 ms, until it is matched or expires.)
  return st;
}

void socket_passing(Socket* s) {
  Stream* st = s->stream();
  if (st == nullptr || st->client()) return;
  // This process may own the listener the client's request reaches.
  if (!g_passed_share.load(std::memory_order_acquire))
    g_passed_share.store(listen_share::open_passed(), std::memory_order_release);
  // A claim this process published (it accepted on an inherited listener)
  // would send the request here; the receiver publishes its own.
  std::lock_guard lk(g_mu);
  if (!g_claims.empty()) drop_claim(st);
}

void adopt_passed(Socket* s, int fd) {
  struct stat sb{};
  bool client = false;
  // (No device: no sender here left it shared.)
  if (!rdma_available() || fstat(fd, &sb) != 0) return;
  holders::Slot* h = holders::find_passed(uint64_t(sb.st_ino), &client);
  if (h == nullptr) return;  // its sender kept it on TCP, or ran without librsock
  if (client) stats::set_direction(s->slot(), stats::Direction::kClient);
  sockaddr_storage local{}, peer{};
  socklen_t ll = sizeof local, pl = sizeof peer;
  bool ok = sys::libc.getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) == 0 &&
            sys::libc.getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) == 0;
  const auto* rule = reinterpret_cast<const sockaddr*>(client ? &peer : &local);
  ok = ok && process_config().tunables.reupgrade && !io_uring_started() &&
       eligible(client ? config::Direction::kClient : config::Direction::kServer, rule) &&
       !(client && negative_cache_hit(peer)) && fd_room(s) && maps_room(s);
  listen_share::Table* share = nullptr;
  if (ok && !client) {
    share = listen_share::open_passed();
    g_passed_share.store(share, std::memory_order_release);
    ok = share != nullptr;
  }
  Stream* st = ok ? new_stream(s, fd, client, local, peer) : nullptr;
  if (st == nullptr) {
    // This process will not count its bytes on the socket: nobody may
    // upgrade it again from the slot's positions.
    holders::poison(h);
    return;
  }
  st->set_listen_table(share);
  st->adopt_passed(h);
  s->set_stream(st);
  std::lock_guard lk(g_mu);
  poke();
}

void adopt_after_exec() {
  int cursor = 0;
  uint64_t ino = 0;
  bool client = false;
  int fds[holders::kExecFds];
  while (holders::Slot* h = holders::take_exec(&cursor, &ino, &client, fds)) {
    FdTable* t = FdTable::get_or_create();
    SocketRef s;
    int first = -1;
    for (int fd : fds) {
      struct stat sb{};
      // (The previous image's numbers: the socket, unless something between
      // the exec and now closed or replaced it.)
      if (fd < 0 || !t || fstat(fd, &sb) != 0 || !S_ISSOCK(sb.st_mode) || uint64_t(sb.st_ino) != ino)
        continue;
      if (!s) {
        int domain = 0;
        socklen_t len = sizeof domain;
        if (sys::libc.getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0) continue;
        int fl = sys::libc.fcntl(fd, F_GETFL);
        SocketRef fresh(new_socket(domain, client ? Role::kClient : Role::kAccepted,
                                   fl >= 0 && (fl & O_NONBLOCK)));
        if (!fresh) break;
        s = std::move(fresh);
        first = fd;
      }
      t->install(fd, s.get());
    }
    if (!s) {
      holders::poison(h);  // nobody here counts its bytes
      continue;
    }
    s->open_stats(first, client ? stats::Direction::kClient : stats::Direction::kServer, nullptr,
                  nullptr, true);
    adopt_passed(s.get(), first);
    LOG_DEBUG("fd %d: a connection the previous image held; waiting to upgrade it again", first);
  }
}

void adopt_inherited_connection(Socket* s, int fd, const sockaddr_storage& local,
                                const sockaddr_storage& peer, uint64_t tx, uint64_t rx) {
  if (!eligible(config::Direction::kServer, reinterpret_cast<const sockaddr*>(&local)) ||
      !fd_room(s) || !maps_room(s))
    return;
  const uint16_t port = port_of(local);
  // Every process that adopts a connection of this address and port meets
  // the others here: the one holding the rdma_cm listener redirects the
  // others' requests (as for a SO_REUSEPORT group or a listener inherited
  // across exec).
  listen_share::Table* named =
      listen_share::open_group(reinterpret_cast<const sockaddr*>(&local), port);
  if (named == nullptr) return;
  // An instance that execs in place with the connection mid-switch passes
  // it to its new image through the per-user table of passed connections,
  // where that image publishes its side listener: whoever holds the port
  // (this process now, or after a takeover) looks there too. (Opened here,
  // in the application's thread: the progress thread must not create an
  // fd.)
  if (!g_passed_share.load(std::memory_order_acquire))
    g_passed_share.store(listen_share::open_passed(), std::memory_order_release);
  // (The application's thread: the takeover's channel, should the holder
  // exit, is opened now; the progress thread must not create an fd.)
  rdma_event_channel* spare = transport::Listener::spare_channel();
  const uint64_t at[2] = {tx, rx};
  Stream* st = new_stream(s, fd, false, local, peer, at);
  if (!st) {
    transport::Listener::free_spare(spare);
    return;
  }
  st->set_listen_table(named);
  s->set_stream(st);
  std::lock_guard lk(g_mu);
  const auto* la = reinterpret_cast<const sockaddr*>(&local);
  const uint64_t now = now_ns();
  // This process holds the port's rdma_cm listener already (it inherited
  // two connections of the port, or took the listener over).
  auto holds_port = [&] {
    return std::any_of(g_listeners.begin(), g_listeners.end(), [&](const ListenerEntry& e) {
      return !e.side && e.listener && e.tcp_port == port &&
             same_ip(reinterpret_cast<const sockaddr*>(&e.addr), la);
    });
  };
  bool held = holds_port();
  // (By port and address: every open_group maps the table anew.)
  bool watched = std::any_of(
      g_inherited_listeners.begin(), g_inherited_listeners.end(), [&](const InheritedListener& il) {
        return il.socket == nullptr && il.tcp_port == port &&
               same_ip(reinterpret_cast<const sockaddr*>(&il.addr), la);
      });
  if (!held && !watched) {
    auto l = open_cm_listener(local, cm_port_of(port), false);
    if (l) {
      // Kept while the process lives, with no TCP listening socket behind
      // it (socket nullptr): the next instances of the service, started for
      // later connections, have their requests redirected from here.
      ListenerEntry e{nullptr, port, std::move(*l), local, 0, named};
      g_listeners.push_back(std::move(e));
      listen_share::set_owner(named, int32_t(getpid()));
      held = true;
    } else if (l.error() != EADDRINUSE) {
      LOG_INFO("fd %d: no rdma_cm listener for an inherited connection's TCP port %u (%s): it "
               "stays on TCP", fd, unsigned(port), strerror(l.error()));
      transport::Listener::free_spare(spare);
      st->fall_back(stats::FallbackReason::kNoResources);
      return;
    } else {
      // Another process holds it (an earlier instance of the service): its
      // exit is watched, and this process takes the port over then.
      g_inherited_listeners.push_back({nullptr, named, port, local, false});
      auto& il = g_inherited_listeners.back();
      il.watched = true;
      il.spare = std::exchange(spare, nullptr);
      watch_owner(g_inherited_listeners.size() - 1, now);
      // (watch_owner may have taken the port over at once: its holder was gone.)
      held = holds_port();
    }
  }
  transport::Listener::free_spare(spare);
  if (!held) {
    // The holder redirects the client's request here, to a side listener.
    uint16_t side_port = side_listener_port(local);
    uint64_t ttl = st->deadline_ns() > now ? st->deadline_ns() - now : 0;
    int slot = side_port == 0 ? -1
                              : listen_share::publish(
                                    named, reinterpret_cast<const sockaddr*>(&peer),
                                    reinterpret_cast<const sockaddr_in*>(&peer)->sin_port,
                                    reinterpret_cast<const sockaddr_in*>(&local)->sin_port,
                                    side_port, now, ttl);
    if (slot < 0) {
      st->fall_back(stats::FallbackReason::kNoResources);
      return;
    }
    g_claims.push_back({st, named, slot});
  }
  add_awaiting(st);
}

void listener_started(Socket* s, int fd, bool shared) {
  sockaddr_storage local{};
  socklen_t ll = sizeof local;
  if (sys::libc.getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) return;
  auto* la = reinterpret_cast<sockaddr*>(&local);
  if (!rdma_available() || process_config().decide(config::Direction::kServer, la) !=
                               config::Action::kRdma)
    return;
  std::lock_guard lk(g_mu);
  for (auto& e : g_listeners)
    if (e.socket == s) return;  // listen() again on the same socket
  // (... one that joined another process's listener: a received or
  // inherited socket, which the program listen()s on again, as Node's
  // workers do.)
  for (auto& il : g_inherited_listeners)
    if (il.socket == s) return;
  uint16_t port = port_of(local);
  for (auto& e : g_listeners) {
    // SO_REUSEPORT: a second socket on a port whose rdma_cm listener we hold
    // (a master opening one socket per worker, as nginx's reuseport does).
    if (!e.socket || !e.listener || e.side || e.tcp_port != port ||
        !same_ip(reinterpret_cast<const sockaddr*>(&e.addr), la))
      continue;
    ListenerEntry a{s, port, nullptr, local, 0, e.share};
    a.v6only = e.v6only;
    a.alias = true;
    g_listeners.push_back(std::move(a));
    return;
  }
  for (size_t i = 0; i < g_listeners.size(); i++) {
    auto& e = g_listeners[i];
    if (e.socket || e.alias || e.tcp_port != port) continue;
    // A lingering rdma_cm listener of a closed TCP listener on this port: the
    // same address is taken over as it is; another one would collide with it.
    if (same_ip(reinterpret_cast<const sockaddr*>(&e.addr), la)) {
      e.socket = s;
      e.closed_until_ns = 0;
      return;
    }
    drop_listener(i);
    break;
  }
  // An AF_INET6 wildcard serves IPv4 clients too unless the socket is
  // IPV6_V6ONLY: the rdma_cm listener then takes IPv6 requests only.
  int v6only = 0;
  socklen_t vl = sizeof v6only;
  if (cm_address(local).ss_family == AF_INET6 &&
      sys::libc.getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &vl) != 0)
    v6only = 0;
  int reuse = 0;
  socklen_t rl = sizeof reuse;
  bool group = sys::libc.getsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &reuse, &rl) == 0 && reuse;
  auto l = open_cm_listener(local, cm_port_of(port), v6only != 0);
  // A socket inherited across exec or received with SCM_RIGHTS shares no
  // memory with the process that holds its port's listener, nor with its
  // siblings: they all meet in the port's named table, as a SO_REUSEPORT
  // group does.
  group = group || shared;
  if (!l && group && l.error() == EADDRINUSE) {
    // Another process of this SO_REUSEPORT group holds the port's rdma_cm
    // listener: like a preforked worker, this one has its connections'
    // requests redirected to it, through the group's table (and takes the
    // listener over when that process exits).
    if (listen_share::Table* t = listen_share::open_group(la, port)) {
      g_inherited_listeners.push_back({s, t, port, local, v6only != 0});
      g_unwatched_inherited.fetch_add(1, std::memory_order_relaxed);
      LOG_DEBUG("TCP port %u: %s, another process holds its rdma_cm listener (pid %d)",
                unsigned(port), shared ? "inherited or received" : "SO_REUSEPORT",
                int(listen_share::owner(t)));
      return;
    }
  }
  if (!l) {
    LOG_INFO("no rdma_cm listener for TCP port %u (%s): its connections stay on TCP", port,
             strerror(l.error()));
    return;
  }
  // The share goes to fork children with the listening socket (preforked
  // workers): through it they get the requests of connections they accept.
  // (A SO_REUSEPORT group's processes share a named one.)
  listen_share::Table* share = group ? listen_share::open_group(la, port) : nullptr;
  ListenerEntry e{s, port, std::move(*l), local, 0, share ? share : listen_share::create()};
  e.v6only = v6only != 0;
  listen_share::set_owner(e.share, int32_t(getpid()));
  g_listeners.push_back(std::move(e));
}

void listener_in_use(int fd) {
  if (g_unwatched_inherited.load(std::memory_order_relaxed) == 0) return;
  SocketRef s = lookup(fd);
  if (!s) return;
  std::lock_guard lk(g_mu);
  for (size_t i = 0; i < g_inherited_listeners.size(); i++) {
    auto& il = g_inherited_listeners[i];
    if (il.socket != s.get() || il.share == nullptr || il.watched) continue;
    il.watched = true;
    if (!il.spare) il.spare = transport::Listener::spare_channel();
    g_unwatched_inherited.fetch_sub(1, std::memory_order_relaxed);
    watch_owner(i, now_ns());
    return;
  }
}

void fd_closing(int fd, bool not_vfork) {
  if (!streams_exist()) return;
  SocketRef s = lookup(fd);
  Stream* st = s ? s->stream() : nullptr;
  if (!st || !st->uses_app_fd(fd)) return;
  // A vfork child shares our memory but not our fd table: its dup2s (before
  // an exec) are its own business. (close() has asked already: a getpid.)
  if (!not_vfork && in_vfork_child()) return;
  // The registry's lock first (the idle-TCP watch is the progress thread's,
  // keyed by the number), then the stream's (retire_fd).
  std::lock_guard lk(g_mu);
  if (!st->uses_app_fd(fd)) return;  // another thread's close got here first
  if (!st->retire_fd(fd, s->names() <= 1)) return;
  // (fd still names the socket: the application's close comes after this.)
  bool watched = st->tcp_watched, armed = st->tcp_watch_armed;
  if (watched) sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_DEL, fd, nullptr);
  st->tcp_watched = st->tcp_watch_armed = false;
  // (A disarmed watch is armed again by the loop once the stream is on RDMA.)
  if (watched && armed) watch_idle_tcp(st, EPOLL_CTL_ADD);
}

void fds_closing(unsigned lo, unsigned hi) {
  FdTable* t = FdTable::get_if_exists();
  if (!t || !streams_exist()) return;
  for (int fd = t->next_tracked(lo, hi); fd >= 0;
       fd = unsigned(fd) < hi ? t->next_tracked(unsigned(fd) + 1, hi) : -1)
    fd_closing(fd);
}

void socket_released(Socket* s) {
  Stream* st = s->stream();
  std::lock_guard lk(g_mu);
  std::erase_if(g_inherited_listeners, [&](InheritedListener& i) {
    if (i.socket != s) return false;
    unwatch_owner(i);
    transport::Listener::free_spare(std::exchange(i.spare, nullptr));
    if (i.share && !i.watched) g_unwatched_inherited.fetch_sub(1, std::memory_order_relaxed);
    return true;
  });
  for (size_t i = 0; i < g_listeners.size(); i++) {
    auto& e = g_listeners[i];
    if (e.socket != s) continue;
    if (e.alias) {
      g_listeners.erase(g_listeners.begin() + long(i));
      break;
    }
    // A SO_REUSEPORT sibling still open goes on with the rdma_cm listener.
    auto sib = std::find_if(g_listeners.begin(), g_listeners.end(), [&](const ListenerEntry& a) {
      return a.alias && a.tcp_port == e.tcp_port &&
             same_ip(reinterpret_cast<const sockaddr*>(&a.addr),
                     reinterpret_cast<const sockaddr*>(&e.addr));
    });
    if (sib != g_listeners.end()) {
      e.socket = sib->socket;
      g_listeners.erase(sib);
      break;
    }
    e.socket = nullptr;
    e.closed_until_ns = now_ns() + uint64_t{process_config().tunables.upgrade_timeout_ms} * 1000000;
    poke();  // the thread expires it
    break;
  }
  if (!st) return;
  // The socket's epoll registrations are dropped by their sets (names() is
  // 0); no push reaches them after this.
  st->release_owner();
  if (st->awaiting) {  // (never deleted while listed)
    auto it = std::find(g_awaiting.begin(), g_awaiting.end(), st);
    if (it != g_awaiting.end()) drop_awaiting(size_t(it - g_awaiting.begin()));
  }
  if (size_t i = st->reg_index; i < g_streams.size() && g_streams[i] == st) {
    const bool done = st->orphan();
    g_stream_owner[i] = nullptr;  // the thread finishes and deletes it
    activate(st);
    // One that needs nothing but its delete (a short connection that never
    // started a rendezvous: the kernel ended it with the application's
    // close) waits for the thread's next turn, at most an idle tick: a poke
    // per close woke the thread for each connection of a connect-heavy
    // program, to contend with its next accept or connect for this lock.
    if (!done) poke();
  }
}

// Any thread, no lock (it may hold the stream's): a lock-free push, once
// until the thread takes it (a load first: no write while it is queued).
void Stream::want_loop() {
  if (loop_wanted.load(std::memory_order_relaxed) ||
      loop_wanted.exchange(true, std::memory_order_acq_rel))
    return;
  Registry* r = reg();
  Stream* head = r->wanted.load(std::memory_order_relaxed);
  do {
    wanted_next = head;
  } while (!r->wanted.compare_exchange_weak(head, this, std::memory_order_release,
                                            std::memory_order_relaxed));
}

void progress_watch(int fd, void (*fn)(void*), void* arg) {
  std::lock_guard lk(g_mu);
  if (!ensure_thread()) return;
  g_watches.push_back({fd, fn, arg});
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = uint32_t(fd);
  sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_ADD, fd, &ev);
}

void progress_unwatch(int fd) {
  std::lock_guard lk(g_mu);
  std::erase_if(g_watches, [&](const Watch& w) {
    if (w.fd != fd) return false;
    sys::libc.epoll_ctl(g_epfd, EPOLL_CTL_DEL, fd, nullptr);
    return true;
  });
}

void log_exit_summary() {
  stats::ProcessCounters* pc = stats::process();
  if (!pc || log::level() < log::Level::kInfo) return;
  constexpr int kTcp = int(stats::Transport::kTcp), kRdma = int(stats::Transport::kRdma);
  uint64_t tx[2], rx[2];
  {
    // Under the registry lock: the progress thread finishes a stream (moves its
    // bytes into `closed` and drops it from the list) under the same lock, so
    // every stream is counted exactly once.
    std::lock_guard lk(g_mu);
    tx[kTcp] = pc->closed.tx_bytes[kTcp].load();
    tx[kRdma] = pc->closed.tx_bytes[kRdma].load();
    rx[kTcp] = pc->closed.rx_bytes[kTcp].load();
    rx[kRdma] = pc->closed.rx_bytes[kRdma].load();
    for (Stream* st : g_streams) {
      if (stats::ConnSlot* sl = st->slot()) {
        for (int t : {kTcp, kRdma}) {
          tx[t] += sl->traffic.tx_bytes[t].load(std::memory_order_relaxed);
          rx[t] += sl->traffic.rx_bytes[t].load(std::memory_order_relaxed);
        }
      }
    }
  }
  uint64_t fallbacks = 0;
  char why[256] = "";
  size_t off = 0;
  for (int r = 0; r < stats::kFallbackReasons; r++) {
    uint64_t n = pc->fallbacks[r].load();
    fallbacks += n;
    if (n && off < sizeof why)
      off += size_t(snprintf(why + off, sizeof why - off, " %s=%llu",
                             stats::fallback_reason_name(stats::FallbackReason(r)),
                             (unsigned long long)n));
  }
  // kits_reused: connections whose verbs resources were a closed one's
  // (transport/kit_pool.h); qps_ahead: of those, the ones whose QP was made
  // ahead while the kit was kept (kit_pool::warm); cqs: the shared CQs held
  // (transport/cq_group.h); cq_arms / cq_events: CQ arms and completion
  // events read (few while the program is busy: cq_group.h, "Arming").
  // switches / switch_ms_*: the switches onto RDMA and how long they took
  // (RDMA connection up to on RDMA; the application's new writes wait
  // meanwhile): stats_layout.h, Switches.
  const stats::Switches* sw = stats::switches();
  const uint64_t nsw = sw ? sw->count.load() : 0;
  const double sw_avg = nsw ? double(sw->switch_us_sum.load()) / double(nsw) / 1000 : 0.0;
  const double sw_max = sw ? double(sw->switch_us_max.load()) / 1000 : 0.0;
  LOG_INFO("summary: connections=%llu upgraded=%llu fallbacks=%llu rdma_tx=%llu rdma_rx=%llu "
           "tcp_tx=%llu tcp_rx=%llu kits_reused=%llu qps_ahead=%llu cqs=%u cq_arms=%llu "
           "cq_events=%llu switches=%llu switch_ms_avg=%.1f switch_ms_max=%.1f "
           "(bytes: closed connections and live upgraded ones; fallbacks:%s)",
           (unsigned long long)pc->conns_seen.load(), (unsigned long long)pc->conns_upgraded.load(),
           (unsigned long long)fallbacks, (unsigned long long)tx[kRdma],
           (unsigned long long)rx[kRdma], (unsigned long long)tx[kTcp], (unsigned long long)rx[kTcp],
           (unsigned long long)transport::kit_pool::reused(),
           (unsigned long long)transport::kit_pool::qps_ahead(), transport::cq_group::groups(),
           (unsigned long long)transport::cq_group::arms(),
           (unsigned long long)transport::cq_group::events(), (unsigned long long)nsw, sw_avg, sw_max,
           off ? why : " none");
}

namespace {
// Under g_mu: every upgraded stream (the application's; with `orphans` also
// those lingering after close) switches back to TCP in hand-off mode (the
// reverse switch, kHandOff: no unread byte stays in our memory). All start
// at once, then we wait for the peers' records together: one round trip
// for all, bounded by upgrade_timeout_ms.
void hand_off_streams(bool orphans, bool at_exit,
                      stats::FallbackReason why = stats::FallbackReason::kHandedOff) {
  auto mine = [orphans](size_t i) { return orphans || g_stream_owner[i]; };
  bool any = false;
  for (size_t i = 0; i < g_streams.size(); i++) {
    Phase p = g_streams[i]->phase();
    if (mine(i) && (p == Phase::kRdma || p == Phase::kReverting)) {
      g_streams[i]->start_hand_off(at_exit, why);
      any = true;
    }
  }
  if (!any) return;
  uint64_t deadline = now_ns() + uint64_t{process_config().tunables.upgrade_timeout_ms} * 1000000;
  for (size_t i = 0; i < g_streams.size(); i++)
    if (mine(i) && g_streams[i]->phase() == Phase::kReverting)
      (void)g_streams[i]->hand_off(deadline, why);
}

// Under g_mu: pending upgrades of the application's streams stay on TCP.
void fall_back_pending(stats::FallbackReason why) {
  for (size_t i = 0; i < g_streams.size(); i++)
    if (g_stream_owner[i]) g_streams[i]->fall_back(why);  // acts on pending ones only
}

// Under g_mu, at fork and exec: switches in flight (kSwitching: neither
// pending, which falls back, nor on RDMA, which is handed off) are driven to
// their end by this thread, every one at once: the progress thread is
// parked (g_loop_mu: fork, ParkedProgress), and both ends of a connection
// may be in this process. Bounded
// by upgrade_timeout_ms; one still switching then is left as it is.
void settle_switches(bool servers = true) {
  uint64_t deadline = now_ns() + uint64_t{process_config().tunables.upgrade_timeout_ms} * 1000000;
  for (;;) {
    bool any = false;
    // (A server whose client's request it accepted is one round trip from
    // switching: settled too, so that the connection is handed off, and
    // upgrades again in whichever process keeps it. Not at exit: its bytes
    // are all in the kernel.)
    auto settling = [servers](Stream* st) {
      Phase p = st->phase();
      return p == Phase::kSwitching ||
             (servers && p == Phase::kPending && !st->client() && st->has_conn());
    };
    for (Stream* st : g_streams) {
      if (!settling(st)) continue;
      st->advance(true);
      any = any || settling(st);
    }
    if (!any) return;
    if (now_ns() > deadline) {
      LOG_WARN("a connection's switch to RDMA did not finish before fork/exec");
      return;
    }
    sys::libc.poll(nullptr, 0, 1);
  }
}
}  // namespace

void progress_before_fork() {
  epoll_before_fork();
  // The progress thread parks first; while it is parked the connections
  // settled below read the rdma_cm hub themselves.
  g_hub_serviced_before_fork = park_progress();

  // Held across fork(): no stream can be created or start its rendezvous
  // meanwhile. An upgrade still pending now would be completed by one process
  // while both own the TCP stream, so those stay on TCP, in both processes.
  g_mu.lock();
  const auto& t = process_config().tunables;
  if (!t.fork_hand_off || !t.reupgrade) {
    fall_back_pending(stats::FallbackReason::kForked);
    settle_switches();
    if (t.fork_hand_off) hand_off_streams(false, false);
    return;
  }
  // A client's rendezvous in flight cannot be finished by whichever process
  // keeps the connection: it stays on TCP (a server's accepted one is
  // settled, below).
  for (size_t i = 0; i < g_streams.size(); i++)
    if (g_stream_owner[i] && g_streams[i]->client() && g_streams[i]->has_conn())
      g_streams[i]->fall_back(stats::FallbackReason::kForked);
  settle_switches();
  // An upgraded connection's state (verbs objects, unread bytes) cannot be
  // shared with the child: switch each back to TCP first, so that whichever
  // process goes on using it has a plain TCP socket. Lingering ones stay
  // with the parent, which goes on.
  for (size_t i = 0; i < g_streams.size(); i++)
    if (g_stream_owner[i]) g_streams[i]->share_after_hand_off();
  hand_off_streams(false, false);
  // Handed off, or still waiting for a rendezvous: both processes hold the
  // socket now, and whichever is left holding it alone upgrades it again
  // (Stream::share_at_fork). The rest stays on TCP.
  for (size_t i = 0; i < g_streams.size(); i++) {
    if (!g_stream_owner[i]) continue;
    if (!g_streams[i]->share_at_fork()) {
      g_streams[i]->fall_back(stats::FallbackReason::kForked);  // acts on pending ones only
      continue;
    }
    // A claim this process published for it (it accepted on an inherited
    // listener) would send the client's request here, where it cannot be
    // taken now: the only holder publishes its own.
    if (!g_claims.empty()) drop_claim(g_streams[i]);
    // The child may exec a program that serves it (inetd style) and
    // publishes its side listener in the per-user table: this process,
    // which may own the listener, looks there too.
    if (!g_streams[i]->client() && !g_passed_share.load(std::memory_order_relaxed))
      g_passed_share.store(listen_share::open_passed(), std::memory_order_release);
  }
}

namespace {
// Under g_mu: whether every fd naming `s` in this process closes on exec.
bool closes_on_exec(Socket* s) {
  FdTable* t = FdTable::get_if_exists();
  if (!t || !s || t->max_fd() < 0) return false;
  const unsigned hi = unsigned(t->max_fd());
  bool any = false;
  for (int fd = t->next_tracked(0, hi); fd >= 0; fd = t->next_tracked(unsigned(fd) + 1, hi)) {
    SocketRef r = t->lookup(fd);
    if (r.get() != s) continue;
    int f = sys::libc.fcntl(fd, F_GETFD);
    if (f < 0 || !(f & FD_CLOEXEC)) return false;
    any = true;
    if (unsigned(fd) == hi) break;
  }
  return any;
}
}  // namespace

namespace {
// Under g_mu: the fds naming `s` that stay open across exec (at most
// holders::kExecFds; how many there are, which may be more).
int kept_on_exec(Socket* s, int* out) {
  FdTable* t = FdTable::get_if_exists();
  if (!t || !s || t->max_fd() < 0) return 0;
  const unsigned hi = unsigned(t->max_fd());
  int n = 0;
  for (int fd = t->next_tracked(0, hi); fd >= 0; fd = t->next_tracked(unsigned(fd) + 1, hi)) {
    if (t->lookup(fd).get() == s) {
      int f = sys::libc.fcntl(fd, F_GETFD);
      if (f >= 0 && !(f & FD_CLOEXEC)) {
        if (n < holders::kExecFds) out[n] = fd;
        n++;
      }
    }
    if (unsigned(fd) == hi) break;
  }
  return n;
}
}  // namespace

namespace {
// Under g_mu: the listening sockets for which keep(socket) holds go to a
// process that shares no memory with this one (an exec that keeps them, an
// SCM_RIGHTS message): it will publish the connections it accepts in the
// port's named table. The owner of the port's rdma_cm listener is told to
// look there (mark_exec on its anonymous table; named_share), and the named
// table names it, so that the other process watches it and takes over when
// it exits. For a socket this process only joined (inherited listeners),
// the owner is another process: its table is marked for it.
template <typename Keep>
void name_kept_listeners(Keep&& keep) {
  for (auto& il : g_inherited_listeners) {
    // (No socket: a port watched for adopted connections, no listener to keep.)
    if (il.share == nullptr || !il.socket || !keep(il.socket)) continue;
    listen_share::mark_exec(il.share);
    if (!listen_share::exec_marked(il.share)) continue;  // a named table already
    if (!il.named)
      il.named = listen_share::open_group(reinterpret_cast<const sockaddr*>(&il.addr), il.tcp_port);
    if (il.named && listen_share::owner(il.share) > 0)
      listen_share::set_owner(il.named, listen_share::owner(il.share));
  }
  for (auto& l : g_listeners) {
    if (!l.listener || l.alias || !l.socket || !keep(l.socket)) continue;
    listen_share::mark_exec(l.share);
    (void)named_share(l);
  }
}
}  // namespace

void listener_passing(Socket* s) {
  std::lock_guard lk(g_mu);
  name_kept_listeners([s](Socket* x) { return x == s; });
}

namespace {
// The progress thread parked for registry work of an exec, an exit or an
// io_uring setup, as at fork: it drives streams and accepts requests
// without g_mu (thread_main), and these hand connections on, fall back
// pending ones and settle switches on the assumption that no rendezvous
// starts or is accepted meanwhile. Taken before g_mu (lock order).
class ParkedProgress {
 public:
  ParkedProgress() : serviced_(park_progress()) {}
  ~ParkedProgress() { unpark_progress(serviced_); }
  ParkedProgress(const ParkedProgress&) = delete;
  ParkedProgress& operator=(const ParkedProgress&) = delete;

 private:
  bool serviced_;
};
}  // namespace

void progress_before_exec(bool replaces) {
  ParkedProgress parked;
  std::lock_guard lk(g_mu);
  const auto& tun = process_config().tunables;
  // A listening socket the new program keeps: it will publish the
  // connections it accepts in the port's named table, since the owner's
  // table (anonymous, passed by fork) does not survive the exec.
  // (posix_spawn: this process goes on as the owner. An exec in place takes
  // the listener with the image; the new one binds the port again and
  // serves it through the port's named table, since the anonymous one dies
  // with this image: fork children still accepting on the socket (a master
  // that re-execs itself under its workers) are told to publish there
  // (the mark; start_server_upgrade), and the named table names this pid,
  // the new image's too.)
  name_kept_listeners([](Socket* s) { return !closes_on_exec(s); });
  // A port's rdma_cm listener held for adopted connections (no TCP
  // listening socket) goes with this image: the other processes that
  // watch it take over (retry_take_overs sees the name change), or the
  // new image binds it again when it adopts its connection.
  for (auto& l : g_listeners)
    if (replaces && !l.socket && !l.side && l.listener && l.closed_until_ns == 0 && l.share &&
        listen_share::owner(l.share) == int32_t(getpid()))
      listen_share::set_owner(l.share, 0);
  for (size_t i = 0; i < g_streams.size(); i++) {
    Stream* st = g_streams[i];
    if (!g_stream_owner[i]) continue;
    // A connection adopted from the kernel that never left TCP: the new
    // image adopts it again the same way, and binds or joins the port's
    // rdma_cm side itself (a wrapper script that ends in `exec prog`).
    // Passed as below instead, it would wait behind a side listener that
    // only the passed table names, which no listener of its port reads.
    if (replaces && st->adopted_first_wait()) {
      if (!g_claims.empty()) drop_claim(st);
      continue;  // falls back below (quietly: handed_off)
    }
    if (closes_on_exec(g_stream_owner[i])) {
      if (!st->shared_by_fork()) continue;  // falls back below
      if (replaces) st->release_for_exec();  // then falls back below: this image goes
      else st->keep_at_spawn = true;         // not inherited: stays as it is
      continue;
    }
    // The new image inherits the socket: it upgrades it again from a slot
    // of the passed table (docs/DESIGN.md, "Upgrading again after exec"),
    // unless a client's rendezvous is in flight (nobody could finish it).
    if (replaces && tun.reupgrade && !(st->client() && st->has_conn())) {
      // (A side listener this image published dies with it: the new image
      // publishes its own.)
      if (!g_claims.empty()) drop_claim(st);
      st->exec_pass = st->keep_at_spawn = true;
    }
  }
  for (size_t i = 0; i < g_streams.size(); i++)
    if (g_stream_owner[i] && !std::exchange(g_streams[i]->keep_at_spawn, false))
      g_streams[i]->fall_back(stats::FallbackReason::kHandedOff);  // acts on pending ones only
  settle_switches();
  for (size_t i = 0; i < g_streams.size(); i++)
    if (g_streams[i]->exec_pass) g_streams[i]->prepare_pass();
  hand_off_streams(true, false);  // lingering ones would die with the image
  for (size_t i = 0; i < g_streams.size(); i++) {
    Stream* st = g_streams[i];
    if (!std::exchange(st->exec_pass, false)) continue;
    int fds[holders::kExecFds];
    int n = kept_on_exec(g_stream_owner[i], fds);
    if (n > 0 && n <= holders::kExecFds && st->pass_to_exec(fds, n)) continue;
    st->fall_back(stats::FallbackReason::kHandedOff);  // acts on pending ones only
  }
}

void progress_exec_failed() {
  std::lock_guard lk(g_mu);
  for (size_t i = 0; i < g_streams.size(); i++)
    if (g_stream_owner[i]) g_streams[i]->exec_failed();
}

void progress_at_exit() {
  ParkedProgress parked;
  std::lock_guard lk(g_mu);
  // Bytes written during a switch are held in our memory until it ends
  // (Stream::holds): the switch is driven to its end first, then every
  // connection on RDMA, closed or not, goes back to TCP with its backlog.
  settle_switches(false);
  hand_off_streams(true, true);
  // Another process that holds a connection since a fork may be its only
  // holder now.
  for (size_t i = 0; i < g_streams.size(); i++)
    if (g_stream_owner[i]) g_streams[i]->release_holders();
}

namespace {
std::atomic<bool> g_io_uring{false};
}  // namespace

bool io_uring_started() { return g_io_uring.load(std::memory_order_acquire); }

void progress_io_uring_started() {
  if (g_io_uring.exchange(true, std::memory_order_acq_rel)) return;
  log::write_line(log::Level::kWarn,
                  "the program set up io_uring, whose I/O bypasses librsock: its connections "
                  "stay on kernel TCP from now on (fallback reason io_uring)");
  ParkedProgress parked;
  std::lock_guard lk(g_mu);
  fall_back_pending(stats::FallbackReason::kIoUring);
  // Connections the application closed finish where they are: no ring can
  // reach them any more.
  hand_off_streams(false, false, stats::FallbackReason::kIoUring);
}

void progress_after_fork_parent(bool failed) {
  for (size_t i = 0; i < g_streams.size(); i++)
    if (g_stream_owner[i]) g_streams[i]->fork_done(failed);
  g_mu.unlock();
  unpark_progress(g_hub_serviced_before_fork);
}

void progress_after_fork_child() {
  // The child must not touch the parent's RDMA resources: the parent's
  // registries (and their lock, held since progress_before_fork) are leaked
  // unseen, every stream the child inherited is detached, and the parent's
  // rdma_cm channels are closed here (the parent's copies keep them alive;
  // were the child to keep them, a parent that exits would leave its
  // listener bound and unread for as long as the child lives). Verbs
  // contexts are the child's own from its first connection on
  // (transport/fds.h), so its new connections upgrade like anyone's; its
  // rdma_cm listener is whatever it listen()s on itself.
  new (&g_loop_mu) std::mutex();  // held by this thread since before the fork
  g_thread_up.store(false, std::memory_order_relaxed);  // no progress thread here yet
  g_unwatched_inherited.store(0, std::memory_order_relaxed);
  transport::cm_hub::after_fork_child();
  transport::cq_hub::after_fork_child();
  transport::cq_group::after_fork_child();
  tcp_hub::after_fork_child();
  transport::contexts_after_fork_child();
  transport::path_quality::after_fork_child();
  transport::kit_pool::after_fork_child();
  thread_wake_after_fork_child();
  Registry* old = g_reg_ptr.load();
  Registry* fresh = new Registry();
  g_reg_ptr.store(fresh);
  if (!old) return;
  for (auto& e : old->listeners) {
    if (e.listener) e.listener.release()->abandon_after_fork();
    if (e.socket) fresh->inherited_listeners.push_back({e.socket, e.share, e.tcp_port, e.addr, e.v6only});
  }
  for (const auto& il : old->inherited_listeners) {
    // The parent's watch is the parent's: this child watches on its own use.
    if (il.owner_fd >= 0) sys::close_owned(il.owner_fd);
    transport::Listener::free_spare(il.spare);  // (this process's copy of the parent's)
    // (A port watched for adopted connections only, socket nullptr: the
    // parent's business, not the child's.)
    if (il.socket) fresh->inherited_listeners.push_back({il.socket, il.share, il.tcp_port, il.addr, il.v6only});
  }
  int unwatched = 0;
  for (const auto& il : fresh->inherited_listeners) unwatched += il.share != nullptr;
  g_unwatched_inherited.store(unwatched, std::memory_order_relaxed);
  // The parent's schedule is the parent's: its lists let go of every stream
  // (nothing links into them any more), its stack is forgotten.
  for (Stream* st = old->wanted.exchange(nullptr); st != nullptr;) {
    Stream* next = st->wanted_next;
    st->loop_wanted.store(false, std::memory_order_relaxed);
    st = next;
  }
  old->active.clear();
  old->timers.clear();
  bool shared = false;
  for (size_t i = 0; i < old->streams.size(); i++) {
    if (!old->stream_owner[i]) continue;
    Stream* st = old->streams[i];
    st->detach_after_fork();
    if (!st->shared_by_fork()) continue;
    // Held by the parent too: this child may be left its only holder, and
    // then upgrades it again, driven by a progress thread of its own.
    st->reg_index = fresh->streams.size();
    fresh->streams.push_back(st);
    fresh->stream_owner.push_back(old->stream_owner[i]);
    fresh->active.push_back(*st);
    shared = true;
  }
  if (shared) {
    std::lock_guard lk(fresh->mu);
    (void)ensure_thread();
  }
}

}  // namespace rsock::socket
