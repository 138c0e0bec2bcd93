// rsock-stat: show what librsock is doing in running processes, from their
// shared-memory stats segments (docs/STATS.md). Read-only; never stops them.
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tools/rsock-stat/view.h"
#include "util/stats.h"
#include "util/stats_files.h"

namespace {

using rsock_stat::Round;
using rsock_stat::View;

const char kUsage[] =
    "usage: rsock-stat [options]\n"
    "  (no option)      list processes using librsock\n"
    "  -p, --pid PID    one process: counters and its connections\n"
    "  -n, --netstat    every connection of every process, netstat-like\n"
    "  -i SECONDS       watch: repeat every SECONDS (may be fractional), with rates\n"
    "  -c COUNT         with -i: stop after COUNT rounds (default: until interrupted)\n"
    "  --json           machine-readable output (one JSON object per round)\n"
    "  --prometheus     Prometheus text format (node-exporter textfile collector),\n"
    "                   one snapshot of the listed processes (or of -p PID)\n"
    "  -a, --all        all users' processes (default when run as root)\n"
    "  --dir DIR        segment root (default: $RSOCK_STATS_DIR or /dev/shm/librsock)\n"
    "  --no-clean       do not remove segments left by dead processes\n"
    "  -h, --help       this text\n";

struct Args {
  View view = View::kList;
  int pid = 0;
  double interval = 0;
  long count = 0;
  bool json = false;
  bool prometheus = false;
  bool netstat = false;  // -n given (the view is the last of -p/-n)
  bool all = false;
  bool clean = true;
  std::string root;
};

[[noreturn]] void usage_error(const std::string& msg) {
  fprintf(stderr, "rsock-stat: %s\n%s", msg.c_str(), kUsage);
  exit(1);
}

Args parse_args(int argc, char** argv) {
  Args a;
  a.all = geteuid() == 0;
  a.root = rsock::stats::default_root_dir();
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto value = [&](const char* what) -> std::string {
      if (i + 1 >= argc) usage_error(s + " needs " + what);
      return argv[++i];
    };
    if (s == "-h" || s == "--help") {
      fputs(kUsage, stdout);
      exit(0);
    } else if (s == "-p" || s == "--pid") {
      std::string v = value("a process id");
      char* end = nullptr;
      long pid = strtol(v.c_str(), &end, 10);
      if (*end != '\0' || pid <= 0 || pid > 0x7fffffff) usage_error("bad pid \"" + v + "\"");
      a.pid = static_cast<int>(pid);
      a.view = View::kProcess;
    } else if (s == "-n" || s == "--netstat") {
      a.view = View::kNetstat;
      a.netstat = true;
    } else if (s == "-i" || s == "--interval") {
      std::string v = value("seconds");
      char* end = nullptr;
      a.interval = strtod(v.c_str(), &end);
      if (*end != '\0' || !(a.interval > 0) || a.interval > 86400) usage_error("bad interval \"" + v + "\"");
    } else if (s == "-c" || s == "--count") {
      std::string v = value("a count");
      char* end = nullptr;
      a.count = strtol(v.c_str(), &end, 10);
      if (*end != '\0' || a.count <= 0) usage_error("bad count \"" + v + "\"");
    } else if (s == "--json") {
      a.json = true;
    } else if (s == "--prometheus") {
      a.prometheus = true;
    } else if (s == "-a" || s == "--all") {
      a.all = true;
    } else if (s == "--dir") {
      a.root = value("a directory");
    } else if (s == "--no-clean") {
      a.clean = false;
    } else {
      usage_error("unknown option \"" + s + "\"");
    }
  }
  if (a.count > 0 && a.interval == 0) usage_error("-c needs -i");
  if (a.prometheus) {
    if (a.json) usage_error("--prometheus and --json are two output formats: choose one");
    if (a.interval > 0) usage_error("--prometheus prints one snapshot: no -i (let the scraper or cron repeat it)");
    if (a.netstat) usage_error("--prometheus has per-process metrics only: no -n");
  }
  if (a.interval == 0) a.count = 1;
  return a;
}

uint64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000 + uint64_t(ts.tv_nsec) / 1000000;
}

// Returns false (with *fatal set) when -p cannot be served.
Round collect(const Args& a, std::string* fatal, int* fatal_errno) {
  Round r;
  r.unix_ms = now_ms();
  auto segments = rsock::stats::list_segments(a.root, a.all, a.clean);
  bool found = false;
  for (const auto& seg : segments) {
    if (a.pid != 0 && seg.pid != a.pid) continue;
    found = true;
    std::string why;
    auto snap = rsock::stats::read_process(seg.dir, seg.pid, &why);
    if (snap.ok()) {
      r.procs.push_back(std::move(*snap));
    } else if (snap.error() == ENOENT || snap.error() == EAGAIN) {
      // Exited or still starting between listing and reading: not an error.
      if (a.pid != 0) {
        *fatal = why;
        *fatal_errno = snap.error();
      }
    } else {
      r.errors.push_back({seg.pid, why});
      if (a.pid != 0) {
        *fatal = why;
        *fatal_errno = snap.error();
      }
    }
  }
  if (a.pid != 0 && !found) {
    *fatal = "no librsock stats for pid " + std::to_string(a.pid) +
             " (not running, not using librsock, stats = off, or another user's: try as root)";
    *fatal_errno = ENOENT;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse_args(argc, argv);
  Round prev;
  bool tty = isatty(STDOUT_FILENO) && !a.json;
  for (long round = 0; a.count == 0 || round < a.count; ++round) {
    if (round > 0) {
      timespec ts{static_cast<time_t>(a.interval), static_cast<long>((a.interval - double(time_t(a.interval))) * 1e9)};
      while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
      }
    }
    std::string fatal;
    int fatal_errno = 0;
    Round cur = collect(a, &fatal, &fatal_errno);
    if (!fatal.empty()) {
      if (round > 0 && fatal_errno == ENOENT) {
        fprintf(stderr, "rsock-stat: pid %d has exited\n", a.pid);
        return 0;
      }
      fprintf(stderr, "rsock-stat: %s\n", fatal.c_str());
      return 2;
    }
    rsock_stat::Rates rates = rsock_stat::compute_rates(prev, cur);
    std::string out = a.prometheus ? rsock_stat::render_prometheus(cur)
                      : a.json     ? rsock_stat::render_json(a.view, cur, rates)
                                   : rsock_stat::render_text(a.view, cur, rates);
    if (a.interval > 0 && !a.json) {
      time_t t = time(nullptr);
      char stamp[32];
      strftime(stamp, sizeof stamp, "%H:%M:%S", localtime(&t));
      char every[32];
      snprintf(every, sizeof every, "%g", a.interval);
      std::string head = std::string(tty ? "\033[H\033[2J" : (round > 0 ? "\n" : "")) + "rsock-stat " + stamp +
                         ", every " + every + "s\n";
      out = head + out;
    }
    fwrite(out.data(), 1, out.size(), stdout);
    fflush(stdout);
    prev = std::move(cur);
  }
  return 0;
}
