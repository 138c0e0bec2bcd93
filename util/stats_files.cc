#include "util/stats_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "util/sys.h"

namespace rsock::stats {

const char* transport_name(Transport t) { return t == Transport::kRdma ? "rdma" : "tcp"; }

const char* state_name(ConnState s) {
  switch (s) {
    case ConnState::kFree: return "free";
    case ConnState::kConnecting: return "connecting";
    case ConnState::kUpgrading: return "upgrading";
    case ConnState::kEstablished: return "established";
    case ConnState::kClosing: return "closing";
  }
  return "unknown";
}

const char* direction_name(Direction d) { return d == Direction::kServer ? "server" : "client"; }

const char* fallback_reason_name(FallbackReason r) {
  static const char* const kNames[kFallbackReasons] = {
      "none",     "policy",      "peer_not_rsock", "no_device", "resolve_failed", "rejected",
      "timeout",  "negative_cache", "no_resources", "protocol", "unsupported",   "peer_closed",
      "forked",   "other",       "memlock",        "connect_failed",
      "path_failed", "handed_off",  "released",       "fd_limit",
      "io_uring", "lossy_path",     "slow_path"};
  auto i = static_cast<unsigned>(r);
  return i < kFallbackReasons ? kNames[i] : "unknown";
}

const char* peer_reason_name(uint8_t r) {
  static const char* const kNames[] = {"none",         "bad_magic", "bad_version", "bad_setup",
                                       "no_resources", "refused",   "timeout",
                                       "redirect",     "lossy_path"};
  return r < sizeof kNames / sizeof kNames[0] ? kNames[r] : "unknown";
}

namespace files {

std::string uid_dir(std::string_view root, uid_t uid) {
  return std::string(root) + "/" + std::to_string(uid);
}

std::string segment_path(std::string_view dir, int pid, uint32_t index) {
  std::string p = std::string(dir) + "/" + std::to_string(pid);
  if (index != 0) p += "." + std::to_string(index);
  return p;
}

bool parse_name(std::string_view name, int* pid, uint32_t* index) {
  uint64_t p = 0, k = 0;
  size_t i = 0;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && i < 10; ++i) p = p * 10 + (name[i] - '0');
  if (i == 0 || p == 0 || p > 0x7fffffff) return false;
  if (i < name.size()) {
    if (name[i] != '.') return false;
    size_t j = ++i;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && i - j < 4; ++i) k = k * 10 + (name[i] - '0');
    if (i == j || i != name.size() || k == 0 || k >= kMaxFiles) return false;
  }
  *pid = static_cast<int>(p);
  *index = static_cast<uint32_t>(k);
  return true;
}

Status<size_t> read_small(const char* path, char* buf, size_t cap) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Err(errno);
  size_t got = 0;
  while (got < cap) {
    ssize_t n = sys::libc.read(fd, buf + got, cap - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  sys::libc.close(fd);
  return got;
}

Status<uint64_t> process_start_time(int pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  char buf[1024];
  auto n = read_small(path, buf, sizeof buf - 1);
  if (!n.ok()) return Err(n.error());
  buf[*n] = '\0';
  // comm may contain spaces and parentheses: fields resume after the LAST ')'.
  char* p = strrchr(buf, ')');
  if (p == nullptr) return Err(EINVAL);
  ++p;
  // Field 3 (state) is the first after ')'; starttime is field 22.
  for (int field = 3; field < 22; ++field) {
    while (*p == ' ') ++p;
    while (*p != ' ' && *p != '\0') ++p;
    if (*p == '\0') return Err(EINVAL);
  }
  uint64_t v = 0;
  while (*p == ' ') ++p;
  if (*p < '0' || *p > '9') return Err(EINVAL);
  for (; *p >= '0' && *p <= '9'; ++p) v = v * 10 + static_cast<uint64_t>(*p - '0');
  return v;
}

bool pid_alive(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno != EPERM) return false;  // EPERM: exists, someone else's
  // A zombie (exited, not yet reaped: common in containers whose init does
  // not reap) still answers kill(0) but will never update its segment.
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  char buf[512];
  auto n = read_small(path, buf, sizeof buf - 1);
  if (!n.ok()) return n.error() != ENOENT;
  buf[*n] = '\0';
  const char* p = strrchr(buf, ')');
  return p == nullptr || p[1] != ' ' || (p[2] != 'Z' && p[2] != 'X');
}

Check check_header(const void* data, size_t file_size, int expect_pid, uint32_t expect_index,
                   std::string* why) {
  auto* h = static_cast<const SegmentHeader*>(data);
  auto bad = [why](std::string s) {
    *why = std::move(s);
    return Check::kBad;
  };
  if (file_size < 16) {
    if (file_size == 0) return Check::kNotReady;  // between creat and ftruncate
    return bad("file is " + std::to_string(file_size) + " bytes, too short for a header");
  }
  uint64_t magic = h->magic.load(std::memory_order_acquire);
  if (magic == 0) return Check::kNotReady;
  if (magic != kMagic) return bad("not a librsock stats segment (bad magic)");
  if (h->layout_version != kLayoutVersion)
    return bad("layout version " + std::to_string(h->layout_version) + ", this rsock-stat reads version " +
               std::to_string(kLayoutVersion) + " (use the rsock-stat of the same librsock release)");
  if (h->header_size != sizeof(SegmentHeader) || h->slot_size != sizeof(ConnSlot))
    return bad("header/slot size " + std::to_string(h->header_size) + "/" + std::to_string(h->slot_size) +
               " does not match version " + std::to_string(kLayoutVersion) + " (" +
               std::to_string(sizeof(SegmentHeader)) + "/" + std::to_string(sizeof(ConnSlot)) + ")");
  if (file_size < sizeof(SegmentHeader)) return bad("file is truncated");
  if (h->slot_count == 0 || h->slot_count > (1u << 26) || file_size < file_bytes(h->slot_count))
    return bad("slot count " + std::to_string(h->slot_count) + " does not fit the file size " +
               std::to_string(file_size));
  if (h->pid != expect_pid || h->file_index != expect_index)
    return bad("header says pid " + std::to_string(h->pid) + " file " + std::to_string(h->file_index) +
               ", file name says pid " + std::to_string(expect_pid) + " file " +
               std::to_string(expect_index));
  return Check::kOk;
}

size_t remove_stale(const std::string& dir, int keep_pid) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;
  size_t removed = 0;
  while (dirent* e = readdir(d)) {
    int pid = 0;
    uint32_t index = 0;
    if (!parse_name(e->d_name, &pid, &index) || pid == keep_pid) continue;
    std::string path = dir + "/" + e->d_name;
    bool stale = !pid_alive(pid);
    if (!stale) {
      // Same pid, different process? Only decidable for a header we can read.
      SegmentHeader h;
      auto n = read_small(path.c_str(), reinterpret_cast<char*>(&h), sizeof h);
      std::string why;
      if (n.ok() && *n == sizeof h &&
          check_header(&h, file_bytes(h.slot_count), pid, index, &why) == Check::kOk) {
        auto st = process_start_time(pid);
        stale = st.ok() && h.start_time != 0 && *st != h.start_time;
      }
    }
    if (stale && unlink(path.c_str()) == 0) ++removed;
  }
  closedir(d);
  return removed;
}

}  // namespace files
}  // namespace rsock::stats
