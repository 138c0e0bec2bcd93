#include "util/stats_reader.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "util/stats_files.h"
#include "util/sys.h"

namespace rsock::stats {

void TrafficTotals::add(const TrafficTotals& o) {
  for (int i = 0; i < kTransports; ++i) {
    tx_bytes[i] += o.tx_bytes[i];
    rx_bytes[i] += o.rx_bytes[i];
    tx_ops[i] += o.tx_ops[i];
    rx_ops[i] += o.rx_ops[i];
  }
  credit_stalls += o.credit_stalls;
}

namespace {

TrafficTotals copy_traffic(const Traffic& t) {
  TrafficTotals out;
  for (int i = 0; i < kTransports; ++i) {
    out.tx_bytes[i] = t.tx_bytes[i].load(std::memory_order_relaxed);
    out.rx_bytes[i] = t.rx_bytes[i].load(std::memory_order_relaxed);
    out.tx_ops[i] = t.tx_ops[i].load(std::memory_order_relaxed);
    out.rx_ops[i] = t.rx_ops[i].load(std::memory_order_relaxed);
  }
  out.credit_stalls = t.credit_stalls.load(std::memory_order_relaxed);
  return out;
}

// A read-only mapping of one file, unmapped on destruction.
class Mapping {
 public:
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (p_ != nullptr) munmap(p_, size_);
  }

  // ENOENT/EACCES/... from open; size 0 maps nothing (not ready).
  Status<void> open_file(const std::string& path) {
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return Err(errno);
    struct stat st{};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      sys::libc.close(fd);
      return Err(EINVAL);
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      void* p = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        int e = errno;
        sys::libc.close(fd);
        return Err(e);
      }
      p_ = p;
    }
    sys::libc.close(fd);
    return Ok();
  }
  const SegmentHeader* header() const { return static_cast<const SegmentHeader*>(p_); }
  size_t size() const { return size_; }

 private:
  void* p_ = nullptr;
  size_t size_ = 0;
};

bool read_slot(const ConnSlot& s, ConnSnapshot* out) {
  if (s.in_use.load(std::memory_order_acquire) == 0) return false;
  bool settled = false;
  // Writers hold the seqlock for a few stores, rarely; yield now and then in
  // case one was preempted mid-update. Give up (and say so) after ~10k tries.
  for (int attempt = 0; attempt < 10000 && !settled; ++attempt) {
    if (attempt % 64 == 63) sched_yield();
    uint32_t a = s.seq.load(std::memory_order_acquire);
    if (a & 1) continue;
    memcpy(&out->info, &s.info, sizeof out->info);
    std::atomic_thread_fence(std::memory_order_acquire);
    settled = s.seq.load(std::memory_order_relaxed) == a;
  }
  if (!settled) {
    memcpy(&out->info, &s.info, sizeof out->info);
    out->torn = true;
  }
  if (out->info.state == static_cast<uint8_t>(ConnState::kFree)) return false;  // closing under us
  out->traffic = copy_traffic(s.traffic);
  out->send_ring_fill = s.send_ring_fill.load(std::memory_order_relaxed);
  out->recv_ring_fill = s.recv_ring_fill.load(std::memory_order_relaxed);
  out->ring_bytes = s.ring_bytes.load(std::memory_order_relaxed);
  out->send_credits = s.send_credits.load(std::memory_order_relaxed);
  out->upgrade_us = s.upgrade_us.load(std::memory_order_relaxed);
  out->switch_us = s.switch_us.load(std::memory_order_relaxed);
  return true;
}

void read_slots(const SegmentHeader* h, uint32_t file_index, ProcessSnapshot* snap) {
  const ConnSlot* slots = slots_of(h);
  for (uint32_t i = 0; i < h->slot_count; ++i) {
    ConnSnapshot c;
    if (!read_slot(slots[i], &c)) continue;
    c.file_index = file_index;
    c.slot_index = i;
    snap->total.add(c.traffic);
    snap->conns.push_back(c);
  }
  snap->slots += h->slot_count;
  ++snap->files;
}

}  // namespace

Status<ProcessSnapshot> read_process(const std::string& dir, int pid, std::string* why) {
  std::string path = files::segment_path(dir, pid, 0);
  Mapping main;
  if (auto st = main.open_file(path); !st.ok()) {
    *why = path + ": " + strerror(st.error());
    return Err(st.error());
  }
  std::string what;
  switch (files::check_header(main.header(), main.size(), pid, 0, &what)) {
    case files::Check::kNotReady:
      *why = path + ": segment is being created";
      return Err(EAGAIN);
    case files::Check::kBad:
      *why = path + ": " + what;
      return Err(EPROTO);
    case files::Check::kOk:
      break;
  }
  const SegmentHeader* h = main.header();
  ProcessSnapshot snap;
  snap.pid = h->pid;
  snap.uid = h->uid;
  snap.start_time = h->start_time;
  snap.start_unix_ms = h->start_unix_ms;
  snap.exe.assign(h->exe, strnlen(h->exe, sizeof h->exe));
  snap.release.assign(h->release, strnlen(h->release, sizeof h->release));
  const ProcessCounters& pc = h->counters;
  // Counters before slots: a connection closing meanwhile is then missed
  // rather than counted twice (closed totals only ever grow).
  snap.conns_seen = pc.conns_seen.load(std::memory_order_relaxed);
  snap.conns_upgraded = pc.conns_upgraded.load(std::memory_order_relaxed);
  snap.conns_untracked = pc.conns_untracked.load(std::memory_order_relaxed);
  snap.handshake_errors = pc.handshake_errors.load(std::memory_order_relaxed);
  for (int i = 0; i < kFallbackReasons; ++i) snap.fallbacks[i] = pc.fallbacks[i].load(std::memory_order_relaxed);
  snap.closed = copy_traffic(pc.closed);
  const Resources& res = h->resources;
  snap.pinned_bytes = res.pinned_bytes.load(std::memory_order_relaxed);
  snap.pinned_budget = res.pinned_budget.load(std::memory_order_relaxed);
  snap.kits_idle = res.kits_idle.load(std::memory_order_relaxed);
  snap.kits_reused = res.kits_reused.load(std::memory_order_relaxed);
  const Switches& sw = h->switches;
  snap.switches = sw.count.load(std::memory_order_relaxed);
  snap.switch_us_sum = sw.switch_us_sum.load(std::memory_order_relaxed);
  snap.switch_us_max = sw.switch_us_max.load(std::memory_order_relaxed);
  snap.upgrade_us_sum = sw.upgrade_us_sum.load(std::memory_order_relaxed);
  snap.total = snap.closed;
  read_slots(h, 0, &snap);

  uint32_t ext = h->extension_count.load(std::memory_order_acquire);
  if (ext >= kMaxFiles) {
    *why = path + ": extension count " + std::to_string(ext) + " is corrupt";
    return Err(EPROTO);
  }
  for (uint32_t k = 1; k <= ext; ++k) {
    std::string epath = files::segment_path(dir, pid, k);
    Mapping m;
    if (auto st = m.open_file(epath); !st.ok()) {
      *why = epath + ": " + strerror(st.error());
      return Err(st.error());
    }
    switch (files::check_header(m.header(), m.size(), pid, k, &what)) {
      case files::Check::kNotReady:
        *why = epath + ": extension is being created";
        return Err(EAGAIN);
      case files::Check::kBad:
        *why = epath + ": " + what;
        return Err(EPROTO);
      case files::Check::kOk:
        break;
    }
    if (m.header()->start_time != h->start_time) {
      *why = epath + ": belongs to another process with the same pid";
      return Err(EPROTO);
    }
    read_slots(m.header(), k, &snap);
  }
  return snap;
}

std::vector<SegmentRef> list_segments(const std::string& root, bool all_users, bool clean) {
  std::vector<SegmentRef> out;
  std::vector<std::pair<std::string, uint32_t>> dirs;
  if (all_users) {
    if (DIR* d = opendir(root.c_str())) {
      while (dirent* e = readdir(d)) {
        char* end = nullptr;
        unsigned long uid = strtoul(e->d_name, &end, 10);
        if (e->d_name[0] < '0' || e->d_name[0] > '9' || *end != '\0') continue;
        dirs.emplace_back(root + "/" + e->d_name, static_cast<uint32_t>(uid));
      }
      closedir(d);
    }
  } else {
    dirs.emplace_back(files::uid_dir(root, getuid()), static_cast<uint32_t>(getuid()));
  }
  for (auto& [dir, uid] : dirs) {
    if (clean) files::remove_stale(dir, 0);
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) continue;
    while (dirent* e = readdir(d)) {
      int pid = 0;
      uint32_t index = 0;
      if (files::parse_name(e->d_name, &pid, &index) && index == 0) out.push_back({dir, pid, uid});
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end(), [](const SegmentRef& a, const SegmentRef& b) { return a.pid < b.pid; });
  return out;
}

std::string format_endpoint(uint8_t family, const uint8_t* addr, uint16_t port) {
  char buf[INET6_ADDRSTRLEN + 16];
  if (family == 4) {
    inet_ntop(AF_INET, addr, buf, sizeof buf);
    return std::string(buf) + ":" + std::to_string(port);
  }
  if (family == 6) {
    inet_ntop(AF_INET6, addr, buf, sizeof buf);
    return "[" + std::string(buf) + "]:" + std::to_string(port);
  }
  return "-";
}

}  // namespace rsock::stats
