#include "transport/cm_hub.h"

#include <fcntl.h>
#include <rdma/rdma_cma.h>

#include <atomic>
#include <cerrno>

#include "transport/connection.h"
#include "transport/fds.h"
#include "util/log.h"
#include "util/sys.h"
#include "transport/fork_guard.h"

namespace rsock::transport::cm_hub {

namespace {
// Heap-free and never destroyed: hooks may run during exit.
std::mutex g_mu;
rdma_event_channel* g_ch = nullptr;  // under g_mu (creation) / read atomically below
std::atomic<int> g_fd{-1};
std::atomic<bool> g_serviced{false};
}  // namespace

std::mutex& mu() { return g_mu; }

rdma_event_channel* channel() {
  std::lock_guard lk(g_mu);
  if (g_ch != nullptr) return g_ch;
  own_device_fds();
  rdma_event_channel* ch = guarded::rdma_create_event_channel();
  if (ch == nullptr) {
    if (errno == 0) errno = ENODEV;
    return nullptr;
  }
  own_channel(ch);
  int fl = sys::libc.fcntl(ch->fd, F_GETFL);
  if (fl < 0 || sys::libc.fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
    int e = errno;
    disown_channel(ch);
    guarded::rdma_destroy_event_channel(ch);
    errno = e;
    return nullptr;
  }
  g_ch = ch;
  g_fd.store(ch->fd, std::memory_order_release);
  return ch;
}

int fd() { return g_fd.load(std::memory_order_acquire); }

void poll() {
  if (fd() < 0) return;
  std::lock_guard lk(g_mu);
  rdma_cm_event* ev;
  while (g_ch != nullptr && guarded::rdma_get_cm_event(g_ch, &ev) == 0) {
    // Every id on this channel is a Connection's (listeners keep their own
    // channel; accepted ids are migrated here once they have one).
    if (auto* c = static_cast<Connection*>(ev->id ? ev->id->context : nullptr)) c->deliver_cm_event(*ev);
    rdma_ack_cm_event(ev);
  }
}

void set_serviced(bool on) { g_serviced.store(on, std::memory_order_release); }
bool serviced() { return g_serviced.load(std::memory_order_acquire); }

void forget(rdma_cm_id* id) {
  if (id == nullptr) return;
  std::lock_guard lk(g_mu);
  id->context = nullptr;
}

void after_fork_child() {
  // The lock may have been held by another parent thread at fork.
  new (&g_mu) std::mutex();
  if (g_ch != nullptr) {
    // rdma_destroy_event_channel only closes the fd and frees the struct:
    // the parent's channel (the same open file) is unaffected.
    disown_channel(g_ch);
    guarded::rdma_destroy_event_channel(g_ch);
    g_ch = nullptr;
  }
  g_fd.store(-1, std::memory_order_release);
  g_serviced.store(false, std::memory_order_release);
}

}  // namespace rsock::transport::cm_hub
