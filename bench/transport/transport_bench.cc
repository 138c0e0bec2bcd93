// Transport micro-benchmark: ping-pong latency (64 B, 4 KiB) and one-way
// streaming bandwidth (64 KiB writes) over transport::Connection between two
// processes on 10.77.0.1, both busy-polling like perftest does.
//   rsock_transport_bench [--iters N] [--stream-mib M] [--stream-spin-us U] [--ring-kib K]
// Prints "lat <bytes> avg <us> median <us>" (one-way = RTT/2, as perftest)
// and "bw <bytes> <MiB/s>". Exit 77 without an RDMA device.
#include <algorithm>
#include <vector>

#include "harness.h"

using rsock::config::Tunables;

namespace {

uint32_t g_ring_bytes = 1u << 20;

Tunables bench_tunables() {
  Tunables t;
  t.resolve_timeout_ms = 5000;
  t.connect_timeout_ms = 10000;
  t.spin_us = 10 * 1000 * 1000;  // never sleep while a test runs: perftest spins too
  t.ring_bytes = g_ring_bytes;
  t.inline_threshold = 64;
  return t;
}

int pingpong(size_t size, int iters) {
  Tunables tun = bench_tunables();
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto c = accept_one(l);
    std::vector<char> buf(size);
    for (int i = 0; i < iters + 10; ++i) {
      if (!recv_all(*c, buf.data(), size)) return 1;
      send_all(*c, buf.data(), size);
    }
    char x;
    recv_all(*c, &x, 1);
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    std::vector<char> buf(size, 'p');
    std::vector<double> us;
    us.reserve(iters);
    for (int i = 0; i < iters + 10; ++i) {  // 10 warm-up rounds
      uint64_t t0 = rsock::now_ns();
      send_all(*c, buf.data(), size);
      CHECK(recv_all(*c, buf.data(), size), "EOF");
      if (i >= 10) us.push_back(double(rsock::now_ns() - t0) / 2000.0);
    }
    CHECK(c->counters().data_wrs > 0, "no RDMA writes");
    double avg = 0;
    for (double v : us) avg += v;
    avg /= double(us.size());
    std::sort(us.begin(), us.end());
    std::printf("lat %zu avg %.2f median %.2f (us, one-way, %d iters, inline WRs %llu)\n", size,
                avg, us[us.size() / 2], iters, (unsigned long long)c->counters().inline_wrs);
    CHECK(c->shutdown_write().ok(), "shutdown");
    return 0;
  };
  return run_pair(server, client, tun, 300);
}

int stream(size_t size, size_t mib, uint32_t spin_us) {
  Tunables tun = bench_tunables();
  // Streaming: a spinning receiver steals the CPU that rxe's kernel side needs
  // on a 2-vCPU guest; a short spin then sleep is faster there.
  tun.spin_us = spin_us;
  const uint64_t total = uint64_t(mib) << 20;
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto c = accept_one(l);
    std::vector<char> buf(size);
    uint64_t got = 0;
    while (got < total) {
      iovec v{buf.data(), buf.size()};
      auto r = c->recv({&v, 1}, false);
      if (r.ok()) {
        if (*r == 0) return 1;
        got += *r;
      } else {
        CHECK(r.error() == EAGAIN, "recv %s", std::strerror(r.error()));
        (void)c->wait(POLLIN, 10000);
      }
    }
    char ack = 'a';
    send_all(*c, &ack, 1);
    recv_all(*c, &ack, 1);
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    std::vector<char> buf(size, 's');
    uint64_t t0 = rsock::now_ns();
    for (uint64_t sent = 0; sent < total; sent += size) send_all(*c, buf.data(), size);
    char ack;
    CHECK(recv_all(*c, &ack, 1), "no ack");
    double s = secs_since(t0);
    const auto& k = c->counters();
    std::printf("bw %zu %.1f (MiB/s, %zu MiB, data WRs %llu, credit stalls %llu)\n", size,
                double(total) / 1048576.0 / s, mib, (unsigned long long)k.data_wrs,
                (unsigned long long)k.credit_stalls);
    CHECK(c->shutdown_write().ok(), "shutdown");
    return 0;
  };
  return run_pair(server, client, tun, 300);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  int iters = 2000;
  size_t mib = 256;
  uint32_t stream_spin = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--iters") iters = std::max(1, atoi(argv[i + 1]));
    else if (a == "--stream-mib") mib = std::max(1, atoi(argv[i + 1]));
    else if (a == "--stream-spin-us") stream_spin = uint32_t(atoi(argv[i + 1]));
    else if (a == "--ring-kib") g_ring_bytes = uint32_t(atoi(argv[i + 1])) * 1024;
    else {
      std::fprintf(stderr, "usage: %s [--iters N] [--stream-mib M] [--stream-spin-us U] [--ring-kib K]\n", argv[0]);
      return 2;
    }
  }
  skip_without_device();
  int rc = 0;
  rc |= pingpong(64, iters);
  rc |= pingpong(4096, iters);
  rc |= stream(64 * 1024, mib, stream_spin);
  return rc;
}
