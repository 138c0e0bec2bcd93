#include "socket/signals.h"

#include <sys/signalfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#include "util/sys.h"

namespace rsock::socket {

namespace {

// Bit (sig - 1): a handler is installed for sig and has SA_RESTART.
std::atomic<uint64_t> g_restart_bits{0};
// Bit (sig - 1): a handler is installed for sig.
std::atomic<uint64_t> g_caught_bits{0};

void record(int sig, bool caught, bool restart) {
  if (sig < 1 || sig > 64) return;
  uint64_t bit = uint64_t{1} << (sig - 1);
  if (caught && restart) g_restart_bits.fetch_or(bit, std::memory_order_acq_rel);
  else g_restart_bits.fetch_and(~bit, std::memory_order_acq_rel);
  if (caught) g_caught_bits.fetch_or(bit, std::memory_order_acq_rel);
  else g_caught_bits.fetch_and(~bit, std::memory_order_acq_rel);
}

bool is_caught(const struct sigaction& sa) {
  if (sa.sa_flags & SA_SIGINFO) return sa.sa_sigaction != nullptr;
  return sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN;
}

// A signalfd per thread for the current restart set: readable while one of
// those signals is pending, so the sleep below can end for it.
struct ThreadSignalFd {
  int fd = -1;
  uint64_t bits = 0;
  ~ThreadSignalFd() {
    if (fd >= 0) sys::libc.close(fd);
  }
};
thread_local ThreadSignalFd t_sfd;

}  // namespace

void signals_scan() {
  for (int sig = 1; sig < NSIG && sig <= 64; sig++) {
    struct sigaction sa {};
    if (sys::libc.sigaction(sig, nullptr, &sa) == 0) record(sig, is_caught(sa), sa.sa_flags & SA_RESTART);
  }
}

void signal_handler_set(int sig, const struct sigaction& sa) {
  record(sig, is_caught(sa), sa.sa_flags & SA_RESTART);
}

void signal_handler_set_bsd(int sig, sighandler_t h, bool restart) {
  record(sig, h != SIG_DFL && h != SIG_IGN && h != SIG_ERR, restart);
}

// How: the restart signals are blocked during the sleep (ppoll's mask) and
// watched through a signalfd instead. A non-restart signal interrupts ppoll
// with EINTR, as it would the kernel's blocking call. A restart signal makes
// the signalfd readable; ppoll returns, restores the mask, and the handler
// runs on the way out: we report "re-check", which is a restart.
int restartable_poll(pollfd* fds, nfds_t n, int timeout_ms) {
  uint64_t bits = g_restart_bits.load(std::memory_order_acquire);
  if (!bits) {
    int r = sys::libc.poll(fds, n, timeout_ms);
    return r < 0 && errno == EINTR ? EINTR : 0;
  }
  sigset_t restart;
  sigemptyset(&restart);
  for (int sig = 1; sig <= 64; sig++)
    if (bits & (uint64_t{1} << (sig - 1))) sigaddset(&restart, sig);
  if (t_sfd.bits != bits || t_sfd.fd < 0) {
    t_sfd.fd = signalfd(t_sfd.fd, &restart, SFD_NONBLOCK | SFD_CLOEXEC);
    t_sfd.bits = t_sfd.fd >= 0 ? bits : 0;
  }
  sigset_t mask;
  pthread_sigmask(SIG_BLOCK, nullptr, &mask);
  sigorset(&mask, &mask, &restart);
  pollfd all[8];
  nfds_t k = 0;
  for (; k < n && k < 7; k++) all[k] = fds[k];
  if (t_sfd.fd >= 0) all[k++] = {t_sfd.fd, POLLIN, 0};
  timespec ts{timeout_ms / 1000, long(timeout_ms % 1000) * 1000000};
  int r = sys::libc.ppoll(all, k, timeout_ms < 0 ? nullptr : &ts, &mask);
  if (r < 0) return errno == EINTR ? EINTR : 0;
  for (nfds_t i = 0; i < n && i < 7; i++) fds[i].revents = all[i].revents;
  return t_sfd.fd >= 0 && (all[k - 1].revents & POLLIN) ? kRestarted : 0;
}

const sigset_t* SignalHold::engage(const sigset_t* caller_mask) {
  if (!engaged_) {
    uint64_t bits = g_caught_bits.load(std::memory_order_acquire);
    sigset_t caught;
    sigemptyset(&caught);
    for (int sig = 1; sig <= 64; sig++)
      if (bits & (uint64_t{1} << (sig - 1))) sigaddset(&caught, sig);
    // SIGKILL/SIGSTOP are never caught; the rest stay pending until ppoll.
    if (pthread_sigmask(SIG_BLOCK, &caught, &orig_) != 0) return caller_mask;
    engaged_ = true;
  }
  return caller_mask ? caller_mask : &orig_;
}

SignalHold::~SignalHold() {
  if (engaged_) pthread_sigmask(SIG_SETMASK, &orig_, nullptr);
}

}  // namespace rsock::socket
