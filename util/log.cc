#include "util/log.h"

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <unistd.h>

#include "util/sys.h"

namespace rsock::log {

std::atomic<int> g_level{static_cast<int>(Level::kWarn)};
static std::atomic<int> g_fd{STDERR_FILENO};

void set_level(Level l) { g_level.store(static_cast<int>(l), std::memory_order_relaxed); }
Level level() { return static_cast<Level>(g_level.load(std::memory_order_relaxed)); }
void set_fd(int fd) { g_fd.store(fd, std::memory_order_relaxed); }

void write_line(Level lvl, const char* fmt, ...) {
  static const char* const kNames[] = {"", "error", "warning", "info", "debug"};
  int saved = errno;
  char buf[512];
  int n = snprintf(buf, sizeof buf, "librsock[%d]: %s: ", static_cast<int>(getpid()),
                   kNames[static_cast<int>(lvl)]);
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(buf + n, sizeof buf - n - 1, fmt, ap);
  va_end(ap);
  size_t len = static_cast<size_t>(n) + (m < 0 ? 0 : static_cast<size_t>(m));
  if (len > sizeof buf - 2) len = sizeof buf - 2;
  buf[len++] = '\n';
  // Short writes to a terminal/pipe are not worth retrying for a log line.
  (void)!sys::libc.write(g_fd.load(std::memory_order_relaxed), buf, len);
  errno = saved;
}

}  // namespace rsock::log
