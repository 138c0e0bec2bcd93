// Per-socket decisions (hot enough to matter: every connect/accept) and the
// small helpers around them. Nothing here allocates except describe/to_string.
#include <netinet/in.h>

#include <cstring>

#include "config/config.h"
#include "config/keys.h"

namespace rsock::config {

const char* action_name(Action a) { return a == Action::kRdma ? "rdma" : "tcp"; }
const char* direction_name(Direction d) { return d == Direction::kServer ? "server" : "client"; }

bool glob_match(std::string_view pattern, std::string_view text) {
  // Iterative matcher with single-star backtracking: linear in practice and
  // never recursive, so a hostile pattern cannot blow the stack.
  size_t p = 0, t = 0, star_p = std::string_view::npos, star_t = 0;
  while (t < text.size()) {
    if (p < pattern.size()) {
      char pc = pattern[p];
      if (pc == '*') {
        star_p = p++;
        star_t = t;
        continue;
      }
      if (pc == '?') {
        ++p, ++t;
        continue;
      }
      if (pc == '[') {
        size_t q = p + 1;
        bool negate = q < pattern.size() && (pattern[q] == '!' || pattern[q] == '^');
        if (negate) ++q;
        bool matched = false;
        bool first = true;
        while (q < pattern.size() && (pattern[q] != ']' || first)) {
          first = false;
          char lo = pattern[q], hi = lo;
          if (q + 2 < pattern.size() && pattern[q + 1] == '-' && pattern[q + 2] != ']') {
            hi = pattern[q + 2];
            q += 2;
          }
          if (text[t] >= lo && text[t] <= hi) matched = true;
          ++q;
        }
        if (q < pattern.size() && matched != negate) {  // well-formed class that matched
          p = q + 1;
          ++t;
          continue;
        }
        if (q >= pattern.size() && text[t] == '[') {  // unterminated: a literal '['
          ++p, ++t;
          continue;
        }
      } else if (pc == text[t]) {
        ++p, ++t;
        continue;
      }
    }
    if (star_p == std::string_view::npos) return false;
    p = star_p + 1;
    t = ++star_t;
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

namespace {

// Extracts family (AF_INET/AF_INET6 after unmapping), address bytes and port.
bool split_sockaddr(const sockaddr* sa, int* family, const uint8_t** addr, uint16_t* port) {
  if (sa == nullptr) return false;
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    *family = AF_INET;
    *addr = reinterpret_cast<const uint8_t*>(&in->sin_addr);
    *port = ntohs(in->sin_port);
    return true;
  }
  if (sa->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    const uint8_t* b = in6->sin6_addr.s6_addr;
    static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    *port = ntohs(in6->sin6_port);
    if (memcmp(b, kMapped, 12) == 0) {
      *family = AF_INET;
      *addr = b + 12;
    } else {
      *family = AF_INET6;
      *addr = b;
    }
    return true;
  }
  return false;
}

bool prefix_equal(const uint8_t* a, const uint8_t* b, unsigned bits) {
  unsigned full = bits / 8;
  if (memcmp(a, b, full) != 0) return false;
  unsigned rem = bits % 8;
  if (rem == 0) return true;
  uint8_t mask = static_cast<uint8_t>(0xff << (8 - rem));
  return (a[full] & mask) == (b[full] & mask);
}

}  // namespace

bool Rule::matches(Direction d, const sockaddr* sa) const {
  if ((directions & (d == Direction::kServer ? 1 : 2)) == 0) return false;
  int fam = 0;
  const uint8_t* a = nullptr;
  uint16_t port = 0;
  if (!split_sockaddr(sa, &fam, &a, &port)) return false;
  if (family != 0 && family != fam) return false;
  if (port < port_lo || port > port_hi) return false;
  return family == 0 || prefix_equal(a, addr, prefix_len);
}

Action Config::decide(Direction d, const sockaddr* sa) const {
  if (passthrough) return Action::kTcp;
  if (sa == nullptr || (sa->sa_family != AF_INET && sa->sa_family != AF_INET6)) return Action::kTcp;
  for (const Rule& r : rules)
    if (r.matches(d, sa)) return r.action;
  return default_action;
}

std::string ParseError::to_string() const {
  return file + ":" + std::to_string(line) + ":" + std::to_string(column) + ": " + what;
}

std::string describe_non_defaults(const Config& cfg) {
  const Config defaults;
  std::string out;
  auto add = [&out](const std::string& s) {
    if (!out.empty()) out += ' ';
    out += s;
  };
  if (cfg.passthrough) add("passthrough (configuration error: every socket stays on TCP)");
  for (size_t i = 0; i < detail::kNumKeys; ++i) {
    const detail::KeySpec& k = detail::kKeys[i];
    std::string v = detail::format_value(k, cfg);
    if (v != detail::format_value(k, defaults)) add(std::string(k.name) + "=" + v);
  }
  if (!cfg.section.empty()) add("section=" + cfg.section + "@" + std::to_string(cfg.section_line));
  if (!cfg.rules.empty()) add("rules=" + std::to_string(cfg.rules.size()));
  if (out.empty()) out = "all defaults";
  return out;
}

}  // namespace rsock::config
