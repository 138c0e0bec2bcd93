// Helpers for the two-process transport tests that run inside the rxe VM.
// A test forks a server child (listens on 10.77.0.1, port 0) and a client
// child (told the port through a pipe); the parent waits for both with a
// deadline, so a hang is a failure, never a stuck ctest.
#pragma once

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "util/clock.h"
#include "transport/connection.h"
#include "transport/listener.h"

namespace rt = rsock::transport;

#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "[%d] CHECK failed %s:%d: %s: ", getpid(), __FILE__, \
                   __LINE__, #cond);                                            \
      std::fprintf(stderr, __VA_ARGS__);                                        \
      std::fprintf(stderr, "\n");                                               \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

inline void log_line(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "[%d] ", getpid());
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
}

inline void skip_without_device() {
  int n = 0;
  ibv_device** l = ibv_get_device_list(&n);
  if (l) ibv_free_device_list(l);
  if (n <= 0) {
    std::printf("SKIP: no RDMA device\n");
    std::exit(77);
  }
}

inline sockaddr_in server_addr(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "10.77.0.1", &a.sin_addr);
  return a;
}

inline double secs_since(uint64_t t0) { return double(rsock::now_ns() - t0) / 1e9; }

inline void raise_fd_limit() {
  rlimit r;
  getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = r.rlim_max;
  setrlimit(RLIMIT_NOFILE, &r);
}

// Drives a connection to ESTABLISHED (or fails the test).
inline void wait_established(rt::Connection& c, int timeout_ms = 10000) {
  uint64_t t0 = rsock::now_ns();
  // A peer that connects, sends its FIN and disconnects at once can leave
  // ESTABLISHED and DISCONNECTED queued together: then one progress() takes
  // the connection through established to closed (orderly), which counts.
  while (!c.established() && !c.closed()) {
    auto s = c.progress();
    CHECK(s.ok(), "connection failed during setup: errno %d (%s), reject reason %d", s.error(),
          std::strerror(s.error()), int(c.reject_reason()));
    CHECK(secs_since(t0) * 1000 < timeout_ms, "setup took longer than %d ms", timeout_ms);
    if (c.established() || c.closed()) break;
    pollfd p{c.fd(), POLLIN, 0};
    poll(&p, 1, 50);
  }
}

// Accepts one connection on `l` and drives it to ESTABLISHED.
inline std::unique_ptr<rt::Connection> accept_one(rt::Listener& l,
                                                  std::span<const std::byte> payload = {}) {
  uint64_t t0 = rsock::now_ns();
  for (;;) {
    auto r = l.next_request();
    if (r.ok()) {
      auto c = l.accept(std::move(r.value()), payload);
      CHECK(c.ok(), "accept failed: %s", std::strerror(c.error()));
      wait_established(*c.value());
      return std::move(c.value());
    }
    CHECK(r.error() == EAGAIN, "next_request: %s", std::strerror(r.error()));
    CHECK(secs_since(t0) < 60, "no connect request within 60 s");
    pollfd p{l.fd(), POLLIN, 0};
    poll(&p, 1, 100);
  }
}

inline std::unique_ptr<rt::Connection> connect_to(uint16_t port, const rsock::config::Tunables& tun,
                                                  std::span<const std::byte> payload = {}) {
  sockaddr_in a = server_addr(port);
  auto c = rt::Connection::connect(reinterpret_cast<sockaddr*>(&a), nullptr, payload, tun);
  CHECK(c.ok(), "connect: %s", std::strerror(c.error()));
  wait_established(*c.value());
  return std::move(c.value());
}

// Sends all of buf (blocking via wait()).
inline void send_all(rt::Connection& c, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    iovec v{const_cast<char*>(p), n};
    auto r = c.send({&v, 1});
    if (r.ok()) {
      p += *r;
      n -= *r;
      continue;
    }
    CHECK(r.error() == EAGAIN, "send: %s", std::strerror(r.error()));
    auto w = c.wait(POLLOUT, 10000);
    CHECK(w.ok(), "wait(POLLOUT): %s", std::strerror(w.error()));
  }
}

// Receives exactly n bytes (false on EOF first).
inline bool recv_all(rt::Connection& c, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    iovec v{p, n};
    auto r = c.recv({&v, 1}, false);
    if (r.ok()) {
      if (*r == 0) return false;
      p += *r;
      n -= *r;
      continue;
    }
    CHECK(r.error() == EAGAIN, "recv: %s", std::strerror(r.error()));
    auto w = c.wait(POLLIN, 10000);
    CHECK(w.ok(), "wait(POLLIN): %s", std::strerror(w.error()));
  }
  return true;
}

// `rdma resource show qp` lines of RC QPs owned by `pid` (proof that the
// traffic runs over real QPs of the rxe device).
inline int count_rc_qps_once(pid_t pid, uint32_t want_qpn, bool* found) {
  FILE* f = popen("rdma resource show qp 2>/dev/null", "r");
  if (!f) return -1;
  char line[512];
  int n = 0;
  std::string pidtok = " pid " + std::to_string(pid) + " ";
  std::string qpntok = " lqpn " + std::to_string(want_qpn) + " ";
  while (fgets(line, sizeof line, f)) {
    std::string s = std::string(" ") + line;
    for (auto& ch : s)
      if (ch == '\n') ch = ' ';
    if (s.find(" type RC ") == std::string::npos || s.find(pidtok) == std::string::npos) continue;
    ++n;
    if (found && want_qpn && s.find(qpntok) != std::string::npos) *found = true;
  }
  pclose(f);
  return n;
}

// The netlink dump behind the rdma tool ends early when another process
// creates or destroys QPs meanwhile: a dump can only undercount, so take the
// largest of a few.
inline int count_rc_qps(pid_t pid, uint32_t want_qpn = 0, bool* found = nullptr) {
  int best = -1;
  for (int i = 0; i < 3; ++i) best = std::max(best, count_rc_qps_once(pid, want_qpn, found));
  return best;
}

// The CQs the kernel lists for `pid` (`rdma resource show cq`), the largest
// of a few dumps like count_rc_qps.
inline int count_cqs(pid_t pid) {
  int best = -1;
  for (int i = 0; i < 3; ++i) {
    FILE* f = popen("rdma resource show cq 2>/dev/null", "r");
    if (!f) return -1;
    char line[512];
    int n = 0;
    std::string pidtok = " pid " + std::to_string(pid) + " ";
    while (fgets(line, sizeof line, f)) {
      std::string s = std::string(" ") + line;
      for (auto& ch : s)
        if (ch == '\n') ch = ' ';
      if (s.find(pidtok) != std::string::npos) ++n;
    }
    pclose(f);
    best = std::max(best, n);
  }
  return best;
}

inline void check_qp_visible(const rt::Connection& c) {
  bool found = false;
  int n = count_rc_qps(getpid(), c.qp_num(), &found);
  CHECK(n >= 1 && found, "rdma resource show qp lists no RC QP %u for pid %d (%d RC QPs)",
        c.qp_num(), getpid(), n);
}

// xorshift64*: cheap reproducible payload.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
};

inline void fill(Rng& r, char* p, size_t n) {
  while (n >= 8) {
    uint64_t v = r.next();
    std::memcpy(p, &v, 8);
    p += 8;
    n -= 8;
  }
  uint64_t v = r.next();
  std::memcpy(p, &v, n);
}

// Word-wise FNV-style hash (byte tail folded in): fast enough under TCG.
inline uint64_t checksum(const char* p, size_t n, uint64_t h = 1469598103934665603ull) {
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = (h ^ v) * 1099511628211ull;
    p += 8;
    n -= 8;
  }
  while (n-- > 0) h = (h ^ uint8_t(*p++)) * 1099511628211ull;
  return h;
}

// Runs server(listener, ctx) and client(port) in two child processes.
// Returns 0 if both exit 0. `timeout_s` bounds the whole run.
inline int run_pair(const std::function<int(rt::Listener&, pid_t client_pid)>& server,
                    const std::function<int(uint16_t port)>& client,
                    const rsock::config::Tunables& tun, int timeout_s,
                    bool client_killed_ok = false) {
  int port_pipe[2], pid_pipe[2];
  CHECK(pipe(port_pipe) == 0 && pipe(pid_pipe) == 0, "pipe");
  pid_t s = fork();
  if (s == 0) {
    close(port_pipe[0]);
    close(pid_pipe[1]);
    alarm(unsigned(timeout_s));
    raise_fd_limit();
    sockaddr_in a = server_addr(0);
    auto l = rt::Listener::listen(reinterpret_cast<sockaddr*>(&a), tun);
    CHECK(l.ok(), "listen: %s", std::strerror(l.error()));
    uint16_t port = l.value()->port();
    CHECK(write(port_pipe[1], &port, sizeof port) == sizeof port, "write port");
    pid_t cp = 0;
    CHECK(read(pid_pipe[0], &cp, sizeof cp) == sizeof cp, "read client pid");
    _exit(server(*l.value(), cp));
  }
  close(port_pipe[1]);
  close(pid_pipe[0]);
  uint16_t port = 0;
  if (read(port_pipe[0], &port, sizeof port) != sizeof port) {
    int st;
    waitpid(s, &st, 0);
    log_line("server died before listening");
    return 1;
  }
  pid_t c = fork();
  if (c == 0) {
    alarm(unsigned(timeout_s));
    raise_fd_limit();
    _exit(client(port));
  }
  CHECK(write(pid_pipe[1], &c, sizeof c) == sizeof c, "write pid");
  int rc = 0;
  uint64_t t0 = rsock::now_ns();
  for (pid_t who : {s, c}) {
    int st = 0;
    for (;;) {
      pid_t w = waitpid(who, &st, WNOHANG);
      if (w == who) break;
      if (secs_since(t0) > timeout_s + 5) {
        log_line("timeout: killing pid %d", who);
        kill(who, SIGKILL);
      }
      usleep(20000);
    }
    bool killed_client = who == c && client_killed_ok && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL;
    if (!killed_client && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
      log_line("%s (pid %d) failed: %s %d", who == s ? "server" : "client", who,
               WIFEXITED(st) ? "exit" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
      rc = 1;
    }
  }
  return rc;
}
