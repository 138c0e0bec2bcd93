#include "socket/backlog.h"

#include <sys/mman.h>
#include <sys/socket.h>

#include <cerrno>
#include <new>

#include "util/sys.h"

namespace rsock::socket {

Backlog* Backlog::create(size_t n) {
  size_t bytes = (sizeof(Backlog) + n + 4095) & ~size_t{4095};
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  auto* b = new (p) Backlog();
  b->len_ = n;
  b->map_bytes_ = bytes;
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  // A process that dies while flushing must not leave the other one stuck.
  pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&b->mu_, &a);
  pthread_mutexattr_destroy(&a);
  return b;
}

void Backlog::release(Backlog* b) {
  if (b != nullptr) munmap(b, b->map_bytes_);
}

bool Backlog::flush(int fd, int* err) {
  *err = 0;
  if (empty()) return true;
  int r = pthread_mutex_lock(&mu_);
  if (r == EOWNERDEAD) pthread_mutex_consistent(&mu_);
  uint64_t off = off_.load(std::memory_order_relaxed);
  while (off < len_) {
    ssize_t k = sys::libc.send(fd, data_ + off, len_ - off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k > 0) {
      off += uint64_t(k);
      // At once: a process killed in this loop must not leave bytes that
      // went out counted as pending (the other would send them again).
      off_.store(off, std::memory_order_release);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) break;
    *err = k < 0 ? errno : EPIPE;
    off = len_;  // the peer is gone: nothing more can reach it
  }
  off_.store(off, std::memory_order_release);
  pthread_mutex_unlock(&mu_);
  return off == len_;
}

}  // namespace rsock::socket
