// Config: what librsock does in this process, from /etc/librsock.conf (or
// $RSOCK_CONFIG) and RSOCK_<KEY> environment variables. docs/config.md is the
// user-facing description of the grammar; this header is the API.
//
// Used twice: preload/ calls load_for_process() once at startup; the socket
// layer calls Config::decide() for every TCP socket that listens, is accepted
// or connects. decide() walks a precomputed array: no allocation, no syscalls.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "config/tunables.h"
#include "util/log.h"
#include "util/status.h"

namespace rsock::config {

enum class Action : uint8_t { kRdma, kTcp };
// server: the socket listens or was accepted (rules match its LOCAL address);
// client: the socket connects (rules match the DESTINATION address).
enum class Direction : uint8_t { kServer, kClient };

const char* action_name(Action a);
const char* direction_name(Direction d);

// One "rdma client 10.0.0.0/8:1000-2000" line, in matchable form.
struct Rule {
  Action action = Action::kRdma;
  uint8_t directions = 0;    // bit 0: server, bit 1: client
  uint8_t family = 0;        // 0 any, AF_INET or AF_INET6
  uint8_t prefix_len = 0;    // bits of addr that must match
  uint8_t addr[16] = {};     // network byte order; IPv4 in the first 4 bytes
  uint16_t port_lo = 0;      // host byte order, inclusive
  uint16_t port_hi = 65535;
  uint32_t line = 0;         // where it came from, for debug logs

  bool matches(Direction d, const sockaddr* sa) const;
};

struct LogSettings {
  log::Level level = log::Level::kWarn;
  std::string file;          // empty: stderr. "%p" is replaced by the pid.
};

struct Config {
  Tunables tunables;
  LogSettings log;
  // Effective rule list for this process: its [app] section's rules, the
  // section's default (as a catch-all rule), then the global rules.
  std::vector<Rule> rules;
  Action default_action = Action::kRdma;
  // Set when the file or environment was invalid: decide() always says TCP.
  bool passthrough = false;
  std::string source;        // file that was read ("" if none)
  std::string section;       // header of the [app] section in use ("" if none)
  uint32_t section_line = 0;

  // First matching rule wins; `addr` is the local address for kServer and the
  // peer for kClient. Non-IP families always get kTcp. IPv4-mapped IPv6
  // addresses (::ffff:a.b.c.d) match IPv4 rules.
  Action decide(Direction d, const sockaddr* addr) const;
};

// Who we are, for [app ...] section headers.
struct Identity {
  std::string_view exe;      // basename of /proc/self/exe
  std::string_view argv0;    // program_invocation_short_name (may equal exe)
  std::string_view app_id;   // $RSOCK_APP_ID ("" if unset)
};

struct ParseError {
  std::string file;
  uint32_t line = 0;
  uint32_t column = 0;
  std::string what;
  // "<file>:<line>:<column>: <what>"
  std::string to_string() const;
};

// Parses a whole file (every section is checked, matching or not) and builds
// the Config for `who`. On failure returns Err(EINVAL) and fills *error.
Status<Config> parse(std::string_view text, std::string_view file_name, const Identity& who,
                     ParseError* error);

// Applies RSOCK_<KEY> variables from `getenv` on top of `cfg` (env beats file).
// RSOCK_CONFIG and RSOCK_APP_ID are not keys and are ignored here.
using GetEnv = const char* (*)(const char*);
Status<void> apply_env(Config* cfg, GetEnv getenv_fn, ParseError* error);

// Startup entry point for preload/: reads $RSOCK_CONFIG or /etc/librsock.conf
// (a missing default file means defaults, silently), applies the environment,
// applies log level/destination, and logs describe_non_defaults() at info.
// On any error prints ONE line
//   librsock: <file>:<line>:<column>: <what>; passing all sockets through to the kernel
// to stderr and returns a Config with passthrough = true.
Config load_for_process();

// Sets log::set_level / log::set_fd from cfg.log (opens the file, O_APPEND).
Status<void> apply_logging(const Config& cfg);

// "ring_bytes=1M log_level=info default=tcp section=[app redis*] rules=3", or
// "all defaults". Only settings that differ from the built-in defaults.
std::string describe_non_defaults(const Config& cfg);

// Shell-style glob: '*', '?', '[a-z]' / '[!a-z]'. Exposed for tests.
bool glob_match(std::string_view pattern, std::string_view text);

}  // namespace rsock::config
