// Backlog: bytes a connection must write into its TCP socket before any new
// application byte, after the reverse switch (docs/DESIGN.md): what the peer
// never got or never consumed over RDMA, copied out of the send ring.
//
// It lives in a MAP_SHARED anonymous mapping with a process-shared mutex, so
// that a connection switched back at fork() has one backlog for parent and
// child: whichever process writes first flushes it, exactly once, and the
// other finds it empty. Each process unmaps its own mapping when it is done.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace rsock::socket {

class Backlog {
 public:
  // nullptr if the mapping cannot be made (ENOMEM).
  static Backlog* create(size_t n);
  static void release(Backlog* b);
  std::byte* data() { return data_; }
  size_t size() const { return len_; }
  // Writes what the (nonblocking) socket takes, under the shared lock.
  // Returns true once nothing is left, also when the socket failed (*err
  // then holds its errno: the peer is gone, the kernel reports the rest).
  bool flush(int fd, int* err);
  bool empty() const { return off_.load(std::memory_order_acquire) == len_; }

 private:
  Backlog() = default;
  pthread_mutex_t mu_;
  std::atomic<uint64_t> off_{0};
  uint64_t len_ = 0;
  size_t map_bytes_ = 0;
  std::byte data_[];
};

}  // namespace rsock::socket
