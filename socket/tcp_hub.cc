#include "socket/tcp_hub.h"

#include <sys/epoll.h>

#include <atomic>

#include "socket/stream.h"
#include "transport/cm_hub.h"
#include "util/owned_fds.h"
#include "util/sys.h"

namespace rsock::socket::tcp_hub {

namespace {
std::atomic<int> g_fd{-1};
std::atomic<int> g_entries{0};
}  // namespace

int fd() { return g_fd.load(std::memory_order_acquire); }

bool add_locked(int tcp_fd, Stream* st) {
  int ep = g_fd.load(std::memory_order_relaxed);
  if (ep < 0) {
    ep = sys::own_fd(sys::libc.epoll_create1(EPOLL_CLOEXEC));
    if (ep < 0) return false;
    g_fd.store(ep, std::memory_order_release);
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  ev.data.ptr = st;
  if (sys::libc.epoll_ctl(ep, EPOLL_CTL_ADD, tcp_fd, &ev) != 0) return false;
  g_entries.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void del_locked(int tcp_fd) {
  int ep = g_fd.load(std::memory_order_relaxed);
  if (ep >= 0 && sys::libc.epoll_ctl(ep, EPOLL_CTL_DEL, tcp_fd, nullptr) == 0)
    g_entries.fetch_sub(1, std::memory_order_relaxed);
}

void poll() {
  // (Nothing can be pending without an entry: no lock, no syscall.)
  if (g_entries.load(std::memory_order_acquire) == 0) return;
  std::lock_guard lk(transport::cm_hub::mu());
  int ep = g_fd.load(std::memory_order_relaxed);
  if (ep < 0) return;
  epoll_event evs[64];
  int n = sys::libc.epoll_wait(ep, evs, 64, 0);
  for (int i = 0; i < n; i++) static_cast<Stream*>(evs[i].data.ptr)->tcp_event(evs[i].events);
}

void after_fork_child() {
  // cm_hub::after_fork_child() renews the lock.
  g_entries.store(0, std::memory_order_relaxed);
  if (int ep = g_fd.exchange(-1, std::memory_order_acq_rel); ep >= 0) sys::close_owned(ep);
}

}  // namespace rsock::socket::tcp_hub
