// dlsym(RTLD_NEXT) for every interposed function; see util/sys.h.
#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "preload/hook.h"
#include "socket/process.h"

namespace rsock::preload {

std::atomic<bool> g_resolved{false};

namespace {

// Returns ENOSYS for a function this libc does not have (epoll_pwait2 before
// glibc 2.35, close_range before 2.34), so the hook still has something to call.
int missing() {
  errno = ENOSYS;
  return -1;
}

[[noreturn]] void fatal_missing(const char* name) {
  // Without the real read/write/... we cannot run the program at all, and
  // there is nothing sane to pass through to.
  // Raw syscalls: write() would be our own hook, which needs this table,
  // and so would syscall() (hooked for libuv's raw closes): libc's own.
  using Raw = long (*)(long, ...);
  if (auto raw = reinterpret_cast<Raw>(dlsym(RTLD_NEXT, "syscall"))) {
    const char msg[] = "librsock: fatal: cannot resolve libc function ";
    raw(SYS_write, STDERR_FILENO, msg, sizeof msg - 1);
    raw(SYS_write, STDERR_FILENO, name, strlen(name));
    raw(SYS_write, STDERR_FILENO, "\n", 1);
  }
  _exit(127);
}

template <typename Fn>
void resolve_one(Fn& slot, const char* name, bool optional) {
  void* p = dlsym(RTLD_NEXT, name);
  if (!p) {
    if (!optional) fatal_missing(name);
    p = reinterpret_cast<void*>(&missing);
  }
  slot = reinterpret_cast<Fn>(p);
}

bool is_optional(const char* name) {
  return !strcmp(name, "epoll_pwait2") || !strcmp(name, "close_range") ||
         !strcmp(name, "fcntl64") || !strncmp(name, "__", 2);
}

}  // namespace

void resolve_libc() {
  // Concurrent first calls may both resolve: harmless, dlsym gives the same
  // answers. Written field by field; readers wait for g_resolved.
  sys::Libc l{};
#define RSOCK_X(ret, name, params, args) resolve_one(l.name, #name, is_optional(#name));
  RSOCK_LIBC_FUNCS(RSOCK_X)
#undef RSOCK_X
#define RSOCK_XV(name, type) resolve_one(l.name, #name, is_optional(#name));
  RSOCK_LIBC_VARIADIC(RSOCK_XV)
#undef RSOCK_XV
  sys::libc = l;
  g_resolved.store(true, std::memory_order_release);
}

// Resolve as early as possible so that lower layers calling sys::libc never
// see our own hooks (the constant-initialised defaults in util/sys.cc).
__attribute__((constructor(101))) static void resolve_early() { resolve_libc(); }

// Then the configuration: one clear line on stderr if it is broken, and from
// then on every socket is the kernel's alone.
__attribute__((constructor(102))) static void init_early() {
  ++t_depth;  // whatever the loader calls (open, read, readlink) is ours
  socket::init_process();
  --t_depth;
}

}  // namespace rsock::preload
