#include "transport/cq_hub.h"

#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/epoll.h>

#include <boost/intrusive/list.hpp>

#include <atomic>
#include <cerrno>
#include <new>

#include "transport/cm_hub.h"
#include "transport/cq_group.h"
#include "transport/fds.h"
#include "util/no_destroy.h"
#include "util/sys.h"

namespace rsock::transport::cq_hub {

namespace {
// A handful of device contexts at most (transport/fds.cc keeps 16). Heap-free
// and never destroyed: hooks may run during exit. Guarded by cm_hub::mu():
// one leaf lock for both hubs, so a Connection's notify callback is read and
// written under the same lock by either.
constexpr int kMaxChannels = 16;
struct Entry {
  ibv_context* ctx;
  ibv_comp_channel* ch;
};
Entry g_ch[kMaxChannels];
std::atomic<int> g_nch{0};
std::atomic<int> g_epfd{-1};
// What sleepers watch: the only channel's own fd while there is one, the
// epoll instance holding all of them from the second on. A nested epoll is
// not free: in the TCG guests it made every sleep and wakeup of a 64 B
// round trip about 40 us slower than on the channel itself.
std::atomic<int> g_fd{-1};

// Under cm_hub::mu(): the epoll instance with every channel so far.
int epfd_locked() {
  int fd = g_epfd.load(std::memory_order_relaxed);
  if (fd >= 0) return fd;
  fd = sys::own_fd(sys::libc.epoll_create1(EPOLL_CLOEXEC));
  if (fd < 0) return -1;
  int n = g_nch.load(std::memory_order_relaxed);
  for (int i = 0; i < n; i++) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    if (sys::libc.epoll_ctl(fd, EPOLL_CTL_ADD, g_ch[i].ch->fd, &ev) < 0) {
      sys::close_owned(fd);
      return -1;
    }
  }
  g_epfd.store(fd, std::memory_order_release);
  return fd;
}
}  // namespace

ibv_comp_channel* channel(ibv_context* ctx) {
  std::lock_guard lk(cm_hub::mu());
  int n = g_nch.load(std::memory_order_relaxed);
  for (int i = 0; i < n; i++)
    if (g_ch[i].ctx == ctx) return g_ch[i].ch;
  if (n == kMaxChannels) {
    errno = EMFILE;
    return nullptr;
  }
  // A second channel needs the epoll instance before it is of any use.
  if (n >= 1 && epfd_locked() < 0) return nullptr;
  ibv_comp_channel* ch = ibv_create_comp_channel(ctx);
  if (ch == nullptr) {
    if (errno == 0) errno = ENOMEM;
    return nullptr;
  }
  own_channel(ch);  // before any CQ hands its number to the kernel
  int fl = sys::libc.fcntl(ch->fd, F_GETFL);
  bool ok = fl >= 0 && sys::libc.fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) == 0;
  if (ok && n >= 1) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ok = sys::libc.epoll_ctl(g_epfd.load(std::memory_order_relaxed), EPOLL_CTL_ADD, ch->fd, &ev) == 0;
  }
  if (!ok) {
    int e = errno;
    disown_channel(ch);
    ibv_destroy_comp_channel(ch);
    errno = e;
    return nullptr;
  }
  g_ch[n] = {ctx, ch};
  g_nch.store(n + 1, std::memory_order_release);
  g_fd.store(n == 0 ? ch->fd : g_epfd.load(std::memory_order_relaxed), std::memory_order_release);
  return ch;
}

int fd() { return g_fd.load(std::memory_order_acquire); }

std::atomic<bool> g_noted{false};

void note_readable() {
  if (!g_noted.load(std::memory_order_relaxed)) g_noted.store(true, std::memory_order_release);
}

bool noted() { return g_noted.load(std::memory_order_acquire); }

void note_if_woken(const pollfd* fds, int n) {
  const int f = fd();
  for (int i = 0; f >= 0 && i < n; i++)
    if (fds[i].fd == f && (fds[i].revents & POLLIN)) return note_readable();
}

void poll() {
  if (g_nch.load(std::memory_order_acquire) == 0) return;
  cq_group::Group* got[kMaxChannels];
  int ngot = 0;
  {
    std::lock_guard lk(cm_hub::mu());
    // (Cleared before the read: an event that stays in the channel marks it
    // again through the next sleeper it wakes.)
    if (g_noted.load(std::memory_order_relaxed)) g_noted.store(false, std::memory_order_relaxed);
    int n = g_nch.load(std::memory_order_relaxed);
    for (int i = 0; i < n; i++) {
      ibv_cq* cq;
      void* ctx;
      // One event per channel and call: a second read would mostly return
      // EAGAIN (a syscall per wakeup); more events leave the fd readable, and
      // whoever sleeps on it comes back for them.
      if (ibv_get_cq_event(g_ch[i].ch, &cq, &ctx) == 0) {
        ibv_ack_cq_events(cq, 1);
        got[ngot++] = static_cast<cq_group::Group*>(ctx);
      }
    }
  }
  // Outside cm_hub::mu(): a group's lock comes first (cq_group.h). Groups
  // are never destroyed, so the pointer outlives the acknowledgement.
  for (int i = 0; i < ngot; i++) cq_group::on_event(got[i]);
}

namespace {
struct Sleeper {
  int wake_fd = -1;
  bool watcher = false;  // this sleep includes fd()
  boost::intrusive::list_member_hook<> hook;
};
thread_local Sleeper t_sleeper;

// Who watches the hub (begin_sleep). g_sleep_mu is a leaf lock: held only
// to update these two, never while calling out (the poke is written after).
using SleeperList = boost::intrusive::list<
    Sleeper, boost::intrusive::member_hook<Sleeper, boost::intrusive::list_member_hook<>,
                                           &Sleeper::hook>>;
std::mutex g_sleep_mu;
bool g_watched = false;
// Asleep without fd(), oldest first. Never destroyed (util/no_destroy.h:
// hooks run during exit); built at load, long before a socket upgrades.
util::NoDestroy<SleeperList> g_sleepers_storage;
SleeperList& g_sleepers = g_sleepers_storage.value;

void poke(int fd) {
  uint64_t one = 1;
  if (fd >= 0) (void)!sys::libc.write(fd, &one, sizeof one);
}
}  // namespace

bool begin_sleep(int wake_fd) {
  Sleeper* s = &t_sleeper;
  s->wake_fd = wake_fd;
  std::lock_guard lk(g_sleep_mu);
  // Still in the list: the thread left its last sleep without end_sleep (a
  // handler that longjmp'd out of it). Never linked twice.
  if (s->hook.is_linked()) g_sleepers.erase(g_sleepers.iterator_to(*s));
  s->watcher = !g_watched;
  if (s->watcher) g_watched = true;
  else g_sleepers.push_back(*s);
  return s->watcher;
}

bool relay(pollfd* fds, nfds_t n, nfds_t hub) {
  if (hub >= n || !(fds[hub].revents & POLLIN)) return false;
  for (nfds_t i = 0; i < n; i++)
    if (i != hub && fds[i].revents) return false;
  {
    std::lock_guard lk(g_sleep_mu);
    if (g_sleepers.empty()) return false;
  }
  poll();
  fds[hub].revents = 0;  // read: neither end_sleep's caller nor note_if_woken reads it again
  return true;
}

bool end_sleep() {
  Sleeper* s = &t_sleeper;
  int hand_to = -1;
  bool others;
  {
    std::lock_guard lk(g_sleep_mu);
    if (s->watcher) g_watched = false;
    else g_sleepers.erase(g_sleepers.iterator_to(*s));
    others = !g_sleepers.empty();
    if (!g_watched && others) hand_to = g_sleepers.front().wake_fd;
  }
  poke(hand_to);
  return s->watcher && others;
}

void after_fork_child() {
  // cm_hub::after_fork_child() renews the shared lock. The parent's channels
  // stay open unused (like its device contexts, fds.h: their CQs are the
  // parent's); our copy of its epoll instance goes.
  g_nch.store(0, std::memory_order_release);
  g_fd.store(-1, std::memory_order_release);
  // Only the forking thread exists here, and it was not asleep; another
  // thread may have held the lock at the fork.
  new (&g_sleep_mu) std::mutex;
  g_watched = false;
  g_sleepers.clear();
  if (int ep = g_epfd.exchange(-1, std::memory_order_acq_rel); ep >= 0) sys::close_owned(ep);
}

}  // namespace rsock::transport::cq_hub
