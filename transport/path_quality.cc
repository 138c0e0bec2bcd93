// Path quality from the device's port counters (path_quality.h).
#include "transport/path_quality.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "util/sys.h"

namespace rsock::transport::path_quality {

namespace {

// One counter file, or -1 if there is none (or it holds no number).
int64_t counter(const char* dir, const char* name) {
  char path[256];
  if (std::snprintf(path, sizeof path, "%s/%s", dir, name) >= int(sizeof path)) return -1;
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);  // open is not hooked
  if (fd < 0) return -1;
  char buf[32];
  ssize_t n = sys::libc.read(fd, buf, sizeof buf - 1);
  sys::libc.close(fd);
  if (n <= 0) return -1;
  buf[n] = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(buf, &end, 10);
  if (end == buf) return -1;
  return int64_t(v);
}

// The first of `names` the directory has (-1: none).
template <size_t N>
int64_t first_of(const char* dir, const char* const (&names)[N]) {
  for (const char* n : names) {
    int64_t v = counter(dir, n);
    if (v >= 0) return v;
  }
  return -1;
}

}  // namespace

Sample read(const char* device, uint8_t port) {
  char hw[192], std_dir[192];
  if (const char* d = ::getenv("RSOCK_DEBUG_HW_COUNTERS"); d && *d) {
    std::snprintf(hw, sizeof hw, "%s", d);
    std::snprintf(std_dir, sizeof std_dir, "%s", d);
  } else {
    std::snprintf(hw, sizeof hw, "/sys/class/infiniband/%s/ports/%u/hw_counters", device,
                  unsigned(port));
    std::snprintf(std_dir, sizeof std_dir, "/sys/class/infiniband/%s/ports/%u/counters", device,
                  unsigned(port));
  }
  // rxe: out_of_seq_request (responder) and rcvd_seq_err (requester, NAK
  // received); mlx5: out_of_sequence and packet_seq_err.
  static constexpr const char* kRxGap[] = {"out_of_seq_request", "out_of_sequence"};
  static constexpr const char* kTxNak[] = {"rcvd_seq_err", "packet_seq_err"};
  static constexpr const char* kSent[] = {"sent_pkts"};
  static constexpr const char* kRcvd[] = {"rcvd_pkts"};
  static constexpr const char* kXmit[] = {"port_xmit_packets"};
  static constexpr const char* kRecv[] = {"port_rcv_packets"};
  Sample s;
  int64_t gap = first_of(hw, kRxGap), nak = first_of(hw, kTxNak);
  int64_t sent = first_of(hw, kSent), rcvd = first_of(hw, kRcvd);
  if (sent < 0 || rcvd < 0) {  // mlx5 counts packets among the standard counters
    sent = first_of(std_dir, kXmit);
    rcvd = first_of(std_dir, kRecv);
  }
  if (gap < 0 || nak < 0 || sent < 0 || rcvd < 0) return s;
  s.packets = uint64_t(sent) + uint64_t(rcvd);
  s.seq_errors = uint64_t(gap) + uint64_t(nak);
  s.ok = true;
  return s;
}

PortJudge::Verdict PortJudge::feed(const Sample& s, uint64_t now_ns, uint32_t ppm) {
  if (!s.ok) return Verdict::kNoData;
  // A counter that went backwards (device re-created, counters reset): start again.
  if (!have_base_ || s.packets < base_.packets || s.seq_errors < base_.seq_errors) {
    have_base_ = true;
    base_ = s;
    base_ns_ = now_ns;
    return Verdict::kNoData;
  }
  uint64_t pk = s.packets - base_.packets, err = s.seq_errors - base_.seq_errors;
  if (pk < kMinPackets) {
    if (now_ns - base_ns_ > kMaxWindowNs) {
      base_ = s;
      base_ns_ = now_ns;
    }
    return Verdict::kNoData;
  }
  base_ = s;
  base_ns_ = now_ns;
  last_packets_ = pk;
  last_errors_ = err;
  // err / pk >= ppm / 1e6, in integers (pk < 2^63 / 1e6 in any real window).
  if (ppm != 0 && err >= kMinErrors && err * 1000000 >= uint64_t{ppm} * pk) return Verdict::kLossy;
  return Verdict::kGood;
}

}  // namespace rsock::transport::path_quality
