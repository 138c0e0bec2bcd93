// Sockets across fork() and exec(), and an event-driven server with many
// connections (the shape of nginx/redis-style programs).
#include <doctest/doctest.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "helpers.h"
#include "preload/librsock.h"

using namespace conf;

namespace {

// Waits for `pid` with a bound; kills it if it overstays. Returns the status.
int wait_child(pid_t pid) {
  int64_t deadline = now_ms() + timeout_ms();
  int status = 0;
  for (;;) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0 || now_ms() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    usleep(2000);
  }
}

// posix_spawn()s `sh -c script` with fd as its fd 7; the pid, or -1.
pid_t spawn_sh_on_fd7(int fd, const char* script) {
  posix_spawn_file_actions_t fa;
  if (posix_spawn_file_actions_init(&fa) != 0) return -1;
  pid_t pid = -1;
  const char* argv[] = {"sh", "-c", script, nullptr};
  if (posix_spawn_file_actions_adddup2(&fa, fd, 7) != 0 ||
      posix_spawn(&pid, "/bin/sh", &fa, nullptr, const_cast<char* const*>(argv), environ) != 0)
    pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

}  // namespace

TEST_CASE("fork: parent and child share an inherited connection") {
  // Both processes use the connection at once: loopback, which librsock never
  // upgrades (a connection on RDMA is switched back to TCP at fork(), see
  // below; this case is about plain sharing).
  Pair p = connected_pair(AF_INET6);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // Child: write, read a reply, then exit without touching doctest.
    const char msg[] = "from-child";
    if (write_all(p.client, msg, sizeof msg - 1) != sizeof msg - 1) _exit(2);
    char b[5];
    if (read_exact(p.client, b, 5) != 5 || memcmp(b, "reply", 5) != 0) _exit(3);
    _exit(0);
  }
  char b[16];
  REQUIRE(read_exact(p.server, b, 10) == 10);
  CHECK(memcmp(b, "from-child", 10) == 0);
  REQUIRE(write_all(p.server, "reply", 5) == 5);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // The child's exit closed only its copy: the parent's still works, no EOF.
  CHECK(poll_one(p.server, POLLIN, 50) == 0);
  REQUIRE(write_all(p.client, "from-parent", 11) == 11);
  REQUIRE(read_exact(p.server, b, 11) == 11);
  CHECK(memcmp(b, "from-parent", 11) == 0);
  REQUIRE(p.client.reset() == 0);
  bool eof = false;
  read_to_eof(p.server, nullptr, &eof);
  CHECK(eof);
}

// Upgraded before fork() (in upgrade.conformance): librsock switches the
// connection back to TCP before fork() returns (docs/DESIGN.md, "The
// reverse switch"), so whichever process goes on sees exactly what it would
// see on kernel TCP, with bytes in flight in both directions at fork time.
TEST_CASE("fork: a connection upgraded before fork() goes on in the child, the parent closes") {
  Pair p = connected_pair();
  REQUIRE(write_all(p.server, "before", 6) == 6);  // unread by the client at fork
  REQUIRE(write_all(p.client, "hello", 5) == 5);   // unread by the server at fork
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    char b[8];
    if (read_exact(p.client, b, 6) != 6 || memcmp(b, "before", 6) != 0) _exit(2);
    if (write_all(p.client, "child", 5) != 5) _exit(3);
    if (read_exact(p.client, b, 5) != 5 || memcmp(b, "reply", 5) != 0) _exit(4);
    _exit(0);
  }
  REQUIRE(p.client.reset() == 0);  // the parent's copy: the child has the connection now
  char b[10];
  REQUIRE(read_exact(p.server, b, 10) == 10);
  CHECK(memcmp(b, "hellochild", 10) == 0);
  REQUIRE(write_all(p.server, "reply", 5) == 5);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  bool eof = false;
  read_to_eof(p.server, nullptr, &eof);  // the child's exit closed the last copy
  CHECK(eof);
  if (expect_rdma()) CHECK(transport_of(p.server) == 0);  // back on TCP, no error
}

TEST_CASE("fork: bytes that arrived before the upgrade, unread at fork(), reach the child") {
  Pair p = connected_pair(AF_INET, /*await_upgrade=*/false);
  REQUIRE(write_all(p.server, "before", 6) == 6);  // on TCP, ahead of the switch
  if (expect_rdma()) await_rdma(p);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    char b[8];
    if (read_exact(p.client, b, 6) != 6 || memcmp(b, "before", 6) != 0) _exit(2);
    if (write_all(p.client, "child", 5) != 5) _exit(3);
    _exit(0);
  }
  REQUIRE(p.client.reset() == 0);
  char b[8];
  REQUIRE(read_exact(p.server, b, 5) == 5);
  CHECK(memcmp(b, "child", 5) == 0);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  bool eof = false;
  read_to_eof(p.server, nullptr, &eof);
  CHECK(eof);
}

TEST_CASE("fork: a connection upgraded before fork() goes on in the parent, the child closes") {
  Pair p = connected_pair();
  REQUIRE(write_all(p.server, "before", 6) == 6);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(p.client.release());
    _exit(0);
  }
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  char b[8];
  REQUIRE(read_exact(p.client, b, 6) == 6);
  CHECK(memcmp(b, "before", 6) == 0);
  REQUIRE(write_all(p.client, "after", 5) == 5);
  REQUIRE(read_exact(p.server, b, 5) == 5);
  CHECK(memcmp(b, "after", 5) == 0);
  CHECK(poll_one(p.server, POLLIN, 50) == 0);
  if (expect_rdma()) {
    // On TCP, or waiting to upgrade again (the pair's listener is closed, so
    // its attempt may find nobody): never broken.
    int tc = transport_of(p.client), ts = transport_of(p.server);
    CHECK((tc == RSOCK_TRANSPORT_TCP || tc == RSOCK_TRANSPORT_UPGRADING || tc == RSOCK_TRANSPORT_RDMA));
    CHECK((ts == RSOCK_TRANSPORT_TCP || ts == RSOCK_TRANSPORT_UPGRADING || ts == RSOCK_TRANSPORT_RDMA));
  }
}

// A ping-pong of counters until both ends report RDMA (under
// RSOCK_CONF_EXPECT_RDMA) or `ms` passed; every echo checked.
static void pingpong_until_rdma(Pair& p, int64_t ms) {
  int64_t end = now_ms() + ms;
  uint32_t n = 0;
  do {
    n++;
    REQUIRE(write_all(p.client, &n, sizeof n) == sizeof n);
    uint32_t got = 0;
    REQUIRE(read_exact(p.server, &got, sizeof got) == sizeof got);
    REQUIRE(got == n);
    REQUIRE(write_all(p.server, &got, sizeof got) == sizeof got);
    REQUIRE(read_exact(p.client, &got, sizeof got) == sizeof got);
    REQUIRE(got == n);
    if (!expect_rdma() || (transport_of(p.client) == RSOCK_TRANSPORT_RDMA &&
                           transport_of(p.server) == RSOCK_TRANSPORT_RDMA))
      return;
    usleep(20000);
  } while (now_ms() < end);
}

// A pair through `l`, which the case keeps open (a connection that upgrades
// again is reached through its listener), on RDMA when that is expected.
static Pair pair_on(const Listener& l) {
  Pair p;
  p.client = Fd(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(p.client >= 0);
  REQUIRE(connect(p.client, reinterpret_cast<const sockaddr*>(&l.addr), l.addr_len) == 0);
  p.server = Fd(accept(l.fd, nullptr, nullptr));
  REQUIRE(p.server >= 0);
  if (expect_rdma()) await_rdma(p);
  return p;
}

// The server wrote "before" ahead of a hand-off: the client reads it, the
// pair ping-pongs until both ends are on RDMA again (with RDMA expected),
// and a last message crosses.
static void goes_on_over_rdma(Pair& p) {
  char b[8];
  REQUIRE(read_exact(p.client, b, 6) == 6);
  CHECK(memcmp(b, "before", 6) == 0);
  pingpong_until_rdma(p, 20000);
  if (expect_rdma()) {
    CHECK(transport_of(p.client) == RSOCK_TRANSPORT_RDMA);
    CHECK(transport_of(p.server) == RSOCK_TRANSPORT_RDMA);
  }
  REQUIRE(write_all(p.server, "after", 5) == 5);
  REQUIRE(read_exact(p.client, b, 5) == 5);
  CHECK(memcmp(b, "after", 5) == 0);
}

// The parent goes on alone once the child is gone (here by _exit with both
// copies open: the kernel closes them, no hook sees it), so the connection
// upgrades again in the parent (docs/DESIGN.md, "Upgrading again in the new
// owner") and carries on over RDMA, every byte in order.
TEST_CASE("fork: the child exits holding its copies, the parent's connection goes on (onto RDMA again)") {
  Listener l = make_listener();
  Pair p = pair_on(l);
  REQUIRE(write_all(p.server, "before", 6) == 6);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) _exit(0);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  goes_on_over_rdma(p);
}

// The child execs a program that outlives the test's exchange, with the
// connection's fds close-on-exec: the new image does not hold the socket,
// so the parent is its only holder from the exec on and upgrades it again
// while the child still runs (docs/DESIGN.md, "Upgrading again in the new
// owner").
TEST_CASE("fork: the child execs with the connection close-on-exec, the parent's goes on (onto RDMA again)") {
  Listener l = make_listener();
  Pair p;
  p.client = Fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(p.client >= 0);
  REQUIRE(connect(p.client, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);
  p.server = Fd(accept4(l.fd, nullptr, nullptr, SOCK_CLOEXEC));
  REQUIRE(p.server >= 0);
  if (expect_rdma()) await_rdma(p);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    execl("/bin/sleep", "sleep", "30", (char*)nullptr);
    _exit(127);
  }
  pingpong_until_rdma(p, 20000);
  bool alive = waitpid(pid, nullptr, WNOHANG) == 0;
  kill(pid, SIGKILL);
  wait_child(pid);
  CHECK(alive);  // so the hold went at the exec, not at the child's exit
  if (expect_rdma()) {
    CHECK(transport_of(p.client) == RSOCK_TRANSPORT_RDMA);
    CHECK(transport_of(p.server) == RSOCK_TRANSPORT_RDMA);
  }
  REQUIRE(write_all(p.server, "after", 5) == 5);
  char b[8];
  REQUIRE(read_exact(p.client, b, 5) == 5);
  CHECK(memcmp(b, "after", 5) == 0);
}

// fd passing: one byte of data carrying `fd` (SCM_RIGHTS) over `via`; the
// fd that arrives, or -1.
static bool send_fd(int via, int fd) {
  char d = 'x';
  iovec v{&d, 1};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  m.msg_iov = &v;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof fd);
  return sendmsg(via, &m, 0) == 1;
}

static int recv_fd(int via) {
  char d;
  iovec v{&d, 1};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  m.msg_iov = &v;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  if (recvmsg(via, &m, 0) != 1) return -1;
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
  int fd;
  memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

// The sender hands the connection over with "before" unread. `early`: the
// bytes are written before the upgrade, so they travel on TCP ahead of the
// switch and librsock has already drained them from the kernel socket into
// its own memory to reach the peer's marker; the hand-off must return them
// to the peer, which sends them again (docs/DESIGN.md, "The reverse switch").
static void pass_connection_unread(bool early) {
  int us[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, us) == 0);
  Fd a(us[0]), w(us[1]);
  pid_t pid = fork();  // the worker exists before the connection
  REQUIRE(pid >= 0);
  if (pid == 0) {
    a.release();
    int fd = recv_fd(w);
    if (fd < 0) _exit(2);
    char b[8];
    if (read_exact(fd, b, 6) != 6 || memcmp(b, "before", 6) != 0) _exit(4);
    if (write_all(fd, "worker", 6) != 6) _exit(5);
    close(fd);
    _exit(0);
  }
  w.reset();
  Pair p = connected_pair(AF_INET, /*await_upgrade=*/!early);
  REQUIRE(write_all(p.server, "before", 6) == 6);
  if (early && expect_rdma()) await_rdma(p);
  REQUIRE(send_fd(a, p.client));
  REQUIRE(p.client.reset() == 0);
  char b[8];
  REQUIRE(read_exact(p.server, b, 6) == 6);
  CHECK(memcmp(b, "worker", 6) == 0);
  bool eof = false;
  read_to_eof(p.server, nullptr, &eof);
  CHECK(eof);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("fd passing: a connection upgraded before it is sent goes on in the receiver") {
  pass_connection_unread(false);
}

TEST_CASE("fd passing: bytes that arrived before the upgrade, unread, reach the receiver") {
  pass_connection_unread(true);
}

// SCM_RIGHTS to a socket of the same process, then the original number is
// closed: the received fd is the connection's only holder, so it upgrades
// again (docs/DESIGN.md, "Upgrading again in the receiver") and carries on
// over RDMA, every byte in order. (The same table serves a receiver in
// another process: upgrade.revert.fdpass, multiproc.node_cluster.)
TEST_CASE("fd passing: a connection sent to ourselves, the original closed, goes on (onto RDMA again)") {
  Pair p = connected_pair();
  REQUIRE(write_all(p.server, "before", 6) == 6);
  int us[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, us) == 0);
  Fd a(us[0]), b(us[1]);
  REQUIRE(send_fd(a, p.server));
  REQUIRE(p.server.reset() == 0);
  int got = recv_fd(b);
  REQUIRE(got >= 0);
  p.server = Fd(got);
  goes_on_over_rdma(p);
}

// A forked worker that writes its reply, closes and calls _exit (Python's
// os._exit in a forked child, C servers' children): the kernel delivers a
// closed socket's bytes after _exit, and so must librsock, though _exit
// runs no atexit handler and the bytes may be in its memory (written during
// a switch) or on RDMA, not yet delivered. Over rxe the child waits until
// its connection is on RDMA before it writes.
TEST_CASE("exit: a child writes 1 MiB, closes and calls _exit; the peer reads every byte, then EOF") {
  int port_pipe[2];
  REQUIRE(pipe(port_pipe) == 0);
  pid_t pid = fork();  // before anything of the connection exists
  REQUIRE(pid >= 0);
  constexpr size_t kBytes = 1 << 20;
  if (pid == 0) {
    close(port_pipe[1]);
    sockaddr_storage a{};
    socklen_t al = 0;
    if (read(port_pipe[0], &al, sizeof al) != sizeof al || al > sizeof a ||
        read(port_pipe[0], &a, al) != ssize_t(al))
      _exit(2);
    int fd = socket(a.ss_family, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&a), al) != 0) _exit(3);
    if (expect_rdma()) {
      int64_t end = now_ms() + timeout_ms();
      while (transport_of(fd) != RSOCK_TRANSPORT_RDMA && now_ms() < end) usleep(10000);
      if (transport_of(fd) != RSOCK_TRANSPORT_RDMA) _exit(4);
    }
    static char buf[kBytes];
    fill_pattern(buf, kBytes, 0, 77);
    if (write_all(fd, buf, kBytes) != kBytes) _exit(5);
    close(fd);
    _exit(0);
  }
  close(port_pipe[0]);
  Listener l = make_listener();
  REQUIRE(write(port_pipe[1], &l.addr_len, sizeof l.addr_len) == sizeof l.addr_len);
  REQUIRE(write(port_pipe[1], &l.addr, l.addr_len) == ssize_t(l.addr_len));
  close(port_pipe[1]);
  Fd s(accept(l.fd, nullptr, nullptr));
  REQUIRE(s >= 0);
  std::string got;
  bool eof = false;
  read_to_eof(s, &got, &eof);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(got.size() == kBytes);
  CHECK(check_pattern(got.data(), got.size(), 0, 77) == got.size());
  CHECK(eof);
}

// c reads to EOF, and the child `pid` exits with status 0.
static void eof_then_child_exit0(int c, pid_t pid) {
  bool eof = false;
  read_to_eof(c, nullptr, &eof);
  CHECK(eof);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("fork: a child accepting on an inherited listener (preforking server)") {
  Listener l = make_listener();
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    if (!wait_readable(l.fd)) _exit(2);
    int s = accept(l.fd, nullptr, nullptr);
    if (s < 0) _exit(3);
    char b[4];
    if (read_exact(s, b, 4) != 4) _exit(4);
    if (write_all(s, b, 4) != 4) _exit(5);  // echo
    close(s);
    _exit(0);
  }
  l.fd.reset();  // the parent only connects
  Fd c(socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);
  REQUIRE(write_all(c, "echo", 4) == 4);
  char b[4];
  CHECK(read_exact(c, b, 4) == 4);
  CHECK(memcmp(b, "echo", 4) == 0);
  eof_then_child_exit0(c, pid);
}

TEST_CASE("exec: a connected socket survives exec; FD_CLOEXEC ones do not") {
  // The exec'd program can only use the kernel socket: a connection on RDMA
  // follows it because librsock switches it back to TCP first (the next two
  // cases). These pairs use loopback, which librsock never upgrades, so exec
  // itself is tested in every run.
  Pair p = connected_pair(AF_INET6);
  Pair q = connected_pair(AF_INET6);
  REQUIRE(fcntl(q.client, F_SETFD, FD_CLOEXEC) == 0);
  const int kKeep = 7, kGone = 8;
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // Move both out of the way first: either may currently be fd 7 or 8.
    int pk = fcntl(p.client, F_DUPFD, 100), qg = fcntl(q.client, F_DUPFD, 100);
    if (pk < 0 || qg < 0) _exit(2);
    close(p.client.get());
    close(q.client.get());
    if (dup2(pk, kKeep) != kKeep) _exit(3);
    if (dup3(qg, kGone, O_CLOEXEC) != kGone) _exit(4);
    // Only fd 7 (kept) and fd 8 (cloexec) refer to them now.
    close(pk);
    close(qg);
    // The shell writes to fd 7, reads one line from it, echoes it back, and
    // reports whether fd 8 is open (it must not be after exec).
    execl("/bin/sh", "sh", "-c",
          "printf 'exec-ok\\n' >&7; read line <&7; printf '%s|' \"$line\" >&7; "
          "if { true >&8; } 2>/dev/null; then printf open >&7; else printf closed >&7; fi",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  // The parent drops its ends so EOF means "every process closed it".
  p.client.reset();
  q.client.reset();
  char b[8];
  REQUIRE(read_exact(p.server, b, 8) == 8);
  CHECK(memcmp(b, "exec-ok\n", 8) == 0);
  REQUIRE(write_all(p.server, "ping\n", 5) == 5);
  std::string rest;
  bool eof = false;
  read_to_eof(p.server, &rest, &eof);
  CHECK(eof);
  CHECK(rest == "ping|closed");
  // q's socket was closed by exec (CLOEXEC) and the parent: EOF there too.
  read_to_eof(q.server, nullptr, &eof);
  CHECK(eof);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

// An exec'd child echoes on connection c (its client end here): numbers
// until the connection is on RDMA (when the run expects it), then 256 KiB of
// pattern `seed` both ways at once, then back to TCP, EOF both ways, and the
// child's exit status 0.
static void echo_through_exec_child(int c, pid_t pid, int seed) {
  int64_t end = now_ms() + 20000;
  uint32_t n = 0;
  do {
    n++;
    REQUIRE(write_all(c, &n, sizeof n) == sizeof n);
    uint32_t got = 0;
    REQUIRE(read_exact(c, &got, sizeof got) == sizeof got);
    REQUIRE(got == n);
    if (!expect_rdma() || transport_of(c) == RSOCK_TRANSPORT_RDMA) break;
    usleep(20000);
  } while (now_ms() < end);
  if (expect_rdma()) CHECK(transport_of(c) == RSOCK_TRANSPORT_RDMA);
  static char big[256 * 1024];
  fill_pattern(big, sizeof big, 0, seed);
  std::thread w([&] { CHECK(write_all(c, big, sizeof big) == sizeof big); });
  std::string back;
  back.resize(sizeof big);
  CHECK(read_exact(c, back.data(), sizeof big) == sizeof big);
  w.join();
  CHECK(check_pattern(back.data(), back.size(), 0, seed) == back.size());
  // Back to TCP before the child exits: its exit hands an RDMA connection
  // off (progress_at_exit), which this end may see as a failed path first
  // (path_failed, which the suite's summary check does not allow). Without
  // librsock the option is unknown, and ignored here.
  int one = 1;
  (void)setsockopt(c, SOL_RSOCK, RSOCK_REVERT, &one, sizeof one);
  REQUIRE(shutdown(c, SHUT_WR) == 0);
  eof_then_child_exit0(c, pid);
}

// inetd style with an unmodified program: the server forks, the child makes
// the connection its stdin and stdout and execs cat; the parent closes its
// copy and keeps the listening socket. cat's image takes the socket in at
// startup (the slot its previous image marked at exec) and, as its only
// holder, upgrades it again (docs/DESIGN.md, "Upgrading again after exec"):
// the client's echoes end on RDMA, every byte in order.
TEST_CASE("exec: a child execs cat on its inherited connection; the echo goes on (onto RDMA again)") {
  Listener l = make_listener();
  Pair p = pair_on(l);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int s = p.server.release();
    close(p.client.release());
    close(l.fd.release());
    if (dup2(s, 0) != 0 || dup2(s, 1) != 1) _exit(2);
    close(s);
    execl("/bin/cat", "cat", static_cast<char*>(nullptr));
    _exit(127);
  }
  REQUIRE(p.server.reset() == 0);
  echo_through_exec_child(p.client, pid, 5);
}

// A listening socket inherited across exec (systemd's socket activation, a
// supervisor that forks and execs its workers): the exec'd program never
// calls listen(). Here the parent listens, forks a child that makes the
// socket its fd 3 and execs this suite's own accept-and-echo program, closes
// its copy and connects. The new image takes the listener in at startup; the
// parent's rdma_cm listener, lingering after its close, redirects the
// request to it (docs/DESIGN.md, "Listeners inherited across exec"): the
// echo ends on RDMA, every byte in order. (It stayed on TCP before: nothing
// served the exec'd program's connections.) The exec'd program also checks
// that its first socket and file take the lowest free numbers, although
// librsock opened the listener's RDMA side while the image started.
TEST_CASE("exec: a child execs a server on the listening socket it inherits; its connection goes onto RDMA") {
  Listener l = make_listener();
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int fd = l.fd.release();
    if (fd != 3 && (dup2(fd, 3) != 3 || close(fd) != 0)) _exit(4);
    execl("/proc/self/exe", "rsock_conformance", "--accept-echo-fd3", static_cast<char*>(nullptr));
    _exit(127);
  }
  REQUIRE(l.fd.reset() == 0);
  Fd c(socket(l.addr.ss_family, SOCK_STREAM, 0));
  REQUIRE(connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) == 0);
  echo_through_exec_child(c, pid, 9);
}

// The inetd shape: a child execs a program that writes to the connection it
// inherited. On RDMA before fork(), librsock switched it back to TCP at
// fork(), so the new image (which knows nothing of librsock's state) writes
// to a plain TCP socket and its bytes arrive as on kernel TCP.
TEST_CASE("exec: bytes an exec'd child writes to an inherited upgraded connection arrive") {
  Pair p = connected_pair();
  const int kKeep = 7;
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int pk = fcntl(p.client, F_DUPFD, 100);
    if (pk < 0 || dup2(pk, kKeep) != kKeep) _exit(2);
    execlp("sh", "sh", "-c", "printf 'exec-ok\\n' >&7", static_cast<char*>(nullptr));
    _exit(127);
  }
  // The parent keeps its copy open: the server's stream is not ended by it.
  char b[8];
  REQUIRE(read_exact(p.server, b, 8) == 8);
  CHECK(memcmp(b, "exec-ok\n", 8) == 0);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  REQUIRE(write_all(p.client, "parent", 6) == 6);
  REQUIRE(read_exact(p.server, b, 6) == 6);
  CHECK(memcmp(b, "parent", 6) == 0);
}

// Python's subprocess (and other spawners) vfork: the child shares the
// parent's memory, closes every fd it does not pass on, dup2s its pipes and
// execs. None of that is the parent's doing: its connections must go on
// exactly as before (upgraded ones on RDMA), and its own fd numbers stay
// what they were.
TEST_CASE("fork: a vfork child that closes every fd, dup2s and execs leaves the parent's connections alone") {
  Pair p = connected_pair();
  int pfd[2];
  REQUIRE(pipe(pfd) == 0);
  pid_t pid = vfork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(pfd[1], 1);
    close_range(3, ~0U, 0);
    execl("/bin/true", "true", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(pfd[1]);
  close(pfd[0]);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  if (expect_rdma()) {  // still tracked, still upgraded
    CHECK(transport_of(p.client) == 2);
    CHECK(transport_of(p.server) == 2);
  }
  REQUIRE(write_all(p.client, "after-vfork", 11) == 11);
  char b[16];
  REQUIRE(read_exact(p.server, b, 11) == 11);
  CHECK(memcmp(b, "after-vfork", 11) == 0);
  REQUIRE(write_all(p.server, "reply", 5) == 5);
  REQUIRE(read_exact(p.client, b, 5) == 5);
  CHECK(memcmp(b, "reply", 5) == 0);
}

// posix_spawn starts the new program without fork(), so only the exec hooks
// can switch the upgraded connection back to TCP for it.
TEST_CASE("exec: a posix_spawn'ed program talks over an inherited upgraded connection") {
  Pair p = connected_pair();
  pid_t pid = spawn_sh_on_fd7(p.client,
                              "printf 'spawn-ok\\n' >&7; read line <&7; printf '%s|' \"$line\" >&7");
  REQUIRE(pid > 0);
  char b[9];
  REQUIRE(read_exact(p.server, b, 9) == 9);
  CHECK(memcmp(b, "spawn-ok\n", 9) == 0);
  REQUIRE(write_all(p.server, "ping\n", 5) == 5);
  REQUIRE(read_exact(p.server, b, 5) == 5);
  CHECK(memcmp(b, "ping|", 5) == 0);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // The spawning process goes on using it.
  REQUIRE(write_all(p.client, "parent", 6) == 6);
  REQUIRE(read_exact(p.server, b, 6) == 6);
  CHECK(memcmp(b, "parent", 6) == 0);
}

// Bytes that came on TCP ahead of the switch and that the program never
// read are in librsock's memory (drained to reach the peer's marker): the
// exec'd program must still read them from the socket it inherits.
TEST_CASE("exec: a posix_spawn'ed program reads bytes that arrived before the upgrade") {
  Pair p = connected_pair(AF_INET, /*await_upgrade=*/false);
  REQUIRE(write_all(p.server, "early\n", 6) == 6);  // on TCP, ahead of the switch
  if (expect_rdma()) await_rdma(p);
  pid_t pid = spawn_sh_on_fd7(p.client, "read line <&7; printf '%s|' \"$line\" >&7");
  REQUIRE(pid > 0);
  char b[8];
  REQUIRE(read_exact(p.server, b, 6) == 6);
  CHECK(memcmp(b, "early|", 6) == 0);
  int status = wait_child(pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

// system() and popen() start their shell through glibc-internal calls that
// no hook sees (docs/DESIGN.md, exec): the program keeps its connections,
// the shell does not use them. Neither may disturb a connection, upgraded
// or not, that the program goes on using in both directions.
TEST_CASE("exec: system() and popen() while a connection is open; it goes on") {
  Pair p = connected_pair();
  char b[16];
  REQUIRE(write_all(p.client, "before", 6) == 6);
  REQUIRE(read_exact(p.server, b, 6) == 6);
  int st = system("exit 3");
  CHECK(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 3);
  FILE* f = popen("echo popen-ok", "r");
  REQUIRE(f != nullptr);
  char line[32] = {};
  CHECK(fgets(line, sizeof line, f) != nullptr);
  CHECK(std::string(line) == "popen-ok\n");
  CHECK(pclose(f) == 0);
  REQUIRE(write_all(p.client, "after-c", 7) == 7);
  REQUIRE(read_exact(p.server, b, 7) == 7);
  CHECK(memcmp(b, "after-c", 7) == 0);
  REQUIRE(write_all(p.server, "after-s", 7) == 7);
  REQUIRE(read_exact(p.client, b, 7) == 7);
  CHECK(memcmp(b, "after-s", 7) == 0);
}

TEST_CASE("server: epoll echo server with many concurrent connections") {
  const int kConns = 48;
  Listener l = make_listener(AF_INET, kConns);
  set_nonblocking(l.fd, true);
  std::atomic<bool> stop{false};
  std::atomic<int> closed{0}, accepted{0};
  std::thread server([&] {
    int ep = epoll_create1(0);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = l.fd;
    epoll_ctl(ep, EPOLL_CTL_ADD, l.fd, &ev);
    std::vector<char> buf(65536);
    epoll_event evs[16];
    int64_t deadline = now_ms() + timeout_ms() * 3;
    while (!stop && closed < kConns && now_ms() < deadline) {
      int n = epoll_wait(ep, evs, 16, 100);
      for (int i = 0; i < n; ++i) {
        int fd = evs[i].data.fd;
        if (fd == l.fd) {
          int s;
          while ((s = accept4(l.fd, nullptr, nullptr, SOCK_NONBLOCK)) >= 0) {
            ++accepted;
            epoll_event cev{};
            cev.events = EPOLLIN | EPOLLRDHUP;
            cev.data.fd = s;
            epoll_ctl(ep, EPOLL_CTL_ADD, s, &cev);
          }
          continue;
        }
        ssize_t r = read(fd, buf.data(), buf.size());
        if (r > 0) {
          write_all(fd, buf.data(), static_cast<size_t>(r));
        } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
          epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
          close(fd);
          ++closed;
        }
      }
    }
    close(ep);
  });

  std::vector<std::thread> clients;
  std::vector<int> ok(kConns, 0);
  for (int i = 0; i < kConns; ++i) {
    clients.emplace_back([&, i] {
      Fd c(socket(AF_INET, SOCK_STREAM, 0));
      if (connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) != 0) return;
      std::vector<uint8_t> msg(500 + static_cast<size_t>(i) * 613), in(msg.size());
      fill_pattern(msg.data(), msg.size(), 0, 100 + static_cast<uint32_t>(i));
      if (write_all(c, msg.data(), msg.size()) != msg.size()) return;
      if (read_exact(c, in.data(), in.size()) != in.size()) return;
      if (shutdown(c, SHUT_WR) != 0) return;
      bool eof = false;
      read_to_eof(c, nullptr, &eof);
      ok[static_cast<size_t>(i)] = eof && memcmp(msg.data(), in.data(), msg.size()) == 0;
    });
  }
  for (auto& t : clients) t.join();
  int64_t deadline = now_ms() + timeout_ms();
  while (closed < kConns && now_ms() < deadline) usleep(1000);
  stop = true;
  server.join();
  int good = 0;
  for (int v : ok) good += v;
  CHECK(good == kConns);
  CHECK(accepted == kConns);
  CHECK(closed == kConns);
}
