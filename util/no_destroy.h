// A global that is constructed at compile time and never destroyed.
//
// librsock's globals are used by hooks and by the progress thread, and both
// run during exit(): after main returns, __cxa_finalize runs the static
// destructors while the progress thread is still in its tick and other
// application threads are still in their hooks. A plain global std::vector
// frees its buffer there, under their feet (ASan: heap-use-after-free in the
// progress thread's path check, one exit in about 30 under load). Wrapped in
// NoDestroy, its storage stays valid until the process is gone; the kernel
// reclaims it. Constant-initialised (constinit), so also valid in a hook that
// runs before our dynamic initialisers.
#pragma once

namespace rsock::util {

template <class T>
union NoDestroy {
  constexpr NoDestroy() : value() {}
  ~NoDestroy() {}  // deliberately does not destroy `value`
  T value;
};

}  // namespace rsock::util
