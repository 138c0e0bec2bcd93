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

}  // namespace rsock::transport::path_quality
