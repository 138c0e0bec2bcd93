// rsock_stress: many concurrent connections through the switch, both ends
// preloaded (ctest sets LD_PRELOAD), inside the RDMA VM.
//
//   rsock_stress [--conns N] [--seed S]      server; execs itself as the client
//   rsock_stress --client PORT N S           (the client process)
//   rsock_stress --latency PORT N            for latency.sh: N times connect,
//       write 1 byte, read it back (an echo server), close; prints the median
//       and p90 of connect-to-first-byte in microseconds
//
// The client is a second process (exec, not fork: a forked child of a
// preloaded process stays on kernel TCP). Each connection has a plan drawn
// from its seed: bytes each way (random message sizes, from tiny to ~512 KiB),
// and how it ends:
//   0  both half-close after their last byte, read to EOF, close
//   1  the client closes (no shutdown) once it has everything; server reads EOF
//   2  the server closes once it has everything; the client reads EOF
//   3  the client half-closes right away without sending (FIN before the
//      switch), the server sends its bytes and closes
// plus a random delay before close. Both sides run nonblocking with poll().
// Every byte is checked against the seeded generator; a count short or long
// of the plan fails. Upgrade: in modes 0-2 the client holds back the second
// half of its bytes until its connection shows transport rdma in the stats
// segment (so some bytes must cross the switch and some go over RDMA), and
// each process checks its conns_upgraded counter at the end.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "util/stats.h"
#include "util/stats_reader.h"

namespace {

using Clock = std::chrono::steady_clock;
const char* g_addr = "10.77.0.1";
constexpr double kConnTimeoutS = 150;
// RSOCK_STRESS_TCP_ONLY=1: no device, no preload, no upgrade required; for
// checking the test's own logic on a host (e.g. over 127.0.0.1). Never in ctest.
bool g_tcp_only = false;

double secs_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
unsigned char gen(uint64_t seed, uint64_t i) {
  return static_cast<unsigned char>(mix(seed ^ (i >> 3) * 0x100000001b3ull) >> (8 * (i & 7)));
}

struct Plan {
  uint64_t seed = 0;
  uint64_t c_bytes = 0, s_bytes = 0;  // client -> server, server -> client
  int mode = 0;
  int close_delay_ms = 0;
};
uint64_t size_from(uint64_t r) {
  switch (r & 3) {
    case 0: return 2 + (r >> 8) % 4096;          // tiny: may end before the switch
    case 1: return 2 + (r >> 8) % (64 * 1024);
    default: return 2 + (r >> 8) % (512 * 1024);
  }
}
Plan plan_of(uint64_t seed) {
  Plan p;
  p.seed = seed;
  p.c_bytes = size_from(mix(seed + 1));
  p.s_bytes = size_from(mix(seed + 2));
  uint64_t r = mix(seed + 3);
  p.mode = int(r % 4);
  p.close_delay_ms = int((r >> 8) % 30);
  if (p.mode == 3) p.c_bytes = 0;
  return p;
}

// Our own connection's transport (1 = rdma) from this process's stats segment.
int transport_of(int fd) {
  std::string dir = rsock::stats::default_root_dir() + "/" + std::to_string(getuid());
  std::string why;
  auto snap = rsock::stats::read_process(dir, getpid(), &why);
  if (!snap) return -1;
  sockaddr_in a{}, b{};
  socklen_t la = sizeof a, lb = sizeof b;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &la);
  getpeername(fd, reinterpret_cast<sockaddr*>(&b), &lb);
  for (const auto& c : snap->conns)
    if (!c.torn && c.info.fd == fd && c.info.local_port == ntohs(a.sin_port) &&
        c.info.peer_port == ntohs(b.sin_port))
      return c.info.transport;
  return -1;
}

struct Result {
  std::string err;
  bool saw_rdma = false;
};

// One end of one connection. `client`: which side of the plan we are.
Result run_conn(int fd, bool client, const Plan& p, uint32_t rnd) {
  Result res;
  std::mt19937 r(rnd);
  uint64_t out_total = client ? p.c_bytes : p.s_bytes, in_total = client ? p.s_bytes : p.c_bytes;
  uint64_t out = 0, in = 0;
  bool eof = false, shut = false;
  // Client, modes 0-2: the second half waits for the upgrade.
  bool gated = client && p.mode != 3 && !g_tcp_only;
  uint64_t gate_at = out_total / 2;
  auto last_probe = Clock::now();
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::vector<unsigned char> buf(64 * 1024);
  auto t0 = Clock::now();
  auto fail = [&](const std::string& what) {
    char b[160];
    snprintf(b, sizeof b, "%s seed=%llu mode=%d out=%llu/%llu in=%llu/%llu: ", client ? "client" : "server",
             (unsigned long long)p.seed, p.mode, (unsigned long long)out, (unsigned long long)out_total,
             (unsigned long long)in, (unsigned long long)in_total);
    res.err = b + what;
    return res;
  };
  for (;;) {
    if (secs_since(t0) > kConnTimeoutS) return fail("timed out");
    bool out_done = out == out_total;
    // Half-closes, per the plan.
    if (out_done && !shut && (p.mode == 0 || (p.mode == 3 && client))) {
      if (shutdown(fd, SHUT_WR)) return fail(std::string("shutdown: ") + strerror(errno));
      shut = true;
    }
    bool done;
    if (p.mode == 0) done = out_done && eof;
    else if (p.mode == 1) done = out_done && (client ? in == in_total : eof);
    else if (p.mode == 2) done = out_done && (client ? eof : in == in_total);
    else done = out_done && (client ? eof : true);
    if (done) break;
    if (gated && (out >= gate_at)) {
      if (secs_since(last_probe) > 0.05) {
        last_probe = Clock::now();
        if (transport_of(fd) == 1) {
          gated = false;
          res.saw_rdma = true;
        } else if (secs_since(t0) > 60) {
          return fail("the connection never showed transport rdma");
        }
      }
    }
    bool want_in = !eof && !(client && p.mode == 1 && in == in_total) &&
                   !(!client && p.mode == 2 && in == in_total);
    bool want_out = !out_done && !(gated && out >= gate_at);
    pollfd pf{fd, short((want_in ? POLLIN : 0) | (want_out ? POLLOUT : 0)), 0};
    int pr = poll(&pf, 1, 20);
    if (pr < 0 && errno != EINTR) return fail(std::string("poll: ") + strerror(errno));
    if (pr <= 0) continue;
    if (pf.revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t n = read(fd, buf.data(), 1 + r() % buf.size());
      if (n < 0 && errno != EAGAIN && errno != EINTR) return fail(std::string("read: ") + strerror(errno));
      if (n == 0) {
        if (in != in_total) return fail("early EOF");
        eof = true;
      }
      for (ssize_t k = 0; k < n; k++)
        if (buf[size_t(k)] != gen(p.seed ^ (client ? 0x5eull : 0xc1ull), in + uint64_t(k)))
          return fail("wrong byte at " + std::to_string(in + uint64_t(k)));
      if (n > 0) in += uint64_t(n);
      if (in > in_total) return fail("more bytes than the plan");
    }
    if ((pf.revents & POLLOUT) && want_out) {
      uint64_t lim = gated ? gate_at : out_total;
      size_t max = (r() & 3) == 0 ? 32 : buf.size();
      size_t len = std::min<uint64_t>(1 + r() % max, lim - out);
      for (size_t k = 0; k < len; k++) buf[k] = gen(p.seed ^ (client ? 0xc1ull : 0x5eull), out + k);
      ssize_t w = write(fd, buf.data(), len);
      if (w < 0 && errno != EAGAIN && errno != EINTR) return fail(std::string("write: ") + strerror(errno));
      if (w > 0) out += uint64_t(w);
    }
  }
  if (!res.saw_rdma) res.saw_rdma = transport_of(fd) == 1;
  if (p.close_delay_ms) usleep(useconds_t(p.close_delay_ms) * 1000);
  close(fd);
  return res;
}

uint64_t own_upgrades() {
  std::string dir = rsock::stats::default_root_dir() + "/" + std::to_string(getuid());
  std::string why;
  auto snap = rsock::stats::read_process(dir, getpid(), &why);
  return snap ? snap->conns_upgraded : 0;
}

// Runs every connection in its own thread; prints failures; returns 0 if all passed.
int run_all(std::vector<int> fds, std::vector<Plan> plans, bool client) {
  std::vector<Result> res(fds.size());
  std::vector<std::thread> th;
  for (size_t i = 0; i < fds.size(); i++)
    th.emplace_back([&, i] { res[i] = run_conn(fds[i], client, plans[i], uint32_t(plans[i].seed * 7 + client)); });
  for (auto& t : th) t.join();
  int bad = 0, must = 0, saw = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < res.size(); i++) {
    bytes += plans[i].c_bytes + plans[i].s_bytes;
    if (plans[i].mode != 3) must++;
    if (res[i].saw_rdma) saw++;
    if (!res[i].err.empty()) {
      fprintf(stderr, "FAIL %s\n", res[i].err.c_str());
      bad++;
    } else if (client && plans[i].mode != 3 && !res[i].saw_rdma && !g_tcp_only) {
      fprintf(stderr, "FAIL client seed=%llu: not on rdma\n", (unsigned long long)plans[i].seed);
      bad++;
    }
  }
  uint64_t ups = own_upgrades();
  printf("%s: %zu connections, %d failed, %llu bytes each side, saw rdma on %d, conns_upgraded=%llu (need >= %d)\n",
         client ? "client" : "server", res.size(), bad, (unsigned long long)bytes, saw,
         (unsigned long long)ups, must);
  fflush(stdout);
  if (!g_tcp_only && ups < uint64_t(must)) {
    fprintf(stderr, "FAIL %s: only %llu connections upgraded, %d must have\n", client ? "client" : "server",
            (unsigned long long)ups, must);
    bad++;
  }
  return bad ? 1 : 0;
}

int connect_to(uint16_t port) {
  int c = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, g_addr, &a.sin_addr);
  if (c < 0 || connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a)) {
    perror("rsock_stress: connect");
    return -1;
  }
  return c;
}

int client_main(uint16_t port, int n, uint64_t seed) {
  std::vector<int> fds;
  std::vector<Plan> plans;
  // All connections first (concurrent upgrades), each announcing its seed.
  for (int i = 0; i < n; i++) {
    int c = connect_to(port);
    if (c < 0) return 1;
    uint64_t s = seed * 1000 + uint64_t(i);
    if (write(c, &s, sizeof s) != sizeof s) {
      perror("rsock_stress: header");
      return 1;
    }
    fds.push_back(c);
    plans.push_back(plan_of(s));
  }
  return run_all(fds, plans, true);
}

int server_main(const char* self, int n, uint64_t seed) {
  int l = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, g_addr, &a.sin_addr);
  socklen_t len = sizeof a;
  if (bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) || listen(l, 128) ||
      getsockname(l, reinterpret_cast<sockaddr*>(&a), &len)) {
    perror("rsock_stress: listen");
    return 1;
  }
  std::string port = std::to_string(ntohs(a.sin_port)), ns = std::to_string(n), ss = std::to_string(seed);
  printf("rsock_stress: %d connections, seed %llu (rerun: --seed %llu)\n", n, (unsigned long long)seed,
         (unsigned long long)seed);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    close(l);
    execl(self, self, "--client", port.c_str(), ns.c_str(), ss.c_str(), nullptr);
    _exit(127);
  }
  std::vector<int> fds;
  std::vector<Plan> plans;
  for (int i = 0; i < n; i++) {
    int c = accept(l, nullptr, nullptr);
    uint64_t s = 0;
    if (c < 0 || recv(c, &s, sizeof s, MSG_WAITALL) != sizeof s) {
      perror("rsock_stress: accept/header");
      kill(pid, SIGKILL);
      return 1;
    }
    fds.push_back(c);
    plans.push_back(plan_of(s));
  }
  int rc = run_all(fds, plans, false);
  int st = 0;
  waitpid(pid, &st, 0);
  int crc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  if (crc != 0) fprintf(stderr, "FAIL: client process exit status %d\n", crc);
  close(l);
  if (rc == 0 && crc == 0) printf("PASS: rsock_stress\n");
  return rc || crc ? 1 : 0;
}

int latency_main(uint16_t port, int n) {
  std::vector<double> us, cus;
  for (int i = 0; i < n; i++) {
    auto t0 = Clock::now();
    int c = connect_to(port);
    cus.push_back(secs_since(t0) * 1e6);
    char b = 'x';
    if (c < 0 || write(c, &b, 1) != 1 || read(c, &b, 1) != 1) {
      perror("rsock_stress: latency round");
      return 1;
    }
    us.push_back(secs_since(t0) * 1e6);
    close(c);
  }
  std::sort(us.begin(), us.end());
  std::sort(cus.begin(), cus.end());
  printf("median_us=%.0f p90_us=%.0f max_us=%.0f n=%d (connect() alone: median_us=%.0f)\n", us[us.size() / 2],
         us[us.size() * 9 / 10], us.back(), n, cus[cus.size() / 2]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* a = getenv("RSOCK_TEST_ADDR")) g_addr = a;
  signal(SIGPIPE, SIG_IGN);
  g_tcp_only = getenv("RSOCK_STRESS_TCP_ONLY") != nullptr;
  if (argc == 4 && !strcmp(argv[1], "--latency")) return latency_main(uint16_t(atoi(argv[2])), atoi(argv[3]));
  if (argc == 5 && !strcmp(argv[1], "--client"))
    return client_main(uint16_t(atoi(argv[2])), atoi(argv[3]), strtoull(argv[4], nullptr, 10));
  int n = 64;
  uint64_t seed = uint64_t(time(nullptr)) % 100000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--conns")) n = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], nullptr, 10);
  }
  bool dev = false;
  if (DIR* d = opendir("/sys/class/infiniband")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') dev = true;
    closedir(d);
  }
  if (!dev && !g_tcp_only) {
    printf("SKIP: no RDMA device\n");
    return 77;
  }
  if (!g_tcp_only && (getenv("LD_PRELOAD") == nullptr || !strstr(getenv("LD_PRELOAD"), "librsock"))) {
    fprintf(stderr, "rsock_stress must run with LD_PRELOAD=librsock.so (ctest sets it)\n");
    return 2;
  }
  alarm(400);
  return server_main(argv[0], n, seed);
}
