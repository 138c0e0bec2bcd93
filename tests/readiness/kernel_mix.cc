// rsock_kernel_mix ADDR: an epoll set whose registrations are all upgraded
// skips its look at the kernel instance while user-space events are ready
// (readiness.cc, kernel_empty); a plain fd added to that instance, by this
// process or by a fork child that shares it, must still be reported with
// them, in the same epoll_wait. Run preloaded inside the RDMA VM (ctest sets
// LD_PRELOAD); exit 77 "SKIP" without an RDMA device. The same program runs
// without librsock (the conformance of the answers: 1, then 2 events).
#include <sys/epoll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "tests/common/inprocess_pair.h"

using namespace inprocess;

namespace {
// epoll_wait(ep, ..., 0) until `want` events or 2 s: a pipe write is seen
// by the kernel at once, an RDMA byte within microseconds.
int wait_for(int ep, int want) {
  epoll_event out[8];
  int n = 0;
  for (int i = 0; i < 2000 && n < want; i++) {
    n = epoll_wait(ep, out, 8, 0);
    if (n < want) usleep(1000);
  }
  return n;
}
}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const char* addr = argc > 1 ? argv[1] : "10.77.0.1";
  const bool plain = getenv("LD_PRELOAD") == nullptr;
  if (!plain) skip_without_device();
  Pair pair = connect_to_self(addr);
  const int c = pair.client, s = pair.server;
  if (!plain) await_rdma(c, s);
  char byte = 'x';
  CHECK(write(c, &byte, 1) == 1, "write");  // s stays readable: never read

  // 1. This process adds a pipe to a set that held only the upgraded socket.
  int ep = epoll_create1(0);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 1;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev) == 0, "epoll_ctl s");
  CHECK(wait_for(ep, 1) == 1, "epoll_wait: s alone not reported once");
  int p[2];
  CHECK(pipe(p) == 0, "pipe");
  ev.data.u64 = 2;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, p[0], &ev) == 0, "epoll_ctl pipe");
  CHECK(write(p[1], &byte, 1) == 1, "write pipe");
  epoll_event out[8];
  int n = epoll_wait(ep, out, 8, 0);
  CHECK(n == 2, "epoll_wait: %d events, expected the socket and the pipe in one call", n);

  // 2. A fork child adds a pipe to the kernel instance it shares with us.
  int ep2 = epoll_create1(0);
  ev.data.u64 = 3;
  CHECK(epoll_ctl(ep2, EPOLL_CTL_ADD, s, &ev) == 0, "epoll_ctl s (2)");
  CHECK(wait_for(ep2, 1) == 1, "epoll_wait (2): s alone not reported once");
  int q[2];
  CHECK(pipe(q) == 0, "pipe (2)");
  pid_t child = fork();
  CHECK(child >= 0, "fork");
  if (child == 0) {
    epoll_event cev{};
    cev.events = EPOLLIN;
    cev.data.u64 = 4;
    int ok = epoll_ctl(ep2, EPOLL_CTL_ADD, q[0], &cev) == 0 && write(q[1], &byte, 1) == 1;
    _exit(ok ? 0 : 1);
  }
  int st = 0;
  CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0, "child failed");
  // (The fork switched the connection back to TCP while two processes held
  // it; with the child gone it upgrades again, and the set's registration
  // is in user space once more: the case to test.)
  if (!plain) await_rdma(c, s);
  n = wait_for(ep2, 2);
  CHECK(n == 2, "epoll_wait (2): %d events, expected the socket and the child's pipe", n);
  n = epoll_wait(ep2, out, 8, 0);
  CHECK(n == 2, "epoll_wait (2): %d events, expected the socket and the child's pipe", n);
  if (!plain)
    CHECK(transport_of(s) == RSOCK_TRANSPORT_RDMA, "fell back meanwhile: not tested on RDMA");
  std::printf("kernel_mix: PASS (%s)\n", plain ? "plain" : "librsock");
  return 0;
}
