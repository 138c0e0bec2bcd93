// The fd table and socket pool: lookup/install/remove semantics, reference
// counting, high fds, and lookups racing with close/dup2 from other threads.
#include <doctest/doctest.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>
#include <vector>

#include "socket/fd_table.h"

using namespace rsock::socket;

TEST_CASE("fd table: only TCP stream sockets are tracked kinds") {
  CHECK(is_tracked_kind(AF_INET, SOCK_STREAM, 0));
  CHECK(is_tracked_kind(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP));
  CHECK_FALSE(is_tracked_kind(AF_INET, SOCK_DGRAM, 0));
  CHECK_FALSE(is_tracked_kind(AF_UNIX, SOCK_STREAM, 0));
  CHECK_FALSE(is_tracked_kind(AF_INET, SOCK_STREAM, IPPROTO_SCTP));
  CHECK_FALSE(is_tracked_kind(AF_INET, SOCK_SEQPACKET, 0));
}

TEST_CASE("fd table: install, lookup, remove and dup sharing") {
  FdTable* t = FdTable::get_or_create();
  REQUIRE(t);
  CHECK(t->capacity() > 65536);  // sized from nr_open, not the soft limit
  Socket* s = new_socket(AF_INET, Role::kClient, true);
  REQUIRE(s);
  t->install(900, s);
  t->install(70000, s);  // a dup at a high fd names the same socket
  {
    SocketRef a = t->lookup(900), b = t->lookup(70000);
    REQUIRE(a);
    CHECK(a.get() == b.get());
    CHECK(a->nonblocking());
    CHECK(a->role() == Role::kClient);
  }
  s->unref();  // drop the creator's reference: the table still holds two
  CHECK(t->lookup(900));
  t->remove(900).reset();
  CHECK_FALSE(t->lookup(900));
  CHECK(t->lookup(70000));  // close of one dup leaves the other working
  t->remove_range(69990, 70010);
  CHECK_FALSE(t->lookup(70000));
  CHECK_FALSE(t->lookup(-1));
  CHECK_FALSE(t->lookup(static_cast<int>(t->capacity())));
}

TEST_CASE("fd table: a freed socket is recycled and cannot be revived") {
  Socket* s = new_socket(AF_INET, Role::kUnknown, false);
  REQUIRE(s);
  s->unref();
  CHECK_FALSE(s->try_ref());  // count is 0: stale pointers cannot take it
  Socket* again = new_socket(AF_INET6, Role::kAccepted, false);
  REQUIRE(again);
  CHECK(again->domain() == AF_INET6);
  CHECK(again->slot() == nullptr);  // no stats slot carried over
  again->unref();
}

TEST_CASE("fd table: lookups race with install/remove without use-after-free") {
  FdTable* t = FdTable::get_or_create();
  REQUIRE(t);
  constexpr int kFd = 1234;
  std::atomic<bool> stop{false};
  std::atomic<long> hits{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < 3; i++) {
    readers.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
        if (SocketRef r = t->lookup(kFd)) {
          // A live reference must see a live socket with a sane domain.
          CHECK((r->domain() == AF_INET || r->domain() == AF_INET6));
          r->on_tcp_rx(1);
          hits.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  }
  for (int i = 0; i < 20000; i++) {
    Socket* s = new_socket(i % 2 ? AF_INET : AF_INET6, Role::kAccepted, false);
    REQUIRE(s);
    t->install(kFd, s);
    s->unref();
    t->remove(kFd).reset();
  }
  stop = true;
  for (auto& th : readers) th.join();
  CHECK_FALSE(t->lookup(kFd));
  MESSAGE("successful racing lookups: " << hits.load());
}

TEST_CASE("fd table: next_tracked finds the tracked fds of a range (close_range, fd_closing)") {
  FdTable* t = FdTable::get_or_create();
  REQUIRE(t);
  Socket* s = new_socket(AF_INET, Role::kClient, false);
  REQUIRE(s);
  t->install(1200, s);
  t->install(1300, s);
  CHECK(t->next_tracked(1100, 1250) == 1200);
  CHECK(t->next_tracked(1200, 1200) == 1200);
  CHECK(t->next_tracked(1201, 1299) == -1);
  CHECK(t->next_tracked(1201, 1300) == 1300);
  CHECK(t->next_tracked(1301, 1200) == -1);  // an empty range
  CHECK(t->next_tracked(unsigned(t->capacity()), ~0u) == -1);
  // A fork child frees every tracked socket's watch lock (a parent thread
  // may have held one at the fork: its pushes would spin forever).
  s->watch_lock.store(true);
  t->reset_watch_locks_after_fork();
  CHECK_FALSE(s->watch_lock.load());
  s->unref();
  t->remove_range(1200, 1300);
  CHECK(t->next_tracked(1100, 1400) == -1);
}
