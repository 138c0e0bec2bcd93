// Minimal logger for code that runs inside someone else's process: formats
// into a stack buffer (no allocation) and writes one line with the real
// write(), so logging never re-enters our hooks or disturbs errno.
#pragma once

#include <atomic>

namespace rsock::log {

enum class Level : int { kOff = 0, kError = 1, kWarn = 2, kInfo = 3, kDebug = 4 };

// Default: errors and warnings only, to stderr. config/ may change both.
void set_level(Level level);
Level level();
void set_fd(int fd);  // where lines go (stderr by default)

// printf-style; adds "librsock[pid]: " and a newline.
void write_line(Level level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

extern std::atomic<int> g_level;

}  // namespace rsock::log

#define RSOCK_LOG(lvl, ...)                                                        \
  do {                                                                             \
    if (static_cast<int>(lvl) <= ::rsock::log::g_level.load(std::memory_order_relaxed)) \
      ::rsock::log::write_line(lvl, __VA_ARGS__);                                  \
  } while (0)
#define LOG_ERROR(...) RSOCK_LOG(::rsock::log::Level::kError, __VA_ARGS__)
#define LOG_WARN(...) RSOCK_LOG(::rsock::log::Level::kWarn, __VA_ARGS__)
#define LOG_INFO(...) RSOCK_LOG(::rsock::log::Level::kInfo, __VA_ARGS__)
#define LOG_DEBUG(...) RSOCK_LOG(::rsock::log::Level::kDebug, __VA_ARGS__)
