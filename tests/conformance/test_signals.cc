// Signals versus blocking socket calls: EINTR, SA_RESTART, alarm().
#include <doctest/doctest.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <thread>

#include "helpers.h"

using namespace conf;

namespace {

std::atomic<int> g_hits{0};
void on_signal(int) { g_hits.fetch_add(1); }

// Installs a handler for `sig` (with or without SA_RESTART) for one scope.
class ScopedHandler {
 public:
  ScopedHandler(int sig, bool restart) : sig_(sig) {
    struct sigaction sa{};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = restart ? SA_RESTART : 0;
    sigaction(sig, &sa, &old_);
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, sig);
    pthread_sigmask(SIG_UNBLOCK, &s, nullptr);
  }
  ~ScopedHandler() { sigaction(sig_, &old_, nullptr); }

 private:
  int sig_;
  struct sigaction old_{};
};

// Sends SIGUSR1 to `target` after `ms` (thread-directed: lands on the
// blocked thread whatever other threads exist in the process). If the call
// has still not returned 3 s later, runs `rescue` (which makes the call
// complete normally) so a missing EINTR fails the test instead of hanging it.
class Kicker {
 public:
  Kicker(pthread_t target, int ms, std::function<void()> rescue)
      : thread_([this, target, ms, rescue = std::move(rescue)] {
          usleep(static_cast<useconds_t>(ms) * 1000);
          pthread_kill(target, SIGUSR1);
          for (int i = 0; i < 300 && !done_; ++i) usleep(10000);
          if (!done_) rescue();
        }) {}
  ~Kicker() { finish(); }
  void finish() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace

TEST_CASE("signals: a handler without SA_RESTART interrupts blocking calls with EINTR") {
  ScopedHandler h(SIGUSR1, false);
  Pair p = connected_pair();
  char b[8];
  pthread_t self = pthread_self();
  auto send_byte = [&] { (void)!write(p.client, "r", 1); };

  SUBCASE("read") {
    int before = g_hits;
    Kicker k(self, 100, send_byte);
    errno = 0;
    ssize_t r = read(p.server, b, sizeof b);
    int e = errno;
    k.finish();
    CHECK(r == -1);
    CHECK(e == EINTR);
    CHECK(g_hits > before);
  }
  SUBCASE("recv") {
    Kicker k(self, 100, send_byte);
    errno = 0;
    ssize_t r = recv(p.server, b, sizeof b, 0);
    int e = errno;
    k.finish();
    CHECK(r == -1);
    CHECK(e == EINTR);
  }
  SUBCASE("accept") {
    Listener l = make_listener();
    Fd rescuer(socket(AF_INET, SOCK_STREAM, 0));
    Kicker k(self, 100, [&] { (void)!connect(rescuer, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len); });
    errno = 0;
    Fd r(accept(l.fd, nullptr, nullptr));
    int e = errno;
    k.finish();
    CHECK(r.get() == -1);
    CHECK(e == EINTR);
  }
  SUBCASE("poll") {
    Kicker k(self, 100, send_byte);
    pollfd pf{p.server, POLLIN, 0};
    errno = 0;
    int r = poll(&pf, 1, timeout_ms());
    int e = errno;
    k.finish();
    CHECK(r == -1);
    CHECK(e == EINTR);
  }
  SUBCASE("epoll_wait") {
    Fd ep(epoll_create1(0));
    REQUIRE(ep >= 0);
    epoll_event ev{};
    ev.events = EPOLLIN;
    REQUIRE(epoll_ctl(ep, EPOLL_CTL_ADD, p.server, &ev) == 0);
    Kicker k(self, 100, send_byte);
    errno = 0;
    int r = epoll_wait(ep, &ev, 1, timeout_ms());
    int e = errno;
    k.finish();
    CHECK(r == -1);
    CHECK(e == EINTR);
  }
  SUBCASE("select") {
    Kicker k(self, 100, send_byte);
    fd_set rs;
    FD_ZERO(&rs);
    FD_SET(p.server, &rs);
    timeval tv{timeout_ms() / 1000, 0};
    errno = 0;
    int r = select(p.server + 1, &rs, nullptr, nullptr, &tv);
    int e = errno;
    k.finish();
    CHECK(r == -1);
    CHECK(e == EINTR);
  }
}

TEST_CASE("signals: SA_RESTART restarts a blocking read; poll still returns EINTR") {
  ScopedHandler h(SIGUSR1, true);
  Pair p = connected_pair();
  pthread_t self = pthread_self();
  int before = g_hits;
  // Signal at 100 ms, data at 400 ms: the read must be restarted and return the data.
  Kicker kick(self, 100, [] {});
  std::thread data([&] {
    usleep(400000);
    (void)!write(p.client, "restarted", 9);
  });
  char b[16];
  errno = 0;
  ssize_t r = read(p.server, b, sizeof b);
  kick.finish();
  data.join();
  CHECK(g_hits > before);
  REQUIRE(r > 0);
  size_t got = static_cast<size_t>(r);
  if (got < 9) got += read_exact(p.server, b + got, 9 - got);
  CHECK(got == 9);
  CHECK(memcmp(b, "restarted", 9) == 0);
  // poll() is never restarted (man 7 signal).
  Kicker kick2(self, 100, [&] { (void)!write(p.client, "r", 1); });
  pollfd pf{p.server, POLLIN, 0};
  errno = 0;
  int pr = poll(&pf, 1, timeout_ms());
  int e = errno;
  kick2.finish();
  CHECK(pr == -1);
  CHECK(e == EINTR);
}

TEST_CASE("signals: alarm() interrupts a blocking read (process-directed signal)") {
  // Programs use alarm() as a read timeout. The signal is process-directed:
  // it must reach the thread blocked in read(), which means helper threads a
  // library creates must keep SIGALRM blocked. If it went astray, data sent
  // after 3 s ends the read so the test fails instead of hanging.
  ScopedHandler h(SIGALRM, false);
  Pair p = connected_pair();
  std::atomic<bool> done{false};
  std::thread rescue([&] {
    for (int i = 0; i < 300 && !done; ++i) usleep(10000);
    if (!done) (void)!write(p.client, "rescue", 6);
  });
  int before = g_hits;
  alarm(1);
  char b[8];
  int64_t t0 = now_ms();
  errno = 0;
  ssize_t r = read(p.server, b, sizeof b);
  int e = errno;
  int64_t took = now_ms() - t0;
  alarm(0);
  done = true;
  rescue.join();
  CHECK(r == -1);
  CHECK(e == EINTR);
  CHECK(g_hits > before);
  CHECK(took >= 500);
}
