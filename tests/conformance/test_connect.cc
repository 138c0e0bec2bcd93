// Connection establishment: blocking/nonblocking connect, refusal, accept4
// flags, addresses, IPv6.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <unistd.h>

#include <string>

#include "helpers.h"

using namespace conf;

namespace {

bool same_addr(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    auto& x = reinterpret_cast<const sockaddr_in&>(a);
    auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  auto& x = reinterpret_cast<const sockaddr_in6&>(a);
  auto& y = reinterpret_cast<const sockaddr_in6&>(b);
  return x.sin6_port == y.sin6_port && memcmp(&x.sin6_addr, &y.sin6_addr, 16) == 0;
}

void exchange_hello(int a, int b) {
  const char msg[] = "hello, conformance";
  REQUIRE(write_all(a, msg, sizeof msg) == sizeof msg);
  char got[sizeof msg] = {};
  REQUIRE(read_exact(b, got, sizeof got) == sizeof got);
  CHECK(memcmp(got, msg, sizeof msg) == 0);
  REQUIRE(write_all(b, "pong", 4) == 4);
  char pong[4];
  REQUIRE(read_exact(a, pong, 4) == 4);
  CHECK(memcmp(pong, "pong", 4) == 0);
}

}  // namespace

TEST_CASE("connect: blocking connect, accept and data both ways") {
  Listener l = make_listener();
  Fd c(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(c >= 0);
  REQUIRE(connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);
  sockaddr_storage peer{};
  socklen_t plen = sizeof peer;
  Fd s(accept(l.fd, reinterpret_cast<sockaddr*>(&peer), &plen));
  REQUIRE(s >= 0);
  CHECK(plen == sizeof(sockaddr_in));
  CHECK(peer.ss_family == AF_INET);
  exchange_hello(c, s);
  // A second connect on a connected socket is EISCONN.
  errno = 0;
  CHECK(connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == -1);
  CHECK(errno == EISCONN);
}

// accept()'s address arguments as the kernel fills them: librsock's hook
// must pass the program's through and leave them exactly as the kernel
// left them.
TEST_CASE("accept: a short address buffer gets what fits and the full length; no buffer, no length") {
  Listener l = make_listener();
  Fd c(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(c >= 0);
  REQUIRE(connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);
  unsigned char buf[8];
  memset(buf, 0xab, sizeof buf);
  socklen_t len = 4;
  Fd s(accept(l.fd, reinterpret_cast<sockaddr*>(buf), &len));
  REQUIRE(s >= 0);
  CHECK(len == sizeof(sockaddr_in));
  sockaddr_in local{};
  socklen_t ll = sizeof local;
  REQUIRE(getsockname(c, reinterpret_cast<sockaddr*>(&local), &ll) == 0);
  CHECK(memcmp(buf, &local, 4) == 0);  // family and port
  CHECK(buf[4] == 0xab);               // nothing past the length given
  exchange_hello(c, s);
  // No buffer: a length passed anyway is left alone.
  Fd c2(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(c2 >= 0);
  REQUIRE(connect(c2, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);
  socklen_t len2 = 99;
  Fd s2(accept4(l.fd, nullptr, &len2, SOCK_CLOEXEC));
  REQUIRE(s2 >= 0);
  CHECK(len2 == 99);
  exchange_hello(c2, s2);
}

// A fresh connection takes writes at once on both ends, and says so in
// poll(), for as long as little is queued. Under librsock the upgrade runs
// underneath during exactly this time (TCP closes for our bytes at the
// switch offer, RDMA opens once the peer's marker is verified): bytes
// written meanwhile are held and sent first afterwards. Before, both ends
// read as not writable and nonblocking writes failed with EAGAIN for that
// window (conformance.rxe_same once failed the select case below on it).
TEST_CASE("connect: both ends stay writable from the start, also while librsock upgrades") {
  Pair p = connected_pair(AF_INET, /*await_upgrade=*/false);
  set_nonblocking(p.client, true);
  set_nonblocking(p.server, true);
  // Small writes, one per end every half millisecond, nobody reading: a
  // kernel socket takes all of them.
  constexpr size_t kMax = 8192, kChunk = 16;
  uint8_t buf[kChunk];
  size_t sent[2] = {0, 0};
  int64_t t0 = now_ms();
  bool settled = false;
  while (!settled && now_ms() - t0 < timeout_ms()) {
    pollfd pf[2] = {{p.client, POLLOUT, 0}, {p.server, POLLOUT, 0}};
    INFO((now_ms() - t0) << " ms in, transports " << transport_of(p.client) << "/"
                       << transport_of(p.server) << ", sent " << sent[0] << "/" << sent[1]);
    REQUIRE(poll(pf, 2, 0) == 2);
    for (int i = 0; i < 2; i++) {
      if (sent[i] == kMax) continue;
      fill_pattern(buf, kChunk, sent[i], uint32_t(i + 1));
      ssize_t w = write(i == 0 ? p.client : p.server, buf, kChunk);
      INFO("end " << i << ": " << (w < 0 ? strerror(errno) : "short write"));
      REQUIRE(w == ssize_t(kChunk));
      sent[i] += kChunk;
    }
    // Until the upgrade (if any) has ended and some time has passed.
    int tc = transport_of(p.client), ts = transport_of(p.server);
    settled = tc != 1 && ts != 1 && (!expect_rdma() || (tc == 2 && ts == 2)) &&
              now_ms() - t0 >= 100;
    usleep(500);
  }
  CHECK(settled);
  // Every byte arrives, in order, on each end.
  for (int i = 0; i < 2; i++) {
    set_nonblocking(i == 0 ? p.server : p.client, false);
    std::string got(sent[i], '\0');
    REQUIRE(read_exact(i == 0 ? p.server : p.client, got.data(), sent[i]) == sent[i]);
    CHECK(check_pattern(got.data(), sent[i], 0, uint32_t(i + 1)) == sent[i]);
  }
}

TEST_CASE("connect: nonblocking connect -> EINPROGRESS, POLLOUT, SO_ERROR 0") {
  Listener l = make_listener();
  Fd c(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
  REQUIRE(c >= 0);
  int r = connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len);
  if (r != 0) {
    CHECK(errno == EINPROGRESS);
    short ev = poll_one(c, POLLOUT, timeout_ms());
    CHECK((ev & POLLOUT));
    CHECK_FALSE((ev & (POLLERR | POLLHUP)));
  }
  CHECK(so_error(c) == 0);
  // Connected: getpeername works and reports the listener's address.
  sockaddr_storage peer{};
  socklen_t plen = sizeof peer;
  REQUIRE(getpeername(c, reinterpret_cast<sockaddr*>(&peer), &plen) == 0);
  CHECK(same_addr(peer, l.addr));
  REQUIRE(wait_readable(l.fd));
  Fd s(accept(l.fd, nullptr, nullptr));
  REQUIRE(s >= 0);
  exchange_hello(c, s);
}

TEST_CASE("connect: blocking connect to a closed port -> ECONNREFUSED") {
  ClosedPort cp = closed_port();
  Fd c(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(c >= 0);
  errno = 0;
  CHECK(connect(c, reinterpret_cast<sockaddr*>(&cp.addr), sizeof cp.addr) == -1);
  CHECK(errno == ECONNREFUSED);
}

TEST_CASE("connect: nonblocking connect to a closed port -> SO_ERROR ECONNREFUSED") {
  ClosedPort cp = closed_port();
  Fd c(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
  REQUIRE(c >= 0);
  errno = 0;
  int r = connect(c, reinterpret_cast<sockaddr*>(&cp.addr), sizeof cp.addr);
  REQUIRE(r == -1);
  if (errno == EINPROGRESS) {
    short ev = poll_one(c, POLLOUT, timeout_ms());
    CHECK(ev != 0);
    CHECK((ev & (POLLERR | POLLHUP)));
    CHECK(so_error(c) == ECONNREFUSED);
    CHECK(so_error(c) == 0);  // SO_ERROR is cleared by reading it
  } else {
    CHECK(errno == ECONNREFUSED);
  }
  // The socket is not connected.
  sockaddr_storage peer{};
  socklen_t plen = sizeof peer;
  errno = 0;
  CHECK(getpeername(c, reinterpret_cast<sockaddr*>(&peer), &plen) == -1);
  CHECK(errno == ENOTCONN);
}

TEST_CASE("accept4: SOCK_NONBLOCK and SOCK_CLOEXEC are visible through fcntl") {
  Listener l = make_listener();
  Fd c1(socket(AF_INET, SOCK_STREAM, 0)), c2(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(connect(c1, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);
  REQUIRE(connect(c2, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);

  REQUIRE(wait_readable(l.fd));
  Fd a(accept4(l.fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
  REQUIRE(a >= 0);
  CHECK((fcntl(a, F_GETFL) & O_NONBLOCK));
  CHECK((fcntl(a, F_GETFD) & FD_CLOEXEC));
  char b;
  errno = 0;
  CHECK(read(a, &b, 1) == -1);
  CHECK(errno == EAGAIN);

  // Plain accept4(0) gives neither flag, even from a nonblocking listener
  // (Linux: accepted sockets do not inherit O_NONBLOCK).
  set_nonblocking(l.fd, true);
  REQUIRE(wait_readable(l.fd));
  Fd p(accept4(l.fd, nullptr, nullptr, 0));
  REQUIRE(p >= 0);
  CHECK_FALSE((fcntl(p, F_GETFL) & O_NONBLOCK));
  CHECK_FALSE((fcntl(p, F_GETFD) & FD_CLOEXEC));

  // Nothing pending on a nonblocking listener: EAGAIN.
  errno = 0;
  CHECK(accept(l.fd, nullptr, nullptr) == -1);
  CHECK(errno == EAGAIN);
  // Bad flags: EINVAL.
  errno = 0;
  CHECK(accept4(l.fd, nullptr, nullptr, 0x40000000) == -1);
  CHECK(errno == EINVAL);

  exchange_hello(c1, a);
  exchange_hello(c2, p);
}

TEST_CASE("getsockname/getpeername agree on both ends") {
  Listener l = make_listener();
  Fd c(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);
  sockaddr_storage from{};
  socklen_t flen = sizeof from;
  REQUIRE(wait_readable(l.fd));
  Fd s(accept(l.fd, reinterpret_cast<sockaddr*>(&from), &flen));
  REQUIRE(s >= 0);

  sockaddr_storage c_local{}, c_peer{}, s_local{}, s_peer{};
  socklen_t len = sizeof c_local;
  REQUIRE(getsockname(c, reinterpret_cast<sockaddr*>(&c_local), &len) == 0);
  CHECK(len == sizeof(sockaddr_in));
  len = sizeof c_peer;
  REQUIRE(getpeername(c, reinterpret_cast<sockaddr*>(&c_peer), &len) == 0);
  len = sizeof s_local;
  REQUIRE(getsockname(s, reinterpret_cast<sockaddr*>(&s_local), &len) == 0);
  len = sizeof s_peer;
  REQUIRE(getpeername(s, reinterpret_cast<sockaddr*>(&s_peer), &len) == 0);

  CHECK(same_addr(c_peer, l.addr));
  CHECK(same_addr(s_local, l.addr));
  CHECK(same_addr(s_peer, c_local));
  CHECK(same_addr(from, c_local));
  auto& cl = reinterpret_cast<sockaddr_in&>(c_local);
  CHECK(cl.sin_family == AF_INET);
  CHECK(ntohs(cl.sin_port) != 0);

  // A too-short buffer is truncated, and the full length is reported.
  char tiny[4];
  len = sizeof tiny;
  REQUIRE(getpeername(c, reinterpret_cast<sockaddr*>(tiny), &len) == 0);
  CHECK(len == sizeof(sockaddr_in));

  // Not a socket / not connected.
  errno = 0;
  len = sizeof c_peer;
  CHECK(getpeername(l.fd, reinterpret_cast<sockaddr*>(&c_peer), &len) == -1);
  CHECK(errno == ENOTCONN);
}

TEST_CASE("ipv6: blocking connect to ::1 and data exchange") {
  if (!ipv6_available()) {
    MESSAGE("SKIP: IPv6 loopback not available");
    return;
  }
  Pair p = connected_pair(AF_INET6);
  sockaddr_storage peer{};
  socklen_t plen = sizeof peer;
  REQUIRE(getpeername(p.client, reinterpret_cast<sockaddr*>(&peer), &plen) == 0);
  CHECK(peer.ss_family == AF_INET6);
  CHECK(plen == sizeof(sockaddr_in6));
  CHECK(memcmp(&reinterpret_cast<sockaddr_in6&>(peer).sin6_addr, &in6addr_loopback, 16) == 0);
  exchange_hello(p.client, p.server);
  CHECK(shutdown(p.client, SHUT_WR) == 0);
  bool eof = false;
  CHECK(read_to_eof(p.server, nullptr, &eof) == 0);
  CHECK(eof);
}

TEST_CASE("ipv6: nonblocking connect to ::1 and refusal") {
  if (!ipv6_available()) {
    MESSAGE("SKIP: IPv6 loopback not available");
    return;
  }
  Listener l = make_listener(AF_INET6);
  Fd c(socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK, 0));
  int r = connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len);
  if (r != 0) {
    CHECK(errno == EINPROGRESS);
    CHECK((poll_one(c, POLLOUT, timeout_ms()) & POLLOUT));
  }
  CHECK(so_error(c) == 0);
  REQUIRE(wait_readable(l.fd));
  Fd s(accept(l.fd, nullptr, nullptr));
  REQUIRE(s >= 0);
  set_nonblocking(c, false);
  exchange_hello(c, s);

  // Close the listener: its port now refuses.
  sockaddr_in6 addr = reinterpret_cast<sockaddr_in6&>(l.addr);
  l.fd.reset();
  Fd r2(socket(AF_INET6, SOCK_STREAM, 0));
  errno = 0;
  CHECK(connect(r2, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == -1);
  CHECK(errno == ECONNREFUSED);
}
