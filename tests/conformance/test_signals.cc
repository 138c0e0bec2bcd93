// Signals versus blocking socket calls: EINTR, SA_RESTART, alarm().
#include <doctest/doctest.h>
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <thread>

#include "helpers.h"

// siginterrupt() is obsolete, but programs call it and librsock hooks it.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

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
  // Signal at 100 ms, data once the handler ran (or after 3 s): the read
  // must be restarted and return the data, and the handler must run while
  // the read still waits, as the kernel runs it.
  Kicker kick(self, 100, [] {});
  std::atomic<bool> ran_first{false};
  std::thread data([&] {
    for (int i = 0; i < 300 && g_hits == before; ++i) usleep(10000);
    ran_first = g_hits > before;
    (void)!write(p.client, "restarted", 9);
  });
  char b[16];
  errno = 0;
  ssize_t r = read(p.server, b, sizeof b);
  kick.finish();
  data.join();
  CHECK(g_hits > before);
  CHECK(ran_first);
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

namespace {

std::atomic<int> g_info_value{0};
std::atomic<int> g_info_code{0};
std::atomic<bool> g_info_ctx{false};
void on_info(int, siginfo_t* info, void* ctx) {
  g_info_value = info->si_value.sival_int;
  g_info_code = info->si_code;
  g_info_ctx = ctx != nullptr;
}

// Restores one signal's disposition at scope exit.
class SavedAction {
 public:
  explicit SavedAction(int sig) : sig_(sig) { sigaction(sig, nullptr, &old_); }
  ~SavedAction() { sigaction(sig_, &old_, nullptr); }

 private:
  int sig_;
  struct sigaction old_{};
};

}  // namespace

TEST_CASE("signals: sigaction reports the handler, flags and mask the program installed") {
  SavedAction saved(SIGUSR2);
  struct sigaction sa{}, got{}, prev{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGUSR1);
  sa.sa_flags = SA_RESTART | SA_NODEFER;
  REQUIRE(sigaction(SIGUSR2, &sa, nullptr) == 0);
  REQUIRE(sigaction(SIGUSR2, nullptr, &got) == 0);
  CHECK(bool(got.sa_handler == on_signal));
  CHECK((got.sa_flags & (SA_RESTART | SA_NODEFER | SA_SIGINFO | SA_RESETHAND)) == (SA_RESTART | SA_NODEFER));
  CHECK(sigismember(&got.sa_mask, SIGUSR1) == 1);
  CHECK(sigismember(&got.sa_mask, SIGTERM) == 0);

  struct sigaction si{};
  si.sa_sigaction = on_info;
  sigemptyset(&si.sa_mask);
  si.sa_flags = SA_SIGINFO;
  REQUIRE(sigaction(SIGUSR2, &si, &prev) == 0);
  CHECK(bool(prev.sa_handler == on_signal));  // the old one, as installed
  CHECK((prev.sa_flags & SA_SIGINFO) == 0);
  REQUIRE(sigaction(SIGUSR2, nullptr, &got) == 0);
  CHECK(bool(got.sa_sigaction == on_info));
  CHECK((got.sa_flags & SA_SIGINFO) != 0);

  // Back to the default: queries say so.
  struct sigaction dfl{};
  dfl.sa_handler = SIG_DFL;
  REQUIRE(sigaction(SIGUSR2, &dfl, &prev) == 0);
  CHECK(bool(prev.sa_sigaction == on_info));
  REQUIRE(sigaction(SIGUSR2, nullptr, &got) == 0);
  CHECK(bool(got.sa_handler == SIG_DFL));
}

TEST_CASE("signals: an SA_SIGINFO handler gets the sender's siginfo and a context") {
  SavedAction saved(SIGUSR2);
  struct sigaction si{};
  si.sa_sigaction = on_info;
  sigemptyset(&si.sa_mask);
  si.sa_flags = SA_SIGINFO;
  REQUIRE(sigaction(SIGUSR2, &si, nullptr) == 0);
  g_info_value = 0;
  sigval v{};
  v.sival_int = 4242;
  REQUIRE(pthread_sigqueue(pthread_self(), SIGUSR2, v) == 0);
  for (int i = 0; i < 100 && g_info_value == 0; i++) usleep(1000);
  CHECK(g_info_value == 4242);
  CHECK(g_info_code == SI_QUEUE);
  CHECK(g_info_ctx);
}

TEST_CASE("signals: SA_RESETHAND runs the handler once, then the default is back") {
  SavedAction saved(SIGUSR2);
  struct sigaction sa{}, got{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  REQUIRE(sigaction(SIGUSR2, &sa, nullptr) == 0);
  int before = g_hits;
  REQUIRE(pthread_kill(pthread_self(), SIGUSR2) == 0);
  CHECK(g_hits == before + 1);
  REQUIRE(sigaction(SIGUSR2, nullptr, &got) == 0);
  CHECK(bool(got.sa_handler == SIG_DFL));
}

TEST_CASE("signals: signal(), sysv_signal() and siginterrupt() set glibc's flags") {
  SavedAction saved(SIGUSR2);
  struct sigaction got{};
  signal(SIGUSR2, SIG_DFL);
  CHECK(bool(signal(SIGUSR2, on_signal) == SIG_DFL));
  REQUIRE(sigaction(SIGUSR2, nullptr, &got) == 0);
  CHECK(bool(got.sa_handler == on_signal));
  CHECK((got.sa_flags & SA_RESTART) != 0);
  CHECK(sigismember(&got.sa_mask, SIGUSR2) == 1);

  REQUIRE(siginterrupt(SIGUSR2, 1) == 0);
  REQUIRE(sigaction(SIGUSR2, nullptr, &got) == 0);
  CHECK(bool(got.sa_handler == on_signal));
  CHECK((got.sa_flags & SA_RESTART) == 0);
  CHECK(bool(signal(SIGUSR2, on_signal) == on_signal));  // stays interrupting
  REQUIRE(sigaction(SIGUSR2, nullptr, &got) == 0);
  CHECK((got.sa_flags & SA_RESTART) == 0);
  REQUIRE(siginterrupt(SIGUSR2, 0) == 0);

  CHECK(bool(sysv_signal(SIGUSR2, on_signal) == on_signal));
  REQUIRE(sigaction(SIGUSR2, nullptr, &got) == 0);
  CHECK(bool(got.sa_handler == on_signal));
  CHECK((got.sa_flags & (SA_RESETHAND | SA_NODEFER | SA_RESTART)) == (SA_RESETHAND | SA_NODEFER));

  errno = 0;
  CHECK(bool(signal(SIGKILL, on_signal) == SIG_ERR));
  CHECK(errno == EINVAL);
}

TEST_CASE("signals: a signal during a MSG_WAITALL read that is receiving data ends it early") {
  // The peer trickles a byte per millisecond, so the read keeps waking up
  // and going back to sleep. A handler without SA_RESTART that runs at any
  // moment of the call must end it with what it has (signal(7)), also when
  // it runs while the call is between two sleeps. Five rounds, because the
  // signal only sometimes lands between two sleeps.
  ScopedHandler h(SIGUSR1, false);
  Pair p = connected_pair();
  constexpr int kBytes = 3000;
  static char b[kBytes];
  pthread_t self = pthread_self();
  for (int round = 0; round < 5; round++) {
    CAPTURE(round);
    std::atomic<bool> stop{false};
    std::thread writer([&] {
      for (int i = 0; i < kBytes && !stop; i++) {
        (void)!write(p.client, "x", 1);
        usleep(1000);
      }
    });
    std::thread kick([&] {
      usleep(300000);
      pthread_kill(self, SIGUSR1);
    });
    int64_t t0 = now_ms();
    ssize_t r = recv(p.server, b, kBytes, MSG_WAITALL);
    int64_t took = now_ms() - t0;
    stop = true;
    kick.join();
    writer.join();
    CHECK(r > 0);
    CHECK(r < kBytes);
    CHECK(took < 2500);
    // What the writer sent after the read ended: drained for the next round.
    usleep(50000);
    while (recv(p.server, b, kBytes, MSG_DONTWAIT) > 0) {
    }
  }
}

namespace {
sigjmp_buf g_jump;
void jump_out(int) { siglongjmp(g_jump, 1); }
}  // namespace

TEST_CASE("signals: a handler that siglongjmps out of a blocking read leaves every socket working") {
  // Programs time reads out with alarm() and a handler that siglongjmps
  // (read() is async-signal-safe, so that is well defined): the sleep the
  // read was in never ends normally. Afterwards this thread's next blocking
  // read, another thread's, and the interrupted socket must work as before.
  // Both kinds of handler: sigaction() without flags, and signal()'s, which
  // glibc installs with SA_RESTART (the read would go on after it).
  struct sigaction sa{}, old{};
  sa.sa_handler = jump_out;
  sigemptyset(&sa.sa_mask);
  REQUIRE(sigaction(SIGUSR1, nullptr, &old) == 0);
  Pair a = connected_pair(), b = connected_pair();
  const bool tracked = transport_of(a.client) >= 0;  // librsock's, before any jump
  pthread_t self = pthread_self();
  for (int round = 0; round < 4; ++round) {
    CAPTURE(round);
    sa.sa_flags = round % 2 ? SA_RESTART : 0;
    REQUIRE(sigaction(SIGUSR1, &sa, nullptr) == 0);
    volatile bool jumped = false;
    {
      Kicker k(self, 100, [&] { (void)!write(a.client, "!", 1); });
      if (sigsetjmp(g_jump, 1) == 0) {
        char c;
        (void)!read(a.server, &c, 1);  // nothing comes: only the signal ends it
      } else {
        jumped = true;
      }
      k.finish();
    }
    CHECK(jumped);
    // This thread sleeps again (data after 50 ms), then another thread does.
    std::thread late([&] {
      usleep(50000);
      (void)!write(b.client, "ping", 4);
    });
    char buf[8] = {};
    int64_t t0 = now_ms();
    size_t got = read_exact(b.server, buf, 4);
    int64_t took = now_ms() - t0;
    late.join();
    CHECK(got == 4);
    CHECK(memcmp(buf, "ping", 4) == 0);
    CHECK(took < 2000);
    std::thread reader([&] {
      char r[4];
      size_t n = read_exact(b.client, r, 4);
      CHECK(n == 4);
      CHECK(memcmp(r, "pong", 4) == 0);
    });
    usleep(50000);
    CHECK(write(b.server, "pong", 4) == 4);
    reader.join();
  }
  CHECK(write(a.client, "after", 5) == 5);
  char buf[8] = {};
  CHECK(read_exact(a.server, buf, 5) == 5);
  CHECK(memcmp(buf, "after", 5) == 0);
  // A connection made afterwards is librsock's as before (tracked: the
  // transport query answers) or, without librsock, the kernel's alike.
  Pair c = connected_pair();
  CHECK((transport_of(c.client) >= 0) == tracked);
  sigaction(SIGUSR1, &old, nullptr);
}
