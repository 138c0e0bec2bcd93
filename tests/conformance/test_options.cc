// Socket options, fcntl and ioctl.
#include <doctest/doctest.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/time.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <vector>

#include <chrono>
#include <future>
#include <thread>

#include "helpers.h"

using namespace conf;

TEST_CASE("options: SO_RCVTIMEO makes a blocking read fail with EAGAIN after the timeout") {
  Pair p = connected_pair();
  timeval tv{0, 200000};
  REQUIRE(setsockopt(p.server, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0);
  timeval back{};
  socklen_t len = sizeof back;
  REQUIRE(getsockopt(p.server, SOL_SOCKET, SO_RCVTIMEO, &back, &len) == 0);
  CHECK(back.tv_sec == 0);
  CHECK(back.tv_usec >= 190000);
  CHECK(back.tv_usec <= 210000);
  char b[8];
  int64_t t0 = now_ms();
  errno = 0;
  CHECK(read(p.server, b, sizeof b) == -1);
  int64_t took = now_ms() - t0;
  CHECK(errno == EAGAIN);
  CHECK(took >= 150);
  CHECK(took < 20 * 200 + 5000);
  // recv honours it too; data arriving before the timeout is returned.
  errno = 0;
  CHECK(recv(p.server, b, sizeof b, 0) == -1);
  CHECK(errno == EAGAIN);
  REQUIRE(write(p.client, "in-time", 7) == 7);
  CHECK(read_exact(p.server, b, 7) == 7);
  CHECK(memcmp(b, "in-time", 7) == 0);
  // Timeout 0 means block forever again: data sent a little later is received.
  timeval zero{0, 0};
  REQUIRE(setsockopt(p.server, SOL_SOCKET, SO_RCVTIMEO, &zero, sizeof zero) == 0);
  // Invalid tv_usec: EDOM.
  timeval bad{0, 2000000};
  errno = 0;
  CHECK(setsockopt(p.server, SOL_SOCKET, SO_RCVTIMEO, &bad, sizeof bad) == -1);
  CHECK(errno == EDOM);
}

// librsock keeps a socket's timeouts between blocking calls (a getsockopt
// per wait was a syscall per round trip): a change, also through a dup,
// must take effect at the next call, both ways.
TEST_CASE("options: a changed SO_RCVTIMEO applies to the next blocking read") {
  Pair p = connected_pair();
  char b = 0;
  auto write_later = [&](int ms) {
    return std::thread([&p, ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      (void)!write(p.client, "x", 1);
    });
  };
  // No timeout: the read waits for a byte that comes later.
  std::thread w = write_later(100);
  CHECK(read(p.server, &b, 1) == 1);
  w.join();
  // Now 150 ms, set through a dup (the same socket): the read times out.
  Fd d(dup(p.server));
  timeval tv{0, 150000};
  REQUIRE(setsockopt(d, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0);
  w = write_later(3000);  // (ends the read if the timeout were lost)
  int64_t t0 = now_ms();
  errno = 0;
  ssize_t r = read(p.server, &b, 1);
  CHECK(r == -1);
  CHECK(errno == EAGAIN);
  int64_t took = now_ms() - t0;
  CHECK(took >= 100);
  CHECK(took < 2500);
  w.join();
  if (r == -1) CHECK(read(p.server, &b, 1) == 1);  // the late byte
  // Back to none: a byte 400 ms later is read, no EAGAIN at 150 ms.
  timeval zero{0, 0};
  REQUIRE(setsockopt(p.server, SOL_SOCKET, SO_RCVTIMEO, &zero, sizeof zero) == 0);
  w = write_later(400);
  t0 = now_ms();
  CHECK(read(p.server, &b, 1) == 1);
  CHECK(now_ms() - t0 >= 300);
  w.join();
}

namespace {
// A blocking read of `fd` must fail with EAGAIN after about 150 ms (the
// socket's SO_RCVTIMEO); `peer` writes a byte after 3 s, or as soon as the
// read returned, so that a lost timeout shows as a late success, not a hang.
void check_read_times_out(int fd, int peer) {
  std::promise<void> returned;
  std::thread w([&peer, f = returned.get_future()] {
    f.wait_for(std::chrono::seconds(3));
    (void)!write(peer, "x", 1);
  });
  char b = 0;
  int64_t t0 = now_ms();
  errno = 0;
  ssize_t r = read(fd, &b, 1);
  int e = errno;
  int64_t took = now_ms() - t0;
  returned.set_value();
  w.join();
  CHECK(r == -1);
  CHECK(e == EAGAIN);
  CHECK(took >= 100);
  CHECK(took < 2500);
  // The byte written after it (waited for: the 150 ms bound still holds,
  // and the byte may take longer while librsock upgrades the connection).
  if (r == -1) {
    CHECK(wait_readable(fd));
    CHECK(read(fd, &b, 1) == 1);
  }
}
}  // namespace

// A connection to l: its accepted end's blocking read must time out.
static void check_accepted_read_times_out(const Listener& l) {
  Fd c(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(c >= 0);
  REQUIRE(connect(c, reinterpret_cast<const sockaddr*>(&l.addr), l.addr_len) == 0);
  Fd s(accept(l.fd, nullptr, nullptr));
  REQUIRE(s >= 0);
  check_read_times_out(s, c);
}

// The child pid ran to exit status 0.
static void require_exited_ok(pid_t pid) {
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
}

// librsock takes a socket's timeouts as none without asking the kernel only
// for one that socket() made with no setsockopt of either since (one
// syscall fewer per connection); the cases below are the ways around that.
// A fresh connection whose listener (on_listener) or client socket (before
// connect()) got a 150 ms SO_RCVTIMEO.
static Pair pair_with_rcvtimeo(bool on_listener) {
  Listener l = make_listener();
  Pair p;
  p.client = Fd(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(p.client >= 0);
  timeval tv{0, 150000};
  REQUIRE(setsockopt(on_listener ? int(l.fd) : int(p.client), SOL_SOCKET, SO_RCVTIMEO, &tv,
                     sizeof tv) == 0);
  REQUIRE(connect(p.client, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);
  p.server = Fd(accept(l.fd, nullptr, nullptr));
  REQUIRE(p.server >= 0);
  return p;
}

TEST_CASE("options: an accepted socket has the SO_RCVTIMEO its listener had") {
  Pair p = pair_with_rcvtimeo(true);
  check_read_times_out(p.server, p.client);
}

TEST_CASE("options: SO_RCVTIMEO set before connect() bounds the connection's reads") {
  Pair p = pair_with_rcvtimeo(false);
  check_read_times_out(p.client, p.server);
}

// The listener is shared with a fork child, which sets the timeout: the
// parent's accepted socket has it (librsock cannot see the child's
// setsockopt, so it must not take what it knew before the fork as known).
TEST_CASE("options: SO_RCVTIMEO set on a listener by a fork child holds for the parent's accepts") {
  Listener l = make_listener();
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    timeval tv{0, 150000};
    _exit(setsockopt(l.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0 ? 0 : 1);
  }
  require_exited_ok(pid);
  check_accepted_read_times_out(l);
}

// The same through posix_spawn: the spawned program (this binary in a mode
// of its own, main.cc) sets the timeout on the listener it inherits.
TEST_CASE("options: SO_RCVTIMEO set on a listener by a spawned program holds for our accepts") {
  Listener l = make_listener();
  posix_spawn_file_actions_t fa;
  REQUIRE(posix_spawn_file_actions_init(&fa) == 0);
  REQUIRE(posix_spawn_file_actions_adddup2(&fa, l.fd, 3) == 0);
  const char* argv[] = {"rsock_conformance", "--rcvtimeo-fd3", nullptr};
  pid_t pid = -1;
  int sr = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, const_cast<char* const*>(argv), environ);
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE(sr == 0);
  require_exited_ok(pid);
  check_accepted_read_times_out(l);
}

TEST_CASE("options: SO_SNDTIMEO bounds a blocking write into a full socket") {
  Pair p = connected_pair();
  // Small buffers so the socket fills quickly.
  int sz = 16384;
  setsockopt(p.client, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  setsockopt(p.server, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
  timeval tv{0, 200000};
  REQUIRE(setsockopt(p.client, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) == 0);
  timeval back{};
  socklen_t len = sizeof back;
  REQUIRE(getsockopt(p.client, SOL_SOCKET, SO_SNDTIMEO, &back, &len) == 0);
  CHECK(back.tv_usec >= 190000);
  CHECK(back.tv_usec <= 210000);

  std::vector<uint8_t> chunk(1 << 20);
  // The peer never reads: each write either returns a short count (timed out
  // after a partial write) or -1/EAGAIN (timed out before anything went out).
  // Each write carries the pattern at its stream offset, so the check below
  // holds whatever the write sizes were (a stack with more buffering, e.g. a
  // library that moves the stream elsewhere, may accept more after a short
  // write).
  uint64_t total = 0;
  bool timed_out = false;
  int64_t last_took = 0;
  for (int i = 0; i < 512 && !timed_out; ++i) {
    fill_pattern(chunk.data(), chunk.size(), total, 31);
    int64_t t0 = now_ms();
    ssize_t r = write(p.client, chunk.data(), chunk.size());
    last_took = now_ms() - t0;
    if (r < 0) {
      REQUIRE_MESSAGE(errno == EAGAIN, errno_str(errno));
      timed_out = true;
    } else {
      total += static_cast<uint64_t>(r);
    }
  }
  REQUIRE(timed_out);
  CHECK(last_took >= 150);
  CHECK(total > 0);
  // Everything that write() accepted arrives (written bytes are not lost on timeout).
  set_nonblocking(p.server, true);
  std::vector<uint8_t> in(total);
  CHECK(read_exact(p.server, in.data(), in.size()) == total);
  REQUIRE(check_pattern(in.data(), in.size(), 0, 31) == in.size());
}

TEST_CASE("options: TCP_NODELAY get/set and other common options") {
  Pair p = connected_pair();
  int v = -1;
  socklen_t len = sizeof v;
  REQUIRE(getsockopt(p.client, IPPROTO_TCP, TCP_NODELAY, &v, &len) == 0);
  CHECK(len == sizeof(int));
  CHECK(v == 0);
  int one = 1;
  REQUIRE(setsockopt(p.client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0);
  v = 0;
  REQUIRE(getsockopt(p.client, IPPROTO_TCP, TCP_NODELAY, &v, &len) == 0);
  CHECK(v != 0);
  int zero = 0;
  REQUIRE(setsockopt(p.client, IPPROTO_TCP, TCP_NODELAY, &zero, sizeof zero) == 0);
  REQUIRE(getsockopt(p.client, IPPROTO_TCP, TCP_NODELAY, &v, &len) == 0);
  CHECK(v == 0);

  // SO_TYPE / SO_DOMAIN / SO_PROTOCOL / SO_ACCEPTCONN.
  REQUIRE(getsockopt(p.client, SOL_SOCKET, SO_TYPE, &v, &len) == 0);
  CHECK(v == SOCK_STREAM);
  REQUIRE(getsockopt(p.client, SOL_SOCKET, SO_DOMAIN, &v, &len) == 0);
  CHECK(v == AF_INET);
  REQUIRE(getsockopt(p.client, SOL_SOCKET, SO_PROTOCOL, &v, &len) == 0);
  CHECK(v == IPPROTO_TCP);
  REQUIRE(getsockopt(p.client, SOL_SOCKET, SO_ACCEPTCONN, &v, &len) == 0);
  CHECK(v == 0);
  // SO_KEEPALIVE round-trips.
  REQUIRE(setsockopt(p.client, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one) == 0);
  REQUIRE(getsockopt(p.client, SOL_SOCKET, SO_KEEPALIVE, &v, &len) == 0);
  CHECK(v == 1);
  // Buffer sizes are positive and settable (Linux doubles the request).
  REQUIRE(getsockopt(p.client, SOL_SOCKET, SO_SNDBUF, &v, &len) == 0);
  CHECK(v > 0);
  int want = 65536;
  REQUIRE(setsockopt(p.client, SOL_SOCKET, SO_RCVBUF, &want, sizeof want) == 0);
  REQUIRE(getsockopt(p.client, SOL_SOCKET, SO_RCVBUF, &v, &len) == 0);
  CHECK(v == 2 * want);
  // Unknown option: ENOPROTOOPT; not a socket: ENOTSOCK.
  errno = 0;
  CHECK(getsockopt(p.client, SOL_SOCKET, 12345, &v, &len) == -1);
  CHECK(errno == ENOPROTOOPT);
  Fd nul(open("/dev/null", O_RDONLY));
  errno = 0;
  CHECK(getsockopt(nul, SOL_SOCKET, SO_TYPE, &v, &len) == -1);
  CHECK(errno == ENOTSOCK);
  // TCP_NODELAY still transfers data correctly.
  REQUIRE(setsockopt(p.client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0);
  for (int i = 0; i < 100; ++i) REQUIRE(write(p.client, &i, sizeof i) == sizeof i);
  int got[100];
  REQUIRE(read_exact(p.server, got, sizeof got) == sizeof got);
  for (int i = 0; i < 100; ++i) CHECK(got[i] == i);
}

// librsock pushes each switch record out by setting TCP_NODELAY for a
// moment (util/sys.h push_unsent): what the program set before the switch
// must read back the same after it, and corked bytes still arrive whole.
TEST_CASE("options: TCP_NODELAY and TCP_CORK set before the switch read back unchanged") {
  Pair p = connected_pair(AF_INET, /*await_upgrade=*/false);
  int one = 1, v = -1;
  socklen_t len = sizeof v;
  REQUIRE(setsockopt(p.client, IPPROTO_TCP, TCP_CORK, &one, sizeof one) == 0);
  REQUIRE(setsockopt(p.server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0);
  if (expect_rdma()) await_rdma(p);
  REQUIRE(getsockopt(p.client, IPPROTO_TCP, TCP_NODELAY, &v, &len) == 0);
  CHECK(v == 0);
  REQUIRE(getsockopt(p.client, IPPROTO_TCP, TCP_CORK, &v, &len) == 0);
  CHECK(v != 0);
  REQUIRE(getsockopt(p.server, IPPROTO_TCP, TCP_NODELAY, &v, &len) == 0);
  CHECK(v != 0);
  REQUIRE(getsockopt(p.server, IPPROTO_TCP, TCP_CORK, &v, &len) == 0);
  CHECK(v == 0);
  for (int i = 0; i < 100; ++i) REQUIRE(write(p.client, &i, sizeof i) == sizeof i);
  int zero = 0;
  REQUIRE(setsockopt(p.client, IPPROTO_TCP, TCP_CORK, &zero, sizeof zero) == 0);
  int got[100];
  REQUIRE(read_exact(p.server, got, sizeof got) == sizeof got);
  for (int i = 0; i < 100; ++i) CHECK(got[i] == i);
  REQUIRE(write(p.server, got, sizeof got) == sizeof got);
  REQUIRE(read_exact(p.client, got, sizeof got) == sizeof got);
  CHECK(got[99] == 99);
}

TEST_CASE("fcntl: O_NONBLOCK and FD_CLOEXEC") {
  Pair p = connected_pair();
  int fl = fcntl(p.server, F_GETFL);
  REQUIRE(fl >= 0);
  CHECK((fl & O_ACCMODE) == O_RDWR);
  CHECK_FALSE((fl & O_NONBLOCK));
  REQUIRE(fcntl(p.server, F_SETFL, fl | O_NONBLOCK) == 0);
  CHECK((fcntl(p.server, F_GETFL) & O_NONBLOCK));
  char b[4];
  errno = 0;
  CHECK(read(p.server, b, sizeof b) == -1);
  CHECK(errno == EAGAIN);
  errno = 0;
  CHECK(recv(p.server, b, sizeof b, 0) == -1);
  CHECK(errno == EAGAIN);
  REQUIRE(fcntl(p.server, F_SETFL, fl) == 0);
  CHECK_FALSE((fcntl(p.server, F_GETFL) & O_NONBLOCK));

  CHECK(fcntl(p.server, F_GETFD) == 0);
  REQUIRE(fcntl(p.server, F_SETFD, FD_CLOEXEC) == 0);
  CHECK(fcntl(p.server, F_GETFD) == FD_CLOEXEC);
  CHECK_FALSE((fcntl(p.server, F_GETFL) & O_NONBLOCK));  // fd flag, not status flag
  REQUIRE(fcntl(p.server, F_SETFD, 0) == 0);
  CHECK(fcntl(p.server, F_GETFD) == 0);

  // Blocking again: a read waits for data sent later.
  REQUIRE(write(p.client, "ok", 2) == 2);
  CHECK(read_exact(p.server, b, 2) == 2);
  // Socket created with SOCK_NONBLOCK|SOCK_CLOEXEC shows both.
  Fd s(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  CHECK((fcntl(s, F_GETFL) & O_NONBLOCK));
  CHECK(fcntl(s, F_GETFD) == FD_CLOEXEC);
}

TEST_CASE("ioctl: FIONBIO toggles nonblocking mode, visible through fcntl") {
  Pair p = connected_pair();
  int on = 1;
  REQUIRE(ioctl(p.server, FIONBIO, &on) == 0);
  CHECK((fcntl(p.server, F_GETFL) & O_NONBLOCK));
  char b[4];
  errno = 0;
  CHECK(read(p.server, b, sizeof b) == -1);
  CHECK(errno == EAGAIN);
  int off = 0;
  REQUIRE(ioctl(p.server, FIONBIO, &off) == 0);
  CHECK_FALSE((fcntl(p.server, F_GETFL) & O_NONBLOCK));
  // Blocking read now waits for data that comes later.
  timeval tv{0, 100000};
  REQUIRE(setsockopt(p.server, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0);
  int64_t t0 = now_ms();
  CHECK(read(p.server, b, sizeof b) == -1);
  CHECK(now_ms() - t0 >= 70);
}

TEST_CASE("ioctl: FIONREAD reports the exact number of queued bytes") {
  Pair p = connected_pair();
  int n = -1;
  REQUIRE(ioctl(p.server, FIONREAD, &n) == 0);
  CHECK(n == 0);
  const int kBytes = 12345;
  std::vector<uint8_t> out(kBytes);
  fill_pattern(out.data(), out.size(), 0, 41);
  REQUIRE(write_all(p.client, out.data(), out.size()) == out.size());
  // Wait until it has all arrived.
  int64_t deadline = now_ms() + timeout_ms();
  while (now_ms() < deadline) {
    REQUIRE(wait_readable(p.server));
    REQUIRE(ioctl(p.server, FIONREAD, &n) == 0);
    if (n >= kBytes) break;
    usleep(1000);
  }
  CHECK(n == kBytes);
  std::vector<uint8_t> in(kBytes);
  REQUIRE(read(p.server, in.data(), 1000) == 1000);
  REQUIRE(ioctl(p.server, FIONREAD, &n) == 0);
  CHECK(n == kBytes - 1000);
  // MSG_PEEK does not change it.
  REQUIRE(recv(p.server, in.data() + 1000, 10, MSG_PEEK) == 10);
  REQUIRE(ioctl(p.server, FIONREAD, &n) == 0);
  CHECK(n == kBytes - 1000);
  REQUIRE(read_exact(p.server, in.data() + 1000, kBytes - 1000) == kBytes - 1000);
  CHECK(check_pattern(in.data(), in.size(), 0, 41) == in.size());
  REQUIRE(ioctl(p.server, FIONREAD, &n) == 0);
  CHECK(n == 0);
  // TIOCOUTQ (SIOCOUTQ): 0 once everything is acknowledged.
  deadline = now_ms() + timeout_ms();
  int outq = -1;
  while (now_ms() < deadline) {
    REQUIRE(ioctl(p.client, TIOCOUTQ, &outq) == 0);
    if (outq == 0) break;
    usleep(1000);
  }
  CHECK(outq == 0);
}
