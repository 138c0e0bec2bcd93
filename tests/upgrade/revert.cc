// rsock_revert: the reverse switch (RDMA back to TCP) end to end, both ends
// preloaded (ctest sets LD_PRELOAD), inside the RDMA VM.
//
//   rsock_revert CASE [MB]
//
// The server listens on 10.77.0.1 and starts the client with fork + exec (a
// forked child cannot use the verbs device contexts its parent opened, and
// librdmacm keeps those for the life of the process). Both directions then carry MB MiB (default 16) of seeded bytes
// at once, nonblocking, and every byte is checked. Once the actor's
// connection is on RDMA (getsockopt RSOCK_TRANSPORT, and `rdma resource show
// qp` lists an RC QP in RTS) and a third of its bytes are out, it stops
// reading for a moment (so the rings fill in both directions: bytes in
// flight everywhere), then acts:
//   revert_client / revert_server   setsockopt(RSOCK_REVERT)
//   fail_client / fail_server       setsockopt(RSOCK_DEBUG_FAIL_PATH): the QP
//                                   breaks without telling the peer, as a
//                                   broken link would; the path works again,
//                                   so the connection must upgrade again and
//                                   end on RDMA (a new RC QP in RTS)
//   fork_child      the server forks; the parent closes its fd, the child
//                   finishes the stream: it must go onto RDMA again there (a
//                   new RC QP in RTS), the only process left holding it
//   fork_parent     the server forks; the child closes its fd and exits, the
//                   parent finishes the stream, on RDMA again
//   fdpass          a worker forked before the connection existed receives the
//                   upgraded socket over a UNIX socket (SCM_RIGHTS) and
//                   finishes the stream; the server closes its copy: it
//                   must go onto RDMA again in the worker (a new RC QP in
//                   RTS), which shares no memory with the server since then
//   failstay_client as fail_client, then, while the connection waits to
//                   upgrade again, setsockopt(RSOCK_REVERT): it must stay on
//                   TCP (both ends hold their FIN for 4 s, time enough for
//                   the first attempt, 0.5 s after the switch back)
//   lossy           the RDMA port starts losing packets: the device counters
//                   librsock reads (RSOCK_DEBUG_HW_COUNTERS, a directory both
//                   ends share) jump to 5000 sequence errors per million
//                   packets; both ends must go back to TCP (lossy_path), and
//                   a second connection to the same host must stay on TCP
//                   from its connect() on (the negative cache)
// Every case must end with every byte delivered exactly once, both ends
// back on TCP (on RDMA again after fail_* and fork_*), and no error; both
// ends of revert_* say released, both ends of fail_* path_failed
// (RSOCK_FALLBACK_REASON). Exit 0 pass, 1 fail, 77 no RDMA device.
//
// Two hosts (tools/rxe-pair, tests/pair/): one end each, no action; faults
// come from outside (link down, netem, rdma link delete). Each end prints
// its transport at the end and must see every byte:
//   rsock_revert --serve ADDR PORT MB        rsock_revert --connect ADDR PORT MB
// and a sender that closes at once while the path fails (close_main):
//   rsock_revert --serve-close ADDR PORT KB  rsock_revert --connect-read ADDR PORT KB
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "preload/librsock.h"

namespace {

using Clock = std::chrono::steady_clock;
const char* kAddr = "10.77.0.1";
constexpr double kTimeoutS = 240;
const char* g_who = "server";
// Two-host runs whose peer is killed (RSOCK_PAIR_EXPECT_END=1): the stream
// must end with an error, and when it does is the result.
bool g_expect_end = false;
std::chrono::steady_clock::time_point g_t0;

void say(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char b[512];
  vsnprintf(b, sizeof b, fmt, ap);
  va_end(ap);
  fprintf(stderr, "revert[%s %d]: %s\n", g_who, getpid(), b);
}
[[noreturn]] void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char b[512];
  vsnprintf(b, sizeof b, fmt, ap);
  va_end(ap);
  if (g_expect_end) {
    double s = std::chrono::duration<double>(Clock::now() - g_t0).count();
    printf("RESULT %s ended_with_error seconds=%.1f: %s\n", g_who, s, b);
    fflush(stdout);
    _exit(0);
  }
  fprintf(stderr, "revert[%s %d]: FAIL: %s\n", g_who, getpid(), b);
  _exit(1);
}

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// The seeded byte stream: n bytes from position i, one mix per 8 bytes (TCG
// is slow).
void fill(uint64_t seed, uint64_t i, unsigned char* out, size_t n) {
  size_t k = 0;
  while (k < n) {
    uint64_t pos = i + k, w = mix(seed ^ (pos >> 3) * 0x100000001b3ull);
    for (unsigned b = unsigned(pos & 7); b < 8 && k < n; b++, k++) out[k] = (unsigned char)(w >> (8 * b));
  }
}

int transport(int fd) {
  int t = -1;
  socklen_t l = sizeof t;
  if (getsockopt(fd, SOL_RSOCK, RSOCK_TRANSPORT, &t, &l) != 0) return -1;
  return t;
}

int fallback_reason(int fd) {
  int r = 0;
  socklen_t l = sizeof r;
  if (getsockopt(fd, SOL_RSOCK, RSOCK_FALLBACK_REASON, &r, &l) != 0) return -1;
  return r;
}

// The kernel's own view: RC QPs in RTS right now.
int rts_qps() {
  FILE* p = popen("rdma resource show qp 2>/dev/null", "r");
  if (!p) return -1;
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, p))
    if (strstr(line, "type RC") && strstr(line, "state RTS")) n++;
  pclose(p);
  return n;
}

struct Pump {
  int fd = -1;
  uint64_t seed_tx = 0, seed_rx = 0, total = 0;
  uint64_t tx = 0, rx = 0;
  bool shut = false, eof = false;
  bool saw_rdma = false;
  // Two-host runs: when the stream went onto RDMA and back (seconds since
  // run() began, -1: never), and the bytes each way at those moments.
  double rdma_at = -1, tcp_again_at = -1;
  // fail_*: the connection upgrades again only while neither end has shut
  // its direction down (a FIN already on TCP cannot be followed by a
  // switch marker), so SHUT_WR waits until it is on RDMA again (or
  // again_wait_s).
  bool shut_waits_for_again = false;
  double again_wait_s = 60;
  double again_at = -1;
  // RC QPs in RTS when it was seen on RDMA again: looked at before our FIN,
  // so the peer, which waits for it, cannot have closed yet.
  int again_qps = -1;
  // Seen on RDMA again (not only the wait ran out). The transport at the
  // end is no proof either way: the peer that finishes first closes, and its
  // close takes the connection back to TCP (released) before a slower end
  // (a fork child under load) looks.
  bool rdma_again = false;
  uint64_t rdma_tx = 0, rdma_rx = 0, back_tx = 0, back_rx = 0;
  // RSOCK_FALLBACK_REASON when it was first seen on RDMA: a change says it
  // left RDMA even when no look saw it off RDMA (a fork child under load
  // slept through its whole TCP interval, onto RDMA again, and then waited
  // for ever to see TCP before its FIN).
  int reason_at_rdma = 0;
  double hold_s = 1e9;  // how long to hold back 3/4 of the bytes for the upgrade
  // lossy: the last `reserve` bytes wait until the connection left RDMA,
  // and once `trickle` is set they go 4 KiB per round: the stream keeps
  // moving while librsock judges the port (it sends back busy streams only).
  uint64_t reserve = 0;
  bool trickle = false;
};

// One round: write what fits, read what is there (checked), unless paused.
// Until the connection has been seen on RDMA, at most a quarter is sent, so
// that the action always happens on an upgraded connection.
// A wrong byte: where the wrong run ends, and which stream position (of
// this peer's stream, within 8 MiB) the first wrong 8-byte word belongs to,
// if any: a stale ring lap, a chunk written twice or memory never written
// tell different bugs apart.
[[noreturn]] void report_wrong(const Pump& p, const unsigned char* got, const unsigned char* want,
                               size_t n) {
  size_t i = 0;
  while (got[i] == want[i]) i++;
  // The run ends at the first whole 8-byte word (a word of the pattern)
  // that is right again.
  size_t end = (i | 7) + 1;
  while (end < n && std::memcmp(got + end, want + end, std::min<size_t>(8, n - end)) != 0) end += 8;
  end = std::min(end, n);
  size_t w = (i + 7) & ~size_t{7};
  if (p.rx % 8 != 0) w = i;  // (reads stay 8-aligned in practice)
  char from[96] = "no position within 8 MiB";
  if (w + 8 <= n) {
    if (std::all_of(got + w, got + w + 8, [](unsigned char c) { return c == 0; })) {
      std::snprintf(from, sizeof from, "zeros");
    } else {
      uint64_t at = p.rx + w, lo = at > (8u << 20) ? at - (8u << 20) : 0;
      unsigned char cand[8];
      for (uint64_t q = lo & ~uint64_t{7}; q < at + (8u << 20); q += 8) {
        fill(p.seed_rx, q, cand, 8);
        if (std::memcmp(cand, got + w, 8) == 0) {
          std::snprintf(from, sizeof from, "the bytes of stream position %llu (%+lld)",
                        (unsigned long long)q, (long long)(q - at));
          break;
        }
      }
    }
  }
  fail("byte %llu of the peer's stream is wrong: %zu bytes wrong up to %llu in this read of %zu at "
       "%llu; the first wrong word holds %s",
       (unsigned long long)(p.rx + i), end - i, (unsigned long long)(p.rx + end), n,
       (unsigned long long)p.rx, from);
}

void step(Pump& p, bool read, int timeout_ms) {
  uint64_t limit = p.saw_rdma || p.hold_s <= 0 ? p.total : p.total / 4;
  if (p.reserve != 0 && p.tcp_again_at < 0) {
    uint64_t cap = p.total - p.reserve;
    if (p.trickle) cap = std::min(p.total, std::max(cap, p.tx + 4096));
    limit = std::min(limit, cap);
  }
  pollfd pf{p.fd, short((read ? POLLIN : 0) | (p.tx < limit ? POLLOUT : 0)), 0};
  if (poll(&pf, 1, timeout_ms) < 0 && errno != EINTR) fail("poll: %s", strerror(errno));
  static unsigned char buf[256 * 1024];
  if (p.tx < limit) {
    size_t n = std::min<uint64_t>(sizeof buf, limit - p.tx);
    fill(p.seed_tx, p.tx, buf, n);
    ssize_t w = send(p.fd, buf, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w > 0) p.tx += uint64_t(w);
    else if (w < 0 && errno != EAGAIN && errno != EINTR) fail("send at %llu: %s", (unsigned long long)p.tx, strerror(errno));
  }
  if (p.tx == p.total && !p.shut && (!p.shut_waits_for_again || p.again_at >= 0)) {
    if (shutdown(p.fd, SHUT_WR) != 0) fail("shutdown: %s", strerror(errno));
    p.shut = true;
  }
  if (!read || p.eof) return;
  for (int k = 0; k < 8; k++) {
    ssize_t r = recv(p.fd, buf, sizeof buf, MSG_DONTWAIT);
    if (r > 0) {
      static unsigned char want[sizeof buf];
      fill(p.seed_rx, p.rx, want, size_t(r));
      if (memcmp(buf, want, size_t(r)) != 0) report_wrong(p, buf, want, size_t(r));
      p.rx += uint64_t(r);
      if (p.rx > p.total) fail("more bytes than the peer sent (%llu)", (unsigned long long)p.rx);
      continue;
    }
    if (r == 0) {
      if (p.rx != p.total) fail("EOF after %llu of %llu bytes", (unsigned long long)p.rx, (unsigned long long)p.total);
      p.eof = true;
    } else if (errno != EAGAIN && errno != EINTR) {
      fail("recv at %llu: %s", (unsigned long long)p.rx, strerror(errno));
    }
    break;
  }
}

// Runs until both directions are complete. `act` is called every round until
// it returns true (it did its thing).
template <class F>
void run(Pump& p, F act) {
  auto t0 = Clock::now();
  bool acted = false;
  while (!(p.eof && p.shut)) {
    if (std::chrono::duration<double>(Clock::now() - t0).count() > kTimeoutS)
      fail("stuck: tx %llu rx %llu of %llu, transport %d", (unsigned long long)p.tx,
           (unsigned long long)p.rx, (unsigned long long)p.total, transport(p.fd));
    double now_s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (p.saw_rdma && p.tcp_again_at < 0 &&
        (transport(p.fd) != RSOCK_TRANSPORT_RDMA || fallback_reason(p.fd) != p.reason_at_rdma)) {
      p.tcp_again_at = now_s;
      p.back_tx = p.tx;
      p.back_rx = p.rx;
    }
    if (p.tcp_again_at >= 0 && p.again_at < 0 &&
        (transport(p.fd) == RSOCK_TRANSPORT_RDMA || now_s > p.tcp_again_at + p.again_wait_s)) {
      p.again_at = now_s;
      p.rdma_again = transport(p.fd) == RSOCK_TRANSPORT_RDMA;
      if (p.shut_waits_for_again) p.again_qps = rts_qps();
    }
    if (!p.saw_rdma && transport(p.fd) == RSOCK_TRANSPORT_RDMA) {
      p.saw_rdma = true;
      p.reason_at_rdma = fallback_reason(p.fd);
      p.rdma_at = std::chrono::duration<double>(Clock::now() - t0).count();
      p.rdma_tx = p.tx;
      p.rdma_rx = p.rx;
      // Two-host runs: tell the fault injector that the stream is on RDMA.
      if (const char* mark = getenv("RSOCK_PAIR_MARK")) close(open(mark, O_CREAT | O_WRONLY, 0644));
    }
    if (std::chrono::duration<double>(Clock::now() - t0).count() > p.hold_s) p.hold_s = 0;
    if (!acted) acted = act(p);
    // An act that handed the stream over (fork_child, fdpass) closed p.fd:
    // a step would send on a closed (or by now reused) fd number.
    if (p.eof && p.shut) break;
    step(p, true, 20);
  }
}

// The actor's trigger: on RDMA (both views), a third of the way, then the
// rings are filled by not reading for a while.
bool ready_to_act(Pump& p) {
  if (p.tx < p.total / 3 || transport(p.fd) != RSOCK_TRANSPORT_RDMA) return false;
  int q = rts_qps();
  if (q < 1) fail("on RDMA but `rdma resource show qp` lists %d RC QPs in RTS", q);
  say("on RDMA at tx %llu rx %llu (%d RC QPs in RTS); pausing reads to fill the rings",
      (unsigned long long)p.tx, (unsigned long long)p.rx, q);
  // (Not past two thirds: the act must leave bytes of ours for the peer to
  // read after it, or the peer may finish, and look at its fallback reason,
  // before the act reaches it. Under ASan in the TCG guest a late switch
  // once let the whole transfer end within the pause.)
  auto t0 = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - t0).count() < 0.3 &&
         p.tx < p.total * 2 / 3)
    step(p, false, 10);
  return true;
}

// The cases after which the connection upgrades again: a failed path
// (fail_*), a fork or fd passing that leaves one process holding it
// (fork_*, fdpass).
bool upgrades_again(const std::string& c) {
  return c.rfind("fail", 0) == 0 || c.rfind("fork", 0) == 0 || c == "fdpass";
}

// Why each end went back to TCP (RSOCK_FALLBACK_REASON, util/stats_layout.h):
// both ends of a failed path say path_failed, the peer included (its record
// says so, rendezvous version 5; before, the peer said released, a
// hand-off's label); both ends of a request say released. -1: not checked.
int g_want_reason = -1;
int want_reason(const std::string& c) {
  if (c == "fail_client" || c == "fail_server") return 16;      // path_failed
  if (c == "revert_client" || c == "revert_server") return 18;  // released
  return -1;
}

void check_reason(int fd) {
  if (g_want_reason < 0) return;
  int code = fallback_reason(fd);
  if (code < 0) fail("getsockopt RSOCK_FALLBACK_REASON: %s", strerror(errno));
  if ((code & 0xff) != g_want_reason)
    fail("fallback reason %d, want %d", code & 0xff, g_want_reason);
}

// `again`: once back on TCP the connection must upgrade again, and end on
// RDMA with an RC QP in RTS.
void finish(Pump& p, bool want_rdma_seen, bool again = false, bool may_wait = false) {
  if (want_rdma_seen && !p.saw_rdma) fail("the connection never showed transport rdma");
  check_reason(p.fd);
  if (again) {
    if (p.tcp_again_at < 0) fail("the connection never left RDMA");
    auto t0 = Clock::now();
    int t = transport(p.fd);
    while (!p.rdma_again && t != RSOCK_TRANSPORT_RDMA &&
           std::chrono::duration<double>(Clock::now() - t0).count() < 20) {
      usleep(10000);
      t = transport(p.fd);
    }
    if (!p.rdma_again && t != RSOCK_TRANSPORT_RDMA)
      fail("transport %d at the end, want rdma again (upgrading again)", t);
    int q = p.again_qps;
    if (q < 1) fail("on RDMA again but `rdma resource show qp` listed %d RC QPs in RTS", q);
    say("done: %llu bytes each way, checked; left RDMA at %.2f s, on RDMA again (%d RC QPs in RTS)",
        (unsigned long long)p.total, p.tcp_again_at, q);
    close(p.fd);
    return;
  }
  // Back on TCP once the peer's record is in: give it a moment.
  auto t0 = Clock::now();
  int t = transport(p.fd);
  while (t != RSOCK_TRANSPORT_TCP && std::chrono::duration<double>(Clock::now() - t0).count() < 10) {
    if (may_wait && t == RSOCK_TRANSPORT_UPGRADING) break;  // waiting to upgrade again, on TCP
    usleep(10000);
    t = transport(p.fd);
  }
  if (t != RSOCK_TRANSPORT_TCP && !(may_wait && t == RSOCK_TRANSPORT_UPGRADING))
    fail("transport %d at the end, want tcp", t);
  say("done: %llu bytes each way, checked; transport tcp", (unsigned long long)p.total);
  close(p.fd);
}

int client_main(uint16_t port, uint64_t total, const std::string& c) {
  g_who = "client";
  g_want_reason = want_reason(c);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, kAddr, &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fail("connect: %s", strerror(errno));
  Pump p;
  p.fd = fd;
  p.seed_tx = 1;
  p.seed_rx = 2;
  p.total = total;
  p.shut_waits_for_again = upgrades_again(c);
  if (c == "failstay_client") p.again_wait_s = 4;
  std::string me = c.substr(c.find('_') + 1);
  bool failed = false;
  run(p, [&](Pump& q) {
    if (me != "client") return true;
    int one = 1;
    if (failed) {  // failstay: once it waits to upgrade again, stay on TCP
      if (transport(q.fd) != RSOCK_TRANSPORT_UPGRADING) return false;
      if (setsockopt(q.fd, SOL_RSOCK, RSOCK_REVERT, &one, sizeof one) != 0) fail("setsockopt: %s", strerror(errno));
      say("RSOCK_REVERT while waiting to upgrade again: stays on TCP");
      return true;
    }
    if (!ready_to_act(q)) return false;
    int opt = c.rfind("revert", 0) == 0 ? RSOCK_REVERT : RSOCK_DEBUG_FAIL_PATH;
    if (setsockopt(q.fd, SOL_RSOCK, opt, &one, sizeof one) != 0) fail("setsockopt: %s", strerror(errno));
    say("%s at tx %llu rx %llu", c.c_str(), (unsigned long long)q.tx, (unsigned long long)q.rx);
    failed = c == "failstay_client";
    return !failed;
  });
  finish(p, true, upgrades_again(c) && c != "failstay_client");
  if (c == "lossy") {
    // Whichever end judged the path lossy keeps the other host on TCP: if
    // this end did, the next connect() starts no rendezvous at all; if only
    // the server did (we joined its switch back), its answer to our next
    // request is a lossy_path rejection, which this end caches in turn. So
    // of two more connections, neither may reach RDMA, and the last must
    // read as plain TCP right after connect().
    for (int k = 2; k <= 3; k++) {
      fd = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fail("connect %d: %s", k, strerror(errno));
      int t = transport(fd);
      if (k == 3 && t != RSOCK_TRANSPORT_TCP)
        fail("connection 3: transport %d after connect, want tcp (negative cache)", t);
      auto t0 = Clock::now();
      while (t == RSOCK_TRANSPORT_UPGRADING && std::chrono::duration<double>(Clock::now() - t0).count() < 15) {
        usleep(10000);
        t = transport(fd);
      }
      if (t != RSOCK_TRANSPORT_TCP) fail("connection %d: transport %d, want tcp", k, t);
      if (write(fd, "x", 1) != 1) fail("write %d: %s", k, strerror(errno));
      say("connection %d to the lossy host stays on TCP", k);
      close(fd);
    }
  }
  return 0;
}

// The lossy case's device counters (transport/path_quality.h names, rxe's).
void write_counters(const std::string& dir, uint64_t packets, uint64_t errors) {
  const std::pair<const char*, uint64_t> kv[] = {{"sent_pkts", packets / 2},
                                                 {"rcvd_pkts", packets - packets / 2},
                                                 {"out_of_seq_request", errors / 2},
                                                 {"rcvd_seq_err", errors - errors / 2}};
  for (auto& [name, v] : kv) {
    std::string tmp = dir + "/." + name, path = dir + "/" + name;
    FILE* f = fopen(tmp.c_str(), "w");
    if (!f) fail("counters: %s", strerror(errno));
    fprintf(f, "%llu\n", (unsigned long long)v);
    fclose(f);
    if (rename(tmp.c_str(), path.c_str()) != 0) fail("rename: %s", strerror(errno));
  }
}

// Two-host runs: the server accepts one connection on ADDR:PORT, the client
// connects to it (retrying while the server's guest still boots).
int pair_connect(bool serve, const char* addr, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, addr, &a.sin_addr);
  int fd;
  if (serve) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(l, 4) != 0)
      fail("listen: %s", strerror(errno));
    fd = accept(l, nullptr, nullptr);
    // The listening socket stays open, as in a real server: a connection
    // upgrades again through its rdma_cm listener (after a flap).
  } else {
    auto t0 = Clock::now();
    for (;;) {  // the server's guest may still be booting
      fd = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) break;
      close(fd);
      if (std::chrono::duration<double>(Clock::now() - t0).count() > 120) fail("no server");
      usleep(200000);
    }
  }
  if (fd < 0) fail("accept: %s", strerror(errno));
  return fd;
}

// One end of a two-host run: no action, every byte checked, the transport
// it ends on printed (faults are injected from outside).
int pair_main(bool serve, const char* addr, uint16_t port, uint64_t total) {
  g_who = serve ? "server" : "client";
  int fd = pair_connect(serve, addr, port);
  Pump p;
  p.fd = fd;
  p.seed_tx = serve ? 2 : 1;
  p.seed_rx = serve ? 1 : 2;
  p.total = total;
  // A path that never upgrades still gets its bytes through; without
  // librsock there is nothing to wait for.
  p.hold_s = transport(fd) < 0 ? 0 : 60;
  // RSOCK_PAIR_AGAIN=S (the flap case): the path comes back, so the stream
  // should upgrade again: neither end shuts its direction down before it
  // has, or for S seconds after it left RDMA.
  if (const char* w = getenv("RSOCK_PAIR_AGAIN")) {
    p.shut_waits_for_again = true;
    p.again_wait_s = atof(w);
  }
  // RSOCK_PAIR_PROBE=S: a small control connection that only asks whether
  // the devices can still set up a new RDMA connection: wait at most S
  // seconds for the upgrade.
  if (const char* w = getenv("RSOCK_PAIR_PROBE"); w && p.hold_s > 0) p.hold_s = atof(w);
  auto t0 = Clock::now();
  g_t0 = t0;
  g_expect_end = getenv("RSOCK_PAIR_EXPECT_END") != nullptr;
  run(p, [](Pump&) { return true; });
  if (g_expect_end) {
    g_expect_end = false;
    fail("the stream completed although the peer was killed");
  }
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  int t = transport(fd);
  say("done: %llu MiB each way in %.1f s, every byte checked; rdma seen: %s; transport at the end: %s",
      (unsigned long long)(total >> 20), s, p.saw_rdma ? "yes" : "no",
      t == RSOCK_TRANSPORT_RDMA ? "rdma" : t == RSOCK_TRANSPORT_TCP ? "tcp" : "other");
  if (p.saw_rdma)
    say("on RDMA at %.2f s (tx %llu rx %llu); left RDMA at %.2f s (tx %llu rx %llu)", p.rdma_at,
        (unsigned long long)p.rdma_tx, (unsigned long long)p.rdma_rx, p.tcp_again_at,
        (unsigned long long)p.back_tx, (unsigned long long)p.back_rx);
  if (p.shut_waits_for_again)
    say("on RDMA again at %.2f s: %d RC QPs in RTS then", p.again_at, p.again_qps);
  printf("RESULT %s saw_rdma=%d transport=%d seconds=%.1f again_qps=%d\n", g_who, p.saw_rdma ? 1 : 0, t,
         s, p.again_qps);
  fflush(stdout);
  close(fd);
  // Stay a moment: the peer may still be taking our last bytes, which the
  // closed connection delivers in the background. Exiting now would hand
  // them to TCP at exit (correct, but the peer would then end on TCP and
  // this check is about a clean run ending on RDMA at both ends).
  if (p.saw_rdma) sleep(2);
  return 0;
}

// Two hosts, a sender that closes at once (tests/pair/faults.sh flap_close):
// the server waits for the client's go (sent once on RDMA), sleeps so that
// the client's link is down by then, writes `total` seeded bytes and closes
// at once: they sit unacknowledged in a lingering connection whose RDMA
// path then fails. It stays alive meanwhile (an exit would hand the
// connection off at exit instead). The client reads to EOF: every byte
// must arrive, as kernel TCP would deliver them after close().
int close_main(bool serve, const char* addr, uint16_t port, uint64_t total) {
  g_who = serve ? "server" : "client";
  int fd = pair_connect(serve, addr, port);
  auto t0 = Clock::now();
  while (transport(fd) != RSOCK_TRANSPORT_RDMA) {
    if (std::chrono::duration<double>(Clock::now() - t0).count() > 60) fail("never on RDMA");
    usleep(10000);
  }
  static unsigned char buf[256 * 1024];
  if (serve) {
    char go;
    if (read(fd, &go, 1) != 1) fail("no go from the client");
    usleep(1000000);  // the client's link goes down 0.5 s after its go
    for (uint64_t off = 0; off < total;) {
      size_t n = std::min<uint64_t>(sizeof buf, total - off);
      fill(7, off, buf, n);
      ssize_t w = write(fd, buf, n);
      if (w <= 0) fail("write: %s", strerror(errno));
      off += uint64_t(w);
    }
    close(fd);
    say("wrote %llu bytes and closed; staying alive for 40 s", (unsigned long long)total);
    printf("RESULT server wrote=%llu\n", (unsigned long long)total);
    fflush(stdout);
    sleep(40);
    return 0;
  }
  if (const char* mark = getenv("RSOCK_PAIR_MARK")) close(open(mark, O_CREAT | O_WRONLY, 0644));
  if (write(fd, "g", 1) != 1) fail("write go: %s", strerror(errno));
  uint64_t got = 0;
  static unsigned char want[sizeof buf];
  for (;;) {
    ssize_t r = read(fd, buf, sizeof buf);
    if (r < 0) fail("read after %llu bytes: %s", (unsigned long long)got, strerror(errno));
    if (r == 0) break;
    fill(7, got, want, size_t(r));
    if (memcmp(buf, want, size_t(r)) != 0) fail("wrong bytes at %llu", (unsigned long long)got);
    got += uint64_t(r);
  }
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  printf("RESULT client read=%llu of %llu exact=%d transport=%d seconds=%.1f\n",
         (unsigned long long)got, (unsigned long long)total, got == total ? 1 : 0, transport(fd), s);
  fflush(stdout);
  if (got != total) fail("EOF after %llu of %llu bytes", (unsigned long long)got, (unsigned long long)total);
  close(fd);
  return 0;
}

int recv_fd(int us, Pump* p) {
  char data[sizeof p->tx + sizeof p->rx];
  iovec v{data, sizeof data};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))];
  msghdr m{};
  m.msg_iov = &v;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  if (recvmsg(us, &m, 0) != ssize_t(sizeof data)) fail("recvmsg: %s", strerror(errno));
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  if (!c || c->cmsg_type != SCM_RIGHTS) fail("no fd received");
  int fd;
  memcpy(&fd, CMSG_DATA(c), sizeof fd);
  memcpy(&p->tx, data, sizeof p->tx);
  memcpy(&p->rx, data + sizeof p->tx, sizeof p->rx);
  return fd;
}

void send_fd(int us, int fd, const Pump& p) {
  char data[sizeof p.tx + sizeof p.rx];
  memcpy(data, &p.tx, sizeof p.tx);
  memcpy(data + sizeof p.tx, &p.rx, sizeof p.rx);
  iovec v{data, sizeof data};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  m.msg_iov = &v;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof fd);
  if (sendmsg(us, &m, 0) != ssize_t(sizeof data)) fail("sendmsg: %s", strerror(errno));
}

int wait_child(pid_t pid, const char* what) {
  int st = 0;
  if (waitpid(pid, &st, 0) != pid) fail("waitpid %s: %s", what, strerror(errno));
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    say("FAIL: %s exited with status 0x%x", what, st);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: rsock_revert CASE [MB]\n");
    return 2;
  }
  if ((std::string(argv[1]) == "--serve" || std::string(argv[1]) == "--connect") && argc == 5)
    return pair_main(std::string(argv[1]) == "--serve", argv[2], uint16_t(atoi(argv[3])),
                     strtoull(argv[4], nullptr, 10) << 20);
  if ((std::string(argv[1]) == "--serve-close" || std::string(argv[1]) == "--connect-read") &&
      argc == 5)
    return close_main(std::string(argv[1]) == "--serve-close", argv[2], uint16_t(atoi(argv[3])),
                      strtoull(argv[4], nullptr, 10) << 10);
  if (std::string(argv[1]) == "--client" && argc == 5)
    return client_main(uint16_t(atoi(argv[2])), strtoull(argv[4], nullptr, 10) << 20, argv[3]);
  std::string c = argv[1];
  g_want_reason = want_reason(c);
  uint64_t total = (argc > 2 ? strtoull(argv[2], nullptr, 10) : 16) << 20;
  if (access("/sys/class/infiniband", F_OK) != 0 || rts_qps() < 0) {
    printf("SKIP: no RDMA device\n");
    return 77;
  }
  int l = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, kAddr, &a.sin_addr);
  if (bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    printf("SKIP: cannot bind %s (not in the RDMA VM): %s\n", kAddr, strerror(errno));
    return 77;
  }
  listen(l, 8);
  std::string hwc;
  if (c == "lossy") {  // before the client starts: it inherits the variable
    char d[] = "/tmp/rsock-hwc-XXXXXX";
    if (!mkdtemp(d)) fail("mkdtemp: %s", strerror(errno));
    hwc = d;
    write_counters(hwc, 0, 0);
    setenv("RSOCK_DEBUG_HW_COUNTERS", d, 1);
  }
  socklen_t al = sizeof a;
  getsockname(l, reinterpret_cast<sockaddr*>(&a), &al);
  uint16_t port = ntohs(a.sin_port);

  pid_t client = fork();
  if (client == 0) {
    close(l);
    char ports[16], mbs[32];
    snprintf(ports, sizeof ports, "%u", port);
    snprintf(mbs, sizeof mbs, "%llu", (unsigned long long)(total >> 20));
    execl("/proc/self/exe", argv[0], "--client", ports, c.c_str(), mbs, (char*)nullptr);
    _exit(127);
  }
  int us[2] = {-1, -1};
  pid_t worker = -1;
  if (c == "fdpass") {
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, us) != 0) fail("socketpair: %s", strerror(errno));
    worker = fork();
    if (worker == 0) {
      g_who = "worker";
      close(l);
      close(us[0]);
      Pump p;
      p.seed_tx = 2;
      p.seed_rx = 1;
      p.total = total;
      p.fd = recv_fd(us[1], &p);
      p.saw_rdma = true;  // the server saw it
      p.shut_waits_for_again = true;
      say("received the socket at tx %llu rx %llu, transport %d", (unsigned long long)p.tx,
          (unsigned long long)p.rx, transport(p.fd));
      run(p, [](Pump&) { return true; });
      finish(p, true, true);  // on RDMA again here, the only process holding it
      _exit(0);
    }
    close(us[1]);
  }
  int fd = accept(l, nullptr, nullptr);
  if (fd < 0) fail("accept: %s", strerror(errno));
  int l2 = -1;  // the lossy case's second connection
  if (c == "lossy") l2 = l;
  else close(l);
  Pump p;
  p.fd = fd;
  p.seed_tx = 2;
  p.seed_rx = 1;
  p.total = total;
  p.shut_waits_for_again = upgrades_again(c);
  if (c == "failstay_client") p.again_wait_s = 4;
  if (c == "lossy") p.reserve = total / 4;
  int rc = 0;
  bool handed = false;
  run(p, [&](Pump& q) {
    if (c == "revert_client" || c == "fail_client" || c == "failstay_client") return true;
    if (!ready_to_act(q)) return false;
    if (c == "lossy") {
      write_counters(hwc, 200000, 1000);
      q.trickle = true;
      say("the port loses packets now (device counters: 5000 ppm) at tx %llu rx %llu",
          (unsigned long long)q.tx, (unsigned long long)q.rx);
      return true;
    }
    if (c == "revert_server" || c == "fail_server") {
      int opt = c == "revert_server" ? RSOCK_REVERT : RSOCK_DEBUG_FAIL_PATH;
      if (setsockopt(q.fd, SOL_RSOCK, opt, &one, sizeof one) != 0) fail("setsockopt: %s", strerror(errno));
      say("%s at tx %llu rx %llu", c.c_str(), (unsigned long long)q.tx, (unsigned long long)q.rx);
      return true;
    }
    if (c == "fdpass") {
      send_fd(us[0], q.fd, q);
      say("passed the socket at tx %llu rx %llu; closing ours", (unsigned long long)q.tx,
          (unsigned long long)q.rx);
      close(q.fd);
      rc |= wait_child(worker, "worker");
      handed = true;
      q.eof = q.shut = true;  // the worker finished the stream
      return true;
    }
    say("fork at tx %llu rx %llu", (unsigned long long)q.tx, (unsigned long long)q.rx);
    pid_t kid = fork();
    if (kid < 0) fail("fork: %s", strerror(errno));
    if (c == "fork_child") {
      if (kid == 0) {
        g_who = "child";
        return true;  // goes on with the stream
      }
      close(q.fd);
      rc |= wait_child(kid, "child");
      handed = true;
      q.eof = q.shut = true;
      return true;
    }
    // fork_parent
    if (kid == 0) {
      close(q.fd);
      _exit(0);
    }
    rc |= wait_child(kid, "child");
    return true;
  });
  // failstay: the server still waits for an attempt the client will not make.
  if (!handed)
    finish(p, true, upgrades_again(c) && c != "failstay_client", c == "failstay_client");
  if (strcmp(g_who, "child") == 0) _exit(0);
  if (c == "lossy") {
    for (int k = 2; k <= 3; k++) {
      int fd2 = accept(l2, nullptr, nullptr);
      char x = 0;
      if (fd2 < 0 || read(fd2, &x, 1) != 1 || x != 'x') fail("connection %d: no byte", k);
      close(fd2);
    }
    for (const char* n : {"sent_pkts", "rcvd_pkts", "out_of_seq_request", "rcvd_seq_err"})
      unlink((hwc + "/" + n).c_str());
    rmdir(hwc.c_str());
  }
  rc |= wait_child(client, "client");
  if (rc == 0) printf("PASS: %s\n", c.c_str());
  return rc;
}
