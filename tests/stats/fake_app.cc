// A process that uses the stats writer directly, as librsock will: opens N
// fake connections with known byte counts, reports its pid, and sleeps until
// killed. Drives tests/stats/run_test.sh against rsock-stat.
//
//   stats_fake_app N INITIAL_SLOTS READY_FILE [fork]
// Connection i (0-based): fd 100+i, client, 127.0.0.1:(40000+i) -> 10.0.0.(i+1):6379;
// even i on RDMA (qp 1000+i) with tx = 1000*(i+1) bytes in i+1 ops, rx = 500*(i+1),
// and i credit stalls, a switch of 1000*(i+1) us 10000*(i+1) us after its
// start (connection 8 a second one of 2500 us); odd i on TCP after fallback
// peer_not_rsock, same byte
// counts on TCP, no credit stalls.
// With "fork": after setting up, forks; the child calls after_fork_child()
// and writes "child PID" to READY_FILE.child; the parent writes its pid to
// READY_FILE. Both sleep.
// $STATS_FAKE_EXE, if set, replaces the executable name in the segment (to
// test how rsock-stat quotes odd names).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "util/stats.h"

using namespace rsock::stats;

static sockaddr_in addr(const char* ip, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, ip, &a.sin_addr);
  return a;
}

static void write_file(const std::string& path, int pid) {
  std::string tmp = path + ".tmp";
  FILE* f = fopen(tmp.c_str(), "w");
  if (f == nullptr) exit(3);
  fprintf(f, "%d\n", pid);
  fclose(f);
  rename(tmp.c_str(), path.c_str());
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s N INITIAL_SLOTS READY_FILE [fork]\n", argv[0]);
    return 1;
  }
  int n = atoi(argv[1]);
  Options opt;
  const char* exe = getenv("STATS_FAKE_EXE");
  opt.exe = exe != nullptr ? exe : "stats_fake_app";
  opt.initial_slots = static_cast<uint32_t>(atoi(argv[2]));
  std::string ready = argv[3];
  bool do_fork = argc > 4 && strcmp(argv[4], "fork") == 0;
  if (!init(opt).ok()) {
    fprintf(stderr, "stats init failed\n");
    return 2;
  }
  // One connection opened and closed: its traffic must show in the totals.
  {
    auto l = addr("127.0.0.1", 39999), p = addr("10.9.9.9", 80);
    ConnSlot* s = open_conn(99, Direction::kClient, reinterpret_cast<sockaddr*>(&l), reinterpret_cast<sockaddr*>(&p));
    s->add_tx(Transport::kTcp, 7);
    close_conn(s);
  }
  for (int i = 0; i < n; ++i) {
    char ip[32];
    snprintf(ip, sizeof ip, "10.0.0.%d", i + 1);
    auto l = addr("127.0.0.1", static_cast<uint16_t>(40000 + i)), p = addr(ip, 6379);
    ConnSlot* s = open_conn(100 + i, Direction::kClient, reinterpret_cast<sockaddr*>(&l),
                            reinterpret_cast<sockaddr*>(&p));
    if (s == nullptr) return 4;
    set_state(s, ConnState::kUpgrading);
    Transport t = i % 2 == 0 ? Transport::kRdma : Transport::kTcp;
    if (t == Transport::kRdma) {
      set_upgraded(s, 1000 + i, false, 1000 * (i + 1), 10000 * (i + 1));
      // Back on RDMA after a switch back: a second, shorter switch.
      if (i == 8) set_upgraded(s, 1000 + i, /*again=*/true, 2500, 0);
    } else {
      set_fallback(s, FallbackReason::kPeerNotRsock);
    }
    for (int k = 0; k <= i; ++k) {
      s->add_tx(t, 1000);
      s->add_rx(t, 500);
    }
    if (t == Transport::kRdma)
      for (int k = 0; k < i; ++k) s->add_credit_stall();
    s->set_ring_fill(64 * i, 32 * i);
    s->set_credits(16);
  }
  // The resource gauges librsock's progress thread writes.
  if (Resources* r = resources()) {
    r->pinned_bytes.store(3 << 20);
    r->pinned_budget.store(6 << 20);
    r->kits_idle.store(3);
    r->kits_reused.store(7);
  }
  if (do_fork) {
    pid_t child = fork();
    if (child < 0) return 5;
    if (child == 0) {
      after_fork_child();
      write_file(ready + ".child", getpid());
      for (;;) pause();
    }
  }
  write_file(ready, getpid());
  for (;;) pause();
}
