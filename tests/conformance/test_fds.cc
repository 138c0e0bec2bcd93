// fd numbers: a program under librsock gets the numbers it would get without
// it. The kernel hands out the lowest free number, so this holds exactly when
// none of librsock's own fds (per upgraded connection: event channels, timer,
// epoll, eventfd, a reference to the TCP socket; per process: device and
// progress fds) sits in the program's part of the fd space. Over rxe
// (upgrade.conformance) every pair below is on RDMA before the check.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <vector>

#include "helpers.h"
#include "preload/librsock.h"

using namespace conf;

namespace {

// Everything below the upper half of the fd space (librsock keeps its fds
// up there, util/owned_fds.h).
int program_range() {
  rlimit rl{};
  long top = 65536;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) top = std::min<long>(top, long(rl.rlim_cur));
  return int(top / 2);
}

std::set<int> open_below(int limit) {
  std::set<int> s;
  for (int fd = 0; fd < limit; fd++)
    if (fcntl(fd, F_GETFD) >= 0) s.insert(fd);
  return s;
}

// Until no end of `pairs` is still upgrading (all on RDMA or on TCP).
void await_settled(const std::vector<Pair>& pairs) {
  for (int64_t end = now_ms() + timeout_ms(); now_ms() < end;) {
    int busy = 0;
    for (auto& pr : pairs)
      for (int fd : {pr.client.get(), pr.server.get()}) {
        int t = -1;
        socklen_t len = sizeof t;
        busy += getsockopt(fd, SOL_RSOCK, RSOCK_TRANSPORT, &t, &len) == 0 && t == RSOCK_TRANSPORT_UPGRADING;
      }
    if (!busy) break;
    usleep(10000);
  }
}

}  // namespace

TEST_CASE("fd numbers: no fd of the program's range is taken by anyone but the program") {
  int range = program_range();
  std::set<int> before = open_below(range);
  std::vector<Fd> mine;
  std::set<int> got;
  auto take = [&](int fd) {
    REQUIRE_MESSAGE(fd >= 0, "allocation failed: " << errno);
    got.insert(fd);
    mine.emplace_back(fd);
    return fd;
  };
  std::vector<Pair> pairs;
  for (int i = 0; i < 3; i++) {
    pairs.push_back(connected_pair());  // upgraded at both ends over rxe
    got.insert(pairs.back().client.get());
    got.insert(pairs.back().server.get());
  }
  int p[2];
  REQUIRE(pipe(p) == 0);
  take(p[0]);
  take(p[1]);
  take(open("/dev/null", O_RDONLY | O_CLOEXEC));
  take(eventfd(0, EFD_CLOEXEC));
  int ep = take(epoll_create1(EPOLL_CLOEXEC));
  for (auto& pr : pairs) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT;
    ev.data.fd = pr.client.get();
    REQUIRE(epoll_ctl(ep, EPOLL_CTL_ADD, pr.client.get(), &ev) == 0);
  }
  epoll_event evs[8];
  // Writable: the emulated sets are built by now. A pair still switching
  // (conformance.rxe_same does not await upgrades) holds its writes for the
  // moment of the switch, so wait rather than ask once.
  int ready = 0;
  for (int64_t end = now_ms() + timeout_ms(); ready < 3 && now_ms() < end;) ready = epoll_wait(ep, evs, 8, 100);
  CHECK(ready >= 3);
  take(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  pairs.push_back(connected_pair());
  got.insert(pairs.back().client.get());
  got.insert(pairs.back().server.get());
  // librsock creates an fd where the kernel puts it and moves it up at once:
  // a scan while an upgrade is still setting up may see one in between. Look
  // once every pair is settled (RDMA or TCP), as a program's next open would.
  await_settled(pairs);

  std::set<int> now = open_below(range);
  std::vector<int> foreign;
  for (int fd : now)
    if (!before.count(fd) && !got.count(fd)) foreign.push_back(fd);
  std::string list;
  for (int fd : foreign) list += " " + std::to_string(fd);
  CHECK_MESSAGE(foreign.empty(), "fds below " << range << " the program did not open:" << list);
}

TEST_CASE("fd numbers: closing every fd the program did not open leaves its connections working") {
  Pair pr = connected_pair();  // upgraded over rxe
  // A daemon's "close everything above what I opened": close_range to the
  // end of the fd space, and close() one by one over the program's range.
  std::set<int> mine = open_below(program_range());
  int top = *mine.rbegin();
  REQUIRE(close_range(unsigned(top) + 1, ~0u, 0) == 0);
  for (int fd = top + 1; fd < 4096; fd++) close(fd);
  const char msg[] = "still here";
  REQUIRE(write(pr.client, msg, sizeof msg) == ssize_t(sizeof msg));
  char buf[sizeof msg] = {};
  size_t n = 0;
  while (n < sizeof msg) {
    ssize_t r = read(pr.server, buf + n, sizeof msg - n);
    REQUIRE(r > 0);
    n += size_t(r);
  }
  CHECK(std::string(buf) == msg);
}

// The kernel hands a closed number to the next fd anyone in the process
// creates. A program that closes a number and then expects EBADF for it, or
// expects its next socket() to get it back, sees something else if librsock
// creates an fd in a background thread at that moment (before moving it up).
// Connections on RDMA must cost no such fd in steady state: the progress
// thread's periodic work (the port counters it reads every 250 ms) opens
// nothing. Probed for 1.5 s, several of those periods.
TEST_CASE("fd numbers: while connections are open, a number the program freed stays free") {
  std::vector<Pair> pairs;
  for (int i = 0; i < 2; i++) pairs.push_back(connected_pair());
  await_settled(pairs);
  int seen = -1;
  long probes = 0;
  char b = 'x';
  for (int64_t end = now_ms() + 1500; seen < 0 && now_ms() < end;) {
    int lo = dup(pairs[0].client);
    REQUIRE(lo >= 0);
    REQUIRE(close(lo) == 0);
    for (int i = 0; i < 200 && seen < 0; i++, probes++)
      if (fcntl(lo, F_GETFD) >= 0) seen = lo;
    // Keep the streams moving bytes (busy, as the path check sees them).
    for (auto& pr : pairs) {
      REQUIRE(write(pr.client, &b, 1) == 1);
      REQUIRE(read_exact(pr.server, &b, 1) == 1);
    }
  }
  CHECK_MESSAGE(seen < 0, "fd " << seen << " was opened by someone else after " << probes
                                << " looks at the number the program had just closed");
}

// The same in a fresh process image (a fork child sets up its own verbs
// context, completion channel and counter files at its first connection),
// probed while that first connection is still upgrading: librsock creates
// what it needs from the connect()/accept() calls themselves, in the
// program's thread, and its background work after them creates no fd.
TEST_CASE("fd numbers: a fork child's first connections upgrade without taking a number it freed") {
  Pair before = connected_pair();  // the parent has set its devices up
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::vector<Pair> pairs;
    for (int i = 0; i < 2; i++) pairs.push_back(connected_pair(AF_INET, /*await_upgrade=*/false));
    int seen = -1;
    for (int64_t end = now_ms() + 1500; seen < 0 && now_ms() < end;) {
      int lo = dup(pairs[0].client);
      if (lo < 0 || close(lo) != 0) _exit(3);
      for (int i = 0; i < 200 && seen < 0; i++)
        if (fcntl(lo, F_GETFD) >= 0) seen = lo;
    }
    _exit(seen < 0 ? 0 : 1);
  }
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);
  REQUIRE(WIFEXITED(st));
  CHECK_MESSAGE(WEXITSTATUS(st) == 0, "the child saw a number it had just closed taken by someone else");
}
