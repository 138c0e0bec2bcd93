// Helpers for the socket conformance suite: loopback listeners, connected
// pairs, bounded waits and byte patterns. Everything here is plain POSIX so
// the suite means the same thing natively, under LD_PRELOAD=librsock.so and
// when connections are moved onto RDMA underneath.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace conf {

// Bound on any single wait, in ms. Generous (the suite must survive a 20-50x
// slower TCG guest); override with RSOCK_CONF_TIMEOUT_MS.
int timeout_ms();

// IPv4 address the TCP tests use: 127.0.0.1, or RSOCK_CONF_IPV4 (e.g. the
// VM's 10.77.0.1, so that connections can be moved onto rxe0 underneath).
in_addr test_ipv4();
// True if test_ipv4() can be bound on this host.
bool ipv4_bindable();

// Monotonic clock in milliseconds.
int64_t now_ms();

// Owns one file descriptor; closes it on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  operator int() const { return fd_; }  // NOLINT: reads like a plain int fd in tests
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  // Closes the current fd (if any) and returns close()'s result.
  int reset(int fd = -1);

 private:
  int fd_ = -1;
};

// A listening TCP socket on the local test address of `family` (AF_INET ->
// test_ipv4(), AF_INET6 -> ::1) with an ephemeral port.
struct Listener {
  Fd fd;
  sockaddr_storage addr{};
  socklen_t addr_len = 0;
  uint16_t port = 0;
};
Listener make_listener(int family = AF_INET, int backlog = 16);

// A connected TCP pair: `client` from connect(), `server` from accept().
// Both blocking, no flags.
// With RSOCK_CONF_EXPECT_RDMA=1 (the suite preloaded over rxe), an AF_INET pair
// is returned only once librsock reports both ends on RDMA (getsockopt
// SOL_RSOCK, preload/librsock.h), and the case fails if they never get there:
// every case then runs on upgraded connections. `await_upgrade` false opts
// out (a case about a documented limit of upgraded connections).
struct Pair {
  Fd client;
  Fd server;
};
Pair connected_pair(int family = AF_INET, bool await_upgrade = true);
// Whether RSOCK_CONF_EXPECT_RDMA=1 is set.
bool expect_rdma();
// With expect_rdma(): both ends of p reach RDMA, or the case fails.
void await_rdma(const Pair& p);
// The transport librsock reports for fd (SOL_RSOCK RSOCK_TRANSPORT: 0 tcp,
// 1 upgrading, 2 rdma, 3 broken), -errno without librsock.
int transport_of(int fd);

// A TCP socket bound to a port of test_ipv4() but not listening: connecting to
// `addr` is refused, and keeping the socket open keeps the port ours.
struct ClosedPort {
  Fd holder;
  sockaddr_in addr{};
};
ClosedPort closed_port();

// True if ::1 can be bound (IPv6 present on loopback).
bool ipv6_available();

// poll() one fd; returns revents (0 on timeout). Retries EINTR.
short poll_one(int fd, short events, int ms);
inline bool wait_readable(int fd, int ms = timeout_ms()) { return poll_one(fd, POLLIN, ms) != 0; }
inline bool wait_writable(int fd, int ms = timeout_ms()) { return poll_one(fd, POLLOUT, ms) & POLLOUT; }

// Sets or clears O_NONBLOCK through fcntl.
void set_nonblocking(int fd, bool on);
bool is_nonblocking(int fd);

// Writes all of buf (blocking or not: waits for POLLOUT on EAGAIN).
// Returns bytes written; less than n only on error (errno kept).
size_t write_all(int fd, const void* buf, size_t n);

// Reads exactly n bytes unless EOF, error or the overall timeout comes first.
// Returns bytes read.
size_t read_exact(int fd, void* buf, size_t n, int ms = timeout_ms());

// Reads until EOF (read()==0) or timeout/error; returns bytes read and sets
// *eof if EOF was seen.
size_t read_to_eof(int fd, std::string* out, bool* eof, int ms = timeout_ms());

// Deterministic byte stream: the byte at stream offset `off` for `seed`.
// Position-dependent so that loss, duplication and reordering all show.
inline uint8_t pattern_byte(uint64_t off, uint32_t seed) {
  uint64_t x = (off + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t{seed} << 32 | seed);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<uint8_t>(x);
}
void fill_pattern(void* buf, size_t n, uint64_t off, uint32_t seed);
// Returns the index of the first mismatching byte, or n if all match.
size_t check_pattern(const void* buf, size_t n, uint64_t off, uint32_t seed);

// FNV-1a, for checksummed records.
uint64_t fnv1a(const void* buf, size_t n, uint64_t h = 1469598103934665603ull);

// Pending SO_ERROR (0 if none); -1 if getsockopt fails.
int so_error(int fd);

// Hides a value from the optimiser so fortified wrappers cannot prove sizes.
template <class T>
T opaque(T v) {
  asm volatile("" : "+r"(v));
  return v;
}

// Count of SIGPIPEs delivered since start (main.cc installs the handler so a
// stray SIGPIPE never kills the whole suite).
int sigpipe_count();
void install_sigpipe_counter();

std::string errno_str(int e);

}  // namespace conf
