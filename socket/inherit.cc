// Listening sockets inherited across exec (docs/DESIGN.md, "Listeners
// inherited across exec"). A program started with a listening socket it did
// not create (systemd's socket activation, a supervisor or master that forks
// and execs its workers, a server that re-execs itself) never calls listen()
// under us, so no rdma_cm listener would ever serve it. At image start each
// such socket is tracked as a listener and its rdma_cm side started, as
// listen() would. At once, not at the program's first accept: a program
// started for its first connection (socket activation) or slow to start
// (an interpreter: about 1 s in the TCG guest) would otherwise leave the
// requests of the connections queued meanwhile without a listener, and
// their clients would take this server for one without librsock.
//
// Connected TCP sockets inherited without a record of the previous image
// (docs/DESIGN.md, "Connections inherited from a process without
// librsock"): an inetd-style service whose acceptor does not run librsock
// (inetd, systemd's Accept=yes, socat run plain with EXEC:...,nofork) gets
// the accepted connection as stdin and stdout. Nothing on our side knows
// it, so it is adopted here as an accepted connection, at the stream
// positions the kernel counts for it; a connect()ed one (socat's
// TCP:...,EXEC:...,nofork, tcpclient) as a client's, which starts its own
// rendezvous.
#include <dirent.h>
#include <cerrno>
#include <fcntl.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <linux/tcp.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include "socket/fd_table.h"
#include "socket/rendezvous.h"
#include "socket/socket.h"
#include "util/log.h"
#include "util/sys.h"

namespace rsock::socket {

namespace {

// The stream positions of an established connection that processes without
// librsock used before us: the application bytes ever written to it (every
// byte acknowledged plus those still in the send queue) and ever read from
// it (every byte received but those still in the receive queue). False if
// the kernel does not say (tcpi_bytes_acked and tcpi_bytes_received: Linux
// 4.1 and 4.2), the connection is not ESTABLISHED (the peer's FIN counts as
// a received byte and no switch follows it), or its counts kept changing
// between our looks (eight tries: a peer that streams at it).
// A client's count of acknowledged bytes includes its SYN (the peer's ACK
// of it moves snd_una by one; an accepted socket's starts past it): `client`
// takes it off.
bool kernel_positions(int fd, bool client, uint64_t* tx, uint64_t* rx) {
  constexpr uint8_t kTcpEstablished = 1;  // (include/net/tcp_states.h)
  constexpr socklen_t kNeed = offsetof(tcp_info, tcpi_bytes_received) + sizeof(uint64_t);
  for (int tries = 0; tries < 8; tries++) {
    tcp_info a{}, b{};
    socklen_t la = sizeof a, lb = sizeof b;
    int inq = 0, outq = 0;
    if (sys::libc.getsockopt(fd, IPPROTO_TCP, TCP_INFO, &a, &la) != 0 || la < kNeed ||
        a.tcpi_state != kTcpEstablished)
      return false;
    // (Raw: ioctl is one of our hooks.)
    if (syscall(SYS_ioctl, fd, SIOCINQ, &inq) != 0 || syscall(SYS_ioctl, fd, SIOCOUTQ, &outq) != 0 ||
        inq < 0 || outq < 0)
      return false;
    if (sys::libc.getsockopt(fd, IPPROTO_TCP, TCP_INFO, &b, &lb) != 0 || lb < kNeed ||
        b.tcpi_state != kTcpEstablished)
      return false;
    // An ACK or a segment between the two looks moves one count against the
    // queue read between them: look again.
    if (a.tcpi_bytes_acked != b.tcpi_bytes_acked || a.tcpi_bytes_received != b.tcpi_bytes_received)
      continue;
    if (a.tcpi_bytes_received < uint64_t(inq) || (client && a.tcpi_bytes_acked == 0)) return false;
    *tx = a.tcpi_bytes_acked - (client ? 1 : 0) + uint64_t(outq);
    *rx = a.tcpi_bytes_received - uint64_t(inq);
    return true;
  }
  return false;
}

// The connected sockets adopted so far in this scan, by inode: fds of one
// socket (inetd's stdin and stdout are dups) share one Socket.
struct Adopted {
  uint64_t ino;
  Socket* socket;
};
constexpr int kMaxAdopted = 16;

// Whether our parent process runs librsock (its mappings name it). Such a
// parent tracked the connection itself: it left it to us through the
// table of passed connections if it could (adopt_after_exec), and may go on
// using it if it did not (a fork child's exec, posix_spawn, system(),
// popen). Adopting it then could switch it under the parent's TCP writes.
// Read once, and only for an image that inherited a connection. A parent
// whose mappings we may not read (another user's: inetd, systemd) counts
// as one without librsock.
bool parent_runs_librsock() {
  char path[32];
  snprintf(path, sizeof path, "/proc/%d/maps", int(getppid()));
  int fd = int(syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC));
  if (fd < 0) return false;
  static constexpr char kName[] = "librsock";
  constexpr size_t kLen = sizeof kName - 1;
  char buf[512];
  size_t kept = 0;  // the previous chunk's tail, for a name across chunks
  bool found = false;
  for (;;) {
    long n = syscall(SYS_read, fd, buf + kept, sizeof buf - kept);
    if (n <= 0) break;
    size_t len = kept + size_t(n);
    for (size_t i = 0; i + kLen <= len && !found; i++) found = memcmp(buf + i, kName, kLen) == 0;
    if (found) break;
    kept = std::min(len, kLen - 1);
    memmove(buf, buf + len - kept, kept);
  }
  syscall(SYS_close, fd);
  return found;
}

// Whether a TCP socket listens on `port` (any address) in this network
// namespace: then a connection whose local port it is was accepted there,
// else it was connect()ed (the listening socket may be long gone: a server
// that accepted, forked and closed; the exec'd child is still a server's,
// and a client's request would go to its peer's ephemeral port). Read
// from /proc/net/tcp and tcp6 with raw syscalls (no allocation), which list
// listening sockets first: the read stops at the first line in another
// state. No /proc: taken for a listener (the server's side, as before).
[[gnu::noinline]] bool port_has_listener(uint16_t port) {
  static const char* const kFiles[] = {"/proc/net/tcp", "/proc/net/tcp6"};
  bool readable = false;
  for (const char* path : kFiles) {
    int fd = int(syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC));
    if (fd < 0) continue;
    readable = true;
    char buf[768];
    size_t have = 0;
    bool done = false, found = false;
    while (!done) {
      long n = syscall(SYS_read, fd, buf + have, sizeof buf - 1 - have);
      if (n <= 0) break;
      have += size_t(n);
      buf[have] = 0;
      char* line = buf;
      for (char* nl; !done && (nl = strchr(line, '\n')) != nullptr; line = nl + 1) {
        *nl = 0;
        // "  sl: local_address rem_address st ...": tokens 1 and 3.
        char* tok[4] = {};
        int nt = 0;
        for (char* p = line; *p && nt < 4;) {
          while (*p == ' ') p++;
          if (!*p) break;
          tok[nt++] = p;
          while (*p && *p != ' ') p++;
        }
        if (nt < 4) continue;
        const char* colon = strchr(tok[1], ':');
        if (colon == nullptr || colon > tok[2]) continue;  // the header
        if (strncmp(tok[3], "0A", 2) != 0) {
          done = true;  // past the listening sockets
          break;
        }
        if (strtoul(colon + 1, nullptr, 16) == port) found = done = true;
      }
      if (found) break;
      // Keep a partial line; a line longer than the buffer is dropped.
      size_t rest = have - size_t(line - buf);
      if (rest >= sizeof buf - 1) rest = 0;
      memmove(buf, line, rest);
      have = rest;
    }
    syscall(SYS_close, fd);
    if (found) return true;
  }
  return !readable;
}

// Whether our parent process holds socket `ino` (one of its fds names it).
// A parent that runs librsock and does may go on using the connection; one
// that does not (it exec'd a plain program that connected: `env -u
// LD_PRELOAD socat TCP:... EXEC:...,nofork`, or it closed its copy) leaves
// it to us. Read only for a parent that runs librsock; one whose fds we may
// not read counts as holding it.
[[gnu::noinline]] bool parent_holds(uint64_t ino) {
  char path[40];
  snprintf(path, sizeof path, "/proc/%d/fd", int(getppid()));
  int dir = int(syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir < 0) return true;
  char want[40];
  const int wl = snprintf(want, sizeof want, "socket:[%llu]", (unsigned long long)ino);
  alignas(8) char buf[512];
  bool held = false, readable = true;
  for (;;) {
    long n = syscall(SYS_getdents64, dir, buf, sizeof buf);
    if (n < 0) readable = false;
    if (n <= 0) break;
    for (long off = 0; off < n && !held;) {
      auto* d = reinterpret_cast<const struct dirent64*>(buf + off);
      off += d->d_reclen;
      if (d->d_name[0] == '.') continue;
      char link[40];
      long k = syscall(SYS_readlinkat, dir, d->d_name, link, sizeof link);
      if (k < 0 && errno == EACCES) readable = false;
      held = k == wl && memcmp(link, want, size_t(wl)) == 0;
    }
    if (held || !readable) break;
  }
  syscall(SYS_close, dir);
  return held || !readable;
}

// Whether `port` lies in the kernel's range for ports it picks itself
// (ip_local_port_range: a client's, unless it bound one). Read once per
// image (the scan runs before main(), in one thread). No /proc: the
// default range.
bool ephemeral_port(uint16_t port) {
  static unsigned lo = 0, hi = 0;
  if (hi == 0) {
    lo = 32768, hi = 60999;
    int fd = int(syscall(SYS_openat, AT_FDCWD, "/proc/sys/net/ipv4/ip_local_port_range",
                         O_RDONLY | O_CLOEXEC));
    if (fd >= 0) {
      char buf[32] = {};
      long n = syscall(SYS_read, fd, buf, sizeof buf - 1);
      syscall(SYS_close, fd);
      unsigned a = 0, b = 0;
      if (n > 0 && sscanf(buf, "%u %u", &a, &b) == 2 && a <= b && b > 0) lo = a, hi = b;
    }
  }
  return port >= lo && port <= hi;
}

void adopt_connected(int fd, Adopted* seen, int* nseen) {
  // (The domain first: a UNIX socket, as a service's stdout to the journal
  // is, must not create the fd table.)
  int domain = tracked_domain(fd);
  if (domain == 0) return;
  FdTable* t = FdTable::get_or_create();
  if (!t || t->lookup(fd)) return;  // (the previous image's record adopted it)
  struct stat sb{};
  if (fstat(fd, &sb) != 0) return;
  for (int i = 0; i < *nseen; i++) {
    if (seen[i].ino != uint64_t(sb.st_ino)) continue;
    // (nullptr: not adopted; none of its fds is, or a read through an
    // untracked dup would pass the stream by.)
    if (seen[i].socket) t->install(fd, seen[i].socket);
    return;
  }
  if (*nseen == kMaxAdopted) return;
  Adopted& me = seen[(*nseen)++];
  me = {uint64_t(sb.st_ino), nullptr};
  sockaddr_storage peer{};
  socklen_t pl = sizeof peer;
  // (Not connected: ENOTCONN. A socket in connect() is not ours to adopt.)
  if (sys::libc.getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0) return;
  sockaddr_storage local{};
  socklen_t ll = sizeof local;
  if (sys::libc.getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) return;
  // (sin_port and sin6_port are at the same offset.) Accepted if its port
  // still listens; else connect()ed, unless the ports say otherwise: a
  // server's port outside the kernel's own range facing one inside it
  // (`nc -l -e`, socat's TCP-LISTEN without fork, which close their
  // listener once they have their connection).
  const uint16_t lport = ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
  const uint16_t pport = ntohs(reinterpret_cast<sockaddr_in*>(&peer)->sin_port);
  const bool client =
      !port_has_listener(lport) && !(!ephemeral_port(lport) && ephemeral_port(pport));
  // A parent that still holds the socket may go on using it: one that runs
  // librsock tracks it itself; a client connection that a parent without
  // librsock holds is one it shares, not one it handed over (a program
  // that connects and hands over execs in place: socat's nofork,
  // tcpclient), so that a switch made here could run under its writes. (An
  // accepted one is adopted even so: inetd closes its copy only after its
  // fork, and the race would leave its services on TCP.)
  static int parent_has_us = -1;
  if (parent_has_us < 0) parent_has_us = parent_runs_librsock() ? 1 : 0;
  if ((parent_has_us || client) && parent_holds(uint64_t(sb.st_ino))) return;
  uint64_t tx = 0, rx = 0;
  if (!kernel_positions(fd, client, &tx, &rx)) return;
  int fl = sys::libc.fcntl(fd, F_GETFL);
  SocketRef s(new_socket(domain, client ? Role::kClient : Role::kAccepted,
                         fl >= 0 && (fl & O_NONBLOCK)));
  if (!s) return;
  t->install(fd, s.get());
  me.socket = s.get();
  s->open_stats(fd, client ? stats::Direction::kClient : stats::Direction::kServer, nullptr,
                nullptr, true);
  LOG_DEBUG("fd %d: a TCP connection inherited from a process without librsock, at stream bytes "
            "out/in %llu/%llu; adopted as a %s's", fd, (unsigned long long)tx,
            (unsigned long long)rx, client ? "client" : "server");
  if (client) {
    const uint64_t at[2] = {tx, rx};
    (void)start_client_upgrade(s.get(), fd, reinterpret_cast<const sockaddr*>(&peer), &local, at);
  } else {
    adopt_inherited_connection(s.get(), fd, local, peer, tx, rx);
  }
  s->upgrade_decided.store(true, std::memory_order_release);
}

// (Not inlined: its frame and the directory buffer's together pass the hooks' 2 KiB.)
[[gnu::noinline]] void adopt_one(int fd, Adopted* seen, int* nseen) {
  // (The first getsockopt fails with ENOTSOCK for a non-socket: one syscall
  // per fd that is not a socket.)
  int listening = 0;
  socklen_t len = sizeof listening;
  if (sys::libc.getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0) return;
  if (!listening) {
    adopt_connected(fd, seen, nseen);
    return;
  }
  int domain = tracked_domain(fd);
  if (domain == 0) return;
  FdTable* t = FdTable::get_or_create();
  if (!t || t->lookup(fd)) return;
  int fl = sys::libc.fcntl(fd, F_GETFL);
  SocketRef s(new_socket(domain, Role::kListener, fl >= 0 && (fl & O_NONBLOCK)));
  if (!s) return;
  t->install(fd, s.get());
  LOG_INFO("fd %d: a TCP listening socket inherited across exec; serving its rdma_cm side as "
           "listen() would", fd);
  listener_started(s.get(), fd, /*shared=*/true);
  s->upgrade_decided.store(true, std::memory_order_release);
}

}  // namespace

void adopt_inherited_sockets() {
  // The fds open at image start, from /proc/self/fd (raw syscalls: no
  // allocation, nothing hooked; the directory's own fd is skipped). Four
  // syscalls plus a getsockopt per inherited fd (usually three: stdin,
  // stdout, stderr). No /proc: nothing is adopted.
  int dir = int(syscall(SYS_openat, AT_FDCWD, "/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir < 0) return;
  alignas(8) char buf[1024];
  Adopted seen[kMaxAdopted];
  int nseen = 0;
  for (;;) {
    long n = syscall(SYS_getdents64, dir, buf, sizeof buf);
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      auto* d = reinterpret_cast<struct dirent64*>(buf + off);
      off += d->d_reclen;
      int fd = 0;
      bool num = d->d_name[0] != '\0';
      for (const char* c = d->d_name; *c && num; c++) {
        num = *c >= '0' && *c <= '9';
        fd = fd * 10 + (*c - '0');
      }
      if (num && fd != dir) adopt_one(fd, seen, &nseen);
    }
  }
  syscall(SYS_close, dir);
}

}  // namespace rsock::socket
