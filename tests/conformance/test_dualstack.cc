// Dual-stack sockets: AF_INET6 sockets that talk IPv4 through IPv4-mapped
// addresses (::ffff:a.b.c.d), mixed with AF_INET ones. The names the kernel
// reports (mapped form included) must come back unchanged, data must flow,
// and over rxe (upgrade.conformance) every pair the kernel connects must
// reach RDMA at both ends, whatever the families.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "helpers.h"

using namespace conf;

namespace {

enum class Kind { kV4, kV6Mapped, kV6Wildcard, kV6WildcardV6Only, kV4Wildcard, kV6 };

// A real (not mapped) IPv6 address for the IPv6 cells: RSOCK_CONF_IPV6 (the
// VM's rxe netdev gets one in upgrade.conformance), else ::1.
in6_addr test_ipv6() {
  in6_addr a = in6addr_loopback;
  const char* s = getenv("RSOCK_CONF_IPV6");
  if (s && *s && inet_pton(AF_INET6, s, &a) != 1) a = in6addr_loopback;
  return a;
}

sockaddr_storage addr_of(Kind k, uint16_t port, socklen_t* len) {
  sockaddr_storage ss{};
  in_addr v4 = test_ipv4();
  if (k == Kind::kV4 || k == Kind::kV4Wildcard) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_port = htons(port);
    a->sin_addr = k == Kind::kV4 ? v4 : in_addr{htonl(INADDR_ANY)};
    *len = sizeof(sockaddr_in);
  } else {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(port);
    if (k == Kind::kV6Mapped) {
      a->sin6_addr.s6_addr[10] = a->sin6_addr.s6_addr[11] = 0xff;
      std::memcpy(&a->sin6_addr.s6_addr[12], &v4, 4);
    } else if (k == Kind::kV6) {
      a->sin6_addr = test_ipv6();
    } else {
      a->sin6_addr = in6addr_any;
    }
    *len = sizeof(sockaddr_in6);
  }
  return ss;
}

int family_of(Kind k) { return k == Kind::kV4 || k == Kind::kV4Wildcard ? AF_INET : AF_INET6; }

// "10.77.0.1:5000" or "[::ffff:10.77.0.1]:5000".
std::string name(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
    return std::string(buf) + ":" + std::to_string(ntohs(a->sin_port));
  }
  auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
  inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
  return "[" + std::string(buf) + "]:" + std::to_string(ntohs(a->sin6_port));
}

std::string sock_name(int fd, bool peer) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  int r = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len)
               : getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  REQUIRE(r == 0);
  return name(ss);
}

std::string v4_text() {
  char buf[INET_ADDRSTRLEN] = {};
  in_addr a = test_ipv4();
  inet_ntop(AF_INET, &a, buf, sizeof buf);
  return buf;
}

// One cell: a server socket of kind `srv`, a client of kind `cli` connecting
// to the server's port. Names as the kernel gives them, 256 KiB both ways.
void cell(Kind srv, Kind cli) {
  if (!ipv6_available()) return;  // no AF_INET6 at all
  Fd l(socket(family_of(srv), SOCK_STREAM, 0));
  REQUIRE(l >= 0);
  int one = 1;
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (family_of(srv) == AF_INET6) {
    int v6only = srv == Kind::kV6WildcardV6Only ? 1 : 0;
    REQUIRE(setsockopt(l, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only) == 0);
  }
  socklen_t slen;
  sockaddr_storage sa = addr_of(srv, 0, &slen);
  REQUIRE_MESSAGE(bind(l, reinterpret_cast<sockaddr*>(&sa), slen) == 0, "bind: " << errno_str(errno));
  REQUIRE(listen(l, 4) == 0);
  socklen_t got = sizeof sa;
  REQUIRE(getsockname(l, reinterpret_cast<sockaddr*>(&sa), &got) == 0);
  uint16_t port = ntohs(reinterpret_cast<sockaddr_in*>(&sa)->sin_port);  // same offset in v6
  socklen_t clen;
  sockaddr_storage ca = addr_of(cli, port, &clen);
  Pair p;
  p.client = Fd(socket(family_of(cli), SOCK_STREAM, 0));
  REQUIRE(p.client >= 0);
  int r = connect(p.client, reinterpret_cast<sockaddr*>(&ca), clen);
  if (srv == Kind::kV6WildcardV6Only && cli == Kind::kV4) {
    // The kernel connects nothing here: an IPv6-only socket takes no IPv4.
    CHECK(r == -1);
    CHECK(errno == ECONNREFUSED);
    return;
  }
  REQUIRE_MESSAGE(r == 0, "connect: " << errno_str(errno));
  REQUIRE(wait_readable(l));
  p.server = Fd(accept(l, nullptr, nullptr));
  REQUIRE(p.server >= 0);
  if (expect_rdma()) await_rdma(p);

  // Names, exactly as the kernel forms them: a socket of family AF_INET6
  // names IPv4 endpoints in the mapped form.
  std::string ip = v4_text();
  char v6[INET6_ADDRSTRLEN] = {};
  in6_addr a6 = test_ipv6();
  inet_ntop(AF_INET6, &a6, v6, sizeof v6);
  auto form = [&](Kind k, uint16_t prt) {
    if (cli == Kind::kV6) return "[" + std::string(v6) + "]:" + std::to_string(prt);
    return family_of(k) == AF_INET6 ? "[::ffff:" + ip + "]:" + std::to_string(prt)
                                    : ip + ":" + std::to_string(prt);
  };
  std::string cl = sock_name(p.client, false);
  uint16_t cport = uint16_t(std::stoi(cl.substr(cl.rfind(':') + 1)));
  CHECK(sock_name(p.client, true) == form(cli, port));
  CHECK(cl == form(cli, cport));
  CHECK(sock_name(p.server, false) == form(srv, port));
  CHECK(sock_name(p.server, true) == form(srv, cport));

  std::vector<uint8_t> out(256 * 1024), in(out.size());
  fill_pattern(out.data(), out.size(), 0, 7);
  REQUIRE(write_all(p.client, out.data(), out.size()) == out.size());
  REQUIRE(read_exact(p.server, in.data(), in.size()) == in.size());
  CHECK(check_pattern(in.data(), in.size(), 0, 7) == in.size());
  REQUIRE(write_all(p.server, in.data(), in.size()) == in.size());
  REQUIRE(read_exact(p.client, out.data(), out.size()) == out.size());
  CHECK(check_pattern(out.data(), out.size(), 0, 7) == out.size());
}

}  // namespace

TEST_CASE("dual-stack: AF_INET6 client to ::ffff:IPv4, AF_INET6 server bound to ::ffff:IPv4") {
  cell(Kind::kV6Mapped, Kind::kV6Mapped);
}
TEST_CASE("dual-stack: AF_INET client, AF_INET6 server bound to ::ffff:IPv4") {
  cell(Kind::kV6Mapped, Kind::kV4);
}
TEST_CASE("dual-stack: AF_INET6 client to ::ffff:IPv4, AF_INET server") { cell(Kind::kV4, Kind::kV6Mapped); }
TEST_CASE("dual-stack: AF_INET6 client to ::ffff:IPv4, AF_INET server on 0.0.0.0") {
  cell(Kind::kV4Wildcard, Kind::kV6Mapped);
}
TEST_CASE("dual-stack: AF_INET6 client to ::ffff:IPv4, AF_INET6 server on :: (V6ONLY off)") {
  cell(Kind::kV6Wildcard, Kind::kV6Mapped);
}
TEST_CASE("dual-stack: AF_INET client, AF_INET6 server on :: (V6ONLY off)") {
  cell(Kind::kV6Wildcard, Kind::kV4);
}
TEST_CASE("dual-stack: AF_INET client, AF_INET6 server on :: with V6ONLY: refused") {
  cell(Kind::kV6WildcardV6Only, Kind::kV4);
}
TEST_CASE("dual-stack: IPv6 client, AF_INET6 server on its IPv6 address") { cell(Kind::kV6, Kind::kV6); }
TEST_CASE("dual-stack: IPv6 client, AF_INET6 server on :: (V6ONLY off)") {
  cell(Kind::kV6Wildcard, Kind::kV6);
}
TEST_CASE("dual-stack: IPv6 client, AF_INET6 server on :: with V6ONLY") {
  cell(Kind::kV6WildcardV6Only, Kind::kV6);
}
