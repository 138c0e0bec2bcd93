// rsock_kernel_mix ADDR: an epoll set whose registrations are all upgraded
// skips its look at the kernel instance while user-space events are ready
// (readiness.cc, kernel_empty); a plain fd added to that instance, by this
// process or by a fork child that shares it, must still be reported with
// them, in the same epoll_wait; and a set that holds a listening socket
// reports it with the upgraded socket as soon as a connection waits. Run
// preloaded inside the RDMA VM (ctest sets LD_PRELOAD); exit 77 "SKIP"
// without an RDMA device. The same program runs without librsock (the
// conformance of the answers).
#include <poll.h>
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

  // 3. A set that holds a kernel registration from the start (a server's
  // listening socket) beside the upgraded socket, which stays due: the
  // listener is reported with the socket once a connection waits on it, and
  // never before; also once the set is polled (watched). A guard for any
  // round that skips its look at the kernel instance.
  int ep3 = epoll_create1(0);
  ev.data.u64 = 5;
  CHECK(epoll_ctl(ep3, EPOLL_CTL_ADD, s, &ev) == 0, "epoll_ctl s (3)");
  ev.data.u64 = 6;
  CHECK(epoll_ctl(ep3, EPOLL_CTL_ADD, pair.listener, &ev) == 0, "epoll_ctl listener (3)");
  CHECK(wait_for(ep3, 1) == 1, "epoll_wait (3): s alone not reported once");
  for (int i = 0; i < 20; i++) {
    n = epoll_wait(ep3, out, 8, 0);
    CHECK(n == 1 && out[0].data.u64 == 5, "epoll_wait (3): %d events before any connection", n);
  }
  int extra = socket(AF_INET, SOCK_STREAM, 0);
  CHECK(extra >= 0 && connect(extra, reinterpret_cast<sockaddr*>(&pair.addr), sizeof pair.addr) == 0,
        "connect (3)");
  n = wait_for(ep3, 2);
  CHECK(n == 2, "epoll_wait (3): %d events, expected the socket and the listener", n);
  n = epoll_wait(ep3, out, 8, 0);
  CHECK(n == 2, "epoll_wait (3): %d events, expected the socket and the listener again", n);
  pollfd pf{ep3, POLLIN, 0};
  CHECK(poll(&pf, 1, 0) == 1, "poll of the epoll fd (3)");
  n = epoll_wait(ep3, out, 8, 0);
  CHECK(n == 2, "epoll_wait (3), polled: %d events, expected the socket and the listener", n);
  int acc = accept(pair.listener, nullptr, nullptr);
  CHECK(acc >= 0, "accept (3)");
  n = epoll_wait(ep3, out, 8, 0);
  CHECK(n == 1 && out[0].data.u64 == 5, "epoll_wait (3): %d events after the accept", n);
  close(acc);
  close(extra);
  close(ep3);

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
