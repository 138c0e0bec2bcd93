// Hooks: liburing's ring setup (util/libc_funcs.h, RSOCK_LIBURING_FUNCS).
// Reads and writes through an io_uring reach the kernel sockets without
// passing any hook, so the process's connections must be plain kernel TCP
// before the program can submit one: each setup call first runs
// progress_io_uring_started() (connections back to TCP, no more upgrades),
// then liburing's own function. liburing returns -errno, never sets errno.
#include <dlfcn.h>
#include <errno.h>

#include "preload/hook.h"
#include "socket/process.h"
#include "socket/rendezvous.h"
#include "util/libc_funcs.h"

namespace {

// liburing's definition, looked up past librsock. Resolved per call (a
// program may dlopen liburing after its first connections); a setup call is
// rare, and dlsym is cheap next to creating a ring.
template <typename Fn>
Fn next_definition(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

}  // namespace

#define RSOCK_URING_HOOK(ret, name, params, args)                                    \
  RSOCK_HOOK ret name params noexcept {                                             \
    const int saved = errno;                                                        \
    {                                                                               \
      rsock::preload::HookScope h;                                                  \
      if (h.outermost() && rsock::socket::tracking_enabled())                       \
        rsock::socket::progress_io_uring_started();                                 \
    }                                                                               \
    auto fn = next_definition<ret(*) params>(#name);                                \
    errno = saved;                                                                  \
    return fn ? fn args : -ENOSYS;                                                  \
  }
RSOCK_LIBURING_FUNCS(RSOCK_URING_HOOK)
#undef RSOCK_URING_HOOK
