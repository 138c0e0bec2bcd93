// Startup: find the file, read it, identify the process, apply environment
// overrides and logging. Runs once, from preload/'s constructor, inside an
// arbitrary program: read files with the real libc (sys::libc), never throw,
// and on any problem leave the program's sockets alone.
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "config/config.h"
#include "util/owned_fds.h"
#include "util/sys.h"

extern "C" char* program_invocation_short_name;  // glibc

namespace rsock::config {

namespace {

constexpr const char* kDefaultPath = "/etc/librsock.conf";
constexpr size_t kMaxFileBytes = 1 << 20;  // a config file is never this big

// Reads a whole (small) file. ENOENT is reported as such so the caller can
// treat a missing default file as "all defaults".
Status<std::string> read_file(const char* path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Err(errno);
  std::string text;
  char buf[4096];
  for (;;) {
    ssize_t n = sys::libc.read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int e = errno;
      sys::libc.close(fd);
      return Err(e);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > kMaxFileBytes) {
      sys::libc.close(fd);
      return Err(EFBIG);
    }
  }
  sys::libc.close(fd);
  return text;
}

std::string exe_basename() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return program_invocation_short_name ? program_invocation_short_name : "";
  std::string_view path(buf, static_cast<size_t>(n));
  size_t slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? path : path.substr(slash + 1));
}

void write_stderr(const std::string& line) {
  (void)!sys::libc.write(STDERR_FILENO, line.data(), line.size());
}

Config passthrough_config(std::string source) {
  Config c;
  c.passthrough = true;
  c.source = std::move(source);
  return c;
}

}  // namespace

Status<void> apply_logging(const Config& cfg) {
  log::set_level(cfg.log.level);
  if (cfg.log.file.empty()) {
    log::set_fd(STDERR_FILENO);
    return Ok();
  }
  std::string path;
  for (size_t i = 0; i < cfg.log.file.size(); ++i) {
    if (cfg.log.file[i] == '%' && i + 1 < cfg.log.file.size() && cfg.log.file[i + 1] == 'p') {
      path += std::to_string(getpid());
      ++i;
    } else {
      path += cfg.log.file[i];
    }
  }
  int fd = open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Err(errno);
  log::set_fd(sys::own_fd(fd));  // opened before the program's first fds: keep 3 theirs
  return Ok();
}

Config load_for_process() {
  const char* env_path = getenv("RSOCK_CONFIG");
  bool explicit_path = env_path != nullptr && env_path[0] != '\0';
  std::string path = explicit_path ? env_path : kDefaultPath;

  std::string text;
  auto file = read_file(path.c_str());
  if (file.ok()) {
    text = std::move(*file);
  } else if (file.error() != ENOENT || explicit_path) {
    // A file named in $RSOCK_CONFIG that does not exist is a mistake worth
    // reporting; the absence of the system-wide default is not.
    write_stderr("librsock: " + path + ": cannot read: " + strerror(file.error()) +
                 "; passing all sockets through to the kernel\n");
    return passthrough_config(path);
  }

  std::string exe = exe_basename();
  const char* argv0 = program_invocation_short_name ? program_invocation_short_name : "";
  const char* app_id = getenv("RSOCK_APP_ID");
  Identity who{exe, argv0, app_id ? app_id : ""};

  ParseError err;
  auto parsed = parse(text, file.ok() ? path : std::string(), who, &err);
  if (!parsed.ok()) {
    write_stderr("librsock: " + err.to_string() + "; passing all sockets through to the kernel\n");
    return passthrough_config(path);
  }
  Config cfg = std::move(*parsed);
  if (!apply_env(&cfg, [](const char* n) -> const char* { return getenv(n); }, &err).ok()) {
    write_stderr("librsock: " + err.to_string() + "; passing all sockets through to the kernel\n");
    return passthrough_config(path);
  }
  if (auto st = apply_logging(cfg); !st.ok()) {
    // Logging is not worth giving up RDMA for: say so and keep stderr.
    log::set_fd(STDERR_FILENO);
    LOG_WARN("cannot open log_file %s: %s; logging to stderr", cfg.log.file.c_str(),
             strerror(st.error()));
  }
  LOG_INFO("config %s: %s", cfg.source.empty() ? "(none)" : cfg.source.c_str(),
           describe_non_defaults(cfg).c_str());
  return cfg;
}

}  // namespace rsock::config
