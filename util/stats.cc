// The stats writer: creates this process's segment files, hands out slots,
// grows by chaining extension files, and re-publishes itself after fork.
//
// Concurrency: slot allocation takes a spinlock (connection open/close only);
// counters are relaxed atomics written by the I/O thread; descriptive fields
// use a per-slot seqlock whose writers serialise on the sequence number.
#include "util/stats.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <netinet/in.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "util/log.h"
#include "util/spin_lock.h"
#include "util/stats_files.h"
#include "util/sys.h"

namespace rsock::stats {

namespace {

class SpinLock {
 public:
  void lock() { spin_lock(flag_); }
  void unlock() { spin_unlock(flag_); }
  void reset() { flag_.store(false, std::memory_order_relaxed); }

 private:
  std::atomic<bool> flag_{false};
};

struct File {
  SegmentHeader* h = nullptr;
  uint32_t slot_count = 0;
};

// Constant-initialised and trivially destructible on purpose: preload/ may
// call init() from a hook that runs before this library's dynamic
// initialisers (another library's constructor opening a socket), and hooks
// still run after static destructors at exit. A std::string or vector here
// would be re-constructed over a live state, silently turning stats off.
struct State {
  std::atomic<bool> on{false};
  char dir[512] = {};  // <root>/<uid>
  char exe[64] = {};
  int pid = 0;
  uint64_t start_time = 0;
  uint64_t start_unix_ms = 0;
  bool unlink_at_exit = true;
  bool atexit_registered = false;

  SpinLock lock;  // guards everything below
  File files[kMaxFiles] = {};
  uint32_t nfiles = 0;
  uint32_t cursor_file = 0;  // first never-used slot: files[cursor_file], index cursor_slot
  uint32_t cursor_slot = 0;
  ConnSlot* free_head = nullptr;  // closed slots, linked through ConnSlot::free_next
};

constinit State g;
static_assert(std::is_trivially_destructible_v<State>);  // usable from constructors that run before ours

uint64_t now_unix_ms() {
  timespec ts{};
  // (Shown in ms: the coarse clock, which is no syscall in VMs without a
  // vDSO clock source, and one is read per connection.)
  clock_gettime(CLOCK_REALTIME_COARSE, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000 + static_cast<uint64_t>(ts.tv_nsec) / 1000000;
}

void fill_header(SegmentHeader* h, uint32_t index, uint32_t slots) {
  h->layout_version = kLayoutVersion;
  h->header_size = sizeof(SegmentHeader);
  h->slot_size = sizeof(ConnSlot);
  h->slot_count = slots;
  h->file_index = index;
  h->pid = g.pid;
  h->uid = static_cast<uint32_t>(getuid());
  h->start_time = g.start_time;
  h->start_unix_ms = g.start_unix_ms;
  memcpy(h->exe, g.exe, sizeof h->exe);
  // The release, so that rsock-stat says which librsock a process runs.
  static_assert(sizeof(RSOCK_RELEASE) <= sizeof h->release);
  memcpy(h->release, RSOCK_RELEASE, sizeof(RSOCK_RELEASE));
  h->magic.store(kMagic, std::memory_order_release);
}

// Creates "<pid>[.index]" with `slots` slots and maps it. With `at` set, maps
// over that address (fork: keep the inherited pointers valid) after copying
// the slots from the old mapping there; the header starts zeroed (not ready).
Status<SegmentHeader*> create_file(uint32_t index, uint32_t slots, void* at) {
  std::string path = files::segment_path(g.dir, g.pid, index);
  unlink(path.c_str());  // leftover of an earlier image of this pid (exec)
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return Err(errno);
  size_t bytes = file_bytes(slots);
  int err = 0;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) err = errno;
  if (err == 0 && at != nullptr) {
    const char* src = static_cast<const char*>(at) + sizeof(SegmentHeader);
    size_t len = bytes - sizeof(SegmentHeader);
    size_t done = 0;
    while (err == 0 && done < len) {
      ssize_t n = pwrite(fd, src + done, len - done, static_cast<off_t>(sizeof(SegmentHeader) + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) err = n < 0 ? errno : EIO;
      else done += static_cast<size_t>(n);
    }
  }
  void* p = MAP_FAILED;
  if (err == 0) {
    p = mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (at ? MAP_FIXED : 0), fd, 0);
    if (p == MAP_FAILED) err = errno;
  }
  sys::libc.close(fd);  // the mapping keeps the file; no fd for the app to trip on
  if (err != 0) {
    unlink(path.c_str());
    return Err(err);
  }
  return static_cast<SegmentHeader*>(p);
}

// Adds one extension file, twice the size of the last. Caller holds g.lock.
bool grow_locked() {
  if (g.nfiles >= kMaxFiles) return false;
  uint32_t slots = g.files[g.nfiles - 1].slot_count * 2;
  auto h = create_file(g.nfiles, slots, nullptr);
  if (!h.ok()) {
    LOG_WARN("stats: cannot add segment file %u: %s", g.nfiles, strerror(h.error()));
    return false;
  }
  fill_header(*h, g.nfiles, slots);
  g.files[g.nfiles] = File{*h, slots};
  ++g.nfiles;
  // Release: a reader that sees the count finds a complete file.
  g.files[0].h->extension_count.store(g.nfiles - 1, std::memory_order_release);
  return true;
}

ConnSlot* alloc_slot() {
  g.lock.lock();
  ConnSlot* s = nullptr;
  if (g.free_head != nullptr) {
    s = g.free_head;
    g.free_head = reinterpret_cast<ConnSlot*>(static_cast<uintptr_t>(s->free_next));
  } else {
    if (g.cursor_slot == g.files[g.cursor_file].slot_count) {
      if (g.cursor_file + 1 == g.nfiles && !grow_locked()) {
        g.lock.unlock();
        return nullptr;
      }
      ++g.cursor_file;
      g.cursor_slot = 0;
    }
    s = slots_of(g.files[g.cursor_file].h) + g.cursor_slot++;
  }
  g.lock.unlock();
  return s;
}

void write_begin(ConnSlot* s) {
  uint32_t v = s->seq.load(std::memory_order_relaxed);
  for (;;) {
    if ((v & 1) == 0 &&
        s->seq.compare_exchange_weak(v, v + 1, std::memory_order_acquire, std::memory_order_relaxed))
      break;
    v = s->seq.load(std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_release);
}

void write_end(ConnSlot* s) { s->seq.fetch_add(1, std::memory_order_release); }

void set_addr(const sockaddr* sa, uint8_t* addr, uint16_t* port, uint8_t* family) {
  memset(addr, 0, 16);
  *port = 0;
  if (sa == nullptr) return;
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    memcpy(addr, &in->sin_addr, 4);
    *port = ntohs(in->sin_port);
    *family = 4;
  } else if (sa->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    memcpy(addr, &in6->sin6_addr, 16);
    *port = ntohs(in6->sin6_port);
    *family = 6;
  }
}

void zero_traffic(Traffic* t) {
  for (int i = 0; i < kTransports; ++i) {
    t->tx_bytes[i].store(0, std::memory_order_relaxed);
    t->rx_bytes[i].store(0, std::memory_order_relaxed);
    t->tx_ops[i].store(0, std::memory_order_relaxed);
    t->rx_ops[i].store(0, std::memory_order_relaxed);
  }
  t->credit_stalls.store(0, std::memory_order_relaxed);
}

void add_traffic(Traffic* to, const Traffic& from) {
  for (int i = 0; i < kTransports; ++i) {
    to->tx_bytes[i].fetch_add(from.tx_bytes[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
    to->rx_bytes[i].fetch_add(from.rx_bytes[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
    to->tx_ops[i].fetch_add(from.tx_ops[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
    to->rx_ops[i].fetch_add(from.rx_ops[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  to->credit_stalls.fetch_add(from.credit_stalls.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

ProcessCounters* counters() {
  return g.on.load(std::memory_order_acquire) ? &g.files[0].h->counters : nullptr;
}

void exe_name(std::string_view given, char* out, size_t cap) {
  char buf[4096];
  std::string_view name = given;
  if (name.empty()) {
    ssize_t n = readlink("/proc/self/exe", buf, sizeof buf);
    if (n > 0) name = std::string_view(buf, static_cast<size_t>(n));
  }
  size_t slash = name.rfind('/');
  if (slash != std::string_view::npos) name.remove_prefix(slash + 1);
  size_t len = name.size() < cap - 1 ? name.size() : cap - 1;
  memcpy(out, name.data(), len);
  out[len] = '\0';
}

// Makes `path` a directory with `mode`, owned by us if `must_own`.
Status<void> ensure_dir(const std::string& path, mode_t mode, bool must_own) {
  if (mkdir(path.c_str(), mode) == 0) {
    chmod(path.c_str(), mode);  // umask may have trimmed it (root dir is 1777)
    return Ok();
  }
  if (errno != EEXIST) return Err(errno);
  struct stat st{};
  if (lstat(path.c_str(), &st) != 0) return Err(errno);
  if (!S_ISDIR(st.st_mode)) return Err(ENOTDIR);
  if (must_own && (st.st_uid != getuid() || (st.st_mode & 077) != 0)) return Err(EPERM);
  return Ok();
}

void shutdown_at_exit() { shutdown(); }

}  // namespace

std::string default_root_dir() {
  const char* env = getenv("RSOCK_STATS_DIR");
  return env != nullptr && env[0] != '\0' ? std::string(env) : std::string("/dev/shm/librsock");
}

Status<void> init(const Options& options) {
  if (g.on.load() || !options.enabled) return Ok();
  std::string root = options.dir.empty() ? default_root_dir() : std::string(options.dir);
  // The root is shared by all users (sticky, like /tmp); each user's own
  // directory is private. A uid directory someone else owns is refused.
  if (auto st = ensure_dir(root, 01777, false); !st.ok()) {
    LOG_WARN("stats: cannot use %s: %s; rsock-stat will not see this process", root.c_str(),
             strerror(st.error()));
    return st;
  }
  std::string dir = files::uid_dir(root, getuid());
  if (dir.size() >= sizeof g.dir) return Err(ENAMETOOLONG);
  if (auto st = ensure_dir(dir, 0700, true); !st.ok()) {
    LOG_WARN("stats: cannot use %s: %s; rsock-stat will not see this process", dir.c_str(),
             strerror(st.error()));
    return st;
  }
  memcpy(g.dir, dir.c_str(), dir.size() + 1);
  g.pid = getpid();
  auto start = files::process_start_time(g.pid);
  g.start_time = start.ok() ? *start : 0;
  g.start_unix_ms = now_unix_ms();
  exe_name(options.exe, g.exe, sizeof g.exe);
  g.unlink_at_exit = options.unlink_at_exit;

  files::remove_stale(g.dir, g.pid);
  for (uint32_t k = 1; k < kMaxFiles; ++k) unlink(files::segment_path(g.dir, g.pid, k).c_str());

  uint32_t slots = options.initial_slots == 0 ? 1 : options.initial_slots;
  auto h = create_file(0, slots, nullptr);
  if (!h.ok()) {
    LOG_WARN("stats: cannot create segment in %s: %s", g.dir, strerror(h.error()));
    return Err(h.error());
  }
  fill_header(*h, 0, slots);
  g.files[0] = File{*h, slots};
  g.nfiles = 1;
  g.cursor_file = 0;
  g.cursor_slot = 0;
  g.free_head = nullptr;
  g.on.store(true, std::memory_order_release);
  if (g.unlink_at_exit && !g.atexit_registered) {
    g.atexit_registered = true;
    atexit(shutdown_at_exit);
  }
  return Ok();
}

void shutdown() {
  if (!g.on.exchange(false)) return;
  if (!g.unlink_at_exit) return;
  // Files go; mappings stay, so a thread still counting during exit writes
  // into memory that merely no longer has a name.
  for (uint32_t i = g.nfiles; i-- > 0;) unlink(files::segment_path(g.dir, g.pid, i).c_str());
}

void after_fork_child() {
  if (!g.on.load()) return;
  g.lock.reset();
  g.pid = getpid();
  auto start = files::process_start_time(g.pid);
  g.start_time = start.ok() ? *start : 0;
  g.start_unix_ms = now_unix_ms();
  // Extensions first, so the main file's extension_count never points to a
  // file that is not ready.
  for (uint32_t i = g.nfiles; i-- > 0;) {
    File& f = g.files[i];
    auto h = create_file(i, f.slot_count, f.h);
    if (!h.ok()) {
      // Keep the addresses valid but stop writing into the parent's file.
      LOG_WARN("stats: fork child cannot publish its segment: %s", strerror(h.error()));
      for (uint32_t j = 0; j <= i; ++j)
        mmap(g.files[j].h, file_bytes(g.files[j].slot_count), PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      g.on.store(false);
      return;
    }
    ConnSlot* slots = slots_of(f.h);
    for (uint32_t s = 0; s < f.slot_count; ++s) {
      zero_traffic(&slots[s].traffic);
      // A parent thread that was inside a seqlock write at fork() left the
      // sequence odd; nobody in the child will ever close it.
      uint32_t seq = slots[s].seq.load(std::memory_order_relaxed);
      if (seq & 1) slots[s].seq.store(seq + 1, std::memory_order_relaxed);
    }
    fill_header(f.h, i, f.slot_count);
  }
  g.files[0].h->extension_count.store(g.nfiles - 1, std::memory_order_release);
}

ProcessCounters* process() { return counters(); }
Resources* resources() {
  return g.on.load(std::memory_order_acquire) ? &g.files[0].h->resources : nullptr;
}
Switches* switches() {
  return g.on.load(std::memory_order_acquire) ? &g.files[0].h->switches : nullptr;
}
bool enabled() { return g.on.load(std::memory_order_relaxed); }

ConnSlot* open_conn(int fd, Direction dir, const sockaddr* local, const sockaddr* peer) {
  ProcessCounters* pc = counters();
  if (pc == nullptr) return nullptr;
  pc->conns_seen.fetch_add(1, std::memory_order_relaxed);
  ConnSlot* s = alloc_slot();
  if (s == nullptr) {
    pc->conns_untracked.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  zero_traffic(&s->traffic);
  s->send_ring_fill.store(0, std::memory_order_relaxed);
  s->recv_ring_fill.store(0, std::memory_order_relaxed);
  s->ring_bytes.store(0, std::memory_order_relaxed);
  s->send_credits.store(0, std::memory_order_relaxed);
  s->upgrade_us.store(0, std::memory_order_relaxed);
  s->switch_us.store(0, std::memory_order_relaxed);
  write_begin(s);
  SlotInfo& in = s->info;
  uint32_t gen = in.generation + 1;
  memset(&in, 0, sizeof in);
  in.fd = fd;
  in.state = static_cast<uint8_t>(ConnState::kConnecting);
  in.transport = static_cast<uint8_t>(Transport::kTcp);
  in.direction = static_cast<uint8_t>(dir);
  set_addr(local, in.local_addr, &in.local_port, &in.family);
  set_addr(peer, in.peer_addr, &in.peer_port, &in.family);
  in.generation = gen;
  in.opened_unix_ms = now_unix_ms();
  write_end(s);
  s->in_use.store(1, std::memory_order_release);
  return s;
}

void close_conn(ConnSlot* s) {
  if (s == nullptr) return;
  s->in_use.store(0, std::memory_order_release);
  write_begin(s);
  s->info.state = static_cast<uint8_t>(ConnState::kFree);
  write_end(s);
  if (ProcessCounters* pc = counters()) add_traffic(&pc->closed, s->traffic);
  g.lock.lock();
  s->free_next = reinterpret_cast<uintptr_t>(g.free_head);
  g.free_head = s;
  g.lock.unlock();
}

void set_state(ConnSlot* s, ConnState state) {
  if (s == nullptr) return;
  write_begin(s);
  s->info.state = static_cast<uint8_t>(state);
  write_end(s);
}

void set_fd(ConnSlot* s, int fd) {
  if (s == nullptr) return;
  write_begin(s);
  s->info.fd = fd;
  write_end(s);
}

void set_direction(ConnSlot* s, Direction dir) {
  if (s == nullptr) return;
  write_begin(s);
  s->info.direction = static_cast<uint8_t>(dir);
  write_end(s);
}

void set_addresses(ConnSlot* s, const sockaddr* local, const sockaddr* peer) {
  if (s == nullptr) return;
  write_begin(s);
  if (local != nullptr) set_addr(local, s->info.local_addr, &s->info.local_port, &s->info.family);
  if (peer != nullptr) set_addr(peer, s->info.peer_addr, &s->info.peer_port, &s->info.family);
  write_end(s);
}

namespace {
void note_switch(ConnSlot* s, uint64_t switch_us, bool first, uint64_t upgrade_us) {
  // 0 means "none yet" to readers: a switch or upgrade quicker than 1 us
  // (or within one tick of the coarse clock) counts as 1.
  switch_us = std::max<uint64_t>(switch_us, 1);
  upgrade_us = std::max<uint64_t>(upgrade_us, 1);
  auto u32 = [](uint64_t v) { return static_cast<uint32_t>(std::min<uint64_t>(v, UINT32_MAX)); };
  if (Switches* w = switches()) {
    w->count.fetch_add(1, std::memory_order_relaxed);
    w->switch_us_sum.fetch_add(switch_us, std::memory_order_relaxed);
    for (uint64_t m = w->switch_us_max.load(std::memory_order_relaxed);
         switch_us > m && !w->switch_us_max.compare_exchange_weak(m, switch_us, std::memory_order_relaxed);) {
    }
    if (first) w->upgrade_us_sum.fetch_add(upgrade_us, std::memory_order_relaxed);
  }
  if (s == nullptr) return;
  s->switch_us.store(u32(switch_us), std::memory_order_relaxed);
  if (first) s->upgrade_us.store(u32(upgrade_us), std::memory_order_relaxed);
}
}  // namespace

void set_upgraded(ConnSlot* s, uint32_t qp_num, bool again, uint64_t switch_us, uint64_t upgrade_us) {
  note_switch(s, switch_us, !again, upgrade_us);
  if (ProcessCounters* pc = counters(); pc && !again)
    pc->conns_upgraded.fetch_add(1, std::memory_order_relaxed);
  if (s == nullptr) return;
  write_begin(s);
  s->info.transport = static_cast<uint8_t>(Transport::kRdma);
  s->info.state = static_cast<uint8_t>(ConnState::kEstablished);
  s->info.fallback_reason = static_cast<uint8_t>(FallbackReason::kNone);
  s->info.qp_num = qp_num;
  write_end(s);
}

void set_fallback(ConnSlot* s, FallbackReason reason, uint8_t peer_reason) {
  auto r = static_cast<unsigned>(reason);
  if (r >= kFallbackReasons) r = static_cast<unsigned>(FallbackReason::kOther);
  if (ProcessCounters* pc = counters()) pc->fallbacks[r].fetch_add(1, std::memory_order_relaxed);
  if (s == nullptr) return;
  write_begin(s);
  s->info.transport = static_cast<uint8_t>(Transport::kTcp);
  s->info.state = static_cast<uint8_t>(ConnState::kEstablished);
  s->info.fallback_reason = static_cast<uint8_t>(r);
  s->info.peer_reason = peer_reason;
  s->info.qp_num = 0;
  write_end(s);
}

void count_handshake_error() {
  if (ProcessCounters* pc = counters()) pc->handshake_errors.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace rsock::stats
