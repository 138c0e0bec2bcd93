// util/sys.h: push_unsent, on a loopback TCP connection.
#include <arpa/inet.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include "util/sys.h"

namespace {

struct Pair {
  int a = -1, b = -1;
  Pair() {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    REQUIRE(bind(l, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
    REQUIRE(listen(l, 1) == 0);
    REQUIRE(getsockname(l, reinterpret_cast<sockaddr*>(&sa), &len) == 0);
    a = socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(connect(a, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
    b = accept(l, nullptr, nullptr);
    REQUIRE(b >= 0);
    close(l);
  }
  ~Pair() {
    close(a);
    close(b);
  }
};

int opt(int fd, int o) {
  int v = -1;
  socklen_t len = sizeof v;
  REQUIRE(getsockopt(fd, IPPROTO_TCP, o, &v, &len) == 0);
  return v;
}

void set(int fd, int o, int v) { REQUIRE(setsockopt(fd, IPPROTO_TCP, o, &v, sizeof v) == 0); }

int unsent(int fd) {
  int n = -1;
  REQUIRE(ioctl(fd, SIOCOUTQNSD, &n) == 0);
  return n;
}

// Writes 10 bytes that TCP_CORK keeps in the queue (a partial segment).
// The kernel sends corked bytes after 200 ms at the latest: a host slow
// enough to pass that between the write and the look gets another try.
bool write_held(int fd) {
  for (int i = 0; i < 5; i++) {
    REQUIRE(write(fd, "0123456789", 10) == 10);
    if (unsent(fd) > 0) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("push_unsent sends what TCP_CORK holds and keeps TCP_NODELAY off") {
  Pair p;
  set(p.a, TCP_CORK, 1);
  REQUIRE(write_held(p.a));
  rsock::sys::push_unsent(p.a);
  CHECK(unsent(p.a) == 0);
  CHECK(opt(p.a, TCP_NODELAY) == 0);
  CHECK(opt(p.a, TCP_CORK) != 0);  // the application's cork stays
}

TEST_CASE("push_unsent keeps TCP_NODELAY on when the application set it") {
  Pair p;
  set(p.a, TCP_NODELAY, 1);
  set(p.a, TCP_CORK, 1);
  REQUIRE(write_held(p.a));
  rsock::sys::push_unsent(p.a);
  CHECK(unsent(p.a) == 0);
  CHECK(opt(p.a, TCP_NODELAY) != 0);
}
