// sendfile, splice, high fd numbers, and sanity for non-TCP sockets (UDP, UNIX).
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/un.h>
#include <unistd.h>

#include <thread>
#include <vector>

#include "helpers.h"
#include "preload/librsock.h"

using namespace conf;

// splice moves a socket's bytes through a pipe: under librsock those bytes
// may travel over RDMA, where the kernel's splice would never see them.
TEST_CASE("splice: pipe -> socket -> pipe carries the stream intact; nonblocking and EOF") {
  Pair p = connected_pair();
  const size_t kSize = (1 << 20) + 777;
  int in[2], out[2];
  REQUIRE(pipe(in) == 0);
  REQUIRE(pipe(out) == 0);
  Fd in_r(in[0]), in_w(in[1]), out_r(out[0]), out_w(out[1]);
  // Nothing to read yet: splice from a nonblocking socket says EAGAIN
  // (SPLICE_F_NONBLOCK is about the pipe side only).
  set_nonblocking(p.server, true);
  errno = 0;
  CHECK(splice(p.server, nullptr, out_w, nullptr, 4096, SPLICE_F_NONBLOCK) == -1);
  CHECK(errno == EAGAIN);
  set_nonblocking(p.server, false);
  std::thread feeder([&] {  // pattern -> pipe `in`
    std::vector<uint8_t> b(kSize);
    fill_pattern(b.data(), kSize, 0, 91);
    write_all(in_w, b.data(), kSize);
  });
  std::thread to_socket([&] {  // pipe `in` -> client socket
    size_t moved = 0;
    while (moved < kSize) {
      ssize_t r = splice(in_r, nullptr, p.client, nullptr, kSize - moved, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      moved += size_t(r);
    }
    shutdown(p.client, SHUT_WR);
  });
  std::vector<uint8_t> got(kSize);
  size_t got_n = 0;
  std::thread drain([&] { got_n = read_exact(out_r, got.data(), kSize); });  // pipe `out`
  size_t moved = 0;  // server socket -> pipe `out`
  ssize_t r = 0;
  while (moved < kSize) {
    r = splice(p.server, nullptr, out_w, nullptr, 65536, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    moved += size_t(r);
  }
  feeder.join();
  to_socket.join();
  drain.join();
  CHECK(moved == kSize);
  CHECK(got_n == kSize);
  CHECK(check_pattern(got.data(), got_n, 0, 91) == got_n);
  // The peer's FIN after the last byte: splice says 0.
  CHECK(splice(p.server, nullptr, out_w, nullptr, 4096, 0) == 0);
  // An offset on the socket's side is the kernel's EINVAL (no pwrite).
  loff_t off = 0;
  errno = 0;
  CHECK(splice(in_r, nullptr, p.server, &off, 16, SPLICE_F_NONBLOCK) == -1);
  CHECK(errno == EINVAL);
}

TEST_CASE("sendfile: file content arrives intact and the offset advances") {
  char path[] = "/tmp/rsock_conf_sendfile_XXXXXX";
  Fd file(mkstemp(path));
  REQUIRE(file >= 0);
  unlink(path);
  const size_t kSize = (3 << 20) + 4321;
  std::vector<uint8_t> content(kSize);
  fill_pattern(content.data(), kSize, 0, 71);
  REQUIRE(write_all(file, content.data(), kSize) == kSize);
  REQUIRE(lseek(file, 0, SEEK_SET) == 0);

  Pair p = connected_pair();
  std::vector<uint8_t> got(kSize);
  size_t got_n = 0;
  std::thread rx([&] { got_n = read_exact(p.server, got.data(), got.size()); });

  // With an offset pointer: sends from *offset, advances it, leaves the file
  // position alone. Start at 1000 to prove the offset is honoured.
  off_t off = 1000;
  size_t sent = 0;
  while (off < static_cast<off_t>(kSize)) {
    ssize_t r = sendfile(p.client, file, &off, kSize - static_cast<size_t>(off));
    if (r < 0 && errno == EINTR) continue;
    REQUIRE_MESSAGE(r > 0, errno_str(errno));
    sent += static_cast<size_t>(r);
  }
  CHECK(off == static_cast<off_t>(kSize));
  CHECK(sent == kSize - 1000);
  CHECK(lseek(file, 0, SEEK_CUR) == 0);
  // Without an offset: uses and advances the file position.
  size_t sent2 = 0;
  while (sent2 < 1000) {
    ssize_t r = sendfile(p.client, file, nullptr, 1000 - sent2);
    REQUIRE(r > 0);
    sent2 += static_cast<size_t>(r);
  }
  CHECK(lseek(file, 0, SEEK_CUR) == 1000);
  rx.join();
  REQUIRE(got_n == kSize);
  // Stream = file[1000..end) then file[0..1000).
  CHECK(memcmp(got.data(), content.data() + 1000, kSize - 1000) == 0);
  CHECK(memcmp(got.data() + kSize - 1000, content.data(), 1000) == 0);
  // At EOF of the file: returns 0.
  off = static_cast<off_t>(kSize);
  CHECK(sendfile(p.client, file, &off, 100) == 0);
}

TEST_CASE("high fds: a connected socket dup2'ed far above 1024 works") {
  rlimit old{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &old) == 0);
  // Try for 70000 (needs raising the hard limit: root only), else the most
  // the hard limit allows.
  rlimit want = old;
  const rlim_t kWanted = 70001;
  if (want.rlim_max != RLIM_INFINITY && want.rlim_max < kWanted) {
    rlimit raised{kWanted, kWanted};
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) want = raised;
  }
  want.rlim_cur = want.rlim_max;
  if (want.rlim_cur == RLIM_INFINITY || want.rlim_cur > kWanted) want.rlim_cur = kWanted;
  REQUIRE(setrlimit(RLIMIT_NOFILE, &want) == 0);
  int target = static_cast<int>(std::min<rlim_t>(70000, want.rlim_cur - 1));
  MESSAGE("RLIMIT_NOFILE soft " << want.rlim_cur << ", using fd " << target);
  CHECK(target > 1024);

  {
    Pair p = connected_pair();
    REQUIRE(dup2(p.client, target) == target);
    Fd high(target);
    REQUIRE(p.client.reset() == 0);  // only the high fd refers to it now
    // I/O both ways on the high fd.
    REQUIRE(write_all(high, "high-fd", 7) == 7);
    char b[8];
    REQUIRE(read_exact(p.server, b, 7) == 7);
    CHECK(memcmp(b, "high-fd", 7) == 0);
    REQUIRE(write_all(p.server, "reply", 5) == 5);
    CHECK(wait_readable(high));
    CHECK(read_exact(high, b, 5) == 5);
    CHECK(memcmp(b, "reply", 5) == 0);
    // send/recv/poll/epoll/fcntl/getsockopt on it.
    CHECK(send(high, "s", 1, 0) == 1);
    CHECK(read_exact(p.server, b, 1) == 1);
    set_nonblocking(high, true);
    errno = 0;
    CHECK(recv(high, b, 1, 0) == -1);
    CHECK(errno == EAGAIN);
    Fd ep(epoll_create1(0));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = target;
    REQUIRE(epoll_ctl(ep, EPOLL_CTL_ADD, high, &ev) == 0);
    REQUIRE(write_all(p.server, "e", 1) == 1);
    epoll_event out{};
    CHECK(epoll_wait(ep, &out, 1, timeout_ms()) == 1);
    int out_fd = out.data.fd;
    CHECK(out_fd == target);
    CHECK(read_exact(high, b, 1) == 1);  // consume it: closing with unread data would RST
    CHECK(so_error(high) == 0);
    // A new socket still gets the lowest free number, not something near the high fd.
    Fd low(socket(AF_INET, SOCK_STREAM, 0));
    CHECK(low.get() < 1024);
    // Closing the high fd gives the peer EOF.
    REQUIRE(high.reset() == 0);
    bool eof = false;
    std::string rest;
    read_to_eof(p.server, &rest, &eof);
    CHECK(eof);
    // dup2 beyond the limit: EBADF.
    errno = 0;
    CHECK(dup2(p.server, static_cast<int>(want.rlim_cur)) == -1);
    CHECK(errno == EBADF);
  }
  setrlimit(RLIMIT_NOFILE, &old);  // best effort (lowering is always allowed)
}

TEST_CASE("udp: datagram sanity on loopback") {
  Fd a(socket(AF_INET, SOCK_DGRAM, 0)), b(socket(AF_INET, SOCK_DGRAM, 0));
  REQUIRE(a >= 0);
  REQUIRE(b >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(b, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(getsockname(b, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  // Message boundaries are kept.
  REQUIRE(sendto(a, "one", 3, 0, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 3);
  REQUIRE(sendto(a, "second", 6, 0, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 6);
  char buf[64];
  sockaddr_in from{};
  socklen_t flen = sizeof from;
  REQUIRE(wait_readable(b));
  CHECK(recvfrom(b, buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &flen) == 3);
  CHECK(memcmp(buf, "one", 3) == 0);
  CHECK(flen == sizeof from);
  sockaddr_in a_addr{};
  len = sizeof a_addr;
  REQUIRE(getsockname(a, reinterpret_cast<sockaddr*>(&a_addr), &len) == 0);
  CHECK(from.sin_port == a_addr.sin_port);
  REQUIRE(wait_readable(b));
  // Truncation: MSG_TRUNC returns the real length.
  CHECK(recv(b, buf, 2, MSG_TRUNC) == 6);
  CHECK(memcmp(buf, "se", 2) == 0);
  // Connected UDP: send/recv, reply path.
  REQUIRE(connect(a, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(send(a, "conn", 4, 0) == 4);
  REQUIRE(wait_readable(b));
  CHECK(recvfrom(b, buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &flen) == 4);
  REQUIRE(sendto(b, "back", 4, 0, reinterpret_cast<sockaddr*>(&from), flen) == 4);
  REQUIRE(wait_readable(a));
  CHECK(recv(a, buf, sizeof buf, 0) == 4);
  CHECK(memcmp(buf, "back", 4) == 0);
  set_nonblocking(a, true);
  errno = 0;
  CHECK(recv(a, buf, sizeof buf, 0) == -1);
  CHECK(errno == EAGAIN);
}

TEST_CASE("unix: socketpair stream and seqpacket sanity") {
  int sv[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  Fd a(sv[0]), b(sv[1]);
  CHECK((fcntl(a, F_GETFD) & FD_CLOEXEC));
  REQUIRE(write_all(a, "unix-stream", 11) == 11);
  char buf[64];
  REQUIRE(read_exact(b, buf, 11) == 11);
  CHECK(memcmp(buf, "unix-stream", 11) == 0);
  std::vector<uint8_t> big(1 << 20), in(1 << 20);
  fill_pattern(big.data(), big.size(), 0, 81);
  std::thread t([&] { write_all(b, big.data(), big.size()); });
  CHECK(read_exact(a, in.data(), in.size()) == in.size());
  t.join();
  CHECK(check_pattern(in.data(), in.size(), 0, 81) == in.size());
  REQUIRE(shutdown(a, SHUT_WR) == 0);
  bool eof = false;
  read_to_eof(b, nullptr, &eof);
  CHECK(eof);

  REQUIRE(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0);
  Fd c(sv[0]), d(sv[1]);
  REQUIRE(send(c, "rec1", 4, 0) == 4);
  REQUIRE(send(c, "record2", 7, 0) == 7);
  REQUIRE(wait_readable(d));
  CHECK(recv(d, buf, sizeof buf, 0) == 4);
  CHECK(recv(d, buf, sizeof buf, 0) == 7);
  CHECK(memcmp(buf, "record2", 7) == 0);
  // Closing one end: EOF on the other.
  REQUIRE(c.reset() == 0);
  CHECK(recv(d, buf, sizeof buf, 0) == 0);

  // A bound UNIX listener in /tmp (abstract namespace: no file on 9p).
  Fd l(socket(AF_UNIX, SOCK_STREAM, 0));
  sockaddr_un ua{};
  ua.sun_family = AF_UNIX;
  snprintf(ua.sun_path + 1, sizeof ua.sun_path - 1, "rsock-conf-%d", getpid());
  socklen_t ulen = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + strlen(ua.sun_path + 1));
  REQUIRE(bind(l, reinterpret_cast<sockaddr*>(&ua), ulen) == 0);
  REQUIRE(listen(l, 4) == 0);
  Fd cl(socket(AF_UNIX, SOCK_STREAM, 0));
  REQUIRE(connect(cl, reinterpret_cast<sockaddr*>(&ua), ulen) == 0);
  Fd sv2(accept(l, nullptr, nullptr));
  REQUIRE(sv2 >= 0);
  REQUIRE(write_all(cl, "abstract", 8) == 8);
  CHECK(read_exact(sv2, buf, 8) == 8);
  CHECK(memcmp(buf, "abstract", 8) == 0);
}

// SOL_RSOCK RSOCK_BYTES (preload/librsock.h): under librsock, every byte
// written and read is counted on exactly one transport; without it the
// kernel refuses the unknown level (and the case checks nothing more). Over
// rxe (connected_pair waits for the upgrade) most of it went over RDMA.
TEST_CASE("SOL_RSOCK: RSOCK_BYTES counts every byte once, per transport") {
  Pair p = connected_pair();
  static char buf[200000];
  fill_pattern(buf, sizeof buf, 0, 3);
  std::thread w([&] { CHECK(write_all(p.client, buf, sizeof buf) == sizeof buf); });
  std::string got;
  got.resize(sizeof buf);
  CHECK(read_exact(p.server, got.data(), got.size()) == got.size());
  w.join();
  rsock_bytes c{}, s{};
  socklen_t cl = sizeof c, sl = sizeof s;
  int rc = getsockopt(p.client, SOL_RSOCK, RSOCK_BYTES, &c, &cl);
  int rs = getsockopt(p.server, SOL_RSOCK, RSOCK_BYTES, &s, &sl);
  CHECK(rc == rs);
  if (rc != 0) return;  // no librsock
  CHECK(cl == sizeof c);
  CHECK(c.tcp_tx + c.rdma_tx == sizeof buf);
  CHECK(c.tcp_rx + c.rdma_rx == 0);
  CHECK(s.tcp_rx + s.rdma_rx == sizeof buf);
  CHECK(s.tcp_tx + s.rdma_tx == 0);
  if (expect_rdma()) CHECK(c.rdma_tx > sizeof buf / 2);
  socklen_t small = sizeof(int);
  CHECK(getsockopt(p.client, SOL_RSOCK, RSOCK_BYTES, &c, &small) == -1);
  CHECK(errno == EINVAL);
}
