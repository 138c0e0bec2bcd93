#include "util/owned_fds.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdint>

#include "util/clock.h"
#include "util/sys.h"

namespace rsock::sys {

namespace {

// One bit per fd below kOwnedFdTop (8 KiB); an fd at or above it (a program
// whose fds already reach that high) is owned but not protected.
std::atomic<uint64_t> g_bits[kOwnedFdTop / 64];
std::atomic<int> g_count{0};

void mark(int fd, bool on) {
  if (fd < 0 || fd >= kOwnedFdTop) return;
  uint64_t bit = uint64_t{1} << (fd % 64);
  uint64_t old = on ? g_bits[fd / 64].fetch_or(bit, std::memory_order_acq_rel)
                    : g_bits[fd / 64].fetch_and(~bit, std::memory_order_acq_rel);
  if (on && !(old & bit)) g_count.fetch_add(1, std::memory_order_relaxed);
  if (!on && (old & bit)) g_count.fetch_sub(1, std::memory_order_relaxed);
}

// A duplicate of fd in the highest band of the fd space with a free number,
// or -1 (fd already up there, upper half full, or the limit moved).
int dup_high(int fd) {
  rlimit rl{};
  long top = kOwnedFdTop;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && long(rl.rlim_cur) < top)
    top = long(rl.rlim_cur);
  int saved = errno, nfd = -1;
  for (long band = 64; band <= top / 2 && fd < top - band; band *= 2) {
    nfd = libc.fcntl(fd, F_DUPFD_CLOEXEC, top - band);
    if (nfd >= 0 || errno != EMFILE) break;  // EINVAL: the limit moved under us
  }
  errno = saved;
  return nfd;
}

}  // namespace

bool owned_fd_room(int n) {
  // Asked per connection: the limit is read again at most every 100 ms
  // (a getrlimit per connect() and accept() was a syscall each; a program
  // that lowers its limit is seen a moment later, and this is only the
  // policy of how many fds librsock may take, not what the kernel enforces).
  static std::atomic<long> cached_top{0};
  static std::atomic<uint64_t> read_at_ns{0};
  uint64_t now = coarse_now_ns();
  long top = cached_top.load(std::memory_order_relaxed);
  if (top == 0 || now - read_at_ns.load(std::memory_order_relaxed) > 100'000'000) {
    rlimit rl{};
    top = kOwnedFdTop;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && long(rl.rlim_cur) < top)
      top = long(rl.rlim_cur);
    cached_top.store(top, std::memory_order_relaxed);
    read_at_ns.store(now, std::memory_order_relaxed);
  }
  return long(g_count.load(std::memory_order_relaxed)) + n <= top / 2;
}

int own_fd(int fd) {
  if (fd < 0) return fd;
  if (int nfd = dup_high(fd); nfd >= 0) {
    libc.close(fd);
    fd = nfd;
  }
  mark(fd, true);
  return fd;
}

int dup_owned(int fd) {
  if (fd < 0) return -1;
  int nfd = dup_high(fd);
  if (nfd < 0) nfd = libc.fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (nfd >= 0) mark(nfd, true);
  return nfd;
}

int next_owned_fd(int from) {
  if (from < 0) from = 0;
  for (int w = from / 64; w < kOwnedFdTop / 64; w++) {
    uint64_t bits = g_bits[w].load(std::memory_order_acquire);
    if (w == from / 64) bits &= ~uint64_t{0} << (from % 64);
    if (bits) return w * 64 + std::countr_zero(bits);
  }
  return -1;
}

void disown_fd(int fd) { mark(fd, false); }

bool owned_fd(int fd) {
  if (fd < 0 || fd >= kOwnedFdTop) return false;
  return g_bits[fd / 64].load(std::memory_order_acquire) & (uint64_t{1} << (fd % 64));
}

void close_owned(int fd) {
  if (fd < 0) return;
  disown_fd(fd);
  libc.close(fd);
}

int owned_fd_count() { return g_count.load(std::memory_order_relaxed); }

}  // namespace rsock::sys
