// poll/select/epoll emulation for upgraded sockets (see readiness.h).
#include "socket/readiness.h"

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>

#include <boost/intrusive/list.hpp>
#include <boost/intrusive/set.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "socket/fd_table.h"
#include "socket/process.h"
#include "socket/rendezvous.h"
#include "socket/signals.h"
#include "socket/stream.h"
#include "socket/tcp_hub.h"
#include "transport/cq_group.h"
#include "transport/cq_hub.h"
#include "util/adaptive_spin.h"
#include "util/clock.h"
#include "util/no_destroy.h"
#include "util/owned_fds.h"
#include "util/spin_lock.h"
#include "util/sys.h"

namespace rsock::socket {

namespace {


// Deadline arithmetic for timeouts given as timespec (null: forever). The
// clock is first read when the call is about to sleep: a call that returns
// without sleeping (most do, under load) reads it not at all (a syscall in
// VMs without a vDSO clock). The timeout thus counts from the first sleep,
// microseconds after the call began.
struct Deadline {
  explicit Deadline(const timespec* t)
      : forever(!t), span(t ? uint64_t(t->tv_sec) * 1000000000ull + uint64_t(t->tv_nsec) : 0) {}
  bool expired() const { return !forever && (span == 0 || (end != 0 && now_ns() >= end)); }
  // Remaining time for ppoll/epoll_pwait2 (null when forever).
  const timespec* left(timespec* buf) {
    if (forever) return nullptr;
    uint64_t now = now_ns();
    if (end == 0) end = now + span;
    uint64_t rem = now >= end ? 0 : end - now;
    buf->tv_sec = time_t(rem / 1000000000ull);
    buf->tv_nsec = long(rem % 1000000000ull);
    return buf;
  }
  // Starts the clock now (for a remaining time reported back, as select's).
  void start() {
    if (!forever && span) end = now_ns() + span;
  }
  bool forever;
  uint64_t span;
  uint64_t end = 0;  // set by the first left()
};

// A sleep that nothing of ours can end early (no wake or poke fd): at most
// kNoWakeSliceMs, then the caller looks again. t may be null (forever).
const timespec* at_most_slice(const timespec* t) {
  static constexpr timespec kSlice{0, kNoWakeSliceMs * 1000000L};
  return !t || t->tv_sec > 0 || t->tv_nsec > kSlice.tv_nsec ? &kSlice : t;
}

bool valid(const timespec* t) {
  return !t || (t->tv_sec >= 0 && t->tv_nsec >= 0 && t->tv_nsec < 1000000000);
}

Stream* governing_stream(const SocketRef& s) {
  if (!s) return nullptr;
  Stream* st = s->stream();
  return st && st->governs() ? st : nullptr;
}

// Busy-poll the streams before sleeping, when any is on RDMA: an answer
// usually comes back sooner than a sleep/wakeup round trip. How long is the
// thread's to learn (spin_us to spin_max_us, util/adaptive_spin.h); `timer`
// spans the call's whole wait, from its first spin to its return.
// `resting_rdma`: the caller also waits for streams on RDMA not in `streams`.
// `syscalls`: `ready` makes a syscall per turn (a zero-timeout look at
// kernel fds or at the shadow instance): such a spin stays at spin_us, as
// a longer one would be a syscall loop that takes the CPU from the peer
// (redis-server's set: 2.9 polls per request with spins up to 200 us).
template <typename Check>
bool spin(const std::vector<Stream*>& streams, WaitTimer& timer, Check&& ready,
          bool resting_rdma, bool syscalls) {
  if (!resting_rdma &&
      std::none_of(streams.begin(), streams.end(), [](Stream* s) { return s->on_rdma(); }))
    return false;
  const config::Tunables& t = process_config().tunables;
  SpinPlace slot(syscalls ? t.spin_us : timer.start(t.spin_us, t.spin_max_us), t.spin_us);
  if (!slot.us()) return false;
  SpinDeadline end(slot.us());
  do {
    if (ready()) return true;
  } while (!end.passed());
  return false;
}

// Per-thread buffers of the emulated waits, reused from call to call: a
// wait allocates only when its thread first meets a larger set, never per
// call. One set per thread is enough: a hook entered while librsock runs on
// the thread (a signal handler's poll during our sleep) passes straight
// through to the kernel (preload/hook.h), so these are never used twice at
// once. Freed when the thread exits.
struct WaitScratch {
  std::vector<SocketRef> refs;  // emptied before every return: no reference outlives a call
  std::vector<Stream*> streams, active;
  std::vector<pollfd> kfds, sleep_set, select_set;
  std::vector<nfds_t> kidx;
  std::vector<uint64_t> seen;
  std::vector<uint8_t> slotted;  // poll: this thread is in stream i's sleepers
  std::vector<Stream*> epoll_streams;
  std::vector<uint64_t> epoll_seen;
};
thread_local WaitScratch t_scratch;

// Drops the references a poll took, on every return path.
struct RefsGuard {
  std::vector<SocketRef>& refs;
  ~RefsGuard() { refs.clear(); }
};

}  // namespace

// ---------------------------------------------------------------------------
// poll / select
// ---------------------------------------------------------------------------

Status<int> poll_emulated(pollfd* fds, nfds_t n, const timespec* timeout, const sigset_t* mask) {
  if (!valid(timeout)) return Err(kRedoPlain);  // the kernel answers EINVAL
  // Common case first, without allocating: no upgraded socket in the set.
  nfds_t first = n;
  for (nfds_t i = 0; i < n; i++) {
    if (fds[i].fd < 0) continue;
    epoll_observed(fds[i].fd);  // a polled epoll fd must keep its ready_fd current
    if (first == n && governing_stream(lookup(fds[i].fd))) first = i;
  }
  if (first == n) return Err(kRedoPlain);
  WaitScratch& ws = t_scratch;
  auto& refs = ws.refs;
  RefsGuard release{refs};
  refs.clear();
  auto& streams = ws.streams;
  streams.assign(n, nullptr);
  bool any = false;
  for (nfds_t i = 0; i < n; i++) {
    if (fds[i].fd < 0) continue;
    SocketRef s = lookup(fds[i].fd);
    if (Stream* st = governing_stream(s)) {
      streams[i] = st;
      refs.push_back(std::move(s));  // keeps the stream alive for the call
      any = true;
    }
  }
  if (!any) return Err(kRedoPlain);
  auto& active = ws.active;
  active.clear();
  for (Stream* st : streams)
    if (st) active.push_back(st);

  Deadline dl(timeout);
  SignalWatch signals;
  WaitTimer timer;  // started by the first spin
  auto& kfds = ws.kfds;
  auto& kidx = ws.kidx;
  auto& seen = ws.seen;  // generation each stream's last look was based on
  seen.assign(n, 0);
  auto scan = [&](bool full) -> int {
    int ready = 0;
    kfds.clear();
    kidx.clear();
    for (nfds_t i = 0; i < n; i++) {
      fds[i].revents = 0;
      if (streams[i]) {
        seen[i] = streams[i]->generation();
        short ev = streams[i]->poll_events(fds[i].events, full);
        if (ev >= 0) {
          fds[i].revents = ev;
          if (ev) ready++;
          continue;
        }
        streams[i] = nullptr;  // fell back to TCP meanwhile: the kernel answers
      }
      kfds.push_back(fds[i]);
      kidx.push_back(i);
    }
    if (!kfds.empty() && sys::libc.poll(kfds.data(), kfds.size(), 0) > 0) {
      for (size_t k = 0; k < kfds.size(); k++) {
        fds[kidx[k]].revents = kfds[k].revents;
        if (kfds[k].revents) ready++;
      }
    }
    return ready;
  };
  for (;;) {
    int ready = scan(true);
    if (ready || dl.expired()) return ready;
    if (spin(active, timer, [&] { return (ready = scan(false)) > 0; }, false, !kfds.empty()))
      return ready;
    // Sleep on the kernel fds plus each stream's own fds, and this thread's
    // wake fd (once), entered in every stream's sleepers.
    bool any_st = false;
    for (nfds_t i = 0; i < n && !any_st; i++) any_st = streams[i] != nullptr;
    const int wake = any_st ? thread_wake_fd() : -1;
    SignalWatch::Sleep sleep(mask, wake);
    if (signals.check()) return Err(EINTR);  // poll is never restarted
    auto& wait = ws.sleep_set;
    wait.assign(kfds.begin(), kfds.end());
    bool still = true;  // no stream changed since the scan
    size_t hub_at = SIZE_MAX;  // once, not once per stream: every stream shares it
    bool no_wake = false;      // a stream that cannot poke us: sleep in slices
    const size_t wake_at = wait.size();
    if (wake >= 0) wait.push_back({wake, POLLIN, 0});
    auto& slotted = ws.slotted;
    slotted.assign(n, 0);
    for (nfds_t i = 0; i < n; i++) {
      if (!streams[i]) continue;
      pollfd w[3];
      bool cq;  // w[k - 1] is the completion hub (told, not compared with
                // cq_hub::fd(), which changes when a second device opens)
      int k = streams[i]->wait_fds(fds[i].events, w, &cq);
      for (int j = 1; j < k; j++) {  // (w[0] is the thread's wake fd)
        const bool is_hub = cq && j == k - 1;
        if (is_hub && hub_at != SIZE_MAX) continue;
        if (is_hub) hub_at = wait.size();
        wait.push_back(w[j]);
      }
      slotted[i] = streams[i]->add_sleeper(wake);
      no_wake |= !slotted[i];
      still &= streams[i]->sleep_begin(seen[i]);
    }
    // CQs raise events only while someone sleeps (transport/cq_group.h,
    // "Arming"): armed now that our wake fd is in the streams' sleepers.
    // A completion the arm's drain filed: look again, do not sleep. (Not
    // armed for a zero-timeout look: nothing would wait for its event.)
    transport::cq_group::ArmedSleep armed(hub_at != SIZE_MAX && still);
    still &= !armed.drained();
    timespec buf, zero{};
    const timespec* left = still ? dl.left(&buf) : &zero;
    if (no_wake) left = at_most_slice(left);
    // One sleeping thread of the process watches the completion hub
    // (transport/cq_hub.h); if another does, ours poke `wake` through the
    // streams' sleepers (so only when every stream has it in a slot).
    const bool hub_token = hub_at != SIZE_MAX && wake >= 0 && !no_wake;
    if (hub_token && !transport::cq_hub::begin_sleep(wake)) wait[hub_at].fd = -1;  // (ppoll skips it)
    const bool watcher = hub_token && still && wait[hub_at].fd >= 0;
    int r;
    for (;;) {
      r = sys::libc.ppoll(wait.data(), wait.size(), left, sleep.mask());
      // Woken by the hub alone for other sleepers' completions: passed on,
      // and the sleep goes on unless one of our streams changed
      // (cq_hub::relay).
      if (!watcher || r <= 0 || !transport::cq_hub::relay(wait.data(), wait.size(), hub_at)) break;
      bool changed = false;
      for (nfds_t i = 0; i < n && !changed; i++)
        changed = streams[i] != nullptr && streams[i]->generation() != seen[i];
      if (changed || dl.expired()) break;
      left = dl.left(&buf);
    }
    int err = errno;
    armed.end();
    if (hub_token) transport::cq_hub::end_sleep();
    for (nfds_t i = 0; i < n; i++) {
      if (!streams[i]) continue;
      streams[i]->sleep_end();
      if (slotted[i]) streams[i]->remove_sleeper(wake);
    }
    // The wake fd is read only when this sleep saw it readable (not at
    // every call: a read that mostly found nothing); a poke left over ends
    // the next sleep at once and is read then.
    if (r > 0 && wake >= 0 && (wait[wake_at].revents & POLLIN)) drain_thread_wake();
    // Woken by the completion hub: its events go to their connections.
    if (r > 0 && hub_at != SIZE_MAX && (wait[hub_at].revents & POLLIN)) transport::cq_hub::poll();
    if (r < 0) return Err(err);
    if (r == 0 && dl.expired()) return scan(true);
  }
}

Status<int> select_emulated(int nfds, fd_set* r, fd_set* w, fd_set* e, timespec* timeout,
                            const sigset_t* mask) {
  if (nfds < 0 || nfds > FD_SETSIZE) return Err(kRedoPlain);  // the kernel says EINVAL
  bool any = false;
  auto& p = t_scratch.select_set;
  p.clear();
  for (int fd = 0; fd < nfds; fd++) {
    short ev = 0;
    if (r && FD_ISSET(fd, r)) ev |= POLLIN;
    if (w && FD_ISSET(fd, w)) ev |= POLLOUT;
    if (e && FD_ISSET(fd, e)) ev |= POLLPRI;
    if (!ev) continue;
    if (!any && governing_stream(lookup(fd))) any = true;
    p.push_back({fd, ev, 0});
  }
  if (!any) return Err(kRedoPlain);
  Deadline dl(timeout);
  dl.start();
  auto res = poll_emulated(p.data(), p.size(), timeout, mask);
  if (!res) return res;
  for (auto& x : p)
    if (x.revents & POLLNVAL) return Err(EBADF);
  if (r) FD_ZERO(r);
  if (w) FD_ZERO(w);
  if (e) FD_ZERO(e);
  int count = 0;
  for (auto& x : p) {
    // The kernel's select maps readiness exactly like this (fs/select.c).
    if ((x.events & POLLIN) && (x.revents & (POLLIN | POLLHUP | POLLERR))) FD_SET(x.fd, r), count++;
    if ((x.events & POLLOUT) && (x.revents & (POLLOUT | POLLERR))) FD_SET(x.fd, w), count++;
    if ((x.events & POLLPRI) && (x.revents & POLLPRI)) FD_SET(x.fd, e), count++;
  }
  if (timeout) {
    timespec buf;
    const timespec* left = dl.left(&buf);
    *timeout = left ? *left : timespec{};
  }
  return count;
}

// ---------------------------------------------------------------------------
// epoll
// ---------------------------------------------------------------------------

// A registration's entry on its set's ready list (epoll_watch_fired): pushed
// lock-free by the data path, taken by collect() under the set's lock.
struct EpollWatch {
  std::atomic<bool> queued{false};  // on the set's pushed stack
  EpollWatch* next = nullptr;       // in that stack
  // In its socket's list of registrations (Socket::watches), under the
  // socket's watch_lock.
  EpollWatch* wnext = nullptr;
  bool linked = false;
  void* reg = nullptr;              // its Reg
  void* set = nullptr;              // its EpollSet
};
// Socket::watches (below, with socket_push_watches).
void socket_link_watch(Socket* s, EpollWatch* w);
void socket_unlink_watch(Socket* s, EpollWatch* w);

namespace {

namespace bi = boost::intrusive;

struct Reg {
  Reg(int f, Socket* s, uint32_t e, epoll_data_t d, void* set)
      : fd(f), sock(s), events(e), data(d) {
    watch.reg = this;
    watch.set = set;
  }
  // On the set's visit list while collect() must look at it (see EpollSet);
  // unlinked when destroyed.
  bi::list_member_hook<bi::link_mode<bi::auto_unlink>> visit_hook;
  // In the set's index by (fd, parked): epoll_ctl finds a registration in
  // O(log n), not by a scan of every registration (10,000 sockets in one set).
  // fd and parked change only through rekey().
  bi::set_member_hook<bi::link_mode<bi::auto_unlink>> key_hook;
  size_t idx = 0;  // its slot in EpollSet::regs
  EpollWatch watch;
  int fd;
  Socket* sock;          // one reference held while registered
  uint32_t events;       // the application's mask (with EPOLLET/EPOLLONESHOT)
  epoll_data_t data;
  bool user = false;     // true: lives here (upgraded); false: in the kernel
  bool disarmed = false; // EPOLLONESHOT fired, waiting for EPOLL_CTL_MOD
  // Deleted by the application, still in the set: event loops (redis's ae,
  // libevent) delete and re-add a socket per request, and a re-ADD of the
  // same socket revives it as it was. It is deleted for real if its socket
  // falls back or closes (collect looks when a push brings it).
  bool parked = false;
  // (No fd of the stream's is in the shadow: its changes push `watch`, which
  // is in the socket's list while the registration is in user space. The
  // stream's TCP socket, while data may still come that way, is in the
  // tcp_hub, whose fd the shadow holds once.)
  bool dirty = true;      // pushed, or new/modified: evaluate
  bool dirty_all = true;  // evaluate with every syscall (new, modified, refreshed)
  bool due_last = false;  // level-triggered and due at the last evaluation
  uint64_t seen_gen = ~0ull;  // stream generation before the last evaluation
  // Edge-triggered bookkeeping: what the last evaluation saw.
  uint64_t last_rx = ~0ull, last_tx = ~0ull;
  short last_ev = 0;
  uint8_t fired = 0;       // kFiredWake: pushed since the last evaluation
};
constexpr uint8_t kFiredWake = 1;

using VisitList = bi::list<Reg, bi::member_hook<Reg, decltype(Reg::visit_hook), &Reg::visit_hook>,
                           bi::constant_time_size<false>>;
struct RegKey {
  using type = std::pair<int, bool>;
  type operator()(const Reg& r) const { return {r.fd, r.parked}; }
};
using RegIndex = bi::multiset<Reg, bi::member_hook<Reg, decltype(Reg::key_hook), &Reg::key_hook>,
                              bi::key_of_value<RegKey>, bi::constant_time_size<false>>;

// The kernel instance (the application's epfd) holds the kernel-side
// registrations and ready_fd; librsock's internal fds (the set's poke fd,
// the completion hub and the tcp_hub) live in a private `shadow` instance,
// so that internal activity never makes the application's epfd look
// readable. ready_fd is
// readable exactly while user-space registrations have events due, so a
// poll() of the epfd, or an outer epoll holding it, sees the right answer.
// Who keeps ready_fd current: every collect(); stream I/O through the hooks
// (readiness_after_io); and, for a `watched` set (one that was polled or put
// in another epoll), the progress thread, woken by the shadow instance.
//
// The ready list. collect() looks only at the registrations on `visit`, so an
// epoll_wait costs what is ready, not what is registered. A registration
// leaves `visit` (rests) only when nothing can change it unseen: its stream
// is on RDMA, nothing fired or is due, no one else looked at the stream since
// (generation), and it is in no other set. It comes back when its stream
// changes (the data path's announce, wake() for phase, fallback, close, and
// the hubs' events: each pushes every registration of the socket on
// `pushed`, lock-free, Socket::watches), or when the application touches it
// (EPOLL_CTL_*). A thread asleep in the set is woken by a push through
// `poke_fd`.
struct EpollSet {
  std::mutex mu;
  // Stable addresses: a registration's EpollWatch is in its socket's list.
  // Unordered (a drop moves the last one into the hole); Reg::idx is each
  // one's slot.
  std::vector<std::unique_ptr<Reg>> regs;
  RegIndex by_fd;
  int parked_count = 0;
  VisitList visit;
  std::atomic<EpollWatch*> pushed{nullptr};  // Treiber stack, taken whole
  int poke_fd = -1;                          // eventfd in the shadow
  int user_count = 0;
  int shadow = -1;
  int ready_fd = -1;
  bool ready_set = false;
  bool due_unsignalled = false;  // user events due, ready_fd not set (set_ready)
  std::atomic<int> sleepers{0};  // threads asleep in an emulated epoll_wait on it
  int hub_target = -1;           // where the completion hub's fd is (shadow or epfd)
  int hub_fd = -1;               // ... and which fd it was (cq_hub::fd() can change)
  int tcp_hub_fd = -1;           // the tcp_hub's fd in the shadow (kTcpHub), or -1
  std::atomic<bool> watched{false};  // written under mu; read without it as a hint
  // Whether the kernel instance may hold a registration of the
  // application's that is not in `regs`: false only for a set created with
  // its instance (epoll_create, in this process since its last fork) that
  // was never given a plain fd (epoll_kernel_added). With no such
  // registration and every one of `regs` in user space, an epoll_wait that
  // has user events skips its zero-timeout look at the kernel instance
  // (kernel_empty below).
  bool born_here = false;
  uint32_t born_epoch = 0;
  std::atomic<bool> foreign{false};
  // The kernel instance woke a sleep: look at it in the next round.
  bool kernel_readable = false;
  // The kernel instance itself is an entry of the shadow (kKernel, under the
  // number nested_fd), so the shadow's harvest tells whether it holds
  // anything: an epoll_wait that has user events to report looks at it only
  // then (a server's listening socket is a kernel registration: redis-server
  // made that zero-timeout look once per request). Not in a watched set: the
  // progress thread sleeps on the shadow there, and a kernel event the
  // application leaves unconsumed would keep waking it.
  int nested_fd = -1;
  bool kernel_fired = false;  // the last harvest found the kernel instance readable
};

// Bumped before every fork: a set created before it shares its kernel
// instance with the other process, which may add to it unseen.
std::atomic<uint32_t> g_fork_epoch{0};

// Under set->mu: the kernel instance holds nothing of the application's, so
// only a sleep needs to look at it (librsock's own fds there: ready_fd).
bool kernel_empty(const EpollSet* set, int epfd) {
  return set->born_here && !set->kernel_readable &&
         set->born_epoch == g_fork_epoch.load(std::memory_order_relaxed) &&
         !set->foreign.load(std::memory_order_relaxed) &&
         set->regs.size() == size_t(set->user_count) && set->shadow >= 0 &&
         set->hub_target != epfd;
}

std::atomic<int> g_watched{0};  // sets with watched == true

// Marks librsock's own registrations in a kernel epoll set. Constant, not
// random: it only has to differ from what applications store, and a hook
// may run before any initialiser of ours.
constexpr uint64_t g_cookie = 0x72736f636b5f6576ull;  // "rsock_ev"

// epfd -> EpollSet. Sets are never freed (epoll fds are few and long-lived),
// so a racing reader never sees freed memory. Mapped on first use.
constexpr size_t kMaxEpfd = 1 << 20;
std::atomic<std::atomic<EpollSet*>*> g_sets_ptr{nullptr};
std::atomic<EpollSet*>* sets() {
  auto* p = g_sets_ptr.load(std::memory_order_acquire);
  if (p) return p;
  void* m = mmap(nullptr, kMaxEpfd * sizeof(std::atomic<EpollSet*>), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  auto* fresh = static_cast<std::atomic<EpollSet*>*>(m);
  if (g_sets_ptr.compare_exchange_strong(p, fresh)) return fresh;
  munmap(m, kMaxEpfd * sizeof(std::atomic<EpollSet*>));
  return p;
}

// Every set ever created, for epoll_take_over().
std::mutex g_all_mu;
// (Constant-initialised and never destroyed: hooks may run during exit.)
constinit util::NoDestroy<std::vector<std::pair<int, EpollSet*>>> g_all_storage;
std::vector<std::pair<int, EpollSet*>>& g_all = g_all_storage.value;

EpollSet* set_of(int epfd) {
  auto* table = g_sets_ptr.load(std::memory_order_acquire);
  if (!table || epfd < 0 || size_t(epfd) >= kMaxEpfd) return nullptr;
  return table[epfd].load(std::memory_order_acquire);
}

EpollSet* set_for(int epfd) {
  auto* g_sets = sets();
  if (!g_sets || epfd < 0 || size_t(epfd) >= kMaxEpfd) return nullptr;
  EpollSet* s = g_sets[epfd].load(std::memory_order_acquire);
  if (s) return s;
  auto* fresh = new (std::nothrow) EpollSet();
  if (!fresh) return nullptr;
  if (!g_sets[epfd].compare_exchange_strong(s, fresh)) {
    delete fresh;
    return s;
  }
  std::lock_guard lk(g_all_mu);
  g_all.push_back({epfd, fresh});
  return fresh;
}

void monitor(void* arg);

// What a shadow entry is (its epoll data): the set's poke fd (a push), or a
// hub: the completion hub (transport/cq_hub.h) or the tcp_hub
// (socket/tcp_hub.h), whose events, once whoever harvests it polls the hub,
// push the registrations of the streams concerned.
constexpr uint64_t kHub = 1, kTcpHub = 2, kPoke = 3, kKernel = 4;

// Under set->mu: r goes on the ready list (if not there yet).
void visit(EpollSet* set, Reg& r) {
  if (!r.visit_hook.is_linked()) set->visit.push_back(r);
}

// Under set->mu: the kernel instance goes into the shadow (kKernel). If the
// kernel refuses (the application nests epoll instances as deep as it
// allows), every wait looks at the kernel instance, as without it.
void nest_kernel(EpollSet* set, int epfd) {
  if (set->shadow < 0 || set->nested_fd >= 0 || epfd < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN;  // level-triggered: readable while it holds events
  ev.data.u64 = kKernel;
  if (sys::libc.epoll_ctl(set->shadow, EPOLL_CTL_ADD, epfd, &ev) == 0) set->nested_fd = epfd;
  set->kernel_fired = true;  // (nothing harvested yet: look)
}

// Under set->mu: out of the shadow again (the set is watched).
void unnest_kernel(EpollSet* set) {
  if (set->nested_fd < 0) return;
  sys::libc.epoll_ctl(set->shadow, EPOLL_CTL_DEL, set->nested_fd, nullptr);
  set->nested_fd = -1;
}

// Under set->mu: creates the shadow instance and ready_fd on the first
// user-space registration. Without them (no fds left) the internal fds go
// into the kernel instance as a fallback: spurious wakeups of a polled or
// nested epfd, nothing worse.
void ensure_aux(EpollSet* set, int epfd) {
  if (set->shadow >= 0 || epfd < 0) return;
  int sh = sys::own_fd(sys::libc.epoll_create1(EPOLL_CLOEXEC));
  int rf = sys::own_fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = g_cookie;
  if (sh < 0 || rf < 0 || sys::libc.epoll_ctl(epfd, EPOLL_CTL_ADD, rf, &ev) != 0) {
    sys::close_owned(sh);
    sys::close_owned(rf);
    return;
  }
  set->shadow = sh;
  set->ready_fd = rf;
  set->ready_set = false;
  int pf = sys::own_fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  epoll_event pev{};
  pev.events = EPOLLIN | EPOLLET;
  pev.data.u64 = kPoke;
  if (pf >= 0 && sys::libc.epoll_ctl(sh, EPOLL_CTL_ADD, pf, &pev) == 0) set->poke_fd = pf;
  else sys::close_owned(pf);
  if (set->watched) progress_watch(sh, monitor, set);
  else nest_kernel(set, epfd);
}

int internal_target(EpollSet* set, int epfd) { return set->shadow >= 0 ? set->shadow : epfd; }


// Under set->mu: the completion hub's fd goes where the internal fds go, once
// per set (every registration's completions arrive there). Checked at every
// collect: the hub's fd appears with the first connection's CQ (maybe after
// the registration moved to user space) and changes with a second device.
void ensure_hub(EpollSet* set, int epfd) {
  int target = internal_target(set, epfd);
  int hub = transport::cq_hub::fd();
  if ((target == set->hub_target && hub == set->hub_fd) || hub < 0 || target < 0) return;
  if (set->hub_target >= 0) {
    sys::libc.epoll_ctl(set->hub_target, EPOLL_CTL_DEL, set->hub_fd, nullptr);
  }
  set->hub_target = set->hub_fd = -1;
  epoll_event ev{};
  ev.events = EPOLLIN;  // level-triggered: readable until someone polls the hub
  ev.data.u64 = target == set->shadow ? kHub : g_cookie;
  if (sys::libc.epoll_ctl(target, EPOLL_CTL_ADD, hub, &ev) == 0) {
    set->hub_target = target;
    set->hub_fd = hub;
    // In the application's own instance (no shadow: no fds left), a sleep
    // in the kernel on it may wait for completions: CQs stay armed.
    if (target != set->shadow) transport::cq_group::hold_armed();
  }
}

// Under set->mu: the tcp_hub's fd goes into the shadow, once per set, as
// soon as one of its registrations is on a stream whose data may come over
// TCP (the stream's entry is added with it: Stream::watch_tcp). Level-
// triggered, like the completion hub's. Without a shadow the set evaluates
// those registrations at every wait anyway.
void ensure_tcp_hub(EpollSet* set) {
  int hub = tcp_hub::fd();
  if (set->shadow < 0 || hub < 0 || hub == set->tcp_hub_fd) return;
  if (set->tcp_hub_fd >= 0)
    sys::libc.epoll_ctl(set->shadow, EPOLL_CTL_DEL, set->tcp_hub_fd, nullptr);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kTcpHub;
  set->tcp_hub_fd = sys::libc.epoll_ctl(set->shadow, EPOLL_CTL_ADD, hub, &ev) == 0 ? hub : -1;
}

// Under set->mu: reads the hubs whose fds fired in the shadow. Their events,
// like every change of a stream, push its registrations onto the set's
// ready list (take_pushed), which is what collect() evaluates.
void drain_shadow(EpollSet* set) {
  if (set->shadow < 0) return;
  // Four entries at most: the poke fd (a push: take_pushed() has it), the
  // two hubs, whose events push the registrations concerned, and the kernel
  // instance (nest_kernel). A hub with more events than one poll reads stays
  // readable (level-triggered) for the next call.
  epoll_event evs[5];
  int k = sys::libc.epoll_wait(set->shadow, evs, 5, 0);
  // (A failed harvest tells nothing: look.)
  set->kernel_fired = k < 0;
  for (int i = 0; i < k; i++) {
    if (evs[i].data.u64 == kHub) transport::cq_hub::poll();
    if (evs[i].data.u64 == kTcpHub) tcp_hub::poll();
    if (evs[i].data.u64 == kKernel) set->kernel_fired = true;
  }
}

// Under set->mu: the registrations pushed since go back on `visit`, marked
// as fired (their stream changed).
void take_pushed(EpollSet* set) {
  EpollWatch* w = set->pushed.exchange(nullptr, std::memory_order_acq_rel);
  while (w) {
    EpollWatch* next = w->next;
    w->queued.store(false, std::memory_order_release);
    Reg& r = *static_cast<Reg*>(w->reg);
    r.dirty = true;
    r.fired |= kFiredWake;
    visit(set, r);
    w = next;
  }
}

// Under set->mu: r leaves its socket's list (no push reaches it from now on)
// and the pushed stack (it is about to leave the set or user space). The
// socket is alive (r holds a reference); its stream is not touched (the
// progress thread may have deleted it once the socket's last fd closed).
void unwatch(EpollSet* set, Reg& r) {
  socket_unlink_watch(r.sock, &r.watch);
  if (r.watch.queued.load(std::memory_order_acquire)) take_pushed(set);
}


// Under set->mu: ready_fd readable iff `due`. Syscalls only on a change,
// and only while someone can see it: an outer poller (a watched set) or
// another thread asleep in this set. Otherwise the next epoll_wait finds
// the events itself; one about to sleep checks due_unsignalled first.
void set_ready(EpollSet* set, bool due) {
  bool seen = set->watched || set->sleepers > 0;
  set->due_unsignalled = due && !seen;
  if (!seen) due = false;
  if (set->ready_fd < 0 || due == set->ready_set) return;
  uint64_t v = 1;
  if (due) (void)!sys::libc.write(set->ready_fd, &v, sizeof v);
  else (void)!sys::libc.read(set->ready_fd, &v, sizeof v);
  set->ready_set = due;
}

// Under set->mu: the registration moves to user space (its socket upgraded).
void to_user(EpollSet* set, int epfd, Reg& r) {
  sys::libc.epoll_ctl(epfd, EPOLL_CTL_DEL, r.fd, nullptr);
  ensure_aux(set, epfd);
  r.user = true;
  r.last_rx = r.last_tx = ~0ull;  // the first evaluation reports what is ready
  r.last_ev = 0;
  r.dirty = r.dirty_all = true;
  visit(set, r);
  set->user_count++;
  // In a second set now: a registration resting in the first must be
  // looked at every time from now on (collect: epoll_users > 1).
  if (r.sock->epoll_users.fetch_add(1, std::memory_order_relaxed) >= 1)
    socket_push_watches(r.sock);
  // Every change of the stream pushes r from now on (Stream::wake and
  // announce): the stream has no fd of its own in the shadow.
  socket_link_watch(r.sock, &r.watch);
  ensure_hub(set, epfd);
}

// Under set->mu: back to the kernel (the upgrade fell back to TCP).
void to_kernel(EpollSet* set, int epfd, Reg& r) {
  unwatch(set, r);
  r.user = false;
  set->user_count--;
  r.sock->epoll_users.fetch_sub(1, std::memory_order_relaxed);
  if (!r.disarmed) {
    epoll_event ev{r.events, r.data};
    sys::libc.epoll_ctl(epfd, EPOLL_CTL_ADD, r.fd, &ev);
  }
}

void drop(EpollSet* set, int /*epfd*/, size_t i) {
  Reg& r = *set->regs[i];
  unwatch(set, r);
  if (r.user) {
    set->user_count--;
    r.sock->epoll_users.fetch_sub(1, std::memory_order_relaxed);
  }
  r.sock->epoll_regs.fetch_sub(1, std::memory_order_acq_rel);
  r.sock->unref();
  if (r.parked) set->parked_count--;
  set->by_fd.erase(set->by_fd.iterator_to(r));
  auto& v = set->regs;
  if (i + 1 != v.size()) {
    v[i] = std::move(v.back());  // frees r
    v[i]->idx = i;
  }
  v.pop_back();
}

size_t index_of(EpollSet*, const Reg* r) { return r->idx; }

// The live registration of fd, or (parked) the parked one.
Reg* find(EpollSet* set, int fd, bool parked = false) {
  auto it = set->by_fd.find(RegKey::type{fd, parked});
  return it == set->by_fd.end() ? nullptr : &*it;
}

// Under set->mu: the only way fd or parked change (they are the index key).
void rekey(EpollSet* set, Reg& r, int fd, bool parked) {
  set->by_fd.erase(set->by_fd.iterator_to(r));
  set->parked_count += int(parked) - int(r.parked);
  r.fd = fd;
  r.parked = parked;
  set->by_fd.insert(r);
}

void add_reg(EpollSet* set, std::unique_ptr<Reg> reg) {
  reg->idx = set->regs.size();
  set->by_fd.insert(*reg);
  set->regs.push_back(std::move(reg));
}

constexpr int kMaxParked = 16;  // per set; beyond that a DEL really deletes

// Under set->mu: a new mask (MOD, or ADD of a parked registration): the next
// collect() evaluates it afresh, as the kernel re-checks on EPOLL_CTL_MOD.
void rearm(EpollSet* set, Reg& r, const epoll_event& ev) {
  r.events = ev.events;
  r.data = ev.data;
  r.disarmed = false;
  r.last_rx = r.last_tx = ~0ull;
  r.last_ev = 0;
  r.dirty = r.dirty_all = true;
  visit(set, r);
  // Only a thread asleep in the set, or an outer poller, must re-check now.
  if ((set->sleepers > 0 || set->watched) && set->poke_fd >= 0) {
    uint64_t one = 1;
    (void)!sys::libc.write(set->poke_fd, &one, sizeof one);
  }
}

short to_poll(uint32_t e) {
  short p = 0;
  if (e & (EPOLLIN | EPOLLRDNORM)) p |= POLLIN;
  if (e & (EPOLLOUT | EPOLLWRNORM)) p |= POLLOUT;
  if (e & EPOLLRDHUP) p |= POLLRDHUP;
  if (e & EPOLLPRI) p |= POLLPRI;
  return p;
}

uint32_t to_epoll(short p) {
  uint32_t e = 0;
  if (p & POLLIN) e |= EPOLLIN;
  if (p & POLLOUT) e |= EPOLLOUT;
  if (p & POLLRDHUP) e |= EPOLLRDHUP;
  if (p & POLLHUP) e |= EPOLLHUP;
  if (p & POLLERR) e |= EPOLLERR;
  if (p & POLLPRI) e |= EPOLLPRI;
  return e;
}

// Under set->mu, after collect() looked at r (all its firings harvested): may
// r leave `visit` until something brings it back (see EpollSet)? Only if
// every change it could miss would reach it: a user-space one must be on RDMA (TCP phases change by
// the kernel socket and the switch: looked at every time), with nothing
// fired, due or unseen, in no other set, and named by its stream as the
// registration the data path pushes.
bool may_rest(Reg& r) {
  // Kernel-held ones are looked at every time: it is how one whose socket
  // was closed without EPOLL_CTL_DEL is dropped (nothing of ours fires for
  // a plain socket).
  if (!r.user) return false;
  Stream* st = r.sock->stream();
  if (!st || !st->governs() || !st->on_rdma()) return false;
  if (r.sock->epoll_users.load(std::memory_order_relaxed) != 1) return false;
  if (r.disarmed) return true;  // nothing to report until EPOLL_CTL_MOD (rearm)
  return !r.dirty && !r.due_last && r.fired == 0 &&
         st->generation() == r.seen_gen;
}

// Under set->mu: keeps registrations in step with their sockets and returns
// the user-space events that are due. `streams` collects the live streams.
// `seen` (with streams): the generation each one's state was last looked at
// in, or kNoCheck (disarmed: nothing to report whatever changes).
constexpr uint64_t kNoCheck = ~0ull;
int collect(EpollSet* set, int epfd, epoll_event* out, int max, std::vector<Stream*>* streams,
            bool full = true, std::vector<uint64_t>* seen = nullptr) {
  int n = 0;
  bool still_due = false;  // user events a next call would report (ready_fd)
  if (full && set->user_count > 0) ensure_hub(set, epfd);
  if (full) drain_shadow(set);
  // Completions of disarmed CQs raise no event (transport/cq_group.h,
  // "Arming"): a busy loop finds them here, without a syscall.
  if (full && set->user_count > 0) transport::cq_group::poll_disarmed();
  // Without a shadow the hub's fd sits in the kernel instance (ensure_hub):
  // its events are read here, or every wait would return at once for them.
  if (full && set->shadow < 0 && set->hub_target >= 0) transport::cq_hub::poll();
  take_pushed(set);
  Reg* resume = nullptr;  // where the next collect starts when maxevents cut this one
  for (auto it = set->visit.begin(); it != set->visit.end();) {
    Reg& r = *it++;  // r may be dropped, or rest (leave `visit`)
    bool cut = false;  // not looked at: maxevents was reached
    // Linux keeps a registration until the socket's last fd is closed (a dup
    // keeps it alive, even when the registered fd number is gone).
    if (r.sock->names() == 0) {
      drop(set, epfd, index_of(set, &r));
      continue;
    }
    if (r.parked) {
      // It fell back: delete it for real (a re-ADD goes to the kernel).
      Stream* pst = r.sock->stream();
      if (!pst || !pst->governs()) {
        drop(set, epfd, index_of(set, &r));
        continue;
      }
      // Rests: a push (its stream changed, fell back, or its socket's last
      // fd closed) brings it back to be looked at. A parked registration
      // holds no fd, so the data path's pushes do not delete it: the
      // re-ADD that event loops do per request stays free of syscalls.
      r.fired = 0;
      if (full && set->poke_fd >= 0) set->visit.erase(set->visit.iterator_to(r));
      continue;
    }
    Stream* st = r.sock->stream();
    if (st && !st->governs()) st = nullptr;
    if (r.user && !st) {
      to_kernel(set, epfd, r);
    } else if (!r.user && st) {
      to_user(set, epfd, r);
    }
    if (r.user && st) {
      if (streams) streams->push_back(st);
      size_t my_seen = seen ? seen->size() : 0;
      if (seen) seen->push_back(kNoCheck);
      // While data may arrive on TCP, its socket must wake the set too.
      bool on_rdma = st->on_rdma();
      if (set->shadow >= 0 && !on_rdma) {
        st->watch_tcp();
        ensure_tcp_hub(set);
      }
      // Skipped only when nothing can have changed: on RDMA, not pushed
      // (events nobody processed yet), the stream's generation is the
      // one we evaluated (nobody else processed any), and it was not due
      // (level-triggered readiness ends only by the application's own I/O).
      bool look = !full || set->shadow < 0 || r.dirty || r.due_last || !on_rdma ||
                  st->generation() != r.seen_gen ||
                  r.sock->epoll_users.load(std::memory_order_relaxed) > 1;
      if (!r.disarmed && n >= max) {
        still_due = true;  // not looked at: assume due
        cut = true;
        if (!resume) resume = &r;
      }
      if (!r.disarmed && n < max && look) {
        // A resting stream on RDMA costs no syscall: only its completion
        // queue is polled (memory only; a CQ whose event the hub took is
        // re-armed there, and a connection with rdma_cm events queued gets
        // its full progress: Stream).
        bool deep = full;
        if (full && set->shadow >= 0 && on_rdma && !r.dirty_all) deep = false;
        if (full) {
          r.dirty = false;
          r.dirty_all = false;
          r.fired = 0;
        }
        r.seen_gen = st->generation();
        short ev = st->poll_events(to_poll(r.events), deep);
        bool due = ev > 0;
        if (due && (r.events & EPOLLET)) {
          // Like the kernel: a new arrival, new send room, or a new
          // hangup/error condition; not the stream's internal changes.
          uint64_t rx = (ev & POLLIN) ? st->rx_arrived() : r.last_rx;
          uint64_t tx = st->tx_room_events();
          // (Arrivals are counted exactly by rx_arrived(); the TCP watch also
          // fires for the switch marker, which is not data.)
          due = ((ev & POLLIN) && rx != r.last_rx) ||
                ((ev & POLLOUT) && tx != r.last_tx) ||
                (ev & ~r.last_ev & (POLLRDHUP | POLLHUP | POLLERR));
          r.last_rx = rx;
          r.last_tx = tx;
        }
        if (ev >= 0) r.last_ev = ev;
        r.due_last = false;
        if (ev < 0) {
          to_kernel(set, epfd, r);
        } else if (due) {
          out[n].events = to_epoll(ev);
          out[n].data = r.data;
          n++;
          if (r.events & EPOLLONESHOT) r.disarmed = true;
          // Level-triggered: reported again next time, as the kernel would.
          if (!(r.events & (EPOLLET | EPOLLONESHOT))) still_due = r.due_last = true;
        }
      }
      if (seen && r.user && !r.disarmed) (*seen)[my_seen] = r.seen_gen;
    }
    // (poke_fd: only in a set whose sleepers a push can wake.)
    if (full && set->poke_fd >= 0 && !cut && may_rest(r)) set->visit.erase(set->visit.iterator_to(r));
  }
  // Like the kernel's ready list, which hands level-triggered entries out in
  // rotation: the registrations maxevents left out come first next time, or
  // a few always-ready sockets at the front would starve the rest.
  if (resume && resume->visit_hook.is_linked()) {
    VisitList front;
    front.splice(front.end(), set->visit, set->visit.begin(), set->visit.iterator_to(*resume));
    set->visit.splice(set->visit.end(), front);
  }
  set_ready(set, still_due);
  return n;
}

// Under set->mu: recomputes ready_fd without consuming any event (an
// edge or a one-shot stays for the application's next epoll_wait).
void refresh(EpollSet* set, bool full) {
  bool due = false;
  for (auto& rp : set->regs) {
    Reg& r = *rp;
    if (!r.user || r.parked || r.disarmed || r.sock->names() == 0) continue;
    Stream* st = r.sock->stream();
    if (!st || !st->governs()) {
      due = true;  // fell back: the next collect hands it to the kernel; look now
      continue;
    }
    if (full) {
      r.dirty = r.dirty_all = true;  // looked at outside collect: the next collect must look
      visit(set, r);
    }
    short ev = st->poll_events(to_poll(r.events), full);
    if (ev < 0) {
      due = true;
    } else if (ev > 0) {
      // Edge-triggered: as collect() would decide, without consuming the edge.
      if (!(r.events & EPOLLET) ||
          ((ev & POLLIN) && st->rx_arrived() != r.last_rx) ||
          ((ev & POLLOUT) && st->tx_room_events() != r.last_tx) ||
          (ev & ~r.last_ev & (POLLRDHUP | POLLHUP | POLLERR)))
        due = true;
    }
  }
  set_ready(set, due);
}

// Debug check (tunable debug_checks), under set->mu, right before a thread
// sleeps in the set: the invariant whose violation is a lost readiness. A
// live level-triggered registration whose socket is ready in user space must
// have been reported by the collect() that preceded the sleep; if it is ready
// now, something must be pending that ends the sleep at once (a push not
// taken yet, or the shadow readable).
// Otherwise the thread would sleep over it, possibly forever. Aborts with a
// message naming the socket: a test then fails at the cause, not at a hang.
void check_before_sleep(EpollSet* set, int epfd) {
  for (auto& rp : set->regs) {
    Reg& r = *rp;
    if (!r.user || r.parked || r.disarmed || (r.events & (EPOLLET | EPOLLONESHOT)) ||
        r.sock->names() == 0 || r.watch.queued.load(std::memory_order_acquire))
      continue;  // (queued: pushed since the collect; the sleep is skipped for it)
    Stream* st = r.sock->stream();
    if (!st || !st->governs()) continue;
    short interest = to_poll(r.events);
    short ev = st->peek_events(interest);
    if (ev <= 0 || !(ev & short(interest | POLLHUP | POLLERR))) continue;
    if (set->pushed.load(std::memory_order_acquire)) continue;  // a push ends the sleep
    pollfd p{set->shadow, POLLIN, 0};
    if (set->shadow >= 0 && sys::libc.poll(&p, 1, 0) > 0) continue;
    log::write_line(log::Level::kError,
                    "invariant violated: epoll %d is about to sleep while fd %d (%s) has events "
                    "0x%x due (interest 0x%x) and nothing pending would wake it: lost readiness",
                    epfd, r.fd, phase_name(st->phase()), unsigned(ev), unsigned(interest));
    abort();
  }
}

// Progress thread: the shadow instance of a watched set fired.
void monitor(void* arg) {
  auto* set = static_cast<EpollSet*>(arg);
  std::lock_guard lk(set->mu);
  refresh(set, true);
}

void watch(EpollSet* set) {
  if (set->watched.load(std::memory_order_relaxed)) return;
  std::lock_guard lk(set->mu);
  if (set->watched) return;
  set->watched = true;
  g_watched.fetch_add(1, std::memory_order_relaxed);
  // The progress thread sleeps on the shadow for it, outside any
  // ArmedSleep: CQs stay armed from now on (transport/cq_group.h).
  transport::cq_group::hold_armed();
  unnest_kernel(set);
  if (set->shadow >= 0) progress_watch(set->shadow, monitor, set);
  refresh(set, true);
}

}  // namespace

Status<int> epoll_ctl_tracked(int epfd, int op, int fd, epoll_event* ev) {
  SocketRef s = lookup(fd);
  if (!s) return Err(kRedoPlain);
  EpollSet* set = op == EPOLL_CTL_ADD ? set_for(epfd) : set_of(epfd);
  if (!set) return Err(kRedoPlain);
  std::lock_guard lk(set->mu);
  Reg* r = find(set, fd);
  if (r && r->sock != s.get()) {
    // The registered fd was closed and its number reused: for the kernel
    // these are different registrations (file, fd); ours are keyed by fd
    // alone, so the old one stops being addressable, as in the kernel.
    if (r->sock->names() == 0) drop(set, epfd, index_of(set, r));
    else rekey(set, *r, -1, r->parked);
    r = nullptr;
  }
  if (Reg* p = op == EPOLL_CTL_ADD && !r ? find(set, fd, true) : nullptr) {
    // The socket it was deleted from comes back: as it was, with the new mask.
    if (p->sock == s.get() && ev && !(ev->events & EPOLLEXCLUSIVE) && governing_stream(s)) {
      rekey(set, *p, fd, false);
      rearm(set, *p, *ev);
      return 0;
    }
    drop(set, epfd, index_of(set, p));
  }
  if (r && r->user) {
    // The kernel does not hold this registration: emulate its answers.
    if (op == EPOLL_CTL_ADD) return Err(EEXIST);
    if (op == EPOLL_CTL_DEL) {
      if (set->parked_count < kMaxParked) {
        rekey(set, *r, fd, true);
        r->fired = 0;
      } else {
        drop(set, epfd, index_of(set, r));
      }
      return 0;
    }
    if (op == EPOLL_CTL_MOD) {
      if (!ev) return Err(EFAULT);
      if (ev->events & EPOLLEXCLUSIVE) return Err(EINVAL);
      rearm(set, *r, *ev);
      return 0;
    }
    return Err(EINVAL);
  }
  // The kernel validates and holds it (possibly only until collect() moves it).
  if (sys::libc.epoll_ctl(epfd, op, fd, ev) != 0) return Err(errno);
  if (op == EPOLL_CTL_ADD) {
    auto reg = std::unique_ptr<Reg>(new (std::nothrow) Reg(fd, s.get(), ev->events, ev->data, set));
    if (!reg) {
      sys::libc.epoll_ctl(epfd, EPOLL_CTL_DEL, fd, nullptr);
      return Err(ENOMEM);
    }
    s->ref();
    s->epoll_regs.fetch_add(1, std::memory_order_acq_rel);
    add_reg(set, std::move(reg));
    visit(set, *set->regs.back());
    if (governing_stream(s)) to_user(set, epfd, *set->regs.back());
  } else if (r && op == EPOLL_CTL_DEL) {
    drop(set, epfd, index_of(set, r));
  } else if (r && op == EPOLL_CTL_MOD) {
    r->events = ev->events;
    r->data = ev->data;
    r->disarmed = false;
  }
  return 0;
}

Status<int> epoll_wait_emulated(int epfd, epoll_event* ev, int max, const timespec* timeout,
                                const sigset_t* mask) {
  EpollSet* set = set_of(epfd);
  if (!set || max <= 0 || !valid(timeout)) return Err(kRedoPlain);  // kernel's errors
  {
    std::lock_guard lk(set->mu);
    if (set->regs.empty()) return Err(kRedoPlain);
  }
  Deadline dl(timeout);
  SignalWatch signals;
  WaitTimer timer;  // started by the first spin
  auto& streams = t_scratch.epoll_streams;
  auto& seen = t_scratch.epoll_seen;
  for (;;) {
    int n, users, shadow_now;
    bool skip_kernel;
    {
      std::lock_guard lk(set->mu);
      streams.clear();
      seen.clear();
      n = collect(set, epfd, ev, max, &streams, true, &seen);
      users = set->user_count;  // in `streams`, or resting on the ready list
      shadow_now = set->shadow;
      // (kernel_fired: the harvest in this collect() saw the kernel instance
      // readable, or it is not in the shadow. An event that comes after the
      // harvest is found by the next call, or ends the sleep below.)
      skip_kernel = (n || users > 0) &&
                    (kernel_empty(set, epfd) ||
                     (set->nested_fd >= 0 && !set->kernel_fired && !set->kernel_readable));
      set->kernel_readable = false;
    }
    // (A syscall per call saved for a set whose every registration is in
    // user space: redis-benchmark over librsock made 1.3 per request.)
    if (n < max && !skip_kernel) {
      // Kernel-held registrations, without sleeping if we already have some
      // or must also wait for user-space ones (the sleep below covers both).
      timespec zero{}, buf;
      const timespec* t = n || users > 0 ? &zero : dl.left(&buf);
      bool sleeps = t != &zero;
      SignalWatch::Sleep sleep(mask, -1, sleeps);  // kernel fds only
      if (sleeps && signals.check()) return Err(EINTR);
      int k = sys::libc.epoll_pwait2(epfd, ev + n, max - n, t, sleep.mask());
      if (k < 0 && errno == ENOSYS) {
        int ms = t ? int(t->tv_sec * 1000 + t->tv_nsec / 1000000) : -1;
        k = sys::libc.epoll_pwait(epfd, ev + n, max - n, ms, sleep.mask());
      }
      if (k < 0) {
        if (n) return n;
        return Err(errno);
      }
      n += epoll_filter_internal(epfd, ev + n, k);
    }
    if (n || dl.expired()) return n;
    if (users == 0) continue;  // only internal wakeups: re-collect
    // Registrations resting in the set (not in `streams`): on RDMA, their
    // arrivals are completions, which push them: a disarmed CQ's are found
    // by polling it (no syscall), an armed one's raise an event, which turns
    // the shadow instance readable. While every CQ is disarmed (a busy
    // process) that look would find nothing of theirs: left out. The spin
    // stays as short as with the look (spin_us): letting it grow to
    // spin_max_us made no difference 4 rounds of redis in the VM could
    // show, and costs CPU the peer may need.
    const int resting = users - int(streams.size());
    bool poked = false;
    auto ready_now = [&] {
      transport::cq_group::poll_disarmed();
      {
        std::lock_guard lk(set->mu);
        if ((n = collect(set, epfd, ev, max, nullptr, false)) > 0) return true;
      }
      if (resting > 0 && shadow_now >= 0 && !transport::cq_group::all_disarmed()) {
        pollfd p{shadow_now, POLLIN, 0};
        poked = sys::libc.poll(&p, 1, 0) == 1;
      }
      return poked;
    };
    if (spin(streams, timer, ready_now, resting > 0, resting > 0 && shadow_now >= 0)) {
      if (poked) continue;  // collect it fully
      return n;
    }
    // Sleep in the kernel on the application's instance (kernel-side
    // registrations) and the shadow one (the streams' wake and connection
    // fds); then collect both again.
    int shadow, poke;
    {
      std::lock_guard lk(set->mu);
      // Another thread's collect() found events due without signalling
      // ready_fd (nobody was asleep): collect them rather than sleep.
      if (set->due_unsignalled) continue;
      if (process_config().tunables.debug_checks) check_before_sleep(set, epfd);
      shadow = set->shadow;
      poke = set->poke_fd;
      set->sleepers++;
    }
    struct Awake {  // sleepers-- once the sleep is over, on every path
      EpollSet* set;
      void done() {
        if (!set) return;
        std::lock_guard lk(set->mu);
        set->sleepers--;
        set = nullptr;
      }
      ~Awake() { done(); }
    } awake{set};
    // The set's poke fd is in the shadow instance: a handler that runs
    // during the sleep ends it through it (without one, the caught signals
    // stay blocked until the sleep's mask unblocks them).
    SignalWatch::Sleep sleep(mask, poke);
    if (signals.check()) return Err(EINTR);
    const sigset_t* sleep_mask = sleep.mask();
    // A stream that changed since collect() looked at it may have found no
    // sleeper to poke: look again instead of sleeping over it.
    bool still = true;
    for (size_t i = 0; i < streams.size(); i++)
      still &= streams[i]->sleep_begin(seen[i]) || seen[i] == kNoCheck;
    // CQs raise events only while someone sleeps (transport/cq_group.h,
    // "Arming"): armed now, after sleepers++ and the streams' sleep_begin,
    // so that what the arm's drain files pushes or pokes us; we look again
    // rather than sleep when it filed anything. (Not armed for a
    // zero-timeout look: nothing would wait for its event.)
    transport::cq_group::ArmedSleep armed(still);
    still &= !armed.drained();
    // A resting registration pushed since the collect: look, do not sleep
    // (pairs with epoll_watch_fired; sleepers was raised above).
    still &= set->pushed.load(std::memory_order_seq_cst) == nullptr;
    timespec buf, zero{};
    const timespec* t = still ? dl.left(&buf) : &zero;
    // Without a poke fd (no fds for the set's own) a push cannot end the
    // sleep: sleep in slices and look again.
    if (poke < 0 && !streams.empty()) t = at_most_slice(t);
    int k;
    if (shadow >= 0) {
      pollfd pf[2] = {{epfd, POLLIN, 0}, {shadow, POLLIN, 0}};
      k = sys::libc.ppoll(pf, 2, t, sleep_mask);
      if (k > 0 && (pf[0].revents & POLLIN)) {
        std::lock_guard lk(set->mu);
        set->kernel_readable = true;  // (ready_fd, or a registration we did not see)
      }
      if (k > 0) k = 0;  // events are gathered below, without sleeping
    } else {
      k = sys::libc.epoll_pwait2(epfd, ev, max, t, sleep_mask);
      if (k < 0 && errno == ENOSYS) {
        int ms = t ? int(t->tv_sec * 1000 + t->tv_nsec / 1000000) : -1;
        k = sys::libc.epoll_pwait(epfd, ev, max, ms, sleep_mask);
      }
    }
    int err = errno;
    armed.end();
    for (Stream* st : streams) st->sleep_end();
    awake.done();
    if (k < 0) return Err(err);
    k = epoll_filter_internal(epfd, ev, k);
    // Kernel events of plain fds are returned with any user ones due now.
    if (k > 0) {
      std::lock_guard lk(set->mu);
      int m = collect(set, epfd, ev + k, max - k, nullptr);
      return k + m;
    }
    if (dl.expired()) {
      std::lock_guard lk(set->mu);
      return collect(set, epfd, ev, max, nullptr);
    }
  }
}

int epoll_filter_internal(int epfd, epoll_event* ev, int n) {
  if (n <= 0 || !set_of(epfd)) return n;
  int k = 0;
  for (int i = 0; i < n; i++)
    if (ev[i].data.u64 != g_cookie) ev[k++] = ev[i];
  return k;
}

bool is_epoll_instance(int fd) { return set_of(fd) != nullptr; }

void epoll_fd_closed(int fd) {
  EpollSet* set = set_of(fd);
  if (!set) return;
  std::lock_guard lk(set->mu);
  set->born_here = false;  // (until an epoll_create gives the number a new instance)
  while (!set->regs.empty()) {
    set->regs.back()->user = false;  // the kernel instance is gone with its fds
    drop(set, -1, set->regs.size() - 1);
  }
  set->user_count = 0;
  if (set->shadow >= 0) {
    if (set->watched) progress_unwatch(set->shadow);
    sys::close_owned(set->shadow);
    sys::close_owned(set->ready_fd);
    sys::close_owned(set->poke_fd);
    set->shadow = set->ready_fd = set->poke_fd = -1;
    set->ready_set = false;
    set->nested_fd = -1;  // (its entry went with the shadow)
  }
  set->hub_target = set->hub_fd = -1;  // (its entry went with the instance)
  set->tcp_hub_fd = -1;
  if (set->watched) g_watched.fetch_sub(1, std::memory_order_relaxed);
  set->watched = false;
}

void epoll_created(int epfd) {
  EpollSet* set = set_for(epfd);
  if (!set) return;
  std::lock_guard lk(set->mu);
  // (A number reused after a close: the set's old registrations went with
  // the old instance, epoll_fd_closed.)
  set->born_here = set->regs.empty();
  set->born_epoch = g_fork_epoch.load(std::memory_order_relaxed);
  set->foreign.store(false, std::memory_order_relaxed);
}

void epoll_kernel_added(int epfd) {
  if (EpollSet* set = set_of(epfd); set && !set->foreign.load(std::memory_order_relaxed))
    set->foreign.store(true, std::memory_order_relaxed);
}

void epoll_before_fork() { g_fork_epoch.fetch_add(1, std::memory_order_relaxed); }

void epoll_observed(int fd) {
  if (EpollSet* set = set_of(fd)) watch(set);
}

void readiness_after_io(const Socket* s) {
  if (g_watched.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard all(g_all_mu);
  for (auto& [epfd, set] : g_all) {
    std::lock_guard lk(set->mu);
    if (!set->watched) continue;
    for (auto& r : set->regs) {
      if (r->sock == s && r->user && !r->parked) {
        refresh(set, false);
        break;
      }
    }
  }
}

void epoll_take_over(int fd) {
  SocketRef s = lookup(fd);
  Stream* st = governing_stream(s);
  if (!st) return;
  std::lock_guard all(g_all_mu);
  for (auto& [epfd, set] : g_all) {
    std::lock_guard lk(set->mu);
    Reg* r = find(set, fd);
    if (r && !r->user && r->sock == s.get()) to_user(set, epfd, *r);
  }
  st->wake();  // a waiter already asleep in one of those sets re-collects
}

void epoll_watch_fired(EpollWatch* w) {
  if (w->queued.exchange(true, std::memory_order_acq_rel)) return;  // already on the list
  auto* set = static_cast<EpollSet*>(w->set);
  EpollWatch* head = set->pushed.load(std::memory_order_relaxed);
  do {
    w->next = head;
  } while (!set->pushed.compare_exchange_weak(head, w, std::memory_order_seq_cst,
                                              std::memory_order_relaxed));
  // seq_cst pairs with the sleeper's sleepers++ then pushed check: either it
  // sees this push and does not sleep, or this sees it and wakes it. A
  // watched set's monitor (progress thread) is woken the same way.
  if ((set->sleepers.load(std::memory_order_seq_cst) > 0 ||
       set->watched.load(std::memory_order_relaxed)) &&
      set->poke_fd >= 0) {
    uint64_t one = 1;
    (void)!sys::libc.write(set->poke_fd, &one, sizeof one);
  }
}

}  // namespace rsock::socket

namespace rsock::socket {

namespace {
// Socket::watch_lock: held for a list walk or edit only (no syscall but the
// pokes of epoll_watch_fired), the innermost lock of all.
struct WatchLock {
  explicit WatchLock(Socket* s) : s_(s) {
    spin_lock(s_->watch_lock);
  }
  ~WatchLock() { spin_unlock(s_->watch_lock); }
  WatchLock(const WatchLock&) = delete;
  WatchLock& operator=(const WatchLock&) = delete;
  Socket* s_;
};
}  // namespace

void socket_link_watch(Socket* s, EpollWatch* w) {
  WatchLock l(s);
  if (w->linked) return;
  w->wnext = s->watches;
  s->watches = w;
  w->linked = true;
}

void socket_unlink_watch(Socket* s, EpollWatch* w) {
  WatchLock l(s);
  if (!w->linked) return;
  for (EpollWatch** p = &s->watches; *p; p = &(*p)->wnext) {
    if (*p == w) {
      *p = w->wnext;
      break;
    }
  }
  w->wnext = nullptr;
  w->linked = false;
}

void socket_push_watches(Socket* s, const std::atomic<Socket*>* owner) {
  // No user-space registration (a program without epoll): no lock either.
  // (to_user counts one before it links it, and evaluates it anyway.)
  if (!s || s->epoll_users.load(std::memory_order_acquire) == 0) return;
  WatchLock l(s);
  if (owner && owner->load(std::memory_order_relaxed) != s) return;
  for (EpollWatch* w = s->watches; w; w = w->wnext) epoll_watch_fired(w);
}

void socket_clear_owner(Socket* s, std::atomic<Socket*>* owner) {
  WatchLock l(s);
  owner->store(nullptr, std::memory_order_release);
}

}  // namespace rsock::socket
