#include "config/keys.h"

#include <cstdio>

namespace rsock::config::detail {

namespace {
constexpr uint64_t kK = 1024;
constexpr uint64_t kM = 1024 * kK;
constexpr uint64_t kG = 1024 * kM;
}  // namespace

// Ranges: wide enough for any sane deployment, narrow enough that a typo
// (an extra zero, ms vs s) is caught at startup instead of hanging a program.
const KeySpec kKeys[] = {
    // Rings are indexed with a mask, hence a power of two.
    {"ring_bytes", KeyKind::kSize, &Tunables::ring_bytes, nullptr, 4 * kK, 256 * kM, true},
    {"ring_min_bytes", KeyKind::kSize, &Tunables::ring_min_bytes, nullptr, 4 * kK, 256 * kM, true},
    {"ring_idle_ms", KeyKind::kUint, &Tunables::ring_idle_ms, nullptr, 0, 3600000},
    {"inline_threshold", KeyKind::kSize, &Tunables::inline_threshold, nullptr, 0, 1024},
    {"spin_us", KeyKind::kUint, &Tunables::spin_us, nullptr, 0, 1000000},
    {"spin_max_us", KeyKind::kUint, &Tunables::spin_max_us, nullptr, 0, 1000000},
    {"resolve_timeout_ms", KeyKind::kUint, &Tunables::resolve_timeout_ms, nullptr, 1, 600000},
    {"connect_timeout_ms", KeyKind::kUint, &Tunables::connect_timeout_ms, nullptr, 1, 600000},
    {"keepalive_ms", KeyKind::kUint, &Tunables::keepalive_ms, nullptr, 0, 3600000},
    {"stall_timeout_ms", KeyKind::kUint, &Tunables::stall_timeout_ms, nullptr, 0, 3600000},
    {"lossy_path_ppm", KeyKind::kUint, &Tunables::lossy_path_ppm, nullptr, 0, 1000000},
    {"slow_path_ratio", KeyKind::kUint, &Tunables::slow_path_ratio, nullptr, 0, 1000000},
    // Ranges the transport accepts (transport/connection.cc, wire.h).
    {"send_queue_depth", KeyKind::kUint, &Tunables::send_queue_depth, nullptr, 8, 4096},
    {"recv_slots", KeyKind::kUint, &Tunables::recv_slots, nullptr, 4, 1024},
    {"kit_pool", KeyKind::kUint, &Tunables::kit_pool, nullptr, 0, 16},  // kit_pool::kMaxIdle
    {"upgrade_timeout_ms", KeyKind::kUint, &Tunables::upgrade_timeout_ms, nullptr, 1, 600000},
    {"upgrade_delay_ms", KeyKind::kUint, &Tunables::upgrade_delay_ms, nullptr, 0, 60000},
    {"negative_cache_ttl_s", KeyKind::kUint, &Tunables::negative_cache_ttl_s, nullptr, 0, 86400},
    {"port_offset", KeyKind::kUint, &Tunables::port_offset, nullptr, 0, 65535},
    {"fork_hand_off", KeyKind::kBool, nullptr, &Tunables::fork_hand_off},
    {"reupgrade", KeyKind::kBool, nullptr, &Tunables::reupgrade},
    {"stats", KeyKind::kBool, nullptr, &Tunables::stats},
    {"debug_checks", KeyKind::kBool, nullptr, &Tunables::debug_checks},
    {"kit_qp_ahead", KeyKind::kBool, nullptr, &Tunables::kit_qp_ahead},
    {"cq_lazy_arm", KeyKind::kBool, nullptr, &Tunables::cq_lazy_arm},
    {"log_level", KeyKind::kLogLevel},
    {"log_file", KeyKind::kLogFile},
    {"default", KeyKind::kDefault},
};
const size_t kNumKeys = sizeof kKeys / sizeof kKeys[0];
static_assert(sizeof kKeys / sizeof kKeys[0] <= 64, "scopes track keys in a 64-bit mask");

const KeySpec* find_key(std::string_view name) {
  for (const KeySpec& k : kKeys)
    if (name == k.name) return &k;
  return nullptr;
}

bool parse_unsigned(std::string_view s, bool allow_suffix, uint64_t* out) {
  if (s.empty()) return false;
  uint64_t v = 0;
  size_t i = 0;
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
    uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  if (i == 0) return false;
  if (i < s.size()) {
    if (!allow_suffix || i + 1 != s.size()) return false;
    uint64_t mult = 0;
    switch (s[i]) {
      case 'k': case 'K': mult = kK; break;
      case 'm': case 'M': mult = kM; break;
      case 'g': case 'G': mult = kG; break;
      default: return false;
    }
    if (v > UINT64_MAX / mult) return false;
    v *= mult;
  }
  *out = v;
  return true;
}

std::string format_size(uint64_t v) {
  char buf[32];
  if (v != 0 && v % kG == 0) snprintf(buf, sizeof buf, "%lluG", static_cast<unsigned long long>(v / kG));
  else if (v != 0 && v % kM == 0) snprintf(buf, sizeof buf, "%lluM", static_cast<unsigned long long>(v / kM));
  else if (v != 0 && v % kK == 0) snprintf(buf, sizeof buf, "%lluK", static_cast<unsigned long long>(v / kK));
  else snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(v));
  return buf;
}

namespace {

const char* const kLevelNames[] = {"off", "error", "warn", "info", "debug"};

bool set_number(const KeySpec& key, std::string_view value, Config* cfg, std::string* what) {
  uint64_t v = 0;
  bool sized = key.kind == KeyKind::kSize;
  if (!parse_unsigned(value, sized, &v)) {
    *what = "bad number \"" + std::string(value) + "\" for " + key.name +
            (sized ? " (expected digits with an optional K, M or G suffix)" : " (expected digits)");
    return false;
  }
  bool bad_pow2 = key.power_of_two && (v & (v - 1)) != 0;
  if (v < key.min || v > key.max || bad_pow2) {
    std::string lo = sized ? format_size(key.min) : std::to_string(key.min);
    std::string hi = sized ? format_size(key.max) : std::to_string(key.max);
    *what = std::string(key.name) + " = " + std::string(value) + " is out of range: must be " +
            (key.power_of_two ? "a power of two " : "") + "from " + lo + " to " + hi;
    return false;
  }
  cfg->tunables.*key.u32 = static_cast<uint32_t>(v);
  return true;
}

}  // namespace

bool set_key(const KeySpec& key, std::string_view value, Config* cfg, std::string* what,
             size_t* column_offset) {
  *column_offset = 0;
  if (value.empty()) {
    *what = std::string("missing value for ") + key.name;
    return false;
  }
  switch (key.kind) {
    case KeyKind::kSize:
    case KeyKind::kUint:
      return set_number(key, value, cfg, what);
    case KeyKind::kBool:
      if (value == "on" || value == "true" || value == "yes" || value == "1") {
        cfg->tunables.*key.flag = true;
        return true;
      }
      if (value == "off" || value == "false" || value == "no" || value == "0") {
        cfg->tunables.*key.flag = false;
        return true;
      }
      *what = "bad value \"" + std::string(value) + "\" for " + key.name + " (expected on or off)";
      return false;
    case KeyKind::kLogLevel:
      for (int i = 0; i < 5; ++i) {
        if (value == kLevelNames[i]) {
          cfg->log.level = static_cast<log::Level>(i);
          return true;
        }
      }
      *what = "bad log_level \"" + std::string(value) + "\" (expected off, error, warn, info or debug)";
      return false;
    case KeyKind::kLogFile:
      cfg->log.file = value == "stderr" ? std::string() : std::string(value);
      return true;
    case KeyKind::kDefault:
      if (value == "rdma") {
        cfg->default_action = Action::kRdma;
        return true;
      }
      if (value == "tcp") {
        cfg->default_action = Action::kTcp;
        return true;
      }
      *what = "bad default \"" + std::string(value) + "\" (expected rdma or tcp)";
      return false;
  }
  return false;
}

std::string format_value(const KeySpec& key, const Config& cfg) {
  switch (key.kind) {
    case KeyKind::kSize: return format_size(cfg.tunables.*key.u32);
    case KeyKind::kUint: return std::to_string(cfg.tunables.*key.u32);
    case KeyKind::kBool: return cfg.tunables.*key.flag ? "on" : "off";
    case KeyKind::kLogLevel: return kLevelNames[static_cast<int>(cfg.log.level)];
    case KeyKind::kLogFile: return cfg.log.file.empty() ? "stderr" : cfg.log.file;
    case KeyKind::kDefault: return action_name(cfg.default_action);
  }
  return "";
}

}  // namespace rsock::config::detail
