// Data path: partial reads/writes, recv flags, scatter/gather, fortified
// entry points.
#include <doctest/doctest.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "helpers.h"

using namespace conf;

TEST_CASE("io: nonblocking write until EAGAIN, then drain exactly what was accepted") {
  Pair p = connected_pair();
  set_nonblocking(p.client, true);
  std::vector<uint8_t> chunk(65536 + 13);  // odd size: forces partial writes
  uint64_t written = 0;
  bool saw_eagain = false;
  const uint64_t kCap = 512ull << 20;  // no buffer is this large; bounded loop
  while (written < kCap) {
    fill_pattern(chunk.data(), chunk.size(), written, 1);
    ssize_t r = write(p.client, chunk.data(), chunk.size());
    if (r < 0) {
      REQUIRE_MESSAGE(errno == EAGAIN, errno_str(errno));
      // Buffers may still be draining into the peer: only stop once a short
      // poll confirms the socket really is not writable.
      if (!(poll_one(p.client, POLLOUT, 100) & POLLOUT)) {
        saw_eagain = true;
        break;
      }
      continue;
    }
    REQUIRE(r > 0);
    REQUIRE(static_cast<size_t>(r) <= chunk.size());
    written += static_cast<uint64_t>(r);
  }
  REQUIRE(saw_eagain);
  CHECK(written > 0);
  // (No second write here: POLLOUT needs a third of the send buffer free,
  // while write() succeeds with any space, so a retry may legitimately work.)

  // Drain with small reads: the peer gets exactly the accepted bytes, in order.
  std::vector<uint8_t> buf(4093);
  uint64_t got = 0;
  while (got < written) {
    REQUIRE(wait_readable(p.server));
    ssize_t r = read(p.server, buf.data(), buf.size());
    REQUIRE(r > 0);
    size_t bad = check_pattern(buf.data(), static_cast<size_t>(r), got, 1);
    REQUIRE_MESSAGE(bad == static_cast<size_t>(r), "mismatch at offset " << got + bad);
    got += static_cast<uint64_t>(r);
  }
  CHECK(got == written);
  // No extra bytes.
  CHECK(poll_one(p.server, POLLIN, 50) == 0);
  // Writable again once drained.
  CHECK(wait_writable(p.client));
  CHECK(write(p.client, "x", 1) == 1);
}

TEST_CASE("io: read returns what is available, not the full request") {
  Pair p = connected_pair();
  REQUIRE(write(p.client, "0123456789", 10) == 10);
  REQUIRE(wait_readable(p.server));
  char buf[1000];
  // Allow the 10 bytes to arrive in pieces, but never more than 10.
  size_t got = 0;
  while (got < 10) {
    ssize_t r = read(p.server, buf + got, sizeof buf - got);
    REQUIRE(r > 0);
    got += static_cast<size_t>(r);
    if (got < 10) REQUIRE(wait_readable(p.server));
  }
  CHECK(got == 10);
  CHECK(memcmp(buf, "0123456789", 10) == 0);
  // A short buffer gets a partial read; the rest stays queued.
  REQUIRE(write(p.client, "abcdef", 6) == 6);
  REQUIRE(read_exact(p.server, buf, 2) == 2);
  CHECK(memcmp(buf, "ab", 2) == 0);
  REQUIRE(read_exact(p.server, buf, 4) == 4);
  CHECK(memcmp(buf, "cdef", 4) == 0);
  // Zero-length read on a socket with nothing queued returns 0 at once.
  CHECK(read(p.server, buf, 0) == 0);
}

TEST_CASE("io: MSG_PEEK leaves data queued") {
  Pair p = connected_pair();
  REQUIRE(write(p.client, "peekaboo", 8) == 8);
  // Wait until all 8 bytes are peekable.
  char buf[16] = {};
  int64_t deadline = now_ms() + timeout_ms();
  ssize_t r = 0;
  while (now_ms() < deadline) {
    REQUIRE(wait_readable(p.server));
    r = recv(p.server, buf, sizeof buf, MSG_PEEK);
    REQUIRE(r > 0);
    if (r == 8) break;
    usleep(1000);
  }
  REQUIRE(r == 8);
  CHECK(memcmp(buf, "peekaboo", 8) == 0);
  // Peeking again sees the same bytes; a short peek sees the prefix.
  memset(buf, 0, sizeof buf);
  CHECK(recv(p.server, buf, 4, MSG_PEEK) == 4);
  CHECK(memcmp(buf, "peek", 4) == 0);
  // Non-blocking peek also works and does not consume.
  CHECK(recv(p.server, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT) == 8);
  // Now a real read consumes exactly those bytes.
  memset(buf, 0, sizeof buf);
  CHECK(recv(p.server, buf, 3, 0) == 3);
  CHECK(memcmp(buf, "pee", 3) == 0);
  CHECK(recv(p.server, buf, sizeof buf, MSG_PEEK) == 5);
  CHECK(memcmp(buf, "kaboo", 5) == 0);
  CHECK(recv(p.server, buf, sizeof buf, 0) == 5);
  CHECK(recv(p.server, buf, sizeof buf, MSG_DONTWAIT) == -1);
  CHECK(errno == EAGAIN);
}

TEST_CASE("io: MSG_WAITALL waits for the whole request across several sends") {
  Pair p = connected_pair();
  const size_t kTotal = 3 * 100000 + 7;
  std::vector<uint8_t> out(kTotal);
  fill_pattern(out.data(), out.size(), 0, 7);
  std::thread sender([&] {
    size_t off = 0;
    const size_t parts[] = {1, 100000, 100000, 100000, 6};
    for (size_t n : parts) {
      usleep(20000);  // separate arrivals
      if (write_all(p.client, out.data() + off, n) != n) return;
      off += n;
    }
  });
  std::vector<uint8_t> in(kTotal);
  ssize_t r = recv(p.server, in.data(), in.size(), MSG_WAITALL);
  sender.join();
  CHECK(r == static_cast<ssize_t>(kTotal));
  CHECK(check_pattern(in.data(), in.size(), 0, 7) == kTotal);

  // MSG_WAITALL stops short at EOF and returns what it has.
  REQUIRE(write(p.client, "tail", 4) == 4);
  REQUIRE(shutdown(p.client, SHUT_WR) == 0);
  char buf[64];
  CHECK(recv(p.server, buf, sizeof buf, MSG_WAITALL) == 4);
  CHECK(memcmp(buf, "tail", 4) == 0);
  CHECK(recv(p.server, buf, sizeof buf, MSG_WAITALL) == 0);
}

TEST_CASE("io: MSG_DONTWAIT on a blocking socket") {
  Pair p = connected_pair();
  char buf[32];
  errno = 0;
  int64_t t0 = now_ms();
  CHECK(recv(p.server, buf, sizeof buf, MSG_DONTWAIT) == -1);
  CHECK(errno == EAGAIN);
  CHECK(now_ms() - t0 < 1000);
  CHECK_FALSE(is_nonblocking(p.server));  // the flag is per call only
  REQUIRE(send(p.client, "dw", 2, MSG_DONTWAIT) == 2);
  REQUIRE(wait_readable(p.server));
  CHECK(read_exact(p.server, buf, 2) == 2);
  CHECK(memcmp(buf, "dw", 2) == 0);
  // send(MSG_DONTWAIT) on a full socket is EAGAIN even though it is blocking.
  std::vector<char> big(1 << 20, 'z');
  bool eagain = false;
  for (int i = 0; i < 2048 && !eagain; ++i) {
    ssize_t r = send(p.client, big.data(), big.size(), MSG_DONTWAIT);
    if (r < 0) {
      REQUIRE(errno == EAGAIN);
      eagain = poll_one(p.client, POLLOUT, 100) == 0;
    }
  }
  CHECK(eagain);
}

namespace {
// 64 iovecs of odd, varying sizes (1..131 bytes, some of them 0).
std::vector<size_t> odd_sizes(size_t n) {
  std::vector<size_t> s(n);
  for (size_t i = 0; i < n; ++i) s[i] = (i * 37 + 11) % 131 + (i % 9 == 4 ? 0 : 1);
  s[5] = 0;
  return s;
}
std::vector<iovec> make_iov(std::vector<uint8_t>& buf, const std::vector<size_t>& sizes) {
  std::vector<iovec> iov;
  size_t off = 0;
  for (size_t s : sizes) {
    iov.push_back({buf.data() + off, s});
    off += s;
  }
  return iov;
}
size_t sum(const std::vector<size_t>& v) {
  size_t t = 0;
  for (size_t x : v) t += x;
  return t;
}
}  // namespace

TEST_CASE("io: writev/readv with 64 odd-sized iovecs") {
  Pair p = connected_pair();
  auto sizes = odd_sizes(64);
  size_t total = sum(sizes);
  std::vector<uint8_t> src(total), dst(total);
  fill_pattern(src.data(), total, 0, 11);
  auto wiov = make_iov(src, sizes);
  CHECK(writev(p.client, wiov.data(), static_cast<int>(wiov.size())) == static_cast<ssize_t>(total));

  // readv may return partially: advance through the iovec array until done.
  auto rsizes = odd_sizes(64);
  std::reverse(rsizes.begin(), rsizes.end());  // different split than the writer
  auto riov = make_iov(dst, rsizes);
  size_t got = 0, first = 0;
  while (got < total) {
    REQUIRE(wait_readable(p.server));
    ssize_t r = readv(p.server, riov.data() + first, static_cast<int>(riov.size() - first));
    REQUIRE(r > 0);
    got += static_cast<size_t>(r);
    size_t left = static_cast<size_t>(r);
    while (left > 0 && first < riov.size()) {
      size_t take = std::min(left, riov[first].iov_len);
      riov[first].iov_base = static_cast<uint8_t*>(riov[first].iov_base) + take;
      riov[first].iov_len -= take;
      left -= take;
      if (riov[first].iov_len == 0) ++first;
    }
  }
  CHECK(got == total);
  CHECK(check_pattern(dst.data(), total, 0, 11) == total);
}

TEST_CASE("io: sendmsg/recvmsg with 64 iovecs and MSG_WAITALL") {
  Pair p = connected_pair();
  auto sizes = odd_sizes(64);
  size_t total = sum(sizes);
  std::vector<uint8_t> src(total), dst(total);
  fill_pattern(src.data(), total, 0, 12);
  auto wiov = make_iov(src, sizes);
  msghdr wm{};
  wm.msg_iov = wiov.data();
  wm.msg_iovlen = wiov.size();
  CHECK(sendmsg(p.client, &wm, 0) == static_cast<ssize_t>(total));

  auto rsizes = odd_sizes(64);
  std::rotate(rsizes.begin(), rsizes.begin() + 17, rsizes.end());
  auto riov = make_iov(dst, rsizes);
  msghdr rm{};
  rm.msg_iov = riov.data();
  rm.msg_iovlen = riov.size();
  CHECK(recvmsg(p.server, &rm, MSG_WAITALL) == static_cast<ssize_t>(total));
  CHECK(rm.msg_flags == 0);
  CHECK(check_pattern(dst.data(), total, 0, 12) == total);

  // recvmsg with MSG_PEEK across iovecs, then a consuming recvmsg.
  const char msg[] = "scatter-gather-peek";
  REQUIRE(write_all(p.client, msg, sizeof msg - 1) == sizeof msg - 1);
  char a[5], b[7], c[64];
  iovec piov[3] = {{a, sizeof a}, {b, sizeof b}, {c, sizeof c}};
  msghdr pm{};
  pm.msg_iov = piov;
  pm.msg_iovlen = 3;
  int64_t deadline = now_ms() + timeout_ms();
  ssize_t r = 0;
  while (now_ms() < deadline) {
    REQUIRE(wait_readable(p.server));
    r = recvmsg(p.server, &pm, MSG_PEEK);
    if (r == static_cast<ssize_t>(sizeof msg - 1)) break;
    usleep(1000);
  }
  REQUIRE(r == static_cast<ssize_t>(sizeof msg - 1));
  CHECK(memcmp(a, "scatt", 5) == 0);
  CHECK(memcmp(b, "er-gath", 7) == 0);
  CHECK(memcmp(c, "er-peek", 7) == 0);
  memset(c, 0, sizeof c);
  CHECK(recvmsg(p.server, &pm, 0) == r);
  CHECK(memcmp(c, "er-peek", 7) == 0);
}

TEST_CASE("io: iovec limits: IOV_MAX works, IOV_MAX+1 is EINVAL") {
  Pair p = connected_pair();
  std::vector<uint8_t> src(IOV_MAX + 1);
  fill_pattern(src.data(), src.size(), 0, 13);
  std::vector<iovec> iov(IOV_MAX + 1);
  for (size_t i = 0; i < iov.size(); ++i) iov[i] = {src.data() + i, 1};
  errno = 0;
  CHECK(writev(p.client, iov.data(), IOV_MAX + 1) == -1);
  CHECK(errno == EINVAL);
  CHECK(writev(p.client, iov.data(), IOV_MAX) == IOV_MAX);
  std::vector<uint8_t> dst(IOV_MAX);
  REQUIRE(read_exact(p.server, dst.data(), dst.size()) == dst.size());
  CHECK(check_pattern(dst.data(), dst.size(), 0, 13) == dst.size());
  // Zero iovecs: nothing sent, returns 0.
  CHECK(writev(p.client, iov.data(), 0) == 0);
  CHECK(poll_one(p.server, POLLIN, 50) == 0);
}

TEST_CASE("io: fortified read/recv/recvfrom/poll (__*_chk entry points)") {
  // Built with -O2 -D_FORTIFY_SOURCE=2: with fixed-size destinations and
  // lengths the compiler cannot prove, glibc routes these calls through
  // __read_chk, __recv_chk, __recvfrom_chk and __poll_chk
  // (check_fortify.sh verifies the binary references them).
  Pair p = connected_pair();
  char buf[64];
  REQUIRE(write_all(p.client, "fortify-read", 12) == 12);
  REQUIRE(wait_readable(p.server));
  size_t n = opaque<size_t>(12);
  CHECK(read_exact(p.server, buf, 0) == 0);  // keeps helper in play
  ssize_t r = read(p.server, buf, n);
  if (r > 0 && r < 12) r += read_exact(p.server, buf + r, static_cast<size_t>(12 - r));
  CHECK(r == 12);
  CHECK(memcmp(buf, "fortify-read", 12) == 0);

  REQUIRE(write_all(p.client, "fortify-recv", 12) == 12);
  pollfd pfd[2] = {{p.server, POLLIN, 0}, {p.client, POLLOUT, 0}};
  nfds_t nfds = opaque<nfds_t>(2);
  CHECK(poll(pfd, nfds, timeout_ms()) == 2);
  CHECK((pfd[0].revents & POLLIN));
  CHECK((pfd[1].revents & POLLOUT));
  char rbuf[64];
  CHECK(recv(p.server, rbuf, opaque<size_t>(12), MSG_WAITALL) == 12);
  CHECK(memcmp(rbuf, "fortify-recv", 12) == 0);

  REQUIRE(write_all(p.client, "fortify-from", 12) == 12);
  char fbuf[64];
  sockaddr_storage from{};
  socklen_t flen = sizeof from;
  REQUIRE(wait_readable(p.server));
  CHECK(recvfrom(p.server, fbuf, opaque<size_t>(12), MSG_WAITALL, reinterpret_cast<sockaddr*>(&from),
                 &flen) == 12);
  CHECK(memcmp(fbuf, "fortify-from", 12) == 0);

  // Nonblocking, nothing queued: the _chk variants report EAGAIN like the plain ones.
  set_nonblocking(p.server, true);
  errno = 0;
  CHECK(read(p.server, buf, opaque<size_t>(sizeof buf)) == -1);
  CHECK(errno == EAGAIN);
  errno = 0;
  CHECK(recv(p.server, rbuf, opaque<size_t>(sizeof rbuf), 0) == -1);
  CHECK(errno == EAGAIN);
  errno = 0;
  CHECK(recvfrom(p.server, fbuf, opaque<size_t>(sizeof fbuf), 0, nullptr, nullptr) == -1);
  CHECK(errno == EAGAIN);
  pfd[0].revents = 0;
  CHECK(poll(pfd, opaque<nfds_t>(1), 0) == 0);
}
