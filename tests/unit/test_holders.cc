// socket/holders.h: the slots through which processes that share a
// connection since fork() count its bytes and tell who is left holding it.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include "socket/holders.h"

using namespace rsock::socket;

TEST_CASE("holders: a slot counts the bytes of every holder, across fork") {
  holders::Slot* s = holders::claim(100, 200);
  REQUIRE(s != nullptr);
  CHECK(holders::sole(s));
  holders::add(s);  // the child below
  CHECK_FALSE(holders::sole(s));
  int before = holders::in_use();
  int go[2];
  REQUIRE(pipe(go) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    holders::enlist(s);
    s->tx.fetch_add(5);
    s->rx.fetch_add(7);
    char c;
    if (read(go[0], &c, 1) != 1) _exit(2);
    if (c == 'r') holders::release(s);  // closes its copy; else exits holding it
    _exit(0);
  }
  s->tx.fetch_add(1);
  REQUIRE(write(go[1], "r", 1) == 1);
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);
  CHECK(holders::sole(s));
  CHECK(s->tx.load() == 106);
  CHECK(s->rx.load() == 207);
  CHECK_FALSE(holders::poisoned(s));
  holders::release(s);
  CHECK(holders::in_use() == before - 1);
  close(go[0]);
  close(go[1]);
}

TEST_CASE("holders: a live holder is looked up once per 100 ms, then found gone") {
  holders::Slot* s = holders::claim(0, 0);
  REQUIRE(s != nullptr);
  holders::add(s);
  int go[2], ready[2];
  REQUIRE(pipe(go) == 0);
  REQUIRE(pipe(ready) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    holders::enlist(s);
    (void)!write(ready[1], "x", 1);
    char c;
    (void)!read(go[0], &c, 1);
    _exit(0);  // still a holder
  }
  char c;
  REQUIRE(read(ready[0], &c, 1) == 1);
  const uint64_t t = 1'000'000'000'000;
  CHECK_FALSE(holders::reap(s, t));  // alive
  REQUIRE(write(go[1], "x", 1) == 1);
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);
  CHECK_FALSE(holders::reap(s, t + 50'000'000));  // trusted alive for 100 ms
  CHECK(holders::reap(s, t + 150'000'000));       // looked up again: gone
  holders::release(s);
  for (int fd : {go[0], go[1], ready[0], ready[1]}) close(fd);
}

TEST_CASE("holders: a holder that dies without releasing is reaped by its pid") {
  holders::Slot* s = holders::claim(0, 0);
  REQUIRE(s != nullptr);
  holders::add(s);
  int ready[2];
  REQUIRE(pipe(ready) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    holders::enlist(s);
    (void)!write(ready[1], "x", 1);
    _exit(0);  // still a holder
  }
  char c;
  REQUIRE(read(ready[0], &c, 1) == 1);
  CHECK_FALSE(holders::sole(s));
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);  // gone (reaped)
  CHECK(holders::reap(s, 1));
  CHECK(holders::sole(s));
  CHECK(holders::reap(s, 2));  // its count is taken off once
  CHECK(holders::sole(s));
  holders::poison(s);
  CHECK(holders::poisoned(s));
  holders::release(s);
  // A freed slot is claimed afresh: not poisoned, new positions.
  holders::Slot* t = holders::claim(9, 9);
  REQUIRE(t != nullptr);
  CHECK_FALSE(holders::poisoned(t));
  holders::release(t);
  close(ready[0]);
  close(ready[1]);
}

// fd passing: the receiver shares no memory with the sender (an exec'd
// worker), so it finds the slot by the socket's inode, in the per-user named
// table; the child below execs nothing, but finds it only by the key.
TEST_CASE("holders: a passed slot is found by inode, in another process, and freed by its holders") {
  const uint64_t ino = 0x7000000000000000ull | uint64_t(getpid()) << 8;  // no real socket's
  holders::Slot* s = holders::claim_passed(ino, /*client=*/true, 10, 20);
  REQUIRE(s != nullptr);
  CHECK(holders::is_passed(s));
  holders::Slot* forked = holders::claim(0, 0);
  REQUIRE(forked != nullptr);
  CHECK_FALSE(holders::is_passed(forked));
  holders::release(forked);
  holders::add(s);  // the receiver, in flight
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    bool client = false;
    holders::Slot* r = holders::find_passed(ino, &client);
    if (r == nullptr || !client || r->tx.load() != 10 || r->rx.load() != 20) _exit(2);
    holders::enlist(r);
    r->rx.fetch_add(3);  // bytes the receiver read
    holders::release(r);  // and closed
    _exit(0);
  }
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);
  CHECK(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
  CHECK(holders::sole(s));
  CHECK(s->rx.load() == 23);
  bool client = false;
  CHECK(holders::find_passed(ino + 1, &client) == nullptr);
  // A message that did not go out: its receiver's count is dropped.
  holders::add(s);
  holders::drop(s);
  CHECK(holders::sole(s));
  holders::release(s);
  CHECK(holders::find_passed(ino, &client) == nullptr);  // free again
}

TEST_CASE("holders: a new socket with a passed slot's inode poisons the old slot") {
  const uint64_t ino = 0x7100000000000000ull | uint64_t(getpid()) << 8;
  holders::Slot* old = holders::claim_passed(ino, false, 1, 1);
  REQUIRE(old != nullptr);
  holders::Slot* fresh = holders::claim_passed(ino, false, 2, 2);
  REQUIRE(fresh != nullptr);
  CHECK(fresh != old);
  CHECK(holders::poisoned(old));
  CHECK_FALSE(holders::poisoned(fresh));
  bool client = true;
  CHECK(holders::find_passed(ino, &client) == fresh);
  CHECK_FALSE(client);
  holders::release(old);
  holders::release(fresh);
}
