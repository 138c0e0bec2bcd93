// config/: grammar, precedence, rule matching, error positions.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "config/config.h"
#include "config/keys.h"

using namespace rsock::config;

namespace {

const Identity kRedis{"redis-server", "redis-server", ""};

Config parse_ok(std::string_view text, const Identity& who = kRedis) {
  ParseError err;
  auto r = parse(text, "t.conf", who, &err);
  INFO("error: ", err.to_string());
  REQUIRE(r.ok());
  return *r;
}

std::string parse_err(std::string_view text, const Identity& who = kRedis) {
  ParseError err;
  auto r = parse(text, "t.conf", who, &err);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error() == EINVAL);
  return err.to_string();
}

sockaddr_storage v4(const char* ip, uint16_t port) {
  sockaddr_storage ss{};
  auto* in = reinterpret_cast<sockaddr_in*>(&ss);
  in->sin_family = AF_INET;
  in->sin_port = htons(port);
  REQUIRE(inet_pton(AF_INET, ip, &in->sin_addr) == 1);
  return ss;
}

sockaddr_storage v6(const char* ip, uint16_t port) {
  sockaddr_storage ss{};
  auto* in = reinterpret_cast<sockaddr_in6*>(&ss);
  in->sin6_family = AF_INET6;
  in->sin6_port = htons(port);
  REQUIRE(inet_pton(AF_INET6, ip, &in->sin6_addr) == 1);
  return ss;
}

Action decide(const Config& c, Direction d, const sockaddr_storage& ss) {
  return c.decide(d, reinterpret_cast<const sockaddr*>(&ss));
}

std::map<std::string, std::string> g_env;
const char* fake_getenv(const char* name) {
  auto it = g_env.find(name);
  return it == g_env.end() ? nullptr : it->second.c_str();
}

}  // namespace

TEST_CASE("config: empty file gives defaults") {
  Config c = parse_ok("");
  Config d;
  CHECK(c.tunables.ring_bytes == d.tunables.ring_bytes);
  CHECK(c.default_action == Action::kRdma);
  CHECK(c.rules.empty());
  CHECK_FALSE(c.passthrough);
  CHECK(describe_non_defaults(c) == "all defaults");
  CHECK(decide(c, Direction::kClient, v4("10.1.2.3", 80)) == Action::kRdma);
}

TEST_CASE("config: settings, suffixes, comments") {
  Config c = parse_ok(
      "# comment\n"
      "ring_bytes = 1M   # trailing comment\n"
      "inline_threshold=128\n"
      "\tspin_us = 0\r\n"
      "stats = off\n"
      "log_level = debug\n"
      "log_file = /tmp/rsock %p.log\n"
      "port_offset = 1000\n"
      "default = tcp\n");
  CHECK(c.tunables.ring_bytes == 1024 * 1024);
  CHECK(c.tunables.inline_threshold == 128);
  CHECK(c.tunables.spin_us == 0);
  CHECK_FALSE(c.tunables.stats);
  CHECK(c.log.level == rsock::log::Level::kDebug);
  CHECK(c.log.file == "/tmp/rsock %p.log");
  CHECK(c.default_action == Action::kTcp);
  CHECK(parse_ok("ring_bytes = 64k\n").tunables.ring_bytes == 64 * 1024);
  CHECK(parse_ok("ring_bytes = 4096\n").tunables.ring_bytes == 4096);
  CHECK(parse_ok("inline_threshold = 1K\n").tunables.inline_threshold == 1024);
  std::string d = describe_non_defaults(c);
  CHECK(d.find("ring_bytes=1M") != std::string::npos);
  CHECK(d.find("stats=off") != std::string::npos);
  CHECK(d.find("default=tcp") != std::string::npos);
  CHECK(d.find("connect_timeout_ms") == std::string::npos);
}

TEST_CASE("config: environment beats file") {
  Config c = parse_ok("ring_bytes = 1M\nlog_level = info\n");
  g_env = {{"RSOCK_RING_BYTES", "2M"}, {"RSOCK_STATS", "no"}, {"RSOCK_DEFAULT", "tcp"}};
  ParseError err;
  REQUIRE(apply_env(&c, fake_getenv, &err).ok());
  CHECK(c.tunables.ring_bytes == 2 * 1024 * 1024);
  CHECK_FALSE(c.tunables.stats);
  CHECK(c.default_action == Action::kTcp);
  CHECK(c.log.level == rsock::log::Level::kInfo);  // untouched by env

  g_env = {{"RSOCK_SPIN_US", "12x"}};
  CHECK_FALSE(apply_env(&c, fake_getenv, &err).ok());
  CHECK(err.to_string() ==
        "$RSOCK_SPIN_US:1:1: bad number \"12x\" for spin_us (expected digits)");
  g_env.clear();
}

TEST_CASE("config: glob") {
  CHECK(glob_match("redis-server*", "redis-server"));
  CHECK(glob_match("redis-*", "redis-server"));
  CHECK(glob_match("*", ""));
  CHECK(glob_match("?ginx", "nginx"));
  CHECK(glob_match("[mn]ginx", "nginx"));
  CHECK_FALSE(glob_match("[!n]ginx", "nginx"));
  CHECK(glob_match("a*b*c", "axxbyyc"));
  CHECK_FALSE(glob_match("a*b*c", "axxbyy"));
  CHECK_FALSE(glob_match("redis", "redis-server"));
  CHECK(glob_match("x[", "x["));
}

TEST_CASE("config: sections pick the first matching program") {
  const char* text =
      "ring_bytes = 512K\n"
      "tcp client 127.0.0.0/8\n"
      "[app nginx]\n"
      "ring_bytes = 8M\n"
      "[app redis-*]\n"
      "ring_bytes = 1M\n"
      "tcp server *:6379\n"
      "[app redis-server]\n"
      "ring_bytes = 2M\n";
  Config c = parse_ok(text);
  CHECK(c.tunables.ring_bytes == 1024 * 1024);
  CHECK(c.section == "[app redis-*]");
  CHECK(c.section_line == 5);
  REQUIRE(c.rules.size() == 2);  // section rule, then global rule
  CHECK(c.rules[0].line == 7);
  CHECK(c.rules[1].line == 2);
  Config other = parse_ok(text, Identity{"python3", "myapp", ""});
  CHECK(other.tunables.ring_bytes == 512 * 1024);
  CHECK(other.section.empty());
  CHECK(other.rules.size() == 1);
  // argv0 matches too (interpreters)
  Config byname = parse_ok(text, Identity{"nginx-1.24", "nginx", ""});
  CHECK(byname.tunables.ring_bytes == 8 * 1024 * 1024);
}

TEST_CASE("config: application id") {
  const char* text =
      "[app * id=front*]\n"
      "default = tcp\n"
      "[app *]\n"
      "inline_threshold = 0\n";
  CHECK(parse_ok(text, Identity{"a", "a", "frontend"}).default_action == Action::kTcp);
  Config no_id = parse_ok(text, Identity{"a", "a", ""});
  CHECK(no_id.default_action == Action::kRdma);
  CHECK(no_id.tunables.inline_threshold == 0);
  CHECK(parse_ok(text, Identity{"a", "a", "backend"}).default_action == Action::kRdma);
}

TEST_CASE("config: section default hides global rules") {
  const char* text =
      "rdma client 10.0.0.0/8\n"
      "default = tcp\n"
      "[app redis-server]\n"
      "rdma server *:6379\n"
      "default = tcp\n";
  Config c = parse_ok(text);
  CHECK(c.rules.size() == 1);
  CHECK(decide(c, Direction::kClient, v4("10.0.0.1", 1)) == Action::kTcp);
  CHECK(decide(c, Direction::kServer, v4("0.0.0.0", 6379)) == Action::kRdma);
  Config g = parse_ok(text, Identity{"x", "x", ""});
  CHECK(decide(g, Direction::kClient, v4("10.0.0.1", 1)) == Action::kRdma);
  CHECK(decide(g, Direction::kClient, v4("11.0.0.1", 1)) == Action::kTcp);
}

TEST_CASE("config: rules - direction, CIDR, ports, first match") {
  Config c = parse_ok(
      "default = tcp\n"
      "tcp client 10.1.0.0/16:22\n"
      "rdma client 10.0.0.0/8:1000-2000\n"
      "rdma client 10.0.0.0/8:5000-*\n"
      "rdma server *:6379\n"
      "rdma any [fd00::/8]:443\n"
      "tcp client 2001:db8::/32\n"
      "rdma client ::/0\n"
      "rdma any 192.168.7.5\n");
  auto cl = Direction::kClient;
  auto sv = Direction::kServer;
  CHECK(decide(c, cl, v4("10.1.2.3", 22)) == Action::kTcp);
  CHECK(decide(c, cl, v4("10.1.2.3", 1500)) == Action::kRdma);
  CHECK(decide(c, cl, v4("10.255.0.1", 2000)) == Action::kRdma);
  CHECK(decide(c, cl, v4("10.255.0.1", 2001)) == Action::kTcp);
  CHECK(decide(c, cl, v4("10.255.0.1", 65535)) == Action::kRdma);
  CHECK(decide(c, cl, v4("11.0.0.1", 1500)) == Action::kTcp);
  CHECK(decide(c, sv, v4("10.1.2.3", 1500)) == Action::kTcp);     // client-only rule
  CHECK(decide(c, sv, v4("0.0.0.0", 6379)) == Action::kRdma);
  CHECK(decide(c, sv, v6("::", 6379)) == Action::kRdma);          // * covers both families
  CHECK(decide(c, cl, v4("1.2.3.4", 6379)) == Action::kTcp);      // server-only rule
  CHECK(decide(c, sv, v6("fd12::1", 443)) == Action::kRdma);
  CHECK(decide(c, sv, v6("fe80::1", 443)) == Action::kTcp);
  CHECK(decide(c, cl, v6("2001:db8::5", 80)) == Action::kTcp);
  CHECK(decide(c, cl, v6("2001:db9::5", 80)) == Action::kRdma);
  CHECK(decide(c, cl, v4("192.168.7.5", 9)) == Action::kRdma);
  CHECK(decide(c, sv, v4("192.168.7.5", 9)) == Action::kRdma);
  CHECK(decide(c, cl, v4("192.168.7.6", 9)) == Action::kTcp);
  // IPv4-mapped IPv6 matches IPv4 rules, not ::/0
  CHECK(decide(c, cl, v6("::ffff:10.1.2.3", 22)) == Action::kTcp);
  CHECK(decide(c, cl, v6("::ffff:10.1.2.3", 1500)) == Action::kRdma);
  // non-IP and null never go RDMA
  sockaddr un{};
  un.sa_family = AF_UNIX;
  CHECK(c.decide(cl, &un) == Action::kTcp);
  CHECK(c.decide(cl, nullptr) == Action::kTcp);
}

TEST_CASE("config: odd prefixes") {
  Config c = parse_ok("default = tcp\nrdma client 10.128.0.0/9\nrdma client 1.2.3.4/0:7\n");
  CHECK(decide(c, Direction::kClient, v4("10.200.0.1", 1)) == Action::kRdma);
  CHECK(decide(c, Direction::kClient, v4("10.100.0.1", 1)) == Action::kTcp);
  CHECK(decide(c, Direction::kClient, v4("99.1.1.1", 7)) == Action::kRdma);
}

TEST_CASE("config: passthrough always says tcp") {
  Config c = parse_ok("rdma any *\n");
  c.passthrough = true;
  CHECK(decide(c, Direction::kClient, v4("10.0.0.1", 1)) == Action::kTcp);
}

TEST_CASE("config: errors carry line and column") {
  CHECK(parse_err("ring_bytes = 1M\nrign_bytes = 2M\n") == "t.conf:2:1: unknown key \"rign_bytes\"");
  CHECK(parse_err("ring_bytes = 12Q\n") ==
        "t.conf:1:14: bad number \"12Q\" for ring_bytes (expected digits with an optional K, M or G suffix)");
  CHECK(parse_err("  ring_bytes = 3000\n") ==
        "t.conf:1:16: ring_bytes = 3000 is out of range: must be a power of two from 4K to 256M");
  CHECK(parse_err("spin_us = 99999999999999999999999\n").find("t.conf:1:11: bad number") == 0);
  CHECK(parse_err("connect_timeout_ms = 0\n") ==
        "t.conf:1:22: connect_timeout_ms = 0 is out of range: must be from 1 to 600000");
  CHECK(parse_err("stats = maybe\n") == "t.conf:1:9: bad value \"maybe\" for stats (expected on or off)");
  CHECK(parse_err("log_level = loud\n").find("t.conf:1:13: bad log_level") == 0);
  CHECK(parse_err("ring_bytes =\n") == "t.conf:1:13: missing value for ring_bytes");
  CHECK(parse_err("ring_bytes 1M\n") == "t.conf:1:12: expected \"=\" after ring_bytes");
  CHECK(parse_err("spin_us = 1 2\n") == "t.conf:1:13: unexpected \"2\" after the value");
  CHECK(parse_err("spin_us = 1\nspin_us = 2\n") == "t.conf:2:1: spin_us is already set on line 1");
  CHECK(parse_err("rdma client 10.0.0.0/33\n") ==
        "t.conf:1:22: prefix length 33 is too long for IPv4 (at most 32)");
  CHECK(parse_err("rdma client [fd00::/129]\n") ==
        "t.conf:1:21: prefix length 129 is too long for IPv6 (at most 128)");
  CHECK(parse_err("rdma client 10.0.0.300\n") == "t.conf:1:13: bad IPv4 address \"10.0.0.300\"");
  CHECK(parse_err("rdma client db.example.com:5432\n") ==
        "t.conf:1:13: bad IPv4 address \"db.example.com\" (host names are not resolved; write an address)");
  CHECK(parse_err("tcp server *:70000\n") == "t.conf:1:14: port 70000 is out of range (0-65535)");
  CHECK(parse_err("tcp server *:90-80\n") == "t.conf:1:14: port range 90-80 is reversed");
  CHECK(parse_err("tcp server *:http\n") ==
        "t.conf:1:14: bad port \"http\" (expected a number, N-M or *)");
  CHECK(parse_err("tcp server *:\n") == "t.conf:1:14: missing port after \":\" (use * for any port)");
  CHECK(parse_err("tcp sever *\n") == "t.conf:1:5: bad direction \"sever\" (expected server, client or any)");
  CHECK(parse_err("tcp server\n").find("t.conf:1:11: missing address") == 0);
  CHECK(parse_err("tcp server * extra\n") == "t.conf:1:14: unexpected \"extra\" after the address");
  CHECK(parse_err("rdma client [10.0.0.1]:80\n").find("t.conf:1:14: bad IPv6 address") == 0);
  CHECK(parse_err("\n\n[app redis\n") == "t.conf:3:11: missing \"]\" at the end of the section header");
  CHECK(parse_err("[global]\n").find("t.conf:1:2: unknown section") == 0);
  CHECK(parse_err("[app]\n").find("t.conf:1:5: [app] needs a program name pattern") == 0);
  CHECK(parse_err("[app x user=y]\n") ==
        "t.conf:1:8: unexpected \"user=y\" in section header (expected id=PATTERN)");
  CHECK(parse_err("use tcp_server *\n").find("t.conf:1:1: expected \"key = value\"") == 0);
  // A mistake in a section that does not match this program is still an error.
  CHECK(parse_err("[app nginx]\nring_bytes = 5\n").find("t.conf:2:14: ring_bytes = 5 is out of range") == 0);
}

TEST_CASE("config: every Tunables field has a key") {
  // Tunables is uint32_t fields plus six bools (padded to 8 bytes). If this
  // fails, a field was added to config/tunables.h without a row in
  // config/keys.cc (and docs).
  size_t u32_keys = 0, bool_keys = 0;
  for (size_t i = 0; i < detail::kNumKeys; ++i) {
    u32_keys += detail::kKeys[i].u32 != nullptr;
    bool_keys += detail::kKeys[i].flag != nullptr;
  }
  CHECK(bool_keys == 6);
  CHECK(sizeof(Tunables) == 4 * u32_keys + 8);
  Config c = parse_ok("send_queue_depth = 4096\nrecv_slots = 4\n");
  CHECK(c.tunables.send_queue_depth == 4096);
  CHECK(c.tunables.recv_slots == 4);
  CHECK(parse_err("recv_slots = 2000\n") == "t.conf:1:14: recv_slots = 2000 is out of range: must be from 4 to 1024");
  CHECK(Tunables{}.kit_pool == 16);
  CHECK(parse_ok("kit_pool = 0\n").tunables.kit_pool == 0);
  CHECK(parse_err("kit_pool = 17\n") == "t.conf:1:12: kit_pool = 17 is out of range: must be from 0 to 16");
}

namespace {

// Runs load_for_process() with the given environment and returns what it
// wrote to stderr. Restores stderr, the variables and the log settings.
std::string load_capturing(Config* out, const std::map<std::string, std::string>& env) {
  for (auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
  char path[] = "/tmp/rsock-unit-stderr.XXXXXX";
  int cap = mkstemp(path);
  REQUIRE(cap >= 0);
  int saved = dup(2);
  dup2(cap, 2);
  *out = load_for_process();
  dup2(saved, 2);
  close(saved);
  rsock::log::set_level(rsock::log::Level::kWarn);
  rsock::log::set_fd(2);
  for (auto& [k, v] : env) unsetenv(k.c_str());
  std::string text;
  char buf[1024];
  ssize_t n;
  lseek(cap, 0, SEEK_SET);
  while ((n = read(cap, buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  close(cap);
  unlink(path);
  return text;
}

std::string write_temp_conf(const char* text) {
  char path[] = "/tmp/rsock-unit-conf.XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, text, strlen(text)) == static_cast<ssize_t>(strlen(text)));
  close(fd);
  return path;
}

}  // namespace

TEST_CASE("config: load_for_process - file, environment, one-line errors") {
  std::string good = write_temp_conf("ring_bytes = 1M\nlog_level = info\n[app *]\ntcp client 127.0.0.0/8\n");
  Config c;
  std::string err = load_capturing(&c, {{"RSOCK_CONFIG", good}, {"RSOCK_SPIN_US", "7"}});
  CHECK_FALSE(c.passthrough);
  CHECK(c.tunables.ring_bytes == 1024 * 1024);
  CHECK(c.tunables.spin_us == 7);
  CHECK(c.section == "[app *]");
  CHECK(err.find("info: config " + good + ": ring_bytes=1M spin_us=7 log_level=info section=[app *]@3 rules=1") !=
        std::string::npos);

  std::string bad = write_temp_conf("ring_bytes = 1M\n\n[app *]\n  rdma client 10.0.0.0/33\n");
  err = load_capturing(&c, {{"RSOCK_CONFIG", bad}});
  CHECK(c.passthrough);
  CHECK(err == "librsock: " + bad + ":4:24: prefix length 33 is too long for IPv4 (at most 32); "
                                    "passing all sockets through to the kernel\n");
  sockaddr_storage ss = v4("10.0.0.1", 80);
  CHECK(c.decide(Direction::kClient, reinterpret_cast<sockaddr*>(&ss)) == Action::kTcp);

  err = load_capturing(&c, {{"RSOCK_CONFIG", good}, {"RSOCK_LOG_LEVEL", "chatty"}});
  CHECK(c.passthrough);
  CHECK(err.find("librsock: $RSOCK_LOG_LEVEL:1:1: bad log_level \"chatty\"") == 0);
  CHECK(std::count(err.begin(), err.end(), '\n') == 1);

  err = load_capturing(&c, {{"RSOCK_CONFIG", "/nonexistent/librsock.conf"}});
  CHECK(c.passthrough);
  CHECK(err == "librsock: /nonexistent/librsock.conf: cannot read: No such file or directory; "
               "passing all sockets through to the kernel\n");
  unlink(good.c_str());
  unlink(bad.c_str());
}
