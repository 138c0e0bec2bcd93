// Path quality: is an RDMA port losing packets?
//
// RC recovers a lost packet by go-back-N: the responder NAKs the first packet
// out of sequence and the requester sends the whole window again from the
// lost one (a lost tail waits for the ACK timeout first). Kernel TCP recovers
// with SACK and fast retransmit. So on a lossy path RC collapses long before
// TCP does: 2 % netem loss on one link, measured between two rxe guests, gave
// kernel TCP 4.9 s for 64 MiB each way and librsock on RDMA 26-56 s
// (docs/PERFORMANCE.md). librsock then goes back to TCP ("choose the better
// path", docs/DESIGN.md).
//
// Verbs have no per-QP retransmission counter, so the signal is the port's
// own: its sequence errors (out-of-sequence requests seen by our responder:
// the peer's packets lost on the way to us; NAKs for sequence errors seen by
// our requester: ours lost on the way there) per packet sent and received, as
// the device counts them in sysfs (/sys/class/infiniband/DEV/ports/N/
// hw_counters, readable by everyone). Names differ by driver: rxe's and
// mlx5's are known. Measured on rxe between two guests: 0 sequence errors in
// 136,000 packets on a clean wire, 4,600 per million with 2 % loss on one
// link (both ends see about the same ratio).
//
// RSOCK_DEBUG_HW_COUNTERS=DIR (tests): the counters are read from files in
// DIR (one number per file, named like rxe's) instead of sysfs, opened at
// every read (tests replace them by rename).
#pragma once

#include <algorithm>
#include <cstdint>

namespace rsock::transport::path_quality {

struct Sample {
  uint64_t packets = 0;     // sent + received
  uint64_t seq_errors = 0;  // out-of-sequence requests + sequence-error NAKs
  bool ok = false;          // the device has counters we know
};

// Reads one port's counters now (a few small sysfs reads, through files it
// keeps open in the owned fd band after the first read).
Sample read(const char* device, uint8_t port);
// Opens the port's counter files now (from the application's own call, so
// that the progress thread's first look creates no fd).
void open_port(const char* device, uint8_t port);
// In a fork child: the table's lock is fresh (a parent thread may have held
// it); the open files are inherited and stay in use.
void after_fork_child();

// Judges a port from successive samples: lossy when, over at least
// kMinPackets packets since the last judgement, sequence errors reach
// `ppm` per million packets, and are at least kMinErrors (a lone drop, as
// when a link comes up, is no lossy path). A window older than kMaxWindowNs
// with too few packets starts again (old errors say little about the path
// now).
class PortJudge {
 public:
  static constexpr uint64_t kMinPackets = 1000;
  static constexpr uint64_t kMinErrors = 3;
  static constexpr uint64_t kMaxWindowNs = 10'000'000'000;
  enum class Verdict : uint8_t { kNoData, kGood, kLossy };
  // `ppm` 0: never lossy.
  Verdict feed(const Sample& s, uint64_t now_ns, uint32_t ppm);
  // The last window's figures (for the log line).
  uint64_t last_packets() const { return last_packets_; }
  uint64_t last_errors() const { return last_errors_; }

 private:
  bool have_base_ = false;
  Sample base_{};
  uint64_t base_ns_ = 0;
  uint64_t last_packets_ = 0, last_errors_ = 0;
};

// Judges a path (the connections to one peer host) by its delivery rate:
// a throughput collapse is the third sign, next to loss and timeouts, that
// RDMA does far worse than TCP would there ("choose the better path").
// Seen between two rxe guests whose RoCE traffic alone was throttled
// (pair.slow: a RoCE traffic class starved, TCP untouched): RC's ACKs waited
// longer than the ACK timeout, every write went out several times, and the
// stream crawled at a fraction of a megabyte per second, with neither a
// sequence error nor, for long stretches, a failed completion.
//
// The rate counts only time when the path was the limit: bytes the device
// acknowledged (send completions) while at least kMinInFlight bytes, or
// half the peer's ring if that is less (a connection whose ring never grew
// on a slow path), were posted and unacknowledged, at the start and the end
// of a look's interval.
// A slow reader keeps our bytes acknowledged but unconsumed (nothing in
// flight); a sender with little to say keeps little in flight: neither is
// the path's fault, and neither counts. Busy intervals add up to windows of
// kWindowNs; a window at least `ratio` times slower than the best window
// seen to the host (within kBestTtlNs) is slow, and kSlowWindows slow ones
// in a row are a collapse. A faster window raises the best at once. A
// window that delivered nothing at all is a stalled path, not a slow one:
// RC's retries and the stall watchdog fail it (path_failed) and the
// connection upgrades again once it works (a link flap), so such a window
// ends a run of slow ones.
class RateJudge {
 public:
  static constexpr uint64_t kMinInFlight = 64 * 1024;
  static bool path_limited(uint64_t in_flight, uint32_t window) {
    return in_flight > 0 && in_flight >= std::min<uint64_t>(kMinInFlight, window / 2);
  }
  static constexpr uint64_t kWindowNs = 500'000'000;
  static constexpr uint32_t kSlowWindows = 2;
  static constexpr uint64_t kBestTtlNs = 600'000'000'000;  // 10 minutes
  // A best window under this is no reference (an idle trickle).
  static constexpr uint64_t kMinBestBytesPerSec = 1 << 20;
  enum class Verdict : uint8_t { kNoData, kGood, kCollapsed };
  // One look's interval ending at now_ns: `acked` bytes acknowledged by the
  // device over it, `busy`: the path was the limit all along. `ratio` 0:
  // never collapsed.
  Verdict feed(uint64_t acked, bool busy, uint64_t now_ns, uint32_t ratio);
  uint64_t best_bytes_per_sec() const { return best_bps_; }
  uint64_t last_bytes_per_sec() const { return last_bps_; }

 private:
  uint64_t last_ns_ = 0;     // the previous look
  uint64_t win_ns_ = 0;      // busy time in the current window
  uint64_t win_bytes_ = 0;   // ... and the bytes acknowledged in it
  uint64_t best_bps_ = 0;
  uint64_t best_ns_ = 0;
  uint64_t last_bps_ = 0;
  uint32_t slow_ = 0;
};

}  // namespace rsock::transport::path_quality
