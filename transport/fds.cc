#include "transport/fds.h"
#include "transport/fork_guard.h"

#include <atomic>
#include <cerrno>
#include <new>
#include <mutex>

#include "transport/cq_hub.h"
#include "transport/path_quality.h"

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
std::atomic<bool> g_prepared{false};  // this process image (prepare_devices)

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
  g_prepared.store(false, std::memory_order_relaxed);
}

void prepare_devices(bool port_counters) {
  if (g_prepared.exchange(true, std::memory_order_acq_rel)) return;
  int saved = errno;  // (a hook's caller may still read it)
  own_device_fds();
  int n = 0;
  ibv_context** ctxs = guarded::rdma_get_devices(&n);
  for (int i = 0; ctxs && i < n; i++) {
    ibv_device_attr da{};
    if (ibv_query_device(ctxs[i], &da) != 0) continue;
    bool active = false;
    for (uint8_t port = 1; port <= da.phys_port_cnt && port != 0; port++) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctxs[i], port, &pa) != 0 || pa.state != IBV_PORT_ACTIVE) continue;
      active = true;
      if (port_counters) path_quality::open_port(ctxs[i]->device->name, port);
    }
    if (!active) continue;
    if (ibv_context* own = own_context(ctxs[i]->device)) (void)cq_hub::channel(own);
  }
  if (ctxs) guarded::rdma_free_devices(ctxs);
  // librdmacm asks the IB address service (ibacm) once per process, at its
  // first route resolution: a socket opened and, without ibacm, closed at
  // once. An empty query makes it ask now.
  rdma_addrinfo hints{};
  rdma_addrinfo* res = nullptr;
  if (guarded::rdma_getaddrinfo(nullptr, nullptr, &hints, &res) == 0) rdma_freeaddrinfo(res);
  errno = saved;
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
