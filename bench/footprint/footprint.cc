// footprint: what N upgraded connections cost a process, and what one
// epoll_wait costs with N registered sockets of which one is active.
//
//   rsock_footprint IP N [--rounds R]
// Opens N connections to itself on IP (2N sockets), waits until every socket
// reports RDMA (or, without librsock, goes on at once), then prints one line
//   conns=N setup_ms=S fds_per_socket=F pinned_kib_per_socket=P rss_kib_per_socket=R
//   epoll_us_per_roundtrip=E epoll_ctl_us=C
// fds/pinned/rss are the process's growth (/proc/self/fd, VmPin, VmRSS)
// beyond the program's own 2N sockets, divided by 2N. The epoll figure: all
// 2N sockets registered level-triggered for EPOLLIN in one set, one pair
// ping-pongs a byte R times; microseconds per round trip (two epoll_waits).
// epoll_ctl_us: one EPOLL_CTL_MOD of the socket registered last, with all 2N
// registered (an event loop re-arms a socket per request).
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "preload/librsock.h"

namespace {

double now_s() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

int count_fds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1;  // the directory's own fd
}

long status_kib(const char* key) {
  FILE* f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long v = -1;
  size_t kl = strlen(key);
  while (fgets(line, sizeof line, f))
    if (strncmp(line, key, kl) == 0) v = strtol(line + kl, nullptr, 10);
  fclose(f);
  return v;
}

// Memory mappings (VMAs) of the process: the kernel allows vm.max_map_count
// (65530 by default) in all, so mappings per connection bound how many
// connections a process can have.
long count_maps() {
  FILE* f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  long n = 0;
  for (int c; (c = fgetc(f)) != EOF;) n += c == '\n';
  fclose(f);
  return n;
}

int transport(int fd) {
  int t = -1;
  socklen_t len = sizeof t;
  if (getsockopt(fd, SOL_RSOCK, RSOCK_TRANSPORT, &t, &len) != 0) return -1;
  return t;
}

[[noreturn]] void die(const char* what) {
  perror(what);
  exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s IP N [--rounds R]\n", argv[0]);
    return 2;
  }
  int n = atoi(argv[2]);
  int rounds = 2000;
  for (int i = 3; i + 1 < argc; i++)
    if (std::string(argv[i]) == "--rounds") rounds = atoi(argv[++i]);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (inet_pton(AF_INET, argv[1], &sa.sin_addr) != 1) die("address");
  int l = socket(AF_INET, SOCK_STREAM, 0);
  if (l < 0 || bind(l, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || listen(l, 4096) != 0)
    die("listen");
  socklen_t sl = sizeof sa;
  getsockname(l, reinterpret_cast<sockaddr*>(&sa), &sl);

  int fds0 = count_fds();
  long maps0 = count_maps();
  long pin0 = status_kib("VmPin:"), rss0 = status_kib("VmRSS:");
  double t0 = now_s();
  std::vector<int> socks;
  for (int i = 0; i < n; i++) {
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) die("connect");
    int s = accept(l, nullptr, nullptr);
    if (s < 0) die("accept");
    socks.push_back(c);
    socks.push_back(s);
    // Progress on stderr (bench/footprint/run drops it): where a large run
    // spends its time.
    if ((i + 1) % 1000 == 0)
      fprintf(stderr, "footprint: %d connections after %.1f s\n", i + 1, now_s() - t0);
  }
  bool preloaded = transport(socks[0]) >= 0;
  int on_rdma = 0;
  double next_report = now_s() + 10;
  for (double end = now_s() + 600; preloaded;) {
    on_rdma = 0;
    int busy = 0;
    for (int fd : socks) {
      int t = transport(fd);
      on_rdma += t == RSOCK_TRANSPORT_RDMA;
      busy += t == RSOCK_TRANSPORT_UPGRADING;
    }
    if (!busy || now_s() > end) break;
    if (now_s() > next_report) {
      fprintf(stderr, "footprint: %d sockets on RDMA, %d upgrading after %.1f s\n", on_rdma, busy,
              now_s() - t0);
      next_report = now_s() + 10;
    }
    usleep(10000);
  }
  double setup = now_s() - t0;
  int extra_fds = count_fds() - fds0 - 2 * n;
  long maps = count_maps() - maps0;
  long pin = status_kib("VmPin:") - pin0, rss = status_kib("VmRSS:") - rss0;

  // epoll_wait with every socket registered, one pair active.
  int ep = epoll_create1(EPOLL_CLOEXEC);
  for (size_t i = 0; i < socks.size(); i++) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u32 = uint32_t(i);
    if (epoll_ctl(ep, EPOLL_CTL_ADD, socks[i], &ev) != 0) die("epoll_ctl");
  }
  std::vector<epoll_event> evs(socks.size());
  char b = 'x';
  double e0 = now_s();
  for (int r = 0; r < rounds; r++) {
    for (int side = 0; side < 2; side++) {
      if (write(socks[size_t(side)], &b, 1) != 1) die("write");
      int got = 0;
      while (!got) {
        int k = epoll_wait(ep, evs.data(), int(evs.size()), 5000);
        if (k <= 0) die("epoll_wait");
        for (int j = 0; j < k; j++)
          if (evs[size_t(j)].data.u32 == uint32_t(1 - side)) got = 1;
      }
      if (read(socks[size_t(1 - side)], &b, 1) != 1) die("read");
    }
  }
  double per_rt = (now_s() - e0) / rounds * 1e6;
  constexpr int kMods = 2000;
  double c0 = now_s();
  for (int r = 0; r < kMods; r++) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u32 = uint32_t(socks.size() - 1);
    if (epoll_ctl(ep, EPOLL_CTL_MOD, socks.back(), &ev) != 0) die("epoll_ctl MOD");
  }
  double per_ctl = (now_s() - c0) / kMods * 1e6;
  printf("conns=%d rdma_sockets=%d/%d setup_ms=%.0f fds_per_socket=%.2f pinned_kib_per_socket=%.1f "
         "rss_kib_per_socket=%.1f epoll_us_per_roundtrip=%.1f epoll_ctl_us=%.2f "
         "maps_per_socket=%.2f\n",
         n, on_rdma, 2 * n, setup * 1000, double(extra_fds) / (2 * n), double(pin) / (2 * n),
         double(rss) / (2 * n), per_rt, per_ctl, double(maps) / (2 * n));
  return 0;
}
