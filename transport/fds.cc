#include "transport/fds.h"

#include <atomic>
#include <mutex>

namespace rsock::transport {

namespace {
std::atomic<bool> g_opened{false};
}  // namespace

bool device_contexts_open() { return g_opened.load(std::memory_order_acquire); }

void own_device_fds() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_opened.store(true, std::memory_order_release);  // rdma_get_devices opens them
    int n = 0;
    ibv_context** ctxs = rdma_get_devices(&n);
    if (!ctxs) return;
    for (int i = 0; i < n; i++) {
      ctxs[i]->cmd_fd = sys::own_fd(ctxs[i]->cmd_fd);
      ctxs[i]->async_fd = sys::own_fd(ctxs[i]->async_fd);
    }
    rdma_free_devices(ctxs);
  });
}

}  // namespace rsock::transport
