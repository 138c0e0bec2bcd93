// rsock_connect_bench: socket workloads with blocking read()/write() only, so
// that the same binary runs over kernel TCP, librsock and rdma-core's
// librspreload (LD_PRELOAD). librspreload cannot run sockperf (it rejects
// sendto() on a connected socket), iperf3 or redis-server; these modes give
// the comparison with it a like-for-like workload (bench/compare/run).
//   rsock_connect_bench server ADDR PORT
//       one thread per connection: a connection whose first byte is 'S' is a
//       stream (read to EOF, then reply with the 8-byte count); any other
//       connection is echoed until EOF
//   rsock_connect_bench client ADDR PORT N [WARMUP [GAP_MS]]
//       connection setup: N sequential connections (socket, connect, send 1
//       byte, recv 1 byte, close); the first WARMUP (default 5) are not
//       counted (one-time costs, e.g. opening the RDMA device); GAP_MS
//       (default 0) is an untimed pause after each close, to tell per-
//       connection cost from background work left by earlier ones. Prints
//       "connect_us n=N median=.. p99=.. avg=.. min=.. max=.." (microseconds),
//       then the same for the connect() call alone ("connect_call_us ...").
//   rsock_connect_bench upgrade ADDR PORT N [WARMUP [GAP_MS [PACE_US]]]
//       connection churn onto RDMA: N sequential connections, each pinging
//       1 byte back and forth until librsock reports it on RDMA
//       (getsockopt SOL_RSOCK RSOCK_TRANSPORT; run with upgrade_delay_ms 0),
//       then closed. Prints "upgrade_us n=.. median=.." (connect() to on
//       RDMA) and "upgrade_cpu_us per_conn=.." (this process's CPU per
//       connection, progress thread included). Exits 1 if a connection is
//       not on RDMA within 5 s. GAP_MS (default 0): an untimed pause after
//       each close; PACE_US (default 0): a pause between pings. Without
//       them the pinging keeps the CPUs busy, so that the setup's own work
//       competes with it: work moved off the setup's path (to another
//       thread) then shows no gain on a 2-vCPU guest.
//   rsock_connect_bench burst ADDR PORT N
//       N connections opened back to back and kept open, each echoing 1 byte
//       once, then left idle until librsock has settled each one (on RDMA,
//       or on TCP for good; a sweep of getsockopt SOL_RSOCK RSOCK_TRANSPORT
//       each ms; run with upgrade_delay_ms 0): a process's setup of N
//       connections at once, the figure rdma-core's `ucmatose -c N` gives for
//       rdma_cm alone (bench/connect/burst). Prints "burst n=.. on_rdma=..
//       on_tcp=.. opened_ms=.. settled_ms=.. cpu_ms=.." (from the first
//       connect(); this process's CPU, progress thread included) and, if any
//       went onto RDMA, "burst_rdma_ms " with their times from the first
//       connect(). Plain (no librsock) every connection counts as on TCP.
//       Exits 1 if one is still upgrading after 30 s.
//   rsock_connect_bench pingpong ADDR PORT SIZE SECS [WARMUP_SECS]
//       one connection, SIZE-byte messages echoed back, SECS seconds measured
//       after WARMUP_SECS (default 1: librsock upgrades in the background).
//       Prints "pingpong_us size=.. n=.. median=.. p99=.. avg=.." (round trip / 2),
//       then "pingpong_cpu size=.. cli_us_rt=.. n_all=..": this process's CPU
//       microseconds per measured round trip, and round trips warm-up included.
//   rsock_connect_bench stream ADDR PORT SIZE SECS [WARMUP_SECS]
//       one connection, SIZE-byte writes for WARMUP_SECS + SECS, then EOF;
//       throughput of the measured part up to the server's byte-count reply.
//       Prints "stream size=.. bytes=.. secs=.. mibps=..".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "librsock.h"

namespace {

using Clock = std::chrono::steady_clock;

double secs_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Exit cleanly on SIGTERM/SIGINT so that preloaded libraries print their exit
// summaries (librsock's counters prove a run really used RDMA).
volatile sig_atomic_t g_stop = 0;

bool read_full(int fd, void* p, size_t n) {
  for (size_t off = 0; off < n;) {
    ssize_t r = read(fd, static_cast<char*>(p) + off, n - off);
    if (r <= 0) return false;
    off += size_t(r);
  }
  return true;
}

bool write_full(int fd, const void* p, size_t n) {
  for (size_t off = 0; off < n;) {
    ssize_t w = write(fd, static_cast<const char*>(p) + off, n - off);
    if (w <= 0) return false;
    off += size_t(w);
  }
  return true;
}

void serve_connection(int c) {
  int nodelay = 1;
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof nodelay);
  // Not zero-filled: a std::vector zeroed (and faulted in) 256 KiB per
  // connection, about a third of a plain server's CPU per connection in the
  // TCG guest, which slowed every connect-to-first-byte figure alike.
  constexpr size_t kBuf = 256 * 1024;
  std::unique_ptr<char[]> buf(new char[kBuf]);
  ssize_t n = read(c, buf.get(), kBuf);
  if (n > 0 && buf[0] == 'S') {
    uint64_t total = uint64_t(n);  // the marker byte counts: the client counts it too
    while ((n = read(c, buf.get(), kBuf)) > 0) total += uint64_t(n);
    write_full(c, &total, sizeof total);
  } else {
    while (n > 0 && write_full(c, buf.get(), size_t(n))) n = read(c, buf.get(), kBuf);
  }
  close(c);
}

int dial(const sockaddr_in& a) {
  int c = socket(AF_INET, SOCK_STREAM, 0);
  if (c < 0) return -1;
  int one = 1;
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (connect(c, reinterpret_cast<const sockaddr*>(&a), sizeof a)) {
    close(c);
    return -1;
  }
  return c;
}

// Prints median/p99/avg of the sorted samples.
void print_stats(std::vector<double>& us) {
  std::sort(us.begin(), us.end());
  double sum = 0;
  for (double v : us) sum += v;
  auto pct = [&](double p) { return us[std::min(us.size() - 1, size_t(p * double(us.size())))]; };
  printf("n=%zu median=%.2f p99=%.2f avg=%.2f min=%.2f max=%.2f\n", us.size(), pct(0.5), pct(0.99),
         sum / double(us.size()), us.front(), us.back());
}

bool make_addr(const char* addr, int port, sockaddr_in* a) {
  *a = {};
  a->sin_family = AF_INET;
  a->sin_port = htons(static_cast<uint16_t>(port));
  return inet_pton(AF_INET, addr, &a->sin_addr) == 1;
}

int serve(const char* addr, int port) {
  sockaddr_in a;
  if (!make_addr(addr, port, &a)) {
    fprintf(stderr, "rsock_connect_bench: bad address %s\n", addr);
    return 2;
  }
  int l = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) || listen(l, 128)) {
    perror("rsock_connect_bench: bind/listen");
    return 1;
  }
  struct sigaction sa {};
  sa.sa_handler = [](int) { g_stop = 1; };  // no SA_RESTART: accept() returns EINTR
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  printf("listening %s:%d\n", addr, port);
  fflush(stdout);
  while (!g_stop) {
    int c = accept(l, nullptr, nullptr);
    if (c < 0) continue;
    std::thread(serve_connection, c).detach();
  }
  close(l);
  return 0;
}

int client(const char* addr, int port, int n, int warmup, int gap_ms) {
  sockaddr_in a;
  if (!make_addr(addr, port, &a) || n <= 0 || warmup < 0) {
    fprintf(stderr, "rsock_connect_bench: bad arguments\n");
    return 2;
  }
  std::vector<double> us, call_us;  // whole setup; the connect() call alone
  us.reserve(size_t(n));
  for (int i = 0; i < n + warmup; i++) {
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0) {
      perror("rsock_connect_bench: socket");
      return 1;
    }
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto t0 = Clock::now();  // from connect(), as the application sees it
    if (connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a)) {
      perror("rsock_connect_bench: connect");
      return 1;
    }
    double call = secs_since(t0) * 1e6;
    char b = 'x';
    if (write(c, &b, 1) != 1 || read(c, &b, 1) != 1 || b != 'x') {
      fprintf(stderr, "rsock_connect_bench: echo failed on connection %d\n", i);
      return 1;
    }
    double dt = secs_since(t0) * 1e6;
    close(c);
    if (gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
    if (i >= warmup) {
      us.push_back(dt);
      call_us.push_back(call);
    }
  }
  printf("connect_us ");
  print_stats(us);
  // Where the time goes: the connect() call itself vs the first round trip.
  printf("connect_call_us ");
  print_stats(call_us);
  return 0;
}

double cpu_secs();

int upgrade(const char* addr, int port, int n, int warmup, int gap_ms, int pace_us) {
  sockaddr_in a;
  if (!make_addr(addr, port, &a) || n <= 0 || warmup < 0) {
    fprintf(stderr, "rsock_connect_bench: bad arguments\n");
    return 2;
  }
  std::vector<double> us;
  double cpu0 = 0;
  for (int i = 0; i < n + warmup; i++) {
    if (i == warmup) cpu0 = cpu_secs();
    auto t0 = Clock::now();
    int c = dial(a);
    if (c < 0) {
      perror("rsock_connect_bench: connect");
      return 1;
    }
    for (;;) {
      char b = 'x';
      if (write(c, &b, 1) != 1 || read(c, &b, 1) != 1 || b != 'x') {
        fprintf(stderr, "rsock_connect_bench: echo failed on connection %d\n", i);
        return 1;
      }
      int t = -1;
      socklen_t len = sizeof t;
      if (getsockopt(c, SOL_RSOCK, RSOCK_TRANSPORT, &t, &len) != 0) {
        fprintf(stderr, "rsock_connect_bench: not under librsock\n");
        return 1;
      }
      if (t == RSOCK_TRANSPORT_RDMA) break;
      if (pace_us > 0) usleep(useconds_t(pace_us));
      if (secs_since(t0) > 5) {
        fprintf(stderr, "rsock_connect_bench: connection %d not on RDMA after 5 s (transport %d)\n",
                i, t);
        return 1;
      }
    }
    double dt = secs_since(t0) * 1e6;
    close(c);
    if (i >= warmup) us.push_back(dt);
    // (Untimed; the CPU any thread uses meanwhile, work done in the
    // background for the next connection, still counts.)
    if (gap_ms > 0) usleep(useconds_t(gap_ms) * 1000);
  }
  double cpu = cpu_secs() - cpu0;
  printf("upgrade_us ");
  print_stats(us);
  printf("upgrade_cpu_us per_conn=%.1f\n", cpu * 1e6 / n);
  return 0;
}

int burst(const char* addr, int port, int n) {
  sockaddr_in a;
  if (!make_addr(addr, port, &a) || n <= 0) {
    fprintf(stderr, "rsock_connect_bench: bad arguments\n");
    return 2;
  }
  std::vector<int> fds;
  std::vector<double> ms;  // first connect() to on RDMA, per connection on RDMA
  std::vector<bool> done(size_t(n), false);
  double cpu0 = cpu_secs();
  auto t0 = Clock::now();
  for (int i = 0; i < n; i++) {
    int c = dial(a);
    char b = 'x';
    if (c < 0 || write(c, &b, 1) != 1 || read(c, &b, 1) != 1 || b != 'x') {
      fprintf(stderr, "rsock_connect_bench: connection %d failed\n", i);
      return 1;
    }
    fds.push_back(c);
  }
  double opened = secs_since(t0) * 1e3;
  int tcp = 0;  // on TCP for good (not eligible, fell back), or no librsock
  for (int left = n; left > 0;) {
    for (int i = 0; i < n; i++) {
      if (done[size_t(i)]) continue;
      int t = RSOCK_TRANSPORT_TCP;
      socklen_t len = sizeof t;
      (void)getsockopt(fds[size_t(i)], SOL_RSOCK, RSOCK_TRANSPORT, &t, &len);  // plain: TCP
      if (t == RSOCK_TRANSPORT_UPGRADING || t == RSOCK_TRANSPORT_REVERTING) continue;
      done[size_t(i)] = true;
      --left;
      if (t == RSOCK_TRANSPORT_RDMA) ms.push_back(secs_since(t0) * 1e3);
      else ++tcp;
    }
    if (left > 0 && secs_since(t0) > 30) {
      fprintf(stderr, "rsock_connect_bench: %d of %d connections still upgrading after 30 s\n", left, n);
      return 1;
    }
    if (left > 0) usleep(1000);
  }
  double all = secs_since(t0) * 1e3, cpu = cpu_secs() - cpu0;
  for (int c : fds) close(c);
  printf("burst n=%d on_rdma=%zu on_tcp=%d opened_ms=%.1f settled_ms=%.1f cpu_ms=%.1f\n", n,
         ms.size(), tcp, opened, all, cpu * 1e3);
  if (!ms.empty()) {
    printf("burst_rdma_ms ");
    print_stats(ms);
  }
  return 0;
}

// The one connection of the pingpong and stream modes: its fd, or -2 (bad
// arguments) / -1 (connect failed), already reported.
int open_measured(const char* addr, int port, size_t size, double secs) {
  sockaddr_in a;
  if (!make_addr(addr, port, &a) || size == 0 || secs <= 0) {
    fprintf(stderr, "rsock_connect_bench: bad arguments\n");
    return -2;
  }
  int c = dial(a);
  if (c < 0) perror("rsock_connect_bench: connect");
  return c < 0 ? -1 : c;
}

// CPU seconds (user + system, every thread: librsock's progress thread too)
// this process has used so far.
double cpu_secs() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

int pingpong(const char* addr, int port, size_t size, double secs, double warmup) {
  int c = open_measured(addr, port, size, secs);
  if (c < 0) return c == -2 ? 2 : 1;
  std::vector<char> out(size, 'p'), in(size);
  std::vector<double> us;
  // One clock read per round trip: its end is the next one's start. (In the
  // TCG guest the clock is a syscall, about 1-2 us each: three reads per
  // round trip were part of what this measured, where perftest reads the
  // TSC.)
  const auto start = Clock::now();
  auto t0 = start;
  uint64_t all = 0;      // round trips, warm-up included
  double cpu0 = -1;      // at the end of the warm-up
  for (;;) {
    double now = std::chrono::duration<double>(t0 - start).count();
    if (now >= warmup + secs) break;
    if (now >= warmup && cpu0 < 0) {
      cpu0 = cpu_secs();
      t0 = Clock::now();  // (not the getrusage call)
    }
    if (!write_full(c, out.data(), size) || !read_full(c, in.data(), size)) {
      fprintf(stderr, "rsock_connect_bench: ping-pong failed\n");
      return 1;
    }
    ++all;
    auto t1 = Clock::now();
    if (now >= warmup) us.push_back(std::chrono::duration<double>(t1 - t0).count() * 1e6 / 2);
    t0 = t1;
  }
  double cpu1 = cpu_secs();
  close(c);
  if (us.empty()) return 1;
  printf("pingpong_us size=%zu ", size);
  print_stats(us);
  // What the latency costs in CPU (issue 14: spinning is paid in CPU).
  printf("pingpong_cpu size=%zu cli_us_rt=%.1f n_all=%llu\n", size,
         (cpu1 - cpu0) * 1e6 / double(us.size()), static_cast<unsigned long long>(all));
  return 0;
}

int stream(const char* addr, int port, size_t size, double secs, double warmup) {
  int c = open_measured(addr, port, size, secs);
  if (c < 0) return c == -2 ? 2 : 1;
  std::vector<char> out(size, 's');
  out[0] = 'S';  // the server counts instead of echoing
  auto start = Clock::now(), t0 = start;
  uint64_t sent = 0, base = 0;
  bool measuring = false;
  for (;;) {
    double now = secs_since(start);
    if (!measuring && now >= warmup) {
      measuring = true;
      t0 = Clock::now();
      base = sent;
    }
    if (now >= warmup + secs) break;
    if (!write_full(c, out.data(), size)) {
      fprintf(stderr, "rsock_connect_bench: stream write failed\n");
      return 1;
    }
    sent += size;
  }
  shutdown(c, SHUT_WR);
  uint64_t got = 0;
  if (!read_full(c, &got, sizeof got) || got != sent) {
    fprintf(stderr, "rsock_connect_bench: server counted %llu of %llu bytes\n",
                 (unsigned long long)got, (unsigned long long)sent);
    return 1;
  }
  double dt = secs_since(t0);
  close(c);
  uint64_t bytes = sent - base;
  printf("stream size=%zu bytes=%llu secs=%.3f mibps=%.2f\n", size, (unsigned long long)bytes, dt,
         double(bytes) / dt / 1048576.0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && !strcmp(argv[1], "server")) return serve(argv[2], atoi(argv[3]));
  if (argc >= 5 && argc <= 7 && !strcmp(argv[1], "client"))
    return client(argv[2], atoi(argv[3]), atoi(argv[4]), argc >= 6 ? atoi(argv[5]) : 5,
                  argc == 7 ? atoi(argv[6]) : 0);
  if (argc >= 5 && argc <= 8 && !strcmp(argv[1], "upgrade"))
    return upgrade(argv[2], atoi(argv[3]), atoi(argv[4]), argc >= 6 ? atoi(argv[5]) : 5,
                   argc >= 7 ? atoi(argv[6]) : 0, argc >= 8 ? atoi(argv[7]) : 0);
  if (argc == 5 && !strcmp(argv[1], "burst")) return burst(argv[2], atoi(argv[3]), atoi(argv[4]));
  if ((argc == 6 || argc == 7) && !strcmp(argv[1], "pingpong"))
    return pingpong(argv[2], atoi(argv[3]), size_t(atol(argv[4])), atof(argv[5]),
                    argc == 7 ? atof(argv[6]) : 1.0);
  if ((argc == 6 || argc == 7) && !strcmp(argv[1], "stream"))
    return stream(argv[2], atoi(argv[3]), size_t(atol(argv[4])), atof(argv[5]),
                  argc == 7 ? atof(argv[6]) : 1.0);
  fprintf(stderr,
          "usage: rsock_connect_bench server ADDR PORT\n"
          "       rsock_connect_bench client ADDR PORT N [WARMUP [GAP_MS]]\n"
          "       rsock_connect_bench upgrade ADDR PORT N [WARMUP [GAP_MS [PACE_US]]]\n"
          "       rsock_connect_bench burst ADDR PORT N\n"
          "       rsock_connect_bench pingpong ADDR PORT SIZE SECS [WARMUP_SECS]\n"
          "       rsock_connect_bench stream ADDR PORT SIZE SECS [WARMUP_SECS]\n");
  return 2;
}
