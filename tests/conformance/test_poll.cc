// Readiness: poll, ppoll, select, pselect.
#include <doctest/doctest.h>
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/select.h>
#include <unistd.h>

#include <thread>

#include "helpers.h"

using namespace conf;

TEST_CASE("poll: readable only after data, writable, timeout returns 0") {
  Pair p = connected_pair();
  pollfd pf{p.server, POLLIN | POLLOUT, 0};
  REQUIRE(poll(&pf, 1, 0) == 1);
  CHECK(pf.revents == POLLOUT);  // writable, not readable
  pf = {p.server, POLLIN, 0};
  int64_t t0 = now_ms();
  CHECK(poll(&pf, 1, 150) == 0);
  CHECK(now_ms() - t0 >= 140);
  CHECK(pf.revents == 0);

  REQUIRE(write(p.client, "x", 1) == 1);
  pf = {p.server, POLLIN | POLLOUT, 0};
  int64_t deadline = now_ms() + timeout_ms();
  while (!(pf.revents & POLLIN) && now_ms() < deadline) REQUIRE(poll(&pf, 1, 1000) >= 0);
  CHECK(pf.revents == (POLLIN | POLLOUT));
  // Level-triggered: still readable until consumed.
  pf.revents = 0;
  CHECK(poll(&pf, 1, 0) == 1);
  CHECK((pf.revents & POLLIN));
  char b;
  REQUIRE(read(p.server, &b, 1) == 1);
  pf = {p.server, POLLIN, 0};
  CHECK(poll(&pf, 1, 0) == 0);

  // Several fds; negative fds are ignored; revents counts fds, not events.
  pollfd many[3] = {{p.server, POLLIN, 0}, {-1, POLLIN, 0}, {p.client, POLLOUT, 0}};
  CHECK(poll(many, 3, 0) == 1);
  CHECK(many[0].revents == 0);
  CHECK(many[1].revents == 0);
  CHECK(many[2].revents == POLLOUT);
  // A closed fd reports POLLNVAL.
  int dead = dup(p.client);
  REQUIRE(close(dead) == 0);
  pollfd nv{dead, POLLIN, 0};
  CHECK(poll(&nv, 1, 0) == 1);
  CHECK(nv.revents == POLLNVAL);
}

TEST_CASE("poll: a blocked poll wakes when data arrives from another thread") {
  Pair p = connected_pair();
  std::thread t([&] {
    usleep(100000);
    (void)!write(p.client, "wake", 4);
  });
  pollfd pf{p.server, POLLIN, 0};
  int64_t t0 = now_ms();
  int r = poll(&pf, 1, timeout_ms());
  int64_t took = now_ms() - t0;
  t.join();
  CHECK(r == 1);
  CHECK((pf.revents & POLLIN));
  CHECK(took >= 50);
  CHECK(took < timeout_ms());
}

TEST_CASE("poll: POLLRDHUP after peer close, POLLHUP once both directions are down") {
  Pair p = connected_pair();
  pollfd pf{p.server, POLLIN | POLLRDHUP, 0};
  CHECK(poll(&pf, 1, 0) == 0);
  REQUIRE(p.client.reset() == 0);
  pf.revents = 0;
  int64_t deadline = now_ms() + timeout_ms();
  while (!(pf.revents & POLLRDHUP) && now_ms() < deadline) REQUIRE(poll(&pf, 1, 1000) >= 0);
  CHECK((pf.revents & POLLIN));  // EOF is readable
  CHECK((pf.revents & POLLRDHUP));
  char b;
  CHECK(read(p.server, &b, 1) == 0);
  // Our side shuts down too: POLLHUP (always reported, even if not requested).
  REQUIRE(shutdown(p.server, SHUT_WR) == 0);
  pf = {p.server, 0, 0};
  CHECK(poll(&pf, 1, 0) == 1);
  CHECK((pf.revents & POLLHUP));
}

TEST_CASE("ppoll: timespec timeout and sigmask") {
  Pair p = connected_pair();
  pollfd pf{p.server, POLLIN, 0};
  timespec ts{0, 120 * 1000000};
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGUSR1);
  int64_t t0 = now_ms();
  CHECK(ppoll(&pf, 1, &ts, &mask) == 0);
  CHECK(now_ms() - t0 >= 110);
  REQUIRE(write(p.client, "pp", 2) == 2);
  timespec longer{timeout_ms() / 1000, 0};
  pf.revents = 0;
  CHECK(ppoll(&pf, 1, &longer, nullptr) == 1);
  CHECK(pf.revents == POLLIN);
  // NULL timeout = infinite; data is already there so it returns at once.
  CHECK(ppoll(&pf, 1, nullptr, &mask) == 1);
}

TEST_CASE("select: readability, writability and timeout") {
  Pair p = connected_pair();
  REQUIRE(p.server.get() < FD_SETSIZE);
  fd_set r, w;
  FD_ZERO(&r);
  FD_ZERO(&w);
  FD_SET(p.server, &r);
  FD_SET(p.server, &w);
  int maxfd = std::max(p.server.get(), p.client.get()) + 1;
  timeval tv{0, 0};
  CHECK(select(maxfd, &r, &w, nullptr, &tv) == 1);
  CHECK_FALSE(FD_ISSET(p.server, &r));
  CHECK(FD_ISSET(p.server, &w));

  FD_ZERO(&r);
  FD_SET(p.server, &r);
  tv = {0, 150000};
  int64_t t0 = now_ms();
  CHECK(select(maxfd, &r, nullptr, nullptr, &tv) == 0);
  CHECK(now_ms() - t0 >= 140);
  CHECK_FALSE(FD_ISSET(p.server, &r));
  // Linux updates the timeval with the time left (0 here).
  CHECK(tv.tv_sec == 0);
  CHECK(tv.tv_usec == 0);

  REQUIRE(write(p.client, "sel", 3) == 3);
  FD_ZERO(&r);
  FD_SET(p.server, &r);
  FD_SET(p.client, &r);
  tv = {timeout_ms() / 1000, 0};
  CHECK(select(maxfd, &r, nullptr, nullptr, &tv) == 1);
  CHECK(FD_ISSET(p.server, &r));
  CHECK_FALSE(FD_ISSET(p.client, &r));
  CHECK(tv.tv_sec + tv.tv_usec > 0);  // returned before the timeout

  // EOF is readable for select too.
  char b[3];
  REQUIRE(read_exact(p.server, b, 3) == 3);
  REQUIRE(shutdown(p.client, SHUT_WR) == 0);
  FD_ZERO(&r);
  FD_SET(p.server, &r);
  tv = {timeout_ms() / 1000, 0};
  CHECK(select(maxfd, &r, nullptr, nullptr, &tv) == 1);
  CHECK(read(p.server, b, 1) == 0);

  // A closed fd in the set: EBADF.
  int dead = dup(p.client);
  REQUIRE(close(dead) == 0);
  FD_ZERO(&r);
  FD_SET(dead, &r);
  tv = {0, 0};
  errno = 0;
  CHECK(select(dead + 1, &r, nullptr, nullptr, &tv) == -1);
  CHECK(errno == EBADF);
}

TEST_CASE("pselect: timespec timeout, sigmask, readiness") {
  Pair p = connected_pair();
  fd_set r;
  FD_ZERO(&r);
  FD_SET(p.server, &r);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGUSR1);
  timespec ts{0, 120 * 1000000};
  int64_t t0 = now_ms();
  CHECK(pselect(p.server + 1, &r, nullptr, nullptr, &ts, &mask) == 0);
  CHECK(now_ms() - t0 >= 110);
  REQUIRE(write(p.client, "ps", 2) == 2);
  FD_ZERO(&r);
  FD_SET(p.server, &r);
  timespec longer{timeout_ms() / 1000, 0};
  CHECK(pselect(p.server + 1, &r, nullptr, nullptr, &longer, nullptr) == 1);
  CHECK(FD_ISSET(p.server, &r));
  fd_set w;
  FD_ZERO(&w);
  FD_SET(p.client, &w);
  CHECK(pselect(p.client + 1, nullptr, &w, nullptr, nullptr, &mask) == 1);
  CHECK(FD_ISSET(p.client, &w));
}
