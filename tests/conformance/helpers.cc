#include "helpers.h"

#include "preload/librsock.h"  // SOL_RSOCK: asking librsock, if loaded, for the transport

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace conf {

int timeout_ms() {
  static const int ms = [] {
    const char* s = getenv("RSOCK_CONF_TIMEOUT_MS");
    int v = s ? atoi(s) : 0;
    return v > 0 ? v : 20000;
  }();
  return ms;
}

in_addr test_ipv4() {
  static const in_addr addr = [] {
    in_addr a{};
    a.s_addr = htonl(INADDR_LOOPBACK);
    const char* s = getenv("RSOCK_CONF_IPV4");
    if (s && *s && inet_pton(AF_INET, s, &a) != 1) {
      fprintf(stderr, "rsock_conformance: bad RSOCK_CONF_IPV4=%s, using 127.0.0.1\n", s);
      a.s_addr = htonl(INADDR_LOOPBACK);
    }
    return a;
  }();
  return addr;
}

int64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000 + ts.tv_nsec / 1000000;
}

int Fd::reset(int fd) {
  int r = 0;
  if (fd_ >= 0) r = close(fd_);
  fd_ = fd;
  return r;
}

Listener make_listener(int family, int backlog) {
  Listener l;
  l.fd = Fd(socket(family, SOCK_STREAM, 0));
  REQUIRE_MESSAGE(l.fd >= 0, "socket: " << errno_str(errno));
  int one = 1;
  REQUIRE(setsockopt(l.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
  if (family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&l.addr);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_loopback;
    l.addr_len = sizeof(sockaddr_in6);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&l.addr);
    a->sin_family = AF_INET;
    a->sin_addr = test_ipv4();
    l.addr_len = sizeof(sockaddr_in);
  }
  REQUIRE_MESSAGE(bind(l.fd, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0,
                  "bind: " << errno_str(errno));
  REQUIRE(listen(l.fd, backlog) == 0);
  // Learn the ephemeral port the kernel picked.
  socklen_t len = sizeof l.addr;
  REQUIRE(getsockname(l.fd, reinterpret_cast<sockaddr*>(&l.addr), &len) == 0);
  l.addr_len = len;
  l.port = ntohs(family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&l.addr)->sin6_port
                                    : reinterpret_cast<sockaddr_in*>(&l.addr)->sin_port);
  REQUIRE(l.port != 0);
  return l;
}

bool expect_rdma() {
  static const bool on = [] {
    const char* e = getenv("RSOCK_CONF_EXPECT_RDMA");
    return e && strcmp(e, "1") == 0;
  }();
  return on;
}

int transport_of(int fd) {
  int t = -1;
  socklen_t len = sizeof t;
  if (getsockopt(fd, SOL_RSOCK, RSOCK_TRANSPORT, &t, &len) != 0) return -errno;
  return t;
}

// Both ends on RDMA, or a failed REQUIRE saying where each end got stuck.
void await_rdma(const Pair& p) {
  int64_t deadline = now_ms() + 20000;  // the rendezvous is slow under TCG
  int tc = -1, ts = -1;
  while (now_ms() < deadline) {
    tc = transport_of(p.client);
    ts = transport_of(p.server);
    if (tc == RSOCK_TRANSPORT_RDMA && ts == RSOCK_TRANSPORT_RDMA) return;
    if (tc != RSOCK_TRANSPORT_UPGRADING && tc != RSOCK_TRANSPORT_RDMA) break;
    if (ts != RSOCK_TRANSPORT_UPGRADING && ts != RSOCK_TRANSPORT_RDMA) break;
    usleep(1000);
  }
  // Why (SOL_RSOCK RSOCK_FALLBACK_REASON: rsock-stat's reason numbers,
  // docs/STATS.md), so that a failure in a CI log says what to look at.
  auto reason = [](int fd) {
    int r = -1;
    socklen_t len = sizeof r;
    return getsockopt(fd, SOL_RSOCK, RSOCK_FALLBACK_REASON, &r, &len) == 0 ? r : -errno;
  };
  FAIL("RSOCK_CONF_EXPECT_RDMA: the pair did not upgrade (transport client "
       << tc << ", server " << ts << "; 0 tcp, 1 upgrading, 2 rdma, 3 broken, <0 -errno; "
       << "fallback reason client " << reason(p.client) << ", server " << reason(p.server) << ")");
}

Pair connected_pair(int family, bool await_upgrade) {
  Listener l = make_listener(family);
  Pair p;
  p.client = Fd(socket(family, SOCK_STREAM, 0));
  REQUIRE(p.client >= 0);
  REQUIRE_MESSAGE(connect(p.client, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0,
                  "connect: " << errno_str(errno));
  REQUIRE(wait_readable(l.fd));
  p.server = Fd(accept(l.fd, nullptr, nullptr));
  REQUIRE_MESSAGE(p.server >= 0, "accept: " << errno_str(errno));
  if (await_upgrade && family == AF_INET && expect_rdma()) await_rdma(p);
  return p;
}

ClosedPort closed_port() {
  ClosedPort c;
  c.holder = Fd(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(c.holder >= 0);
  c.addr.sin_family = AF_INET;
  c.addr.sin_addr = test_ipv4();
  REQUIRE(bind(c.holder, reinterpret_cast<sockaddr*>(&c.addr), sizeof c.addr) == 0);
  socklen_t len = sizeof c.addr;
  REQUIRE(getsockname(c.holder, reinterpret_cast<sockaddr*>(&c.addr), &len) == 0);
  return c;
}

bool ipv4_bindable() {
  Fd s(socket(AF_INET, SOCK_STREAM, 0));
  if (s < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr = test_ipv4();
  return bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
}

bool ipv6_available() {
  Fd s(socket(AF_INET6, SOCK_STREAM, 0));
  if (s < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  return bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
}

short poll_one(int fd, short events, int ms) {
  int64_t deadline = now_ms() + ms;
  for (;;) {
    pollfd p{fd, events, 0};
    int left = static_cast<int>(deadline - now_ms());
    int r = poll(&p, 1, left < 0 ? 0 : left);
    if (r > 0) return p.revents;
    if (r == 0) return 0;
    if (errno != EINTR) return POLLNVAL;
  }
}

void set_nonblocking(int fd, bool on) {
  int fl = fcntl(fd, F_GETFL);
  REQUIRE(fl >= 0);
  REQUIRE(fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK)) == 0);
}

bool is_nonblocking(int fd) { return fcntl(fd, F_GETFL) & O_NONBLOCK; }

size_t write_all(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  size_t done = 0;
  int64_t deadline = now_ms() + timeout_ms();
  while (done < n) {
    ssize_t r = write(fd, p + done, n - done);
    if (r > 0) {
      done += static_cast<size_t>(r);
      deadline = now_ms() + timeout_ms();  // progress: the bound is per stall
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno == EAGAIN) {
      int left = static_cast<int>(deadline - now_ms());
      if (left <= 0 || !(poll_one(fd, POLLOUT, left) & POLLOUT)) {
        errno = ETIMEDOUT;
        break;
      }
      continue;
    }
    break;
  }
  return done;
}

size_t read_exact(int fd, void* buf, size_t n, int ms) {
  char* p = static_cast<char*>(buf);
  size_t done = 0;
  int64_t deadline = now_ms() + ms;
  while (done < n) {
    int left = static_cast<int>(deadline - now_ms());
    if (left <= 0 || poll_one(fd, POLLIN, left) == 0) {
      errno = ETIMEDOUT;
      break;
    }
    ssize_t r = read(fd, p + done, n - done);
    if (r > 0) {
      done += static_cast<size_t>(r);
      deadline = now_ms() + ms;
      continue;
    }
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    break;  // EOF or error
  }
  return done;
}

size_t read_to_eof(int fd, std::string* out, bool* eof, int ms) {
  *eof = false;
  size_t total = 0;
  char buf[65536];
  int64_t deadline = now_ms() + ms;
  for (;;) {
    int left = static_cast<int>(deadline - now_ms());
    if (left <= 0 || poll_one(fd, POLLIN, left) == 0) break;
    ssize_t r = read(fd, buf, sizeof buf);
    if (r == 0) {
      *eof = true;
      break;
    }
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      break;
    }
    if (out) out->append(buf, static_cast<size_t>(r));
    total += static_cast<size_t>(r);
  }
  return total;
}

void fill_pattern(void* buf, size_t n, uint64_t off, uint32_t seed) {
  auto* p = static_cast<uint8_t*>(buf);
  for (size_t i = 0; i < n; ++i) p[i] = pattern_byte(off + i, seed);
}

size_t check_pattern(const void* buf, size_t n, uint64_t off, uint32_t seed) {
  auto* p = static_cast<const uint8_t*>(buf);
  for (size_t i = 0; i < n; ++i)
    if (p[i] != pattern_byte(off + i, seed)) return i;
  return n;
}

uint64_t fnv1a(const void* buf, size_t n, uint64_t h) {
  auto* p = static_cast<const uint8_t*>(buf);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

int so_error(int fd) {
  int err = 0;
  socklen_t len = sizeof err;
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return -1;
  return err;
}

namespace {
std::atomic<int> g_sigpipes{0};
void on_sigpipe(int) { g_sigpipes.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

int sigpipe_count() { return g_sigpipes.load(); }

void install_sigpipe_counter() {
  struct sigaction sa{};
  sa.sa_handler = on_sigpipe;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGPIPE, &sa, nullptr);
}

std::string errno_str(int e) {
  const char* name = strerrorname_np(e);
  return std::to_string(e) + " (" + (name ? name : "?") + ")";
}

}  // namespace conf
