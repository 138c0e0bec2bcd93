// rsock_noalloc ADDR: poll, ppoll, select and epoll_wait over upgraded
// sockets allocate nothing on the heap per call (issue 11: the emulation
// reuses per-thread buffers). Run preloaded inside the RDMA VM (ctest sets
// LD_PRELOAD); exit 77 "SKIP" without an RDMA device.
//
// The program defines malloc and friends itself. The executable comes first
// in symbol lookup, so librsock's allocations (and operator new's) land here
// and are counted while a measured loop runs, then forwarded to glibc.
// One in-process connection upgrades (both ends in this process, checked with
// SOL_RSOCK); after a warm-up round, every waiting call of 200 more rounds,
// ready and not ready, with and without sleeping, must allocate nothing.
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "tests/common/inprocess_pair.h"

extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
void __libc_free(void*);
}

namespace {
// Counted on the measuring thread only: librsock's progress thread has its
// own work (timers, stats) that is not a waiting call's.
thread_local bool t_counting = false;
long g_allocs = 0;
void count() {
  if (t_counting) g_allocs++;
}
}  // namespace

extern "C" {
void* malloc(size_t n) {
  count();
  return __libc_malloc(n);
}
void* calloc(size_t a, size_t b) {
  count();
  return __libc_calloc(a, b);
}
void* realloc(void* p, size_t n) {
  count();
  return __libc_realloc(p, n);
}
void* memalign(size_t a, size_t n) {
  count();
  return __libc_memalign(a, n);
}
void* aligned_alloc(size_t a, size_t n) {
  count();
  return __libc_memalign(a, n);
}
int posix_memalign(void** out, size_t a, size_t n) {
  count();
  void* p = __libc_memalign(a, n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
void free(void* p) { __libc_free(p); }
}

using namespace inprocess;

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const char* addr = argc > 1 ? argv[1] : "10.77.0.1";
  skip_without_device();
  Pair pair = connect_to_self(addr);
  const int c = pair.client, s = pair.server;
  CHECK(s < FD_SETSIZE && c < FD_SETSIZE, "fds %d %d past FD_SETSIZE", c, s);
  await_rdma(c, s);
  char byte = 'x';
  CHECK(write(c, &byte, 1) == 1, "write");
  int ep = epoll_create1(0);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = s;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev) == 0, "epoll_ctl");
  ev.data.fd = c;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev) == 0, "epoll_ctl");

  // One round: s is readable (one unread byte), c is not.
  long calls = 0;
  auto round = [&] {
    pollfd p[2] = {{s, POLLIN, 0}, {c, POLLIN, 0}};
    CHECK(poll(p, 2, 0) == 1 && (p[0].revents & POLLIN), "poll: s not readable");
    pollfd q{c, POLLIN, 0};
    CHECK(poll(&q, 1, 2) == 0, "poll: c readable");  // sleeps 2 ms
    timespec z{0, 0};
    CHECK(ppoll(p, 2, &z, nullptr) == 1, "ppoll");
    fd_set r;
    FD_ZERO(&r);
    FD_SET(s, &r);
    FD_SET(c, &r);
    timeval tv{0, 0};
    CHECK(select((s > c ? s : c) + 1, &r, nullptr, nullptr, &tv) == 1 && FD_ISSET(s, &r), "select");
    FD_ZERO(&r);
    FD_SET(c, &r);
    tv = {0, 2000};
    CHECK(select(c + 1, &r, nullptr, nullptr, &tv) == 0, "select: c readable");
    epoll_event out[4];
    CHECK(epoll_wait(ep, out, 4, 0) == 1 && out[0].data.fd == s, "epoll_wait");
    CHECK(epoll_wait(ep, out, 4, 2) == 1, "epoll_wait (2 ms)");
    calls += 7;
  };
  round();  // warm-up: per-thread buffers grow here, once
  calls = 0;
  g_allocs = 0;
  t_counting = true;
  for (int i = 0; i < 200; i++) round();
  t_counting = false;
  long n = g_allocs;
  std::printf("noalloc: %ld waiting calls over upgraded sockets, %ld heap allocations\n", calls, n);
  CHECK(transport_of(c) == RSOCK_TRANSPORT_RDMA && transport_of(s) == RSOCK_TRANSPORT_RDMA,
        "fell back meanwhile: not measured on RDMA");
  CHECK(n == 0, "%ld heap allocations in %ld calls", n, calls);
  std::printf("noalloc: PASS\n");
  return 0;
}
