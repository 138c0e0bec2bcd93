// Helpers of the preloaded single-process VM tests (tests/readiness/noalloc.cc,
// tests/upgrade/io_uring.cc): a failing check, the SOL_RSOCK transport of a
// socket, the RDMA-device skip, and one TCP connection to itself over ADDR
// that both ends upgrade.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "preload/librsock.h"

#define CHECK(c, ...)                                             \
  do {                                                            \
    if (!(c)) {                                                   \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);   \
      std::fprintf(stderr, __VA_ARGS__);                          \
      std::fprintf(stderr, "\n");                                 \
      std::exit(1);                                               \
    }                                                             \
  } while (0)

namespace inprocess {

// RSOCK_TRANSPORT_*, or -1 without librsock.
inline int transport_of(int fd) {
  int t = -1;
  socklen_t len = sizeof t;
  if (getsockopt(fd, SOL_RSOCK, RSOCK_TRANSPORT, &t, &len) != 0) return -1;
  return t;
}

inline void sleep_ms(int ms) {
  timespec t{ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, nullptr);
}

// Exits 77 ("SKIP") when this host has no verbs device.
inline void skip_without_device() {
  bool any = false;
  if (DIR* d = opendir("/sys/class/infiniband")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') any = true;
    closedir(d);
  }
  if (!any) {
    std::printf("SKIP: no RDMA device\n");
    std::exit(77);
  }
}

struct Pair {
  int listener = -1, client = -1, server = -1;
  sockaddr_in addr{};  // the listener's
};

// A listener on ADDR (any port), one connection to it, accepted.
inline Pair connect_to_self(const char* addr) {
  Pair p;
  p.addr.sin_family = AF_INET;
  CHECK(inet_pton(AF_INET, addr, &p.addr.sin_addr) == 1, "bad address %s", addr);
  p.listener = socket(AF_INET, SOCK_STREAM, 0);
  CHECK(p.listener >= 0 &&
            bind(p.listener, reinterpret_cast<sockaddr*>(&p.addr), sizeof p.addr) == 0 &&
            listen(p.listener, 4) == 0,
        "listen: %s", std::strerror(errno));
  socklen_t al = sizeof p.addr;
  CHECK(getsockname(p.listener, reinterpret_cast<sockaddr*>(&p.addr), &al) == 0, "getsockname");
  p.client = socket(AF_INET, SOCK_STREAM, 0);
  CHECK(connect(p.client, reinterpret_cast<sockaddr*>(&p.addr), sizeof p.addr) == 0,
        "connect: %s", std::strerror(errno));
  p.server = accept(p.listener, nullptr, nullptr);
  CHECK(p.server >= 0, "accept: %s", std::strerror(errno));
  return p;
}

// Waits (at most 30 s) until both ends report RDMA.
inline void await_rdma(int a, int b) {
  for (int i = 0; transport_of(a) != RSOCK_TRANSPORT_RDMA || transport_of(b) != RSOCK_TRANSPORT_RDMA;
       i++) {
    CHECK(i < 3000, "no upgrade within 30 s (transports %d %d)", transport_of(a), transport_of(b));
    sleep_ms(10);
  }
}

}  // namespace inprocess
