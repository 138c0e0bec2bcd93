// Choosing the better path: the port judge and the counter reader
// (transport/path_quality.h), with counters in a temporary directory.
#include <doctest/doctest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "transport/path_quality.h"

using rsock::transport::path_quality::PortJudge;
using rsock::transport::path_quality::Sample;
using Verdict = PortJudge::Verdict;

namespace {
Sample sample(uint64_t packets, uint64_t errors) { return {packets, errors, true}; }
constexpr uint64_t kMs = 1'000'000;
}  // namespace

TEST_CASE("path quality: the first sample is the base, no verdict") {
  PortJudge j;
  CHECK(j.feed(sample(5000, 100), 0, 1000) == Verdict::kNoData);
}

TEST_CASE("path quality: a clean wire is good, a lossy one lossy, at the threshold") {
  PortJudge j;
  j.feed(sample(0, 0), 0, 1000);
  CHECK(j.feed(sample(100000, 0), 500 * kMs, 1000) == Verdict::kGood);
  // 99 errors in 100000 packets: 990 ppm, under 1000.
  CHECK(j.feed(sample(200000, 99), 1000 * kMs, 1000) == Verdict::kGood);
  // 100 in 100000: exactly 1000 ppm.
  CHECK(j.feed(sample(300000, 199), 1500 * kMs, 1000) == Verdict::kLossy);
  CHECK(j.last_packets() == 100000);
  CHECK(j.last_errors() == 100);
  // Measured on rxe with 2 % netem loss on one link: about 4600 ppm.
  CHECK(j.feed(sample(400000, 199 + 460), 2000 * kMs, 1000) == Verdict::kLossy);
  // Two errors in 1000 packets are 2000 ppm, but a drop or two is no path.
  CHECK(j.feed(sample(401000, 659 + 2), 2500 * kMs, 1000) == Verdict::kGood);
}

TEST_CASE("path quality: too few packets wait for more; an old thin window starts over") {
  PortJudge j;
  j.feed(sample(0, 0), 0, 1000);
  // 3 errors in 500 packets would be 6000 ppm, but 500 packets prove nothing.
  CHECK(j.feed(sample(500, 3), 500 * kMs, 1000) == Verdict::kNoData);
  // 1000 packets since the base: judged over all of them.
  CHECK(j.feed(sample(1000, 3), 1000 * kMs, 1000) == Verdict::kLossy);
  // A trickle: 900 packets over more than 10 s, then the window starts over,
  // so its errors are not held against the next one.
  j.feed(sample(1400, 3 + 9), 6000 * kMs, 1000);
  CHECK(j.feed(sample(1900, 12), 12000 * kMs, 1000) == Verdict::kNoData);  // restarted here
  CHECK(j.feed(sample(2950, 12), 13000 * kMs, 1000) == Verdict::kGood);
}

TEST_CASE("path quality: ppm 0 never judges lossy; counters that go back restart") {
  PortJudge j;
  j.feed(sample(0, 0), 0, 0);
  CHECK(j.feed(sample(10000, 5000), 500 * kMs, 0) == Verdict::kGood);
  CHECK(j.feed(sample(10, 0), 1000 * kMs, 1000) == Verdict::kNoData);  // device re-created
  CHECK(j.feed(sample(2010, 0), 1500 * kMs, 1000) == Verdict::kGood);
  CHECK(j.feed(Sample{}, 2000 * kMs, 1000) == Verdict::kNoData);  // no counters
}

TEST_CASE("path quality: counters read from files named like rxe's or mlx5's") {
  char dir[] = "/tmp/rsock-hwc-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  auto put = [&](const char* name, const char* value) {
    std::string p = std::string(dir) + "/" + name;
    FILE* f = std::fopen(p.c_str(), "w");
    REQUIRE(f != nullptr);
    std::fputs(value, f);
    std::fclose(f);
  };
  auto drop = [&](const char* name) { unlink((std::string(dir) + "/" + name).c_str()); };
  setenv("RSOCK_DEBUG_HW_COUNTERS", dir, 1);
  CHECK_FALSE(rsock::transport::path_quality::read("rxe0", 1).ok);  // nothing there
  put("sent_pkts", "1000\n");
  put("rcvd_pkts", "2000\n");
  put("out_of_seq_request", "7\n");
  CHECK_FALSE(rsock::transport::path_quality::read("rxe0", 1).ok);  // one of four missing
  put("rcvd_seq_err", "5\n");
  Sample s = rsock::transport::path_quality::read("rxe0", 1);
  CHECK(s.ok);
  CHECK(s.packets == 3000);
  CHECK(s.seq_errors == 12);
  // mlx5's names: the packet counts live among the standard counters, which
  // the override directory stands in for too.
  for (const char* n : {"sent_pkts", "rcvd_pkts", "out_of_seq_request", "rcvd_seq_err"}) drop(n);
  put("out_of_sequence", "1\n");
  put("packet_seq_err", "2\n");
  put("port_xmit_packets", "10\n");
  put("port_rcv_packets", "20\n");
  s = rsock::transport::path_quality::read("mlx5_0", 1);
  CHECK(s.ok);
  CHECK(s.packets == 30);
  CHECK(s.seq_errors == 3);
  put("packet_seq_err", "junk\n");
  CHECK_FALSE(rsock::transport::path_quality::read("mlx5_0", 1).ok);
  unsetenv("RSOCK_DEBUG_HW_COUNTERS");
  for (const char* n : {"out_of_sequence", "packet_seq_err", "port_xmit_packets", "port_rcv_packets"})
    drop(n);
  rmdir(dir);
}

// The throughput collapse (RateJudge): busy time adds up to 0.5 s windows.
using rsock::transport::path_quality::RateJudge;
using RateVerdict = RateJudge::Verdict;

namespace {
// Looks of 100 ms: kW of them fill one window.
constexpr int kW = int(RateJudge::kWindowNs / (100 * kMs));
// Feeds `looks` looks of 100 ms, each acknowledging `per_look` bytes.
RateVerdict feed_for(RateJudge& j, uint64_t* now, int looks, uint64_t per_look, bool busy,
                     uint32_t ratio = 16) {
  RateVerdict last = RateVerdict::kNoData;
  for (int i = 0; i < looks; i++) {
    *now += 100 * kMs;
    auto v = j.feed(per_look, busy, *now, ratio);
    if (v != RateVerdict::kNoData) last = v;
  }
  return last;
}
// A judge whose best is one window of 16 MiB/s (ratio 16 unless told).
RateJudge at_best(uint64_t* now, uint32_t ratio = 16) {
  RateJudge j;
  *now = 1000 * kMs;
  j.feed(0, true, *now, ratio);
  feed_for(j, now, 1 * kW, 1677722, true, ratio);
  return j;
}
}  // namespace

TEST_CASE("rate judge: a steady path is good; a 16-fold drop for two windows is a collapse") {
  RateJudge j;
  uint64_t now = 1000 * kMs;
  CHECK(j.feed(0, true, now, 16) == RateVerdict::kNoData);  // the first look is the base
  // 16 MiB/s (1.6 MiB per 100 ms): the best.
  CHECK(feed_for(j, &now, 1 * kW, 1677722, true) == RateVerdict::kGood);
  CHECK(j.best_bytes_per_sec() > 16'000'000);
  // A fourth of it (four times more streams sharing the path): no collapse.
  CHECK(feed_for(j, &now, 3 * kW, 1677722 / 4, true) == RateVerdict::kGood);
  // 1/20: the first slow window is only a warning, the second a collapse.
  CHECK(feed_for(j, &now, 1 * kW, 1677722 / 20, true) == RateVerdict::kGood);
  CHECK(feed_for(j, &now, 1 * kW, 1677722 / 20, true) == RateVerdict::kCollapsed);
  CHECK(j.last_bytes_per_sec() * 16 < j.best_bytes_per_sec());
}

TEST_CASE("rate judge: a window that delivered nothing (a link down) ends a run of slow ones") {
  uint64_t now;
  RateJudge j = at_best(&now);
  CHECK(feed_for(j, &now, 1 * kW, 1677722 / 20, true) == RateVerdict::kGood);  // slow 1
  CHECK(feed_for(j, &now, 3 * kW, 0, true) == RateVerdict::kNoData);            // stalled
  CHECK(feed_for(j, &now, 1 * kW, 1677722 / 20, true) == RateVerdict::kGood);  // slow 1 again
  CHECK(feed_for(j, &now, 1 * kW, 1677722 / 20, true) == RateVerdict::kCollapsed);
}

TEST_CASE("rate judge: only busy time counts; a fast window in between starts again") {
  uint64_t now;
  RateJudge j = at_best(&now);
  // Idle or reader-limited looks (nothing in flight) never count, however
  // long and however little they move.
  CHECK(feed_for(j, &now, 10 * kW, 0, false) == RateVerdict::kNoData);
  CHECK(feed_for(j, &now, 1 * kW, 1677722 / 20, true) == RateVerdict::kGood);   // slow 1
  CHECK(feed_for(j, &now, 1 * kW, 1677722, true) == RateVerdict::kGood);        // fast again
  CHECK(feed_for(j, &now, 1 * kW, 1677722 / 20, true) == RateVerdict::kGood);   // slow 1 again
  CHECK(feed_for(j, &now, 1 * kW, 1677722 / 20, true) == RateVerdict::kCollapsed);
}

TEST_CASE("rate judge: ratio 0, a trickle of a best, and a best older than 10 minutes") {
  uint64_t now;
  RateJudge j = at_best(&now, 0);
  CHECK(feed_for(j, &now, 4 * kW, 1000, true, 0) == RateVerdict::kGood);  // never with ratio 0

  RateJudge t;  // a best of 100 KiB/s is no reference
  now = 1000 * kMs;
  t.feed(0, true, now, 16);
  feed_for(t, &now, 1 * kW, 10240, true);
  CHECK(feed_for(t, &now, 4 * kW, 10, true) == RateVerdict::kGood);

  RateJudge o = at_best(&now);  // the best expires: the slow rate becomes the new reference
  now += RateJudge::kBestTtlNs;
  CHECK(o.feed(0, false, now, 16) == RateVerdict::kNoData);  // (no stream for 10 minutes)
  CHECK(feed_for(o, &now, 1 * kW, 1677722 / 20, true) == RateVerdict::kGood);
  CHECK(feed_for(o, &now, 2 * kW, 1677722 / 20, true) == RateVerdict::kGood);
}
