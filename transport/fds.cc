#include "transport/fds.h"
#include "transport/fork_guard.h"

#include <atomic>
#include <cerrno>
#include <new>
#include <mutex>

namespace rsock::transport {

namespace {
// A handful of devices at most, looked up once per connection setup.
constexpr int kMaxContexts = 16;
struct OwnContext {
  ibv_device* dev;
  ibv_context* ctx;
};
OwnContext g_ctx[kMaxContexts];
int g_nctx = 0;
std::mutex g_ctx_mu;

// A device context's command and async fds, into the owned band.
void own_fds_of(ibv_context* ctx) {
  ctx->cmd_fd = sys::own_fd(ctx->cmd_fd);
  ctx->async_fd = sys::own_fd(ctx->async_fd);
}
}  // namespace

ibv_context* own_context(ibv_device* dev) {
  if (dev == nullptr) {
    errno = ENODEV;
    return nullptr;
  }
  std::lock_guard lk(g_ctx_mu);
  for (int i = 0; i < g_nctx; i++)
    if (g_ctx[i].dev == dev) return g_ctx[i].ctx;
  if (g_nctx == kMaxContexts) {
    errno = EMFILE;
    return nullptr;
  }
  ibv_context* ctx = guarded::ibv_open_device(dev);
  if (ctx == nullptr) {
    if (errno == 0) errno = ENODEV;
    return nullptr;
  }
  own_fds_of(ctx);
  g_ctx[g_nctx++] = {dev, ctx};
  return ctx;
}

void contexts_after_fork_child() {
  new (&g_ctx_mu) std::mutex();  // another parent thread may have held it at fork
  g_nctx = 0;
}

void own_device_fds() {
  static std::once_flag once;
  std::call_once(once, [] {
    int n = 0;
    ibv_context** ctxs = guarded::rdma_get_devices(&n);
    if (!ctxs) return;
    for (int i = 0; i < n; i++) own_fds_of(ctxs[i]);
    guarded::rdma_free_devices(ctxs);
  });
}

}  // namespace rsock::transport
