// Path quality from the device's port counters (path_quality.h).
#include "transport/path_quality.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <utility>

#include "util/owned_fds.h"
#include "util/sys.h"

namespace rsock::transport::path_quality {

namespace {

// The counter files stay open, in the owned band, and are read again with
// pread at offset 0 (sysfs makes a fresh value for every read from 0). An
// open() at every look (every 100-250 ms) would take the lowest free fd number for a moment,
// from a background thread: a program that had just closed that number and
// used it again (its next socket(), or a call that must fail EBADF) would
// get something else. Now each file costs one such open per process, at
// the first look (or none: open_port() from the application's own call).
// A file that fails to read (its device went away) is closed and opened
// again at a later look; a name that is not there is remembered as missing. Override directories (RSOCK_DEBUG_HW_COUNTERS,
// tests) are opened at every read: tests replace files by rename.
constexpr int kMaxOpen = 32;
struct OpenCounter {
  char path[256];
  int fd;
};
OpenCounter g_open[kMaxOpen];
int g_nopen = 0;
std::mutex g_open_mu;

int64_t parse(const char* buf, ssize_t n) {
  if (n <= 0) return -1;
  char* end = nullptr;
  unsigned long long v = std::strtoull(buf, &end, 10);
  if (end == buf) return -1;
  return int64_t(v);
}

// One file read through a fresh fd (override directories, or the table of
// open files is full).
int64_t read_once(const char* path) {
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);  // open is not hooked
  if (fd < 0) return -1;
  char buf[32];
  ssize_t n = sys::libc.read(fd, buf, sizeof buf - 1);
  sys::libc.close(fd);
  if (n > 0) buf[n] = 0;
  return parse(buf, n);
}

// One counter file, or -1 if there is none (or it holds no number).
int64_t counter(const char* dir, const char* name, bool keep) {
  char path[256];
  if (std::snprintf(path, sizeof path, "%s/%s", dir, name) >= int(sizeof path)) return -1;
  if (!keep) return read_once(path);
  std::lock_guard lk(g_open_mu);
  int i = 0;
  while (i < g_nopen && std::strcmp(g_open[i].path, path) != 0) i++;
  if (i == g_nopen) {
    if (g_nopen == kMaxOpen) return read_once(path);
    // A name the driver does not have (rxe's on mlx5, and the other way)
    // is remembered as missing (fd -1): it would otherwise cost a failed
    // open() at every look.
    int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    std::memcpy(g_open[i].path, path, sizeof path);
    g_open[i].fd = fd < 0 ? -1 : sys::own_fd(fd);
    g_nopen++;
  }
  if (g_open[i].fd < 0) return -1;
  char buf[32];
  ssize_t n = ::pread(g_open[i].fd, buf, sizeof buf - 1, 0);
  if (n < 0) {
    sys::close_owned(g_open[i].fd);
    g_open[i] = g_open[--g_nopen];
    return -1;
  }
  buf[n] = 0;
  return parse(buf, n);
}

// The first of `names` the directory has (-1: none).
template <size_t N>
int64_t first_of(const char* dir, const char* const (&names)[N], bool keep) {
  for (const char* n : names) {
    int64_t v = counter(dir, n, keep);
    if (v >= 0) return v;
  }
  return -1;
}

}  // namespace

Sample read(const char* device, uint8_t port) {
  char hw[192], std_dir[192];
  bool keep = true;
  if (const char* d = ::getenv("RSOCK_DEBUG_HW_COUNTERS"); d && *d) {
    std::snprintf(hw, sizeof hw, "%s", d);
    std::snprintf(std_dir, sizeof std_dir, "%s", d);
    keep = false;
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
  int64_t gap = first_of(hw, kRxGap, keep), nak = first_of(hw, kTxNak, keep);
  int64_t sent = first_of(hw, kSent, keep), rcvd = first_of(hw, kRcvd, keep);
  if (sent < 0 || rcvd < 0) {  // mlx5 counts packets among the standard counters
    sent = first_of(std_dir, kXmit, keep);
    rcvd = first_of(std_dir, kRecv, keep);
  }
  if (gap < 0 || nak < 0 || sent < 0 || rcvd < 0) return s;
  s.packets = uint64_t(sent) + uint64_t(rcvd);
  s.seq_errors = uint64_t(gap) + uint64_t(nak);
  s.ok = true;
  return s;
}

void open_port(const char* device, uint8_t port) { (void)read(device, port); }

void after_fork_child() { new (&g_open_mu) std::mutex(); }

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

RateJudge::Verdict RateJudge::feed(uint64_t acked, bool busy, uint64_t now_ns, uint32_t ratio) {
  uint64_t prev = std::exchange(last_ns_, now_ns);
  if (prev == 0 || now_ns <= prev) return Verdict::kNoData;
  if (!busy) return Verdict::kNoData;  // the window waits for busy time
  win_ns_ += now_ns - prev;
  win_bytes_ += acked;
  if (win_ns_ < kWindowNs) return Verdict::kNoData;
  // bytes * 1e9 / ns: a window of 2^64 / 1e9 bytes (18 GB) cannot happen in
  // a few looks.
  uint64_t bps = win_bytes_ * 1'000'000'000 / win_ns_;
  bool stalled = win_bytes_ == 0;
  win_ns_ = win_bytes_ = 0;
  if (stalled) {
    slow_ = 0;
    return Verdict::kNoData;
  }
  last_bps_ = bps;
  if (best_ns_ != 0 && now_ns - best_ns_ > kBestTtlNs) best_bps_ = 0;  // a stale reference
  if (bps >= best_bps_) {
    best_bps_ = bps;
    best_ns_ = now_ns;
    slow_ = 0;
    return Verdict::kGood;
  }
  if (ratio == 0 || best_bps_ < kMinBestBytesPerSec || bps * ratio > best_bps_) {
    slow_ = 0;
    return Verdict::kGood;
  }
  if (++slow_ < kSlowWindows) return Verdict::kGood;
  slow_ = 0;
  return Verdict::kCollapsed;
}

}  // namespace rsock::transport::path_quality
