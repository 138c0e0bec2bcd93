// many: N connections between two processes, every one upgraded, every one
// echoing checksummed data (issue 11's "10,000 upgraded connections between
// two processes").
//
//   rsock_many server IP PORT N
//     accepts N connections and echoes whatever arrives on each until its
//     EOF; exits once all N are closed; prints
//       server conns=N on_rdma=R (R: on RDMA when their EOF came)
//   rsock_many client IP PORT N BYTES [TIMEOUT_S]
//     opens N connections, waits (up to TIMEOUT_S, 600) until none is still
//     upgrading, then sends BYTES of seeded data on each, all at once, reads
//     the echo back and checks every byte; prints
//       client conns=N on_rdma=R setup_s=S echo_s=E bad=B
//     and exits 0 only if every byte came back right (B == 0). Whether R is
//     enough is the caller's verdict (tests/footprint/many.sh). With
//     MANY_GO=PATH set it waits for PATH to exist before the echo.
// Without librsock both run as plain TCP (on_rdma counts 0).
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "preload/librsock.h"

namespace {

double now_s() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

int transport(int fd) {
  int t = -1;
  socklen_t len = sizeof t;
  if (getsockopt(fd, SOL_RSOCK, RSOCK_TRANSPORT, &t, &len) != 0) return -1;
  return t;
}

// Byte i of connection `c`'s stream.
unsigned char byte_of(uint32_t c, uint64_t i) {
  uint64_t x = (uint64_t(c) << 32 | (i >> 3)) + 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<unsigned char>(x >> (8 * (i & 7)));
}

bool make_addr(const char* ip, int port, sockaddr_in* a) {
  *a = {};
  a->sin_family = AF_INET;
  a->sin_port = htons(uint16_t(port));
  return inet_pton(AF_INET, ip, &a->sin_addr) == 1;
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

struct Echo {
  std::vector<unsigned char> pending;  // read, not yet written back
  size_t off = 0;
  bool eof = false;
};

int serve(const char* ip, int port, int n) {
  sockaddr_in a;
  if (!make_addr(ip, port, &a)) return 2;
  int l = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(l, 4096) != 0) {
    perror("rsock_many server: listen");
    return 1;
  }
  set_nonblocking(l);
  int ep = epoll_create1(0);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = l;
  epoll_ctl(ep, EPOLL_CTL_ADD, l, &ev);
  std::vector<Echo> conns;
  int accepted = 0, closed = 0, on_rdma = 0;
  std::vector<unsigned char> buf(64 * 1024);
  epoll_event evs[256];
  printf("server listening\n");
  fflush(stdout);
  while (closed < n) {
    int k = epoll_wait(ep, evs, 256, 1000);
    for (int i = 0; i < k; i++) {
      int fd = evs[i].data.fd;
      if (fd == l) {
        for (;;) {
          int c = accept(l, nullptr, nullptr);
          if (c < 0) break;
          set_nonblocking(c);
          if (size_t(c) >= conns.size()) conns.resize(size_t(c) + 1);
          conns[size_t(c)] = Echo{};
          epoll_event ce{};
          ce.events = EPOLLIN;
          ce.data.fd = c;
          epoll_ctl(ep, EPOLL_CTL_ADD, c, &ce);
          accepted++;
        }
        continue;
      }
      Echo& e = conns[size_t(fd)];
      bool done = false;
      // Write back what is pending first, then read more.
      while (e.off < e.pending.size()) {
        ssize_t w = write(fd, e.pending.data() + e.off, e.pending.size() - e.off);
        if (w <= 0) break;
        e.off += size_t(w);
      }
      if (e.off == e.pending.size()) {
        e.pending.clear();
        e.off = 0;
        for (;;) {
          ssize_t r = read(fd, buf.data(), buf.size());
          if (r == 0) {
            e.eof = true;
            break;
          }
          if (r < 0) {
            if (errno != EAGAIN) e.eof = true;
            break;
          }
          ssize_t w = write(fd, buf.data(), size_t(r));
          if (w < 0) w = 0;
          if (w < r) {
            e.pending.assign(buf.data() + w, buf.data() + r);
            break;
          }
        }
      }
      if (e.eof && e.pending.empty()) done = true;
      epoll_event ce{};
      ce.events = e.pending.empty() ? EPOLLIN : EPOLLOUT;
      ce.data.fd = fd;
      if (done) {
        on_rdma += transport(fd) == RSOCK_TRANSPORT_RDMA;
        epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
        close(fd);
        closed++;
      } else {
        epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ce);
      }
    }
  }
  printf("server conns=%d on_rdma=%d\n", accepted, on_rdma);
  return 0;
}

struct Conn {
  int fd = -1;
  uint64_t sent = 0, got = 0;
  bool bad = false;
};

int client(const char* ip, int port, int n, uint64_t bytes, double timeout_s) {
  sockaddr_in a;
  if (!make_addr(ip, port, &a) || n <= 0) return 2;
  double t0 = now_s();
  std::vector<Conn> cs(static_cast<size_t>(n));
  for (int i = 0; i < n; i++) {
    int c = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (c < 0 || connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      fprintf(stderr, "rsock_many client: connect %d: %s\n", i, strerror(errno));
      return 1;
    }
    cs[size_t(i)].fd = c;
  }
  // Until none is still deciding (upgrading or switching).
  int on_rdma = 0;
  for (;;) {
    int busy = 0;
    on_rdma = 0;
    for (auto& c : cs) {
      int t = transport(c.fd);
      busy += t == RSOCK_TRANSPORT_UPGRADING || t == RSOCK_TRANSPORT_REVERTING;
      on_rdma += t == RSOCK_TRANSPORT_RDMA;
    }
    if (busy == 0 || now_s() - t0 > timeout_s) break;
    usleep(100000);
  }
  double setup = now_s() - t0;
  printf("client setup done: on_rdma=%d of %d after %.1f s\n", on_rdma, n, setup);
  fflush(stdout);
  // MANY_GO=PATH: wait for PATH to exist first (the caller lists the QPs
  // while every connection is up).
  if (const char* go = getenv("MANY_GO"))
    while (access(go, F_OK) != 0) usleep(100000);
  // Every connection at once: write its stream, read its echo, check it.
  double t1 = now_s();
  int ep = epoll_create1(0);
  for (int i = 0; i < n; i++) {
    set_nonblocking(cs[size_t(i)].fd);
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT;
    ev.data.u32 = uint32_t(i);
    epoll_ctl(ep, EPOLL_CTL_ADD, cs[size_t(i)].fd, &ev);
  }
  int done = 0, bad = 0;
  std::vector<unsigned char> buf(64 * 1024);
  epoll_event evs[256];
  while (done < n) {
    int k = epoll_wait(ep, evs, 256, 10000);
    if (k == 0) {
      fprintf(stderr, "rsock_many client: no progress for 10 s (%d of %d done)\n", done, n);
      return 1;
    }
    for (int j = 0; j < k; j++) {
      uint32_t i = evs[j].data.u32;
      Conn& c = cs[i];
      while (c.sent < bytes) {
        size_t len = size_t(std::min<uint64_t>(buf.size(), bytes - c.sent));
        for (size_t b = 0; b < len; b++) buf[b] = byte_of(i, c.sent + b);
        ssize_t w = write(c.fd, buf.data(), len);
        if (w <= 0) break;
        c.sent += uint64_t(w);
        if (c.sent == bytes) shutdown(c.fd, SHUT_WR);
      }
      for (;;) {
        ssize_t r = read(c.fd, buf.data(), buf.size());
        if (r <= 0) {
          if (r == 0 || errno != EAGAIN) {
            if (c.got != bytes) c.bad = true;
            bad += c.bad;
            done++;
            epoll_ctl(ep, EPOLL_CTL_DEL, c.fd, nullptr);
          }
          break;
        }
        for (ssize_t b = 0; b < r; b++)
          if (buf[size_t(b)] != byte_of(i, c.got + uint64_t(b))) c.bad = true;
        c.got += uint64_t(r);
      }
      if (c.sent == bytes && c.got < bytes) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u32 = i;
        epoll_ctl(ep, EPOLL_CTL_MOD, c.fd, &ev);
      }
    }
  }
  double echo = now_s() - t1;
  for (auto& c : cs) close(c.fd);
  printf("client conns=%d on_rdma=%d setup_s=%.1f echo_s=%.1f bad=%d\n", n, on_rdma, setup, echo,
         bad);
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && !strcmp(argv[1], "server")) return serve(argv[2], atoi(argv[3]), atoi(argv[4]));
  if ((argc == 6 || argc == 7) && !strcmp(argv[1], "client"))
    return client(argv[2], atoi(argv[3]), atoi(argv[4]), strtoull(argv[5], nullptr, 10),
                  argc == 7 ? atof(argv[6]) : 600);
  fprintf(stderr,
          "usage: rsock_many server IP PORT N\n"
          "       rsock_many client IP PORT N BYTES [TIMEOUT_S]\n");
  return 2;
}
