// epoll: level/edge-triggered, oneshot, rdhup, nesting, ctl errors, pwait(2).
#include <doctest/doctest.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <thread>

#include "helpers.h"

using namespace conf;

namespace {

// epoll_event is packed on x86-64: copy fields out before comparing.
uint64_t tag_of(const epoll_event& e) { return e.data.u64; }
int fd_of(const epoll_event& e) { return e.data.fd; }
uint32_t events_of(const epoll_event& e) { return e.events; }

Fd make_epoll() {
  Fd ep(epoll_create1(EPOLL_CLOEXEC));
  REQUIRE(ep >= 0);
  return ep;
}

void add(int ep, int fd, uint32_t events, uint64_t tag) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  REQUIRE(epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0);
}

// Waits for at most `max` events for up to `ms`; retries EINTR.
int wait_events(int ep, epoll_event* evs, int max, int ms) {
  int64_t deadline = now_ms() + ms;
  for (;;) {
    int left = static_cast<int>(deadline - now_ms());
    int r = epoll_wait(ep, evs, max, left < 0 ? 0 : left);
    if (r >= 0 || errno != EINTR) return r;
  }
}

// Waits until `fd` has exactly `n` bytes queued (data arrives in any split).
void wait_queued(int fd, int n) {
  int64_t deadline = now_ms() + timeout_ms();
  char buf[4096];
  while (now_ms() < deadline) {
    REQUIRE(wait_readable(fd));
    ssize_t r = recv(fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    if (r >= n) break;
    usleep(1000);
  }
}

}  // namespace

TEST_CASE("epoll: level-triggered reports readiness until drained") {
  Pair p = connected_pair();
  Fd ep = make_epoll();
  add(ep, p.server, EPOLLIN, 42);
  epoll_event evs[4];
  CHECK(wait_events(ep, evs, 4, 0) == 0);
  int64_t t0 = now_ms();
  CHECK(wait_events(ep, evs, 4, 120) == 0);  // timeout returns 0
  CHECK(now_ms() - t0 >= 110);

  REQUIRE(write(p.client, "level", 5) == 5);
  REQUIRE(wait_events(ep, evs, 4, timeout_ms()) == 1);
  CHECK(tag_of(evs[0]) == 42);
  CHECK(events_of(evs[0]) == EPOLLIN);
  wait_queued(p.server, 5);
  // Not consumed: reported again, and again.
  CHECK(wait_events(ep, evs, 4, 0) == 1);
  CHECK(wait_events(ep, evs, 4, 0) == 1);
  char b[8];
  REQUIRE(read(p.server, b, 2) == 2);
  CHECK(wait_events(ep, evs, 4, 0) == 1);  // 3 bytes left
  REQUIRE(read(p.server, b, 3) == 3);
  CHECK(wait_events(ep, evs, 4, 0) == 0);

  // EPOLLOUT on a writable socket, tagged with the fd.
  epoll_event ev{};
  ev.events = EPOLLOUT;
  ev.data.fd = p.client;
  REQUIRE(epoll_ctl(ep, EPOLL_CTL_ADD, p.client, &ev) == 0);
  REQUIRE(wait_events(ep, evs, 4, timeout_ms()) == 1);
  CHECK(fd_of(evs[0]) == p.client);
  CHECK(events_of(evs[0]) == EPOLLOUT);
}

TEST_CASE("epoll: EPOLLET reports each arrival once, not repeatedly") {
  Pair p = connected_pair();
  set_nonblocking(p.server, true);
  Fd ep = make_epoll();
  add(ep, p.server, EPOLLIN | EPOLLET, 7);
  epoll_event evs[4];
  CHECK(wait_events(ep, evs, 4, 0) == 0);

  REQUIRE(write(p.client, "a", 1) == 1);
  REQUIRE(wait_events(ep, evs, 4, timeout_ms()) == 1);
  CHECK(tag_of(evs[0]) == 7);
  CHECK((evs[0].events & EPOLLIN));
  // Not drained, but no new arrival: no second event.
  CHECK(wait_events(ep, evs, 4, 100) == 0);
  CHECK(wait_events(ep, evs, 4, 0) == 0);

  // A new arrival re-triggers even though the old byte is still queued.
  REQUIRE(write(p.client, "b", 1) == 1);
  REQUIRE(wait_events(ep, evs, 4, timeout_ms()) == 1);
  CHECK(wait_events(ep, evs, 4, 100) == 0);

  // Drain to EAGAIN (the ET contract), then new data re-triggers.
  char b[8];
  wait_queued(p.server, 2);
  CHECK(read(p.server, b, sizeof b) == 2);
  CHECK(memcmp(b, "ab", 2) == 0);
  errno = 0;
  CHECK(read(p.server, b, sizeof b) == -1);
  CHECK(errno == EAGAIN);
  CHECK(wait_events(ep, evs, 4, 50) == 0);
  REQUIRE(write(p.client, "c", 1) == 1);
  REQUIRE(wait_events(ep, evs, 4, timeout_ms()) == 1);
  CHECK(read_exact(p.server, b, 1) == 1);
  CHECK(b[0] == 'c');

  // EPOLLOUT|EPOLLET: reported once when writable, not again while idle.
  Fd ep2 = make_epoll();
  add(ep2, p.client, EPOLLOUT | EPOLLET, 8);
  REQUIRE(wait_events(ep2, evs, 4, timeout_ms()) == 1);
  CHECK(events_of(evs[0]) == EPOLLOUT);
  CHECK(wait_events(ep2, evs, 4, 100) == 0);
}

TEST_CASE("epoll: EPOLLONESHOT disables after one event until EPOLL_CTL_MOD") {
  Pair p = connected_pair();
  Fd ep = make_epoll();
  add(ep, p.server, EPOLLIN | EPOLLONESHOT, 9);
  epoll_event evs[4];
  REQUIRE(write(p.client, "1", 1) == 1);
  REQUIRE(wait_events(ep, evs, 4, timeout_ms()) == 1);
  CHECK(tag_of(evs[0]) == 9);
  // Disabled now, even with more data coming.
  REQUIRE(write(p.client, "2", 1) == 1);
  wait_queued(p.server, 2);
  CHECK(wait_events(ep, evs, 4, 100) == 0);
  // Still registered: ADD again is EEXIST.
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.u64 = 10;
  errno = 0;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, p.server, &ev) == -1);
  CHECK(errno == EEXIST);
  // Re-arm with MOD: the pending data is reported (with the new tag), once.
  REQUIRE(epoll_ctl(ep, EPOLL_CTL_MOD, p.server, &ev) == 0);
  REQUIRE(wait_events(ep, evs, 4, timeout_ms()) == 1);
  CHECK(tag_of(evs[0]) == 10);
  CHECK(wait_events(ep, evs, 4, 50) == 0);
  char b[2];
  CHECK(read_exact(p.server, b, 2) == 2);
}

TEST_CASE("epoll: EPOLLRDHUP and EPOLLHUP on peer shutdown/close") {
  Pair p = connected_pair();
  Fd ep = make_epoll();
  add(ep, p.server, EPOLLIN | EPOLLRDHUP, 11);
  epoll_event evs[4];
  CHECK(wait_events(ep, evs, 4, 0) == 0);
  REQUIRE(shutdown(p.client, SHUT_WR) == 0);
  REQUIRE(wait_events(ep, evs, 4, timeout_ms()) == 1);
  int64_t deadline = now_ms() + timeout_ms();
  while (!(evs[0].events & EPOLLRDHUP) && now_ms() < deadline)
    REQUIRE(wait_events(ep, evs, 4, 1000) >= 0);
  CHECK((evs[0].events & EPOLLRDHUP));
  CHECK((evs[0].events & EPOLLIN));
  CHECK_FALSE((evs[0].events & EPOLLHUP));
  char b;
  CHECK(read(p.server, &b, 1) == 0);
  // Our side shuts down too: EPOLLHUP is reported without asking.
  REQUIRE(shutdown(p.server, SHUT_WR) == 0);
  REQUIRE(wait_events(ep, evs, 4, timeout_ms()) == 1);
  CHECK((evs[0].events & EPOLLHUP));

  // A reset peer: EPOLLERR|EPOLLHUP.
  Pair q = connected_pair();
  Fd ep2 = make_epoll();
  add(ep2, q.server, EPOLLIN, 12);
  linger lg{1, 0};
  REQUIRE(setsockopt(q.client, SOL_SOCKET, SO_LINGER, &lg, sizeof lg) == 0);
  REQUIRE(q.client.reset() == 0);
  REQUIRE(wait_events(ep2, evs, 4, timeout_ms()) == 1);
  deadline = now_ms() + timeout_ms();
  while (!(evs[0].events & EPOLLERR) && now_ms() < deadline) REQUIRE(wait_events(ep2, evs, 4, 1000) >= 0);
  CHECK((evs[0].events & EPOLLERR));
  CHECK((evs[0].events & EPOLLHUP));
}

TEST_CASE("epoll: nested epoll (an epoll fd inside another epoll)") {
  Pair p = connected_pair();
  Fd inner = make_epoll();
  Fd outer = make_epoll();
  add(inner, p.server, EPOLLIN, 100);
  add(outer, inner, EPOLLIN, 200);
  epoll_event evs[4];
  CHECK(wait_events(outer, evs, 4, 50) == 0);
  // The inner epoll fd itself is pollable.
  CHECK(poll_one(inner, POLLIN, 0) == 0);

  std::thread t([&] {
    usleep(50000);
    (void)!write(p.client, "nest", 4);
  });
  int r = wait_events(outer, evs, 4, timeout_ms());
  t.join();
  REQUIRE(r == 1);
  CHECK(tag_of(evs[0]) == 200);
  CHECK(events_of(evs[0]) == EPOLLIN);
  CHECK((poll_one(inner, POLLIN, 0) & POLLIN));
  REQUIRE(wait_events(inner, evs, 4, 0) == 1);
  CHECK(tag_of(evs[0]) == 100);
  char b[4];
  REQUIRE(read_exact(p.server, b, 4) == 4);
  CHECK(wait_events(outer, evs, 4, 50) == 0);
  // An epoll fd cannot watch itself; a loop between two is ELOOP.
  epoll_event ev{};
  ev.events = EPOLLIN;
  errno = 0;
  CHECK(epoll_ctl(inner, EPOLL_CTL_ADD, outer, &ev) == -1);
  CHECK(errno == ELOOP);
}

TEST_CASE("epoll: EPOLL_CTL errors (ENOENT, EEXIST, EBADF, EINVAL, EPERM)") {
  Pair p = connected_pair();
  Fd ep = make_epoll();
  epoll_event ev{};
  ev.events = EPOLLIN;
  errno = 0;
  CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, p.server, &ev) == -1);
  CHECK(errno == ENOENT);
  errno = 0;
  CHECK(epoll_ctl(ep, EPOLL_CTL_DEL, p.server, &ev) == -1);
  CHECK(errno == ENOENT);
  REQUIRE(epoll_ctl(ep, EPOLL_CTL_ADD, p.server, &ev) == 0);
  errno = 0;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, p.server, &ev) == -1);
  CHECK(errno == EEXIST);
  // A dup of a registered fd is a separate registration.
  Fd d(dup(p.server));
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, d, &ev) == 0);
  CHECK(epoll_ctl(ep, EPOLL_CTL_DEL, d, nullptr) == 0);
  // Bad fds.
  int dead = dup(p.server);
  REQUIRE(close(dead) == 0);
  errno = 0;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, dead, &ev) == -1);
  CHECK(errno == EBADF);
  errno = 0;
  CHECK(epoll_ctl(dead, EPOLL_CTL_ADD, p.server, &ev) == -1);
  CHECK(errno == EBADF);
  // epfd == fd, or epfd that is not an epoll: EINVAL.
  errno = 0;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, ep, &ev) == -1);
  CHECK(errno == EINVAL);
  errno = 0;
  CHECK(epoll_ctl(p.client, EPOLL_CTL_ADD, p.server, &ev) == -1);
  CHECK(errno == EINVAL);
  errno = 0;
  CHECK(epoll_ctl(ep, 999, p.server, &ev) == -1);
  CHECK(errno == EINVAL);
  // Regular files do not support epoll: EPERM.
  Fd file(open("/proc/self/exe", O_RDONLY));
  REQUIRE(file >= 0);
  errno = 0;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, file, &ev) == -1);
  CHECK(errno == EPERM);
  // epoll_wait argument errors.
  epoll_event evs[1];
  errno = 0;
  CHECK(epoll_wait(ep, evs, 0, 0) == -1);
  CHECK(errno == EINVAL);
  errno = 0;
  CHECK(epoll_wait(p.client, evs, 1, 0) == -1);
  CHECK(errno == EINVAL);
  // DEL works, then MOD is ENOENT again.
  CHECK(epoll_ctl(ep, EPOLL_CTL_DEL, p.server, nullptr) == 0);
  errno = 0;
  CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, p.server, &ev) == -1);
  CHECK(errno == ENOENT);
}

TEST_CASE("epoll: closing a socket removes it from the set") {
  Pair p = connected_pair();
  Fd ep = make_epoll();
  add(ep, p.server, EPOLLIN, 13);
  add(ep, p.client, EPOLLIN, 14);
  REQUIRE(write(p.client, "x", 1) == 1);
  epoll_event evs[2];
  REQUIRE(wait_events(ep, evs, 2, timeout_ms()) == 1);
  CHECK(tag_of(evs[0]) == 13);
  // Close the registered socket (its only fd): no more events for it, the
  // wait does not fail, and the other registration is unaffected.
  // The peer's close shows up on the client side (EOF readable).
  REQUIRE(p.server.reset() == 0);
  REQUIRE(wait_events(ep, evs, 2, timeout_ms()) == 1);
  CHECK(tag_of(evs[0]) == 14);
  // ...and only there, on every later wait too.
  CHECK(wait_events(ep, evs, 2, 50) == 1);
  CHECK(tag_of(evs[0]) == 14);
  // The closed fd's number can be reused and registered afresh.
  Fd again(socket(AF_INET, SOCK_STREAM, 0));
  epoll_event ev{};
  ev.events = EPOLLOUT;
  CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, again, &ev) == 0);
}

TEST_CASE("epoll: a registration outlives closing one of two fds of the socket") {
  // Linux keys registrations by open file description: closing the
  // registered fd while a dup keeps the socket open leaves it registered
  // (the classic epoll gotcha some programs rely on, knowingly or not).
  Pair p = connected_pair();
  Fd ep = make_epoll();
  int fd = dup(p.server);
  REQUIRE(fd >= 0);
  add(ep, fd, EPOLLIN, 15);
  REQUIRE(close(fd) == 0);  // p.server still references the socket
  REQUIRE(write(p.client, "x", 1) == 1);
  epoll_event evs[2];
  REQUIRE(wait_events(ep, evs, 2, timeout_ms()) == 1);
  CHECK(tag_of(evs[0]) == 15);
  // Now really close the socket: no more events.
  REQUIRE(p.server.reset() == 0);
  CHECK(wait_events(ep, evs, 2, 50) == 0);
}

TEST_CASE("epoll: epoll_pwait and epoll_pwait2") {
  Pair p = connected_pair();
  Fd ep = make_epoll();
  add(ep, p.server, EPOLLIN, 14);
  epoll_event evs[2];
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGUSR1);
  int64_t t0 = now_ms();
  CHECK(epoll_pwait(ep, evs, 2, 100, &mask) == 0);
  CHECK(now_ms() - t0 >= 90);
  REQUIRE(write(p.client, "pw", 2) == 2);
  REQUIRE(epoll_pwait(ep, evs, 2, timeout_ms(), &mask) == 1);
  CHECK(tag_of(evs[0]) == 14);

  char b[2];
  REQUIRE(read_exact(p.server, b, 2) == 2);
  timespec ts{0, 100 * 1000000};
  t0 = now_ms();
  errno = 0;
  int r = epoll_pwait2(ep, evs, 2, &ts, &mask);
  if (r == -1 && errno == ENOSYS) {
    MESSAGE("SKIP: epoll_pwait2 not supported by this kernel");
    return;
  }
  CHECK(r == 0);
  CHECK(now_ms() - t0 >= 90);
  timespec zero{0, 0};
  CHECK(epoll_pwait2(ep, evs, 2, &zero, nullptr) == 0);
  REQUIRE(write(p.client, "p2", 2) == 2);
  timespec longer{timeout_ms() / 1000, 0};
  REQUIRE(epoll_pwait2(ep, evs, 2, &longer, nullptr) == 1);
  CHECK(tag_of(evs[0]) == 14);
  CHECK(events_of(evs[0]) == EPOLLIN);
  // NULL timeout blocks until ready; it is ready.
  CHECK(epoll_pwait2(ep, evs, 2, nullptr, &mask) == 1);
  // Bad timespec: EINVAL.
  timespec bad{0, 2000000000};
  errno = 0;
  CHECK(epoll_pwait2(ep, evs, 2, &bad, nullptr) == -1);
  CHECK(errno == EINVAL);
}

TEST_CASE("epoll: delete and re-add per request, as event loops do, reports by the new mask") {
  // redis's ae and libevent delete a socket and add it back (often with
  // another mask) for every request. Each re-added registration must behave
  // like a fresh one: nothing while deleted, then the current state.
  Pair p = connected_pair();
  Fd ep = make_epoll();
  epoll_event evs[2];
  char b[16];
  for (int round = 0; round < 20; round++) {
    CAPTURE(round);
    add(ep, p.server, EPOLLOUT, 30);  // a request to write
    REQUIRE(wait_events(ep, evs, 2, timeout_ms()) == 1);
    CHECK(tag_of(evs[0]) == 30);
    CHECK(events_of(evs[0]) == EPOLLOUT);
    REQUIRE(write(p.server, "q", 1) == 1);
    epoll_event in{};
    in.events = EPOLLIN;
    in.data.u64 = 31;
    REQUIRE(epoll_ctl(ep, EPOLL_CTL_MOD, p.server, &in) == 0);  // now wait for the reply
    REQUIRE(read_exact(p.client, b, 1) == 1);
    CHECK(wait_events(ep, evs, 2, 0) == 0);
    REQUIRE(write(p.client, "r", 1) == 1);
    REQUIRE(wait_events(ep, evs, 2, timeout_ms()) == 1);
    CHECK(tag_of(evs[0]) == 31);
    CHECK(events_of(evs[0]) == EPOLLIN);
    REQUIRE(epoll_ctl(ep, EPOLL_CTL_DEL, p.server, nullptr) == 0);
    // Deleted: the unread reply is reported to nobody, and a second
    // delete or a modify fails as for any unknown fd.
    CHECK(wait_events(ep, evs, 2, 0) == 0);
    CHECK(epoll_ctl(ep, EPOLL_CTL_DEL, p.server, nullptr) == -1);
    CHECK(errno == ENOENT);
    CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, p.server, &in) == -1);
    CHECK(errno == ENOENT);
    REQUIRE(read_exact(p.server, b, 1) == 1);
    if (round % 5 == 4) {
      // Re-added edge-triggered while data is already there: one report.
      REQUIRE(write(p.client, "e", 1) == 1);
      wait_queued(p.server, 1);
      add(ep, p.server, EPOLLIN | EPOLLET, 32);
      REQUIRE(wait_events(ep, evs, 2, timeout_ms()) == 1);
      CHECK(tag_of(evs[0]) == 32);
      CHECK(wait_events(ep, evs, 2, 0) == 0);
      REQUIRE(read_exact(p.server, b, 1) == 1);
      REQUIRE(epoll_ctl(ep, EPOLL_CTL_DEL, p.server, nullptr) == 0);
    }
  }
  // A deleted socket closed and its number reused: the new socket is added
  // afresh (nothing of the old registration leaks into it).
  int num = p.server.get();
  REQUIRE(p.server.reset() == 0);
  Fd fresh(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(fresh >= 0);
  REQUIRE(dup2(fresh, num) == num);
  Fd again(num);
  add(ep, again, EPOLLIN, 33);
  CHECK(wait_events(ep, evs, 2, 50) == 1);  // an unconnected socket: EPOLLHUP
  CHECK(tag_of(evs[0]) == 33);
}
