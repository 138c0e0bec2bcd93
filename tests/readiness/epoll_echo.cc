// epoll_echo: the C/epoll counterpart of asyncio_echo.py (issue 17). One
// single-threaded process runs an echo server and N clients on one epoll
// set, level- or edge-triggered. Every client sends BYTES of checksummed
// data, half-closes, reads the echo until EOF and compares. The data phase
// starts for all clients at once, so that (with --await-rdma, once every
// connection reports RDMA at both ends) dozens of upgraded sockets become
// ready together: the situation in which the epoll emulation used to
// livelock while harvesting its internal fds.
//
//   rsock_epoll_echo IP [--conns N] [--bytes B] [--et] [--await-rdma] [--oneshot]
//                       [--await-settled] [--poll]
// --poll: the same loop on poll() over every unfinished socket (level-
// triggered), and at the end "fds: N", the process's open fds (librsock's
// included): a poll() program's upgraded sockets must cost no library fd
// each (issue 11).
// --await-settled: wait until no socket is still upgrading, print
// "transport: rdma=X tcp=Y" and go on (for tests that expect some to stay
// on TCP, e.g. at the pinned-memory limit).
// Exit 0 and "ok N" when every client got its bytes back; 1 otherwise; 77
// with --await-rdma when not preloaded (nothing to await).
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <dirent.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "preload/librsock.h"

namespace {

struct Conn {
  int fd = -1;
  bool client = false;
  std::vector<uint8_t> out;  // bytes still to send (client: its blob; server: echo backlog)
  size_t out_off = 0;
  std::vector<uint8_t> want;  // client: what it sent
  std::vector<uint8_t> got;   // client: what came back
  bool wr_shut = false, peer_eof = false, done = false;
};

double now_s() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

[[noreturn]] void die(const char* what) {
  fprintf(stderr, "epoll_echo: %s: %s\n", what, strerror(errno));
  exit(1);
}

int transport(int fd) {
  int t = -1;
  socklen_t len = sizeof t;
  if (getsockopt(fd, SOL_RSOCK, RSOCK_TRANSPORT, &t, &len) != 0) return -1;
  return t;
}

uint32_t mask_of(const Conn& c, bool et, bool oneshot) {
  // Edge-triggered users register for everything once, as usual.
  if (et && !oneshot) return EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
  uint32_t ev = EPOLLIN | EPOLLRDHUP;
  if (c.out_off < c.out.size() || (c.client && !c.wr_shut)) ev |= EPOLLOUT;
  if (et) ev |= EPOLLET;
  if (oneshot) ev |= EPOLLONESHOT;
  return ev;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s IP [--conns N] [--bytes B] [--et] [--await-rdma] [--oneshot]\n", argv[0]);
    return 2;
  }
  const char* ip = argv[1];
  int conns = 50;
  size_t bytes = 200000;
  bool et = false, await_rdma = false, oneshot = false, await_settled = false, use_poll = false;
  for (int i = 2; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--conns" && i + 1 < argc) conns = atoi(argv[++i]);
    else if (a == "--bytes" && i + 1 < argc) bytes = size_t(atoll(argv[++i]));
    else if (a == "--et") et = true;
    else if (a == "--oneshot") oneshot = true;
    else if (a == "--await-rdma") await_rdma = true;
    else if (a == "--await-settled") await_settled = true;
    else if (a == "--poll") use_poll = true;
    else {
      fprintf(stderr, "epoll_echo: unknown argument %s\n", a.c_str());
      return 2;
    }
  }

  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1) die("bad IP");
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  if (lfd < 0) die("socket");
  if (bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) die("bind");
  if (listen(lfd, 4096) != 0) die("listen");
  socklen_t sl = sizeof sa;
  getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &sl);

  // Connect and accept every pair first (blocking: simple and exact).
  std::vector<Conn> cs;
  cs.reserve(size_t(conns) * 2);
  std::mt19937_64 rng(12345);
  for (int i = 0; i < conns; i++) {
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0) die("socket");
    if (connect(c, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) die("connect");
    int s = accept(lfd, nullptr, nullptr);
    if (s < 0) die("accept");
    Conn cc;
    cc.fd = c;
    cc.client = true;
    cc.want.resize(bytes);
    for (auto& b : cc.want) b = uint8_t(rng());
    cc.out = cc.want;
    cs.push_back(std::move(cc));
    Conn sc;
    sc.fd = s;
    cs.push_back(std::move(sc));
  }
  if (await_rdma) {
    if (transport(cs[0].fd) < 0) {
      printf("SKIP: --await-rdma without librsock\n");
      return 77;
    }
    double end = now_s() + 120;
    for (;;) {
      int on = 0;
      for (auto& c : cs) on += transport(c.fd) == RSOCK_TRANSPORT_RDMA;
      if (on == int(cs.size())) break;
      if (now_s() > end) {
        fprintf(stderr, "epoll_echo: only %d of %zu sockets reached RDMA\n", on, cs.size());
        return 1;
      }
      usleep(20000);
    }
  }
  if (await_settled) {
    double end = now_s() + 120;
    int rdma = 0, tcp = 0;
    for (;;) {
      rdma = tcp = 0;
      int busy = 0;
      for (auto& c : cs) {
        int t = transport(c.fd);
        rdma += t == RSOCK_TRANSPORT_RDMA;
        tcp += t == RSOCK_TRANSPORT_TCP || t < 0;
        busy += t == RSOCK_TRANSPORT_UPGRADING;
      }
      if (!busy || now_s() > end) break;
      usleep(20000);
    }
    printf("transport: rdma=%d tcp=%d\n", rdma, tcp);
    fflush(stdout);
  }
  int ep = epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) die("epoll_create1");
  for (size_t i = 0; i < cs.size(); i++) {
    fcntl(cs[i].fd, F_SETFL, fcntl(cs[i].fd, F_GETFL) | O_NONBLOCK);
    if (use_poll) continue;
    epoll_event ev{};
    ev.events = mask_of(cs[i], et, oneshot);
    ev.data.u64 = i;
    if (epoll_ctl(ep, EPOLL_CTL_ADD, cs[i].fd, &ev) != 0) die("epoll_ctl ADD");
  }

  if (use_poll) {
    // An idle poll first: nothing is readable yet, so it sleeps on every
    // socket at once (where each used to get a wake fd of its own).
    std::vector<pollfd> idle;
    for (auto& c : cs) idle.push_back({c.fd, POLLIN, 0});
    if (poll(idle.data(), idle.size(), 300) != 0) {
      fprintf(stderr, "epoll_echo: the idle poll saw an event\n");
      return 1;
    }
  }
  int clients_left = conns;
  double t0 = now_s();
  std::vector<uint8_t> buf(65536);
  std::vector<epoll_event> evs(size_t(conns) * 2 + 1);
  std::vector<pollfd> pfds;
  std::vector<size_t> pidx;
  while (clients_left > 0) {
    // asyncio's selector asks for as many events as it has registrations.
    int n;
    if (use_poll) {
      pfds.clear();
      pidx.clear();
      for (size_t i = 0; i < cs.size(); i++) {
        if (cs[i].done) continue;
        pfds.push_back({cs[i].fd, short(mask_of(cs[i], false, false)), 0});
        pidx.push_back(i);
      }
      n = poll(pfds.data(), pfds.size(), 30000);
      if (n > 0) {
        n = 0;
        for (size_t k = 0; k < pfds.size(); k++)
          if (pfds[k].revents) evs[size_t(n++)].data.u64 = pidx[k];
      }
    } else {
      n = epoll_wait(ep, evs.data(), int(evs.size()), 30000);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      die(use_poll ? "poll" : "epoll_wait");
    }
    if (n == 0) {
      fprintf(stderr, "epoll_echo: no event for 30 s with %d clients unfinished\n", clients_left);
      return 1;
    }
    for (int k = 0; k < n; k++) {
      Conn& c = cs[evs[k].data.u64];
      if (c.done) continue;
      // Edge-triggered users must drain; level-triggered ones may not, and
      // read one buffer per event like most event loops.
      for (;;) {
        ssize_t r = read(c.fd, buf.data(), buf.size());
        if (r > 0) {
          if (c.client) c.got.insert(c.got.end(), buf.begin(), buf.begin() + r);
          else c.out.insert(c.out.end(), buf.begin(), buf.begin() + r);
          if (!et) break;
          continue;
        }
        if (r == 0) c.peer_eof = true;
        else if (errno != EAGAIN) die("read");
        break;
      }
      while (c.out_off < c.out.size()) {
        ssize_t w = write(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off);
        if (w > 0) {
          c.out_off += size_t(w);
          continue;
        }
        if (w < 0 && errno != EAGAIN) die("write");
        break;
      }
      if (c.out_off == c.out.size()) {
        c.out.clear();
        c.out_off = 0;
        // Client: everything sent, half-close. Server: the client's EOF
        // has been echoed, half-close too.
        if (!c.wr_shut && (c.client || c.peer_eof)) {
          shutdown(c.fd, SHUT_WR);
          c.wr_shut = true;
        }
      }
      if (c.client && c.peer_eof) {
        c.done = true;
        clients_left--;
        if (c.got != c.want) {
          fprintf(stderr, "epoll_echo: fd %d: %zu bytes back, %zu sent, %s\n", c.fd, c.got.size(),
                  c.want.size(), c.got.size() == c.want.size() ? "content differs" : "length differs");
          return 1;
        }
      }
      if (!c.client && c.peer_eof && c.wr_shut) c.done = true;
      epoll_event ev{};
      ev.events = mask_of(c, et, oneshot);
      ev.data.u64 = evs[k].data.u64;
      if (use_poll) continue;
      if (c.done) epoll_ctl(ep, EPOLL_CTL_DEL, c.fd, nullptr);
      else if (oneshot || !et) epoll_ctl(ep, EPOLL_CTL_MOD, c.fd, &ev);
    }
  }
  // For bench/compare: the bytes echoed back to the clients per second,
  // from the first epoll_wait to the last client's EOF.
  double secs = now_s() - t0;
  printf("echo conns=%d bytes=%zu seconds=%.3f mibps=%.2f\n", conns, bytes, secs,
         secs > 0 ? double(conns) * double(bytes) / secs / 1048576.0 : 0.0);
  if (use_poll) {
    int fds = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
      while (dirent* e = readdir(d)) fds += e->d_name[0] != '.';
      closedir(d);
      printf("fds: %d\n", fds - 1);  // (not the directory's own)
    } else {
      printf("fds: none left to count them (%s)\n", strerror(errno));
    }
  }
  printf("ok %d\n", conns);
  return 0;
}
