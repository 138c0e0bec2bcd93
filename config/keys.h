// The table of `key = value` settings: one row per key, shared by the file
// parser, the RSOCK_<KEY> environment overrides and describe_non_defaults(),
// so a key can never be accepted by one and unknown to another.
// Internal to config/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "config/config.h"

namespace rsock::config::detail {

enum class KeyKind : uint8_t {
  kSize,      // unsigned, K/M/G suffixes (binary) allowed
  kUint,      // unsigned, no suffix
  kBool,      // on/off, true/false, yes/no, 1/0
  kLogLevel,  // off/error/warn/info/debug
  kLogFile,   // "stderr" or a path
  kDefault,   // rdma/tcp: the action when no rule matches
};

struct KeySpec {
  const char* name;
  KeyKind kind;
  uint32_t Tunables::*u32 = nullptr;
  bool Tunables::*flag = nullptr;
  uint64_t min = 0;
  uint64_t max = 0;
  bool power_of_two = false;
};

extern const KeySpec kKeys[];
extern const size_t kNumKeys;

// nullptr if `name` is not a key (exact, lower-case match).
const KeySpec* find_key(std::string_view name);

// Parses `value` for `key` into cfg. On failure returns false, sets *what and
// *column_offset (0-based offset into `value` where the problem starts).
bool set_key(const KeySpec& key, std::string_view value, Config* cfg, std::string* what,
             size_t* column_offset);

// The value as it would be written in the file ("1M", "info", "stderr").
std::string format_value(const KeySpec& key, const Config& cfg);

// Shared helpers for the parser.
bool parse_unsigned(std::string_view s, bool allow_suffix, uint64_t* out);
std::string format_size(uint64_t v);

}  // namespace rsock::config::detail
