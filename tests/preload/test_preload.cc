// Properties of the hooks themselves, run with and without LD_PRELOAD:
// errno discipline, constructor-time use, untracked fds untouched, fork.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "preload/librsock.h"

extern int g_early_result;

namespace {

struct Pair {
  int l = -1, c = -1, s = -1;
  Pair() {
    l = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    REQUIRE(bind(l, reinterpret_cast<sockaddr*>(&a), len) == 0);
    REQUIRE(listen(l, 4) == 0);
    REQUIRE(getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    c = socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(connect(c, reinterpret_cast<sockaddr*>(&a), len) == 0);
    s = accept(l, nullptr, nullptr);
    REQUIRE(s >= 0);
  }
  ~Pair() {
    close(c);
    close(s);
    close(l);
  }
};

}  // namespace

TEST_CASE("a library constructor can use TCP before librsock is initialised") {
  CHECK(g_early_result == 0);
}

TEST_CASE("successful calls leave errno exactly as it was") {
  Pair p;
  char buf[16];
  errno = 4242;
  CHECK(write(p.c, "abc", 3) == 3);
  CHECK(errno == 4242);
  CHECK(read(p.s, buf, sizeof buf) == 3);
  CHECK(send(p.c, "x", 1, 0) == 1);
  CHECK(recv(p.s, buf, 1, 0) == 1);
  int one = 1;
  CHECK(setsockopt(p.c, IPPROTO_TCP, 1 /*TCP_NODELAY*/, &one, sizeof one) == 0);
  CHECK(fcntl(p.c, F_GETFL) >= 0);
  int d = dup(p.c);
  CHECK(d >= 0);
  CHECK(close(d) == 0);
  pollfd pf{p.c, POLLOUT, 0};
  CHECK(poll(&pf, 1, 0) == 1);
  int ep = epoll_create1(0);
  CHECK(ep >= 0);
  CHECK(close(ep) == 0);
  CHECK(errno == 4242);
}

TEST_CASE("failing calls report the kernel's errno") {
  Pair p;
  char b;
  errno = 0;
  CHECK(recv(p.c, &b, 1, MSG_DONTWAIT) == -1);
  CHECK(errno == EAGAIN);
  CHECK(read(-5, &b, 1) == -1);
  CHECK(errno == EBADF);
  CHECK(close(987654) == -1);
  CHECK(errno == EBADF);
  CHECK(dup2(p.c, -1) == -1);
  CHECK(errno == EBADF);
  CHECK(getsockopt(p.c, SOL_SOCKET, 999999, &b, nullptr) == -1);
}

TEST_CASE("non-TCP fds are untouched: pipes, UDP, UNIX") {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  CHECK(write(fds[1], "pipe", 4) == 4);
  char b[8] = {};
  CHECK(read(fds[0], b, sizeof b) == 4);
  CHECK(std::strcmp(b, "pipe") == 0);
  close(fds[0]);
  close(fds[1]);
  int sv[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  CHECK(send(sv[0], "u", 1, 0) == 1);
  CHECK(recv(sv[1], b, 1, 0) == 1);
  close(sv[0]);
  close(sv[1]);
  int u = socket(AF_INET, SOCK_DGRAM, 0);
  CHECK(u >= 0);
  close(u);
}

TEST_CASE("fork: both processes keep using inherited and new sockets") {
  Pair p;
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // Child: writes through the inherited socket and makes a new one.
    bool ok = write(p.c, "child", 5) == 5;
    int n = socket(AF_INET, SOCK_STREAM, 0);
    ok = ok && n >= 0 && close(n) == 0;
    _exit(ok ? 0 : 1);
  }
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);
  CHECK(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
  char b[8] = {};
  CHECK(recv(p.s, b, 5, MSG_WAITALL) == 5);
  CHECK(std::strcmp(b, "child") == 0);
  CHECK(write(p.c, "parent", 6) == 6);
  CHECK(recv(p.s, b, 6, MSG_WAITALL) == 6);
}

TEST_CASE("ioctl FIONBIO and FIONREAD pass through") {
  Pair p;
  int on = 1;
  CHECK(ioctl(p.s, FIONBIO, &on) == 0);
  char b;
  CHECK(read(p.s, &b, 1) == -1);
  CHECK(errno == EAGAIN);
  CHECK(write(p.c, "1234", 4) == 4);
  pollfd pf{p.s, POLLIN, 0};
  CHECK(poll(&pf, 1, 2000) == 1);
  int n = 0;
  CHECK(ioctl(p.s, FIONREAD, &n) == 0);
  CHECK(n == 4);
}

// An int option at SOL_RSOCK of a loopback pair: under librsock it answers
// (*value) with errno untouched, and a buffer of `short_len` bytes gets
// EINVAL, like the kernel's int options; the kernel alone does not know the
// level (EOPNOTSUPP). Returns whether librsock answered.
bool rsock_int_option(const Pair& p, int opt, int* value, socklen_t short_len) {
  const bool preloaded = getenv("LD_PRELOAD") && strstr(getenv("LD_PRELOAD"), "librsock");
  socklen_t len = sizeof *value;
  errno = 1234;
  int r = getsockopt(p.c, SOL_RSOCK, opt, value, &len);
  if (!preloaded) {
    CHECK(r == -1);
    CHECK(errno == EOPNOTSUPP);
    return false;
  }
  CHECK(r == 0);
  CHECK(len == sizeof(int));
  CHECK(errno == 1234);
  int v;
  len = short_len;
  CHECK(getsockopt(p.s, SOL_RSOCK, opt, &v, &len) == -1);
  CHECK(errno == EINVAL);
  return true;
}

TEST_CASE("getsockopt(SOL_RSOCK, RSOCK_TRANSPORT): tcp under librsock, EOPNOTSUPP without it") {
  // Loopback never upgrades, so under librsock the answer is "tcp".
  Pair p;
  int t = -1;
  if (rsock_int_option(p, RSOCK_TRANSPORT, &t, 2)) CHECK(t == RSOCK_TRANSPORT_TCP);
  // Not a TCP socket: the kernel answers in both cases.
  int u = socket(AF_INET, SOCK_DGRAM, 0);
  socklen_t len = sizeof t;
  CHECK(getsockopt(u, SOL_RSOCK, RSOCK_TRANSPORT, &t, &len) == -1);
  CHECK(errno == EOPNOTSUPP);
  close(u);
}

TEST_CASE("getsockopt(SOL_RSOCK, RSOCK_FALLBACK_REASON): an int under librsock, EOPNOTSUPP without it") {
  Pair p;
  int why = -1;
  if (rsock_int_option(p, RSOCK_FALLBACK_REASON, &why, 1)) {
    // Loopback is not eligible: no rendezvous was tried, nothing fell back.
    CHECK(why == 0);
    socklen_t len = sizeof why;
    CHECK(getsockopt(p.s, SOL_RSOCK, RSOCK_FALLBACK_REASON, nullptr, &len) == -1);
    CHECK(errno == EFAULT);
  }
}
