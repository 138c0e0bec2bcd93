// libFuzzer target for the librsock.conf parser (config/parse.cc).
// Any input must either parse, giving rules decide() can walk, or fail with a
// position that lies inside the input. Crashes, leaks, UB and hangs are bugs.
// Build and run: tests/fuzz/run (outside CMake; needs clang + libclang-rt-dev).
#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdint>
#include <cstring>
#include <string_view>

#include "config/config.h"

using namespace rsock::config;

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

void decide_some(const Config& c) {
  sockaddr_in in{};
  in.sin_family = AF_INET;
  sockaddr_in6 in6{};
  in6.sin6_family = AF_INET6;
  const char* v4[] = {"0.0.0.0", "10.0.0.1", "127.0.0.1", "255.255.255.255"};
  const char* v6[] = {"::", "::1", "fd00::1", "::ffff:10.0.0.1"};
  for (uint16_t port : {0, 22, 6379, 65535}) {
    for (const char* a : v4) {
      inet_pton(AF_INET, a, &in.sin_addr);
      in.sin_port = htons(port);
      for (Direction d : {Direction::kServer, Direction::kClient})
        (void)c.decide(d, reinterpret_cast<sockaddr*>(&in));
    }
    for (const char* a : v6) {
      inet_pton(AF_INET6, a, &in6.sin6_addr);
      in6.sin6_port = htons(port);
      for (Direction d : {Direction::kServer, Direction::kClient})
        (void)c.decide(d, reinterpret_cast<sockaddr*>(&in6));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  for (const Identity& who : {Identity{"redis-server", "redis-server", "frontend"}, Identity{"", "", ""}}) {
    ParseError err;
    auto r = parse(text, "fuzz.conf", who, &err);
    if (r.ok()) {
      for (const Rule& rule : r->rules) {
        check(rule.port_lo <= rule.port_hi);
        check(rule.directions >= 1 && rule.directions <= 3);
        check(rule.prefix_len <= (rule.family == AF_INET ? 32 : 128));
      }
      check(r->tunables.ring_bytes >= 4096 && (r->tunables.ring_bytes & (r->tunables.ring_bytes - 1)) == 0);
      decide_some(*r);
      check(!describe_non_defaults(*r).empty());
    } else {
      check(r.error() == EINVAL);
      check(err.line >= 1 && err.column >= 1 && !err.what.empty());
      // The line exists, and the column is within it (or just past its end).
      size_t line_start = 0;
      for (uint32_t l = 1; l < err.line; ++l) {
        size_t nl = text.find('\n', line_start);
        check(nl != std::string_view::npos);
        line_start = nl + 1;
      }
      size_t nl = text.find('\n', line_start);
      size_t line_len = (nl == std::string_view::npos ? text.size() : nl) - line_start;
      check(err.column <= line_len + 1);
      check(!err.to_string().empty());
    }
  }
  return 0;
}
