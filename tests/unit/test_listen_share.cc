// socket/listen_share.h: the table through which the process that holds a
// port's rdma_cm listener redirects requests to the process that accepted
// the connection (fork children, SO_REUSEPORT groups, images exec'd with
// the listening socket).
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "socket/listen_share.h"

using namespace rsock::socket;

namespace {
sockaddr_in v4(const char* ip) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, ip, &a.sin_addr);
  return a;
}
const sockaddr* sa(const sockaddr_in& a) { return reinterpret_cast<const sockaddr*>(&a); }

// The named tables of `port` this user created (the test's own: a port no
// listener uses), removed.
void remove_named(uint16_t port) {
  DIR* d = opendir("/dev/shm");
  if (!d) return;
  std::string prefix = "librsock-rp-" + std::to_string(geteuid()) + "-";
  std::string suffix = "-" + std::to_string(port);
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n.rfind(prefix, 0) == 0 && n.size() > suffix.size() &&
        n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0)
      shm_unlink(("/" + n).c_str());
  }
  closedir(d);
}
}  // namespace

TEST_CASE("listen_share: a published connection is found by client address and ports until it expires") {
  listen_share::Table* t = listen_share::create();
  REQUIRE(t != nullptr);
  auto client = v4("10.1.2.3");
  int slot = listen_share::publish(t, sa(client), htons(40000), htons(80), 51000, 1000, 500);
  REQUIRE(slot >= 0);
  CHECK(listen_share::lookup(t, sa(client), htons(40000), htons(80), 1200) == 51000);
  CHECK(listen_share::lookup(t, sa(client), htons(40001), htons(80), 1200) == 0);
  CHECK(listen_share::lookup(t, sa(v4("10.1.2.4")), htons(40000), htons(80), 1200) == 0);
  CHECK(listen_share::lookup(t, sa(client), htons(40000), htons(80), 1600) == 0);  // expired
  listen_share::clear(t, slot);
  CHECK(listen_share::lookup(t, sa(client), htons(40000), htons(80), 1200) == 0);
}

TEST_CASE("listen_share: an exec mark and the port's named table, seen from a second mapping") {
  const uint16_t port = uint16_t(61000 + getpid() % 4000);
  remove_named(port);
  auto bound = v4("127.0.0.1");
  listen_share::Table* owner_side = listen_share::create();
  REQUIRE(owner_side != nullptr);
  CHECK_FALSE(listen_share::exec_marked(owner_side));
  listen_share::mark_exec(owner_side);  // what an exec'ing child does to the owner's table
  CHECK(listen_share::exec_marked(owner_side));
  // The exec'd image and the owner map the same named table independently.
  listen_share::Table* a = listen_share::open_group(sa(bound), port);
  listen_share::Table* b = listen_share::open_group(sa(bound), port);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  CHECK(a != b);
  listen_share::set_owner(a, 4242);
  CHECK(listen_share::owner(b) == 4242);
  CHECK_FALSE(listen_share::exec_marked(b));
  auto client = v4("10.9.9.9");
  REQUIRE(listen_share::publish(a, sa(client), htons(33333), htons(port), 52000, 10, 1000) >= 0);
  CHECK(listen_share::lookup(b, sa(client), htons(33333), htons(port), 20) == 52000);
  // Another port's table is another object.
  listen_share::Table* other = listen_share::open_group(sa(bound), uint16_t(port + 1));
  REQUIRE(other != nullptr);
  CHECK(listen_share::lookup(other, sa(client), htons(33333), htons(port), 20) == 0);
  remove_named(port);
  remove_named(uint16_t(port + 1));
}
