#include "socket/listen_share.h"

#include <netinet/in.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "util/sys.h"
#include "util/user_shm.h"

namespace rsock::socket::listen_share {

namespace {

constexpr uint32_t kSlots = 256;  // connections accepted by children, not yet rendezvoused
constexpr uint64_t kFree = 0, kWriting = 1, kPublished = 2;

struct Slot {
  // generation << 2 | phase: a reader keeps what it read only if the word
  // is the same, and published, before and after.
  std::atomic<uint64_t> word;
  std::atomic<uint64_t> ip_hi, ip_lo;  // client IP, IPv4 as ::ffff:a.b.c.d
  // client port | server port << 16 | side port << 32
  std::atomic<uint64_t> ports;
  std::atomic<uint64_t> expires_ns;
};

uint64_t key_ports(uint16_t client_port, uint16_t server_port) {
  return uint64_t{client_port} | uint64_t{server_port} << 16;
}

// The client's IP as 16 bytes, IPv4 in its mapped form, so that a v4 request
// matches a dual-stack socket's ::ffff: peer.
bool ip16(const sockaddr* a, uint64_t* hi, uint64_t* lo) {
  unsigned char b[16] = {};
  if (a == nullptr) return false;
  if (a->sa_family == AF_INET) {
    b[10] = b[11] = 0xff;
    std::memcpy(b + 12, &reinterpret_cast<const sockaddr_in*>(a)->sin_addr, 4);
  } else if (a->sa_family == AF_INET6) {
    std::memcpy(b, &reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr, 16);
  } else {
    return false;
  }
  std::memcpy(hi, b, 8);
  std::memcpy(lo, b + 8, 8);
  return true;
}

}  // namespace

struct Table {
  Slot slots[kSlots];
  std::atomic<int32_t> owner_pid;
  // kExecMarked: set by a process that execs with the listening socket
  // kept open, whose new image may publish in the port's named table
  // (open_group). kIsNamed: this is a named table (every open_group says
  // so), which such an image finds by itself: never marked. In the padding
  // after owner_pid, so named tables keep their size.
  std::atomic<int32_t> exec_named;
};
constexpr int32_t kExecMarked = 1, kIsNamed = 2;
static_assert(sizeof(Table) == kSlots * sizeof(Slot) + 8, "the named tables' size");

Table* create() {
  void* p = mmap(nullptr, sizeof(Table), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  return static_cast<Table*>(p);  // zero-filled: every slot free, generation 0
}

Table* open_group(const sockaddr* addr, uint16_t port) {
  uint64_t hi, lo;
  if (!ip16(addr, &hi, &lo)) return nullptr;
  char name[96];
  snprintf(name, sizeof name, "/librsock-rp-%u-%016llx%016llx-%u", unsigned(geteuid()),
           (unsigned long long)hi, (unsigned long long)lo, unsigned(port));
  auto* t = static_cast<Table*>(sys::map_user_shm(name, sizeof(Table)));
  if (t) t->exec_named.store(kIsNamed, std::memory_order_release);
  return t;
}

Table* open_passed() {
  static std::atomic<Table*> t{nullptr};
  if (Table* p = t.load(std::memory_order_acquire)) return p;
  char name[64];
  snprintf(name, sizeof name, "/librsock-pass-%u", unsigned(geteuid()));
  Table* p = static_cast<Table*>(sys::map_user_shm(name, sizeof(Table)));
  Table* none = nullptr;
  if (p && !t.compare_exchange_strong(none, p, std::memory_order_acq_rel)) {
    munmap(p, sizeof(Table));  // another thread's mapping won
    return none;
  }
  return p;
}

int publish(Table* t, const sockaddr* client, uint16_t client_port, uint16_t server_port,
            uint16_t side_port, uint64_t now_ns, uint64_t ttl_ns) {
  const uint64_t expires_ns = now_ns + ttl_ns;
  uint64_t hi, lo;
  if (t == nullptr || !ip16(client, &hi, &lo)) return -1;
  for (uint32_t i = 0; i < kSlots; i++) {
    Slot& s = t->slots[i];
    uint64_t w = s.word.load(std::memory_order_acquire);
    // A free slot, or one whose publisher never cleared it (a child that
    // died) and whose expiry has passed.
    bool stale = (w & 3) == kPublished && s.expires_ns.load(std::memory_order_relaxed) < now_ns;
    if ((w & 3) != kFree && !stale) continue;
    uint64_t gen = (w >> 2) + 1;
    if (!s.word.compare_exchange_strong(w, gen << 2 | kWriting, std::memory_order_acq_rel))
      continue;
    s.ip_hi.store(hi, std::memory_order_relaxed);
    s.ip_lo.store(lo, std::memory_order_relaxed);
    s.ports.store(key_ports(client_port, server_port) | uint64_t{side_port} << 32,
                  std::memory_order_relaxed);
    s.expires_ns.store(expires_ns, std::memory_order_relaxed);
    s.word.store(gen << 2 | kPublished, std::memory_order_release);
    return static_cast<int>(i);
  }
  return -1;
}

void clear(Table* t, int slot) {
  if (t == nullptr || slot < 0 || slot >= static_cast<int>(kSlots)) return;
  Slot& s = t->slots[slot];
  uint64_t w = s.word.load(std::memory_order_acquire);
  if ((w & 3) == kPublished)
    s.word.compare_exchange_strong(w, ((w >> 2) + 1) << 2 | kFree, std::memory_order_acq_rel);
}

uint16_t lookup(const Table* t, const sockaddr* client, uint16_t client_port,
                uint16_t server_port, uint64_t now_ns) {
  uint64_t hi, lo;
  if (t == nullptr || !ip16(client, &hi, &lo)) return 0;
  const uint64_t want = key_ports(client_port, server_port);
  for (uint32_t i = 0; i < kSlots; i++) {
    const Slot& s = t->slots[i];
    uint64_t w = s.word.load(std::memory_order_acquire);
    if ((w & 3) != kPublished) continue;
    uint64_t ports = s.ports.load(std::memory_order_relaxed);
    bool match = (ports & 0xffffffffull) == want && s.ip_hi.load(std::memory_order_relaxed) == hi &&
                 s.ip_lo.load(std::memory_order_relaxed) == lo &&
                 s.expires_ns.load(std::memory_order_relaxed) > now_ns;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (!match || s.word.load(std::memory_order_relaxed) != w) continue;
    return static_cast<uint16_t>(ports >> 32 & 0xffff);
  }
  return 0;
}

void set_owner(Table* t, int32_t pid) {
  if (t != nullptr) t->owner_pid.store(pid, std::memory_order_release);
}

void mark_exec(Table* t) {
  int32_t none = 0;
  if (t != nullptr)
    t->exec_named.compare_exchange_strong(none, kExecMarked, std::memory_order_acq_rel);
}

bool exec_marked(const Table* t) {
  return t != nullptr && t->exec_named.load(std::memory_order_acquire) == kExecMarked;
}

int32_t owner(const Table* t) {
  return t == nullptr ? 0 : t->owner_pid.load(std::memory_order_acquire);
}

}  // namespace rsock::socket::listen_share
