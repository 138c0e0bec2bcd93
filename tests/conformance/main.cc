// rsock_conformance: doctest main plus a per-test-case watchdog, so a test
// that hangs (e.g. a lost wakeup under librsock) fails loudly instead of
// stalling CI. The watchdog is a thread, not alarm(), so tests stay free to
// use signals themselves.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <cerrno>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "helpers.h"

namespace {

class Watchdog {
 public:
  static Watchdog& instance() {
    static Watchdog* w = new Watchdog;  // leaked: must outlive static destructors
    return *w;
  }
  void arm(const std::string& name) {
    std::lock_guard<std::mutex> g(mu_);
    name_ = name;
    deadline_ = std::chrono::steady_clock::now() + budget_;
    armed_ = true;
    cv_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> g(mu_);
    armed_ = false;
    cv_.notify_all();
  }

 private:
  Watchdog() {
    const char* s = getenv("RSOCK_CONF_WATCHDOG_S");
    int secs = s ? atoi(s) : 0;
    budget_ = std::chrono::seconds(secs > 0 ? secs : 60);
    // Block every signal in the watchdog so SIGPIPE/SIGALRM land on test threads.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    std::thread([this] { run(); }).detach();
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }
  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      if (!armed_) {
        cv_.wait(lk);
        continue;
      }
      if (cv_.wait_until(lk, deadline_) == std::cv_status::timeout && armed_ &&
          std::chrono::steady_clock::now() >= deadline_) {
        std::string msg = "\nWATCHDOG: test case \"" + name_ + "\" exceeded " +
                          std::to_string(budget_.count()) + " s; aborting the suite\n";
        ssize_t r = write(2, msg.data(), msg.size());
        (void)r;
        _exit(124);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::string name_;
  std::chrono::steady_clock::time_point deadline_{};
  std::chrono::seconds budget_{60};
  bool armed_ = false;
};

struct WatchdogListener : doctest::IReporter {
  explicit WatchdogListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& tc) override {
    // RSOCK_CONF_TRACE=1 names each case on stderr, so library logs can be
    // attributed to the case that caused them.
    static const bool trace = getenv("RSOCK_CONF_TRACE") != nullptr;
    if (trace) fprintf(stderr, "CASE: %s\n", tc.m_name);
    Watchdog::instance().arm(tc.m_name);
  }
  void test_case_reenter(const doctest::TestCaseData& tc) override { Watchdog::instance().arm(tc.m_name); }
  void test_case_end(const doctest::CurrentTestCaseStats&) override { Watchdog::instance().disarm(); }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

REGISTER_LISTENER("rsock_watchdog", 1, WatchdogListener);

// The program a conformance case execs to serve on a listening socket it
// inherits as fd 3 (test_process.cc): first checks that its new socket and
// file get the lowest free numbers (librsock adopts the listener and opens
// its RDMA side while this image starts), then accepts one connection and
// echoes it to EOF. Exit status: 0 served, 2 accept failed, 3 I/O failed,
// 5 a number was taken.
static int accept_echo_fd3() {
  for (int i = 0; i < 2; i++) {
    int low = fcntl(0, F_DUPFD, 0);
    if (low < 0 || close(low) != 0) return 5;
    int fd = i == 0 ? socket(AF_INET, SOCK_STREAM, 0) : open("/dev/null", O_RDONLY);
    if (fd != low) return 5;
    close(fd);
  }
  int c = accept(3, nullptr, nullptr);
  if (c < 0) return 2;
  close(3);
  static char buf[65536];
  for (;;) {
    ssize_t n = read(c, buf, sizeof buf);
    if (n == 0) return close(c) == 0 ? 0 : 3;
    if (n < 0) {
      if (errno == EINTR) continue;
      return 3;
    }
    for (ssize_t off = 0; off < n;) {
      ssize_t w = write(c, buf + off, size_t(n - off));
      if (w <= 0) return 3;
      off += w;
    }
  }
}

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--accept-echo-fd3") return accept_echo_fd3();
  // (A spawned program that sets a 150 ms SO_RCVTIMEO on the socket it got
  // as fd 3: test_options.cc.)
  if (argc == 2 && std::string(argv[1]) == "--rcvtimeo-fd3") {
    timeval tv{0, 150000};
    return setsockopt(3, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0 ? 0 : 1;
  }
  conf::install_sigpipe_counter();
  // An RSOCK_CONF_IPV4 that is not configured here (e.g. the VM's rxe address
  // on the host) means "this environment does not apply": skip, don't fail.
  if (!conf::ipv4_bindable()) {
    char buf[INET_ADDRSTRLEN] = "?";
    in_addr a = conf::test_ipv4();
    inet_ntop(AF_INET, &a, buf, sizeof buf);
    fprintf(stderr, "SKIP: test address %s (RSOCK_CONF_IPV4) is not a local address here\n", buf);
    return 77;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
