#include "socket/fd_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>

#include "util/log.h"
#include "util/sys.h"

namespace rsock::socket {

std::atomic<FdTable*> FdTable::g_table{nullptr};

namespace {

// Beyond this many fds the table stops tracking (the fds still work, they just
// stay plain kernel sockets); 2^26 slots = 512 MiB of address space, untouched.
constexpr size_t kMaxSlots = size_t{1} << 26;

// The largest fd number the kernel may ever return + 1. nr_open bounds every
// RLIMIT_NOFILE, so the table never needs to grow.
size_t max_fds() {
  size_t n = 0;
  int fd = ::open("/proc/sys/fs/nr_open", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    char buf[32] = {};
    ssize_t r = sys::libc.read(fd, buf, sizeof buf - 1);
    if (r > 0) n = strtoull(buf, nullptr, 10);
    sys::libc.close(fd);
  }
  rlimit rl{};
  if (n == 0 && getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_max != RLIM_INFINITY) n = rl.rlim_max;
  if (n == 0) n = 1 << 20;  // Linux's default nr_open
  return n < kMaxSlots ? n : kMaxSlots;
}

}  // namespace

FdTable* FdTable::get_or_create() {
  FdTable* t = g_table.load(std::memory_order_acquire);
  if (t) return t;
  size_t cap = max_fds();
  size_t bytes = sizeof(FdTable) + cap * sizeof(std::atomic<Socket*>);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) return nullptr;  // caller leaves the socket untracked
  auto* slots = reinterpret_cast<std::atomic<Socket*>*>(static_cast<char*>(mem) + sizeof(FdTable));
  auto* fresh = new (mem) FdTable(slots, cap);  // zero pages == nullptr slots
  if (!g_table.compare_exchange_strong(t, fresh, std::memory_order_acq_rel)) {
    munmap(mem, bytes);  // another thread won the race
    return t;
  }
  LOG_DEBUG("fd table: %zu slots", cap);
  return fresh;
}

SocketRef FdTable::lookup(int fd) const {
  if (fd < 0 || static_cast<size_t>(fd) >= capacity_) return {};
  for (;;) {
    Socket* s = slots_[fd].load(std::memory_order_acquire);
    if (!s) return {};
    if (s->try_ref()) {
      if (slots_[fd].load(std::memory_order_acquire) == s) return SocketRef(s);
      s->unref();
    }
    // The slot changed under us (close/dup2 racing): read it again.
  }
}

void FdTable::install(int fd, Socket* s) {
  if (fd < 0 || static_cast<size_t>(fd) >= capacity_) {
    LOG_WARN("fd %d is beyond the fd table (%zu): left as a plain kernel socket", fd, capacity_);
    return;
  }
  s->ref();
  s->add_name();
  for (int m = max_fd_.load(std::memory_order_relaxed);
       fd > m && !max_fd_.compare_exchange_weak(m, fd, std::memory_order_relaxed);) {
  }
  if (Socket* old = slots_[fd].exchange(s, std::memory_order_acq_rel)) {
    old->drop_name();
    old->unref();
  }
}

SocketRef FdTable::remove(int fd) {
  if (fd < 0 || static_cast<size_t>(fd) >= capacity_) return {};
  Socket* old = slots_[fd].exchange(nullptr, std::memory_order_acq_rel);
  if (old) old->drop_name();
  return SocketRef(old);
}

void FdTable::reset_watch_locks_after_fork() {
  int top = max_fd_.load(std::memory_order_relaxed);
  for (int fd = 0; fd <= top && size_t(fd) < capacity_; fd++)
    if (Socket* s = slots_[fd].load(std::memory_order_relaxed))
      s->watch_lock.store(false, std::memory_order_relaxed);
}

int FdTable::next_tracked(unsigned lo, unsigned hi) const {
  if (lo >= capacity_ || lo > hi) return -1;
  size_t end = hi < capacity_ ? static_cast<size_t>(hi) + 1 : capacity_;
  for (size_t fd = lo; fd < end; fd++)
    if (slots_[fd].load(std::memory_order_relaxed)) return static_cast<int>(fd);
  return -1;
}

void FdTable::remove_range(unsigned lo, unsigned hi) {
  if (lo >= capacity_) return;
  size_t end = hi < capacity_ ? static_cast<size_t>(hi) + 1 : capacity_;
  for (size_t fd = lo; fd < end; fd++) {
    // Only touch slots that are set: reading a never-used page maps the zero
    // page, which costs nothing, but writing would allocate memory.
    if (slots_[fd].load(std::memory_order_relaxed)) remove(static_cast<int>(fd));
  }
}

}  // namespace rsock::socket
