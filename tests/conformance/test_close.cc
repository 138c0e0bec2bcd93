// Teardown: half-close, resets, SIGPIPE/EPIPE, and fd duplication versus the
// lifetime of the underlying connection.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "helpers.h"

using namespace conf;

namespace {

// Waits until `fd` reports an error/hangup (an RST has arrived).
// Waits until the reset is reported (POLLERR/POLLHUP). Data sent before the
// reset may wake poll() first with POLLIN alone: the data and the reset are
// separate arrivals on any path (two segments on TCP, a DATA write and a
// RESET message on RDMA), so look again until the deadline.
bool wait_reset(int fd) {
  int64_t deadline = now_ms() + timeout_ms();
  for (;;) {
    int64_t left = deadline - now_ms();
    short ev = poll_one(fd, POLLIN, left > 0 ? int(left) : 0);
    if (ev & (POLLERR | POLLHUP)) return true;
    if (left <= 0) return false;
    if (ev) usleep(1000);
  }
}

// Writes 1 byte at a time to a socket whose peer is gone until write fails
// with EPIPE. The first failure after an RST may be ECONNRESET (Linux reports
// the pending error first); anything else is wrong. Returns the last errno.
int write_until_epipe(int fd, int flags) {
  int64_t deadline = now_ms() + timeout_ms();
  while (now_ms() < deadline) {
    ssize_t r = send(fd, "x", 1, flags);
    if (r == 1) {
      usleep(2000);  // let the RST come back
      continue;
    }
    if (r < 0 && errno == ECONNRESET) continue;
    return r < 0 ? errno : 0;
  }
  return ETIMEDOUT;
}

}  // namespace

TEST_CASE("close: shutdown(SHUT_WR) half-close: EOF one way, data still flows back") {
  Pair p = connected_pair();
  REQUIRE(write_all(p.client, "request", 7) == 7);
  REQUIRE(shutdown(p.client, SHUT_WR) == 0);
  std::string got;
  bool eof = false;
  CHECK(read_to_eof(p.server, &got, &eof) == 7);
  CHECK(eof);
  CHECK(got == "request");
  // EOF is sticky.
  char b;
  CHECK(read(p.server, &b, 1) == 0);
  CHECK(recv(p.server, &b, 1, MSG_DONTWAIT) == 0);
  // POLLIN|POLLRDHUP on the reading side after the peer's FIN.
  short ev = poll_one(p.server, POLLIN | POLLRDHUP, 0);
  CHECK((ev & POLLIN));
  CHECK((ev & POLLRDHUP));
  CHECK_FALSE((ev & POLLHUP));
  // The other direction still works, any amount.
  std::vector<uint8_t> big(300000);
  fill_pattern(big.data(), big.size(), 0, 21);
  std::vector<uint8_t> in(big.size());
  REQUIRE(write_all(p.server, big.data(), big.size()) == big.size());
  REQUIRE(shutdown(p.server, SHUT_WR) == 0);
  CHECK(read_exact(p.client, in.data(), in.size()) == in.size());
  CHECK(check_pattern(in.data(), in.size(), 0, 21) == in.size());
  CHECK(read(p.client, &b, 1) == 0);
  // Writing after our own SHUT_WR: EPIPE.
  errno = 0;
  CHECK(send(p.client, "late", 4, MSG_NOSIGNAL) == -1);
  CHECK(errno == EPIPE);
  // Both directions shut: POLLHUP.
  CHECK((poll_one(p.client, POLLIN, 0) & POLLHUP));
  // Shutting down an unconnected socket: ENOTCONN.
  Fd u(socket(AF_INET, SOCK_STREAM, 0));
  errno = 0;
  CHECK(shutdown(u, SHUT_WR) == -1);
  CHECK(errno == ENOTCONN);
}

// A program that writes its answer in many small pieces and closes at once,
// to a peer that reads only later: the kernel keeps a closed socket's
// unsent bytes and delivers them, then EOF. A closed upgraded connection
// must do the same (each small write takes one of the peer's receive slots,
// and the FIN needs one too).
TEST_CASE("close: many small writes just before close reach a peer that starts reading seconds later") {
  Pair p = connected_pair();
  const size_t piece = 1000, pieces = 400;
  std::vector<uint8_t> out(piece * pieces);
  fill_pattern(out.data(), out.size(), 0, 33);
  int wfd = p.server.release();
  size_t wrote = 0;
  int closed = -1;
  std::thread w([&] {
    for (size_t i = 0; i < pieces; i++) wrote += write_all(wfd, out.data() + i * piece, piece);
    closed = close(wfd);
  });
  usleep(1500 * 1000);  // past the close linger (connect_timeout_ms, 1 s)
  std::vector<uint8_t> in(out.size());
  CHECK(read_exact(p.client, in.data(), in.size()) == in.size());
  CHECK(check_pattern(in.data(), in.size(), 0, 33) == in.size());
  char b;
  CHECK(read(p.client, &b, 1) == 0);
  w.join();
  CHECK(wrote == out.size());
  CHECK(closed == 0);
}

// TIME_WAIT stays with the side that closed first. A server whose client
// closes first can bind its port again (without SO_REUSEADDR) as soon as
// its own socket is gone. Under librsock the server's TCP FIN once went out
// before the client's (its RDMA close finished first), so the server took
// TIME_WAIT and a restarted server could not bind for a minute.
TEST_CASE("close: the side that closes first keeps TIME_WAIT; the server can bind its port again") {
  uint16_t port;
  sockaddr_storage addr;
  socklen_t alen;
  {
    Listener l = make_listener();
    port = l.port;
    addr = l.addr;
    alen = l.addr_len;
    // The client is another process that closes and exits at once, as a
    // benchmark client does (its exit hands a still-lingering connection
    // to TCP: docs/DESIGN.md, exit).
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int c = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(c, reinterpret_cast<sockaddr*>(&l.addr), l.addr_len) != 0) _exit(2);
      if (expect_rdma()) {
        int64_t end = now_ms() + 20000;
        while (transport_of(c) != 2 && now_ms() < end) usleep(1000);
        if (transport_of(c) != 2) _exit(3);
      }
      char b[4];
      if (write_all(c, "ping", 4) != 4 || read_exact(c, b, 4) != 4) _exit(4);
      close(c);  // first
      exit(0);   // atexit handlers run, as in any program
    }
    REQUIRE(wait_readable(l.fd));
    Fd s(accept(l.fd, nullptr, nullptr));
    REQUIRE(s >= 0);
    char b[4];
    REQUIRE(read_exact(s, b, 4) == 4);
    REQUIRE(write_all(s, "pong", 4) == 4);
    bool eof = false;
    read_to_eof(s, nullptr, &eof);
    REQUIRE(eof);
    REQUIRE(s.reset() == 0);
    int st = 0;
    REQUIRE(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
  }  // and the listener
  // The server's socket passes LAST_ACK to CLOSED once the client's ACK is
  // in (a few ms, longer under librsock's close); TIME_WAIT would be 60 s.
  int64_t deadline = now_ms() + 5000;
  int err = 0;
  bool bound = false;
  while (!bound) {
    Fd f(socket(AF_INET, SOCK_STREAM, 0));
    REQUIRE(f >= 0);
    bound = bind(f, reinterpret_cast<sockaddr*>(&addr), alen) == 0;
    err = errno;
    if (!bound && now_ms() > deadline) break;
    if (!bound) usleep(20000);
  }
  CHECK_MESSAGE(bound, "bind to port " << port << ": " << errno_str(err));
}

TEST_CASE("close: closing with unread data resets the peer (ECONNRESET)") {
  Pair p = connected_pair();
  REQUIRE(write_all(p.client, "unread data", 11) == 11);
  // Make sure it arrived at the server before the server closes.
  int avail = 0;
  int64_t deadline = now_ms() + timeout_ms();
  while (now_ms() < deadline && avail < 11) {
    REQUIRE(ioctl(p.server, FIONREAD, &avail) == 0);
    if (avail < 11) usleep(1000);
  }
  REQUIRE(avail == 11);
  REQUIRE(p.server.reset() == 0);
  REQUIRE(wait_reset(p.client));
  char b[16];
  errno = 0;
  CHECK(recv(p.client, b, sizeof b, 0) == -1);
  CHECK(errno == ECONNRESET);
  // After the error is reported the socket reads as EOF, and writes fail.
  CHECK(recv(p.client, b, sizeof b, 0) == 0);
  errno = 0;
  CHECK(send(p.client, "x", 1, MSG_NOSIGNAL) == -1);
  CHECK(errno == EPIPE);
}

TEST_CASE("close: SO_LINGER {1,0} sends RST instead of FIN") {
  Pair p = connected_pair();
  linger lg{1, 0};
  REQUIRE(setsockopt(p.server, SOL_SOCKET, SO_LINGER, &lg, sizeof lg) == 0);
  linger back{};
  socklen_t len = sizeof back;
  REQUIRE(getsockopt(p.server, SOL_SOCKET, SO_LINGER, &back, &len) == 0);
  CHECK(back.l_onoff != 0);
  CHECK(back.l_linger == 0);
  REQUIRE(write_all(p.server, "bye", 3) == 3);  // data in flight does not matter
  REQUIRE(p.server.reset() == 0);
  REQUIRE(wait_reset(p.client));
  short ev = poll_one(p.client, POLLIN | POLLRDHUP, 0);
  CHECK((ev & POLLHUP));
  CHECK((ev & POLLERR));
  char b[16];
  // Buffered data may or may not be readable before the reset is reported;
  // the reset itself must be.
  ssize_t r;
  int tries = 0;
  while ((r = recv(p.client, b, sizeof b, MSG_DONTWAIT)) > 0 && ++tries < 10) {
  }
  CHECK(r == -1);
  CHECK(errno == ECONNRESET);
  CHECK(so_error(p.client) == 0);
}

TEST_CASE("close: MSG_NOSIGNAL gives EPIPE without SIGPIPE") {
  Pair p = connected_pair();
  REQUIRE(p.server.reset() == 0);
  int before = sigpipe_count();
  CHECK(write_until_epipe(p.client, MSG_NOSIGNAL) == EPIPE);
  usleep(20000);
  CHECK(sigpipe_count() == before);
  // Deterministic variant: after our own SHUT_WR.
  Pair q = connected_pair();
  REQUIRE(shutdown(q.client, SHUT_WR) == 0);
  errno = 0;
  CHECK(send(q.client, "x", 1, MSG_NOSIGNAL) == -1);
  CHECK(errno == EPIPE);
  usleep(20000);
  CHECK(sigpipe_count() == before);
}

TEST_CASE("close: without MSG_NOSIGNAL, EPIPE comes with SIGPIPE") {
  // main() installed a counting SIGPIPE handler; make sure it is ours and
  // SIGPIPE is not blocked on this thread.
  struct sigaction old{};
  REQUIRE(sigaction(SIGPIPE, nullptr, &old) == 0);
  bool is_default = old.sa_handler == SIG_DFL, is_ignored = old.sa_handler == SIG_IGN;
  REQUIRE_FALSE(is_default);
  REQUIRE_FALSE(is_ignored);
  sigset_t cur;
  pthread_sigmask(SIG_SETMASK, nullptr, &cur);
  REQUIRE_FALSE(sigismember(&cur, SIGPIPE));

  Pair p = connected_pair();
  REQUIRE(p.server.reset() == 0);
  int before = sigpipe_count();
  CHECK(write_until_epipe(p.client, 0) == EPIPE);
  int64_t deadline = now_ms() + 2000;
  while (sigpipe_count() == before && now_ms() < deadline) usleep(1000);
  CHECK(sigpipe_count() > before);

  Pair q = connected_pair();
  REQUIRE(shutdown(q.client, SHUT_WR) == 0);
  before = sigpipe_count();
  errno = 0;
  CHECK(write(q.client, "x", 1) == -1);
  CHECK(errno == EPIPE);
  deadline = now_ms() + 2000;
  while (sigpipe_count() == before && now_ms() < deadline) usleep(1000);
  CHECK(sigpipe_count() == before + 1);
}

TEST_CASE("dup: the connection lives while any duplicate is open") {
  Pair p = connected_pair();
  Fd d(dup(p.client));
  REQUIRE(d >= 0);
  CHECK(d.get() != p.client.get());
  REQUIRE(p.client.reset() == 0);
  // Peer sees no EOF: the socket is still open through the dup.
  CHECK(poll_one(p.server, POLLIN, 100) == 0);
  REQUIRE(write_all(d, "via-dup", 7) == 7);
  char b[16];
  REQUIRE(read_exact(p.server, b, 7) == 7);
  CHECK(memcmp(b, "via-dup", 7) == 0);
  REQUIRE(write_all(p.server, "back", 4) == 4);
  REQUIRE(read_exact(d, b, 4) == 4);
  CHECK(memcmp(b, "back", 4) == 0);
  // Closing the last reference: EOF at the peer.
  REQUIRE(d.reset() == 0);
  bool eof = false;
  CHECK(read_to_eof(p.server, nullptr, &eof) == 0);
  CHECK(eof);
}

TEST_CASE("dup: duplicates share file status flags and the byte stream") {
  Pair p = connected_pair();
  Fd d(dup(p.server));
  REQUIRE(d >= 0);
  set_nonblocking(p.server, true);
  CHECK(is_nonblocking(d));  // O_NONBLOCK is on the shared open file description
  CHECK_FALSE((fcntl(d, F_GETFD) & FD_CLOEXEC));
  REQUIRE(write_all(p.client, "abcdef", 6) == 6);
  char b[8];
  REQUIRE(read_exact(p.server, b, 3) == 3);
  REQUIRE(read_exact(d, b + 3, 3) == 3);
  CHECK(memcmp(b, "abcdef", 6) == 0);
  errno = 0;
  CHECK(read(d, b, 1) == -1);
  CHECK(errno == EAGAIN);
  // shutdown() acts on the socket, not the fd: it is seen through the dup too.
  REQUIRE(shutdown(d, SHUT_WR) == 0);
  bool eof = false;
  read_to_eof(p.client, nullptr, &eof);
  CHECK(eof);
}

TEST_CASE("dup2/dup3: target numbers, closing the old target, O_CLOEXEC") {
  Pair p = connected_pair();
  Pair q = connected_pair();
  // dup2 onto an fd that holds another connection closes that connection.
  int target = q.client.get();
  REQUIRE(dup2(p.client, target) == target);
  q.client.release();  // now refers to p's connection
  Fd t(target);
  bool eof = false;
  read_to_eof(q.server, nullptr, &eof);
  CHECK(eof);  // q's client end was closed by dup2
  REQUIRE(write_all(t, "dup2", 4) == 4);
  char b[8];
  REQUIRE(read_exact(p.server, b, 4) == 4);
  CHECK(memcmp(b, "dup2", 4) == 0);
  CHECK_FALSE((fcntl(t, F_GETFD) & FD_CLOEXEC));

  // dup2(fd, fd) is a no-op returning fd.
  CHECK(dup2(t, t) == t);
  // dup3 with O_CLOEXEC sets FD_CLOEXEC on the new fd only.
  int high = fcntl(p.client, F_DUPFD, 200);
  REQUIRE(high >= 200);
  Fd h(high);
  REQUIRE(dup3(p.client, high, O_CLOEXEC) == high);
  CHECK((fcntl(high, F_GETFD) & FD_CLOEXEC));
  CHECK_FALSE((fcntl(p.client, F_GETFD) & FD_CLOEXEC));
  REQUIRE(write_all(h, "dup3", 4) == 4);
  REQUIRE(read_exact(p.server, b, 4) == 4);
  CHECK(memcmp(b, "dup3", 4) == 0);
  // dup3(fd, fd) is EINVAL; bad flags are EINVAL; bad source is EBADF.
  errno = 0;
  CHECK(dup3(high, high, O_CLOEXEC) == -1);
  CHECK(errno == EINVAL);
  errno = 0;
  CHECK(dup3(p.client, high, O_NONBLOCK) == -1);
  CHECK(errno == EINVAL);
  errno = 0;
  CHECK(dup2(987654, high) == -1);
  CHECK(errno == EBADF);
  // F_DUPFD_CLOEXEC.
  Fd c(fcntl(p.client, F_DUPFD_CLOEXEC, 0));
  REQUIRE(c >= 0);
  CHECK((fcntl(c, F_GETFD) & FD_CLOEXEC));

  // Close every alias but one: still connected; close the last: EOF.
  REQUIRE(p.client.reset() == 0);
  REQUIRE(t.reset() == 0);
  REQUIRE(h.reset() == 0);
  CHECK(poll_one(p.server, POLLIN, 50) == 0);
  REQUIRE(write_all(c, "last", 4) == 4);
  REQUIRE(c.reset() == 0);
  std::string got;
  read_to_eof(p.server, &got, &eof);
  CHECK(got == "last");
  CHECK(eof);
}

// Under librsock a connection's stream uses the number connect()/accept()
// returned until the program closes it (then a reference of its own): every
// way of closing that number must leave the connection to its other names.
TEST_CASE("close_range/dup2: the first number of a connection closed, its duplicate carries on") {
  Pair p = connected_pair();  // upgraded over rxe
  Fd ch(fcntl(p.client, F_DUPFD, 300));
  Fd sh(fcntl(p.server, F_DUPFD, 310));
  REQUIRE(ch >= 300);
  REQUIRE(sh >= 310);
  int corig = p.client.release();
  REQUIRE(close_range(unsigned(corig), unsigned(corig), 0) == 0);
  // dup2 onto the server's first number: another connection takes it over.
  Pair q = connected_pair();
  int sorig = p.server.get();
  REQUIRE(dup2(q.client, sorig) == sorig);
  p.server.release();
  Fd qalias(sorig);
  // A few MB each way at once, checked, through the duplicates.
  constexpr size_t kBytes = 4 << 20;
  std::thread writer([&] {
    std::vector<char> b(64 << 10);
    for (size_t off = 0; off < kBytes; off += b.size()) {
      fill_pattern(b.data(), b.size(), off, 7);
      if (write_all(sh, b.data(), b.size()) != b.size()) return;
    }
  });
  size_t rgot = 0, rbad = 0;
  std::thread reader([&] {
    std::vector<char> b(64 << 10);
    while (rgot < kBytes) {
      if (read_exact(sh, b.data(), b.size()) != b.size()) return;
      rbad += check_pattern(b.data(), b.size(), rgot, 9) != b.size();
      rgot += b.size();
    }
  });
  std::vector<char> out(64 << 10), in(64 << 10);
  size_t got = 0, bad = 0;
  for (size_t off = 0; off < kBytes; off += out.size()) {
    fill_pattern(out.data(), out.size(), off, 9);
    if (write_all(ch, out.data(), out.size()) != out.size()) break;
    if (read_exact(ch, in.data(), in.size()) != in.size()) break;
    bad += check_pattern(in.data(), in.size(), got, 7) != in.size();
    got += in.size();
  }
  writer.join();
  reader.join();
  CHECK(got == kBytes);
  CHECK(bad == 0);
  CHECK(rgot == kBytes);
  CHECK(rbad == 0);
  // The second connection works through the number it took over.
  REQUIRE(write_all(qalias, "q", 1) == 1);
  char c;
  REQUIRE(read_exact(q.server, &c, 1) == 1);
  // Closing the last name ends the first connection: EOF at the peer.
  REQUIRE(ch.reset() == 0);
  bool eof = false;
  CHECK(read_to_eof(sh, nullptr, &eof) == 0);
  CHECK(eof);
}

TEST_CASE("close: I/O on a closed fd is EBADF") {
  Pair p = connected_pair();
  int fd = p.client.release();
  REQUIRE(close(fd) == 0);
  char b;
  errno = 0;
  CHECK(read(fd, &b, 1) == -1);
  CHECK(errno == EBADF);
  errno = 0;
  CHECK(send(fd, "x", 1, MSG_NOSIGNAL) == -1);
  CHECK(errno == EBADF);
  errno = 0;
  CHECK(close(fd) == -1);
  CHECK(errno == EBADF);
  // Socket calls on a non-socket: ENOTSOCK.
  Fd nul(open("/dev/null", O_RDWR));
  errno = 0;
  CHECK(send(nul, "x", 1, 0) == -1);
  CHECK(errno == ENOTSOCK);
}

// libuv (Node) closes with syscall(SYS_close): the peer must still get every
// byte and then EOF, and the number must be free for the next socket, as
// with close(). (Unseen by librsock, such a close left an upgraded
// connection without its FIN and the fd table naming a dead socket.)
TEST_CASE("close: syscall(SYS_close) of a connection: every byte, then EOF; the number is closed") {
  Pair p = connected_pair();
  REQUIRE(write_all(p.server, "bye", 3) == 3);
  int fd = p.server.release();
  REQUIRE(syscall(SYS_close, fd) == 0);
  errno = 0;
  CHECK(syscall(SYS_close, fd) == -1);
  CHECK(errno == EBADF);
  std::string got;
  bool eof = false;
  read_to_eof(p.client, &got, &eof);
  CHECK(got == "bye");
  CHECK(eof);
  // The number names nothing now, for librsock too.
  char b;
  errno = 0;
  CHECK(send(fd, "x", 1, MSG_NOSIGNAL) == -1);
  CHECK(errno == EBADF);
  errno = 0;
  CHECK(recv(fd, &b, 1, MSG_DONTWAIT) == -1);
  CHECK(errno == EBADF);
  // Other raw calls go through unchanged.
  CHECK(syscall(SYS_getpid) == getpid());
}
