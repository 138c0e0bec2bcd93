// The real libc functions, as one table every layer calls through.
//
// Inside librsock.so a plain call to read() would land in our own hook (it is
// exported and preloaded), so lower layers never call the hooked functions by
// name: they call sys::libc.read(). preload/ fills the table with
// dlsym(RTLD_NEXT) before any hook does real work; in test programs that link
// the layers without preload/ the table starts out pointing at libc directly.
//
// errno: the sys::*_status() helpers below are the only place below preload/
// that reads errno; they turn it into Status<T> right at the libc boundary.
#pragma once

#include <cerrno>

#include "util/libc_funcs.h"
#include "util/status.h"

namespace rsock::sys {

struct Libc {
#define RSOCK_X(ret, name, params, args) ret(*name) params;
  RSOCK_LIBC_FUNCS(RSOCK_X)
#undef RSOCK_X
#define RSOCK_XV(name, type) type name;
  RSOCK_LIBC_VARIADIC(RSOCK_XV)
#undef RSOCK_XV
};

// Written once by preload::resolve_libc() (before it is read by any hook).
extern Libc libc;

// Wraps a libc return value: -1 becomes Err(errno).
template <typename T>
inline Status<T> check(T r) {
  if (r < 0) return Err(errno);
  return r;
}

// Sends what a TCP socket's kernel queue holds back now (Nagle, TCP_CORK)
// and leaves its TCP_NODELAY as it was: setting TCP_NODELAY pushes (there
// is no flag for one send), so it is set, and cleared again if it was off.
// The caller keeps the application's own TCP_NODELAY calls out meanwhile
// (Stream::push_tcp). Errors are ignored: the bytes then go as the kernel
// would have sent them anyway.
void push_unsent(int tcp_fd);

}  // namespace rsock::sys
