#include "socket/signals.h"

#include <pthread.h>
#include <ucontext.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <utility>

#include "util/sys.h"

namespace rsock::socket {

constinit thread_local int t_depth __attribute__((tls_model("initial-exec"))) = 0;
constinit thread_local std::atomic<int> t_deferred __attribute__((tls_model("initial-exec"))){0};
constinit thread_local int t_held_locks __attribute__((tls_model("initial-exec"))) = 0;

namespace {

// Handler calls deferred while the thread ran librsock's code (signals.h).
// Appended only at depth > 0 (by the trampoline), taken only at depth 0, so
// the two never overlap on one thread. The handler and its flags are the
// ones of the delivery (SA_RESETHAND may have reset them since).
struct Deferred {
  int sig;
  int flags;
  uintptr_t fn;
  siginfo_t info;
};
constexpr int kMaxDeferred = 4;
thread_local Deferred t_queue[kMaxDeferred] __attribute__((tls_model("initial-exec")));
// In an emulated call (a SignalWatch lives): its restart point runs deferred
// SA_RESTART handlers.
thread_local bool t_emulated __attribute__((tls_model("initial-exec"))) = false;

// Bit (sig - 1): the application has a handler for sig. These are the
// signals a Sleep blocks until the sleep starts.
std::atomic<uint64_t> g_caught_bits{0};

// The application's own handler behind the trampoline, per signal. Written
// before the trampoline is installed, so a delivery never finds it empty.
struct UserHandler {
  std::atomic<uintptr_t> fn{0};
  std::atomic<int> flags{0};
};
UserHandler g_user[65];

// Handler runs on this thread, by kind. initial-exec: the trampoline reads
// them in signal context, where a lazily allocated TLS block is not safe.
thread_local std::atomic<uint32_t> t_intr_runs __attribute__((tls_model("initial-exec"))){0};
thread_local std::atomic<uint32_t> t_restart_runs __attribute__((tls_model("initial-exec"))){0};
// The eventfd this thread is about to sleep on (-1: none): the trampoline
// writes to it so that the sleep ends at once (SignalWatch::Sleep).
thread_local std::atomic<int> t_sleep_fd __attribute__((tls_model("initial-exec"))){-1};
// Application handlers running on this thread (a handler that longjmps out
// leaves it counted: in_signal_handler() then errs on the safe side).
thread_local int t_handlers __attribute__((tls_model("initial-exec"))) = 0;

void set_caught(int sig, bool caught) {
  if (sig < 1 || sig > 64) return;
  uint64_t bit = uint64_t{1} << (sig - 1);
  if (caught) g_caught_bits.fetch_or(bit, std::memory_order_acq_rel);
  else g_caught_bits.fetch_and(~bit, std::memory_order_acq_rel);
}

bool is_caught(const struct sigaction& sa) {
  if (sa.sa_flags & SA_SIGINFO) return sa.sa_sigaction != nullptr;
  return sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN;
}

// Whether a handler may wait for the end of the librsock call it
// interrupted: not a fault's (the faulting code must not go on), not a
// profiler's (it samples the interrupted context), and SA_RESTART's only
// in an emulated call (a call passed to the kernel may go on for long).
bool deferrable(int sig, int flags) {
  if ((flags & SA_RESTART) && !t_emulated) return false;
  switch (sig) {
    case SIGSEGV: case SIGBUS: case SIGILL: case SIGFPE: case SIGTRAP: case SIGSYS:
    case SIGABRT:  // abort() resets it and raises it again: the handler would never run
    case SIGPROF: case SIGVTALRM:
      return false;
    default:
      return true;
  }
}

void trampoline(int sig, siginfo_t* info, void* ctx) {
  uintptr_t fn = g_user[sig].fn.load(std::memory_order_acquire);
  int flags = g_user[sig].flags.load(std::memory_order_acquire);
  (flags & SA_RESTART ? t_restart_runs : t_intr_runs).fetch_add(1, std::memory_order_relaxed);
  if (int fd = t_sleep_fd.load(std::memory_order_relaxed); fd >= 0) {
    int saved = errno;  // write() is async-signal-safe; errno is the program's
    uint64_t one = 1;
    (void)!sys::libc.write(fd, &one, sizeof one);
    errno = saved;
  }
  if (flags & SA_RESETHAND) set_caught(sig, false);  // the kernel reset it to SIG_DFL
  if (t_depth > 0 && deferrable(sig, flags)) {
    // (The slot is taken before it is filled: another signal may nest here.)
    int n = t_deferred.fetch_add(1, std::memory_order_relaxed);
    if (n < kMaxDeferred) {
      t_queue[n] = {sig, flags, fn, info ? *info : siginfo_t{}};
      return;
    }
    t_deferred.fetch_sub(1, std::memory_order_relaxed);
  }
  t_handlers++;
  if (flags & SA_SIGINFO)
    reinterpret_cast<void (*)(int, siginfo_t*, void*)>(fn)(sig, info, ctx);
  else if (fn != uintptr_t(SIG_DFL) && fn != uintptr_t(SIG_IGN))  // only in a racing install
    reinterpret_cast<void (*)(int)>(fn)(sig);
  t_handlers--;
}

bool is_trampoline(const struct sigaction& sa) {
  return (sa.sa_flags & SA_SIGINFO) && sa.sa_sigaction == trampoline;
}

sigset_t caught_set() {
  uint64_t bits = g_caught_bits.load(std::memory_order_acquire);
  sigset_t s;
  sigemptyset(&s);
  for (int sig = 1; sig <= 64; sig++)
    if (bits & (uint64_t{1} << (sig - 1))) sigaddset(&s, sig);
  return s;
}

}  // namespace

bool in_signal_handler() { return t_handlers > 0; }

void run_deferred_signals() {
  if (t_held_locks > 0) return;  // (signals.h: the hook's end runs them)
  sigset_t all;
  sigfillset(&all);
  while (t_deferred.load(std::memory_order_relaxed) != 0) {
    // The queue is taken with every signal blocked: one that came between
    // the look and the shift would run at once (depth 0), and a hook its
    // handler calls would run this queue too, the same entry twice.
    sigset_t old;
    if (pthread_sigmask(SIG_BLOCK, &all, &old) != 0) return;
    int n = t_deferred.load(std::memory_order_relaxed);
    if (n <= 0 || n > kMaxDeferred) {
      pthread_sigmask(SIG_SETMASK, &old, nullptr);
      return;
    }
    Deferred d = t_queue[0];
    for (int i = 1; i < n; ++i) t_queue[i - 1] = t_queue[i];
    t_deferred.store(n - 1, std::memory_order_relaxed);
    // As the kernel runs it: the thread's mask plus its sa_mask and itself
    // (unless SA_NODEFER), errno kept, and a context to hand to an
    // SA_SIGINFO handler (this point's: the signal is delivered here now).
    // Not counted in t_handlers: the interrupted code holds nothing now
    // (_exit from it may flush), and one that jumps out would leave the
    // count raised.
    struct sigaction sa {};
    sigset_t mask = old;
    if (sys::libc.sigaction(d.sig, nullptr, &sa) == 0) sigorset(&mask, &mask, &sa.sa_mask);
    if (!(d.flags & SA_NODEFER)) sigaddset(&mask, d.sig);
    pthread_sigmask(SIG_SETMASK, &mask, nullptr);
    int saved = errno;
    if (d.flags & SA_SIGINFO) {
      ucontext_t uc;
      getcontext(&uc);
      reinterpret_cast<void (*)(int, siginfo_t*, void*)>(d.fn)(d.sig, &d.info, &uc);
    } else if (d.fn != uintptr_t(SIG_DFL) && d.fn != uintptr_t(SIG_IGN)) {
      reinterpret_cast<void (*)(int)>(d.fn)(d.sig);
    }
    errno = saved;
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }
}

void forget_deferred_signals() { t_deferred.store(0, std::memory_order_relaxed); }

void signals_scan() {
  for (int sig = 1; sig < NSIG && sig <= 64; sig++) {
    struct sigaction sa {};
    if (sys::libc.sigaction(sig, nullptr, &sa) == 0) set_caught(sig, is_caught(sa));
  }
}

int signal_action(int sig, const struct sigaction* act, struct sigaction* old) {
  bool valid = sig >= 1 && sig <= 64;
  UserHandler& u = g_user[valid ? sig : 0];
  uintptr_t prev_fn = u.fn.load(std::memory_order_acquire);
  int prev_flags = u.flags.load(std::memory_order_acquire);
  struct sigaction wrapped;
  const struct sigaction* give = act;
  const bool caught = act && is_caught(*act);  // now: `old` may be the same struct
  bool wrap = caught && valid && sig != SIGKILL && sig != SIGSTOP;
  if (wrap) {
    wrapped = *act;
    wrapped.sa_flags |= SA_SIGINFO;
    wrapped.sa_sigaction = trampoline;
    u.fn.store(act->sa_flags & SA_SIGINFO ? uintptr_t(act->sa_sigaction) : uintptr_t(act->sa_handler),
               std::memory_order_release);
    u.flags.store(act->sa_flags, std::memory_order_release);
    give = &wrapped;
  }
  struct sigaction kold;
  int r = sys::libc.sigaction(sig, give, &kold);
  if (r != 0) {
    if (wrap) {
      u.fn.store(prev_fn, std::memory_order_release);
      u.flags.store(prev_flags, std::memory_order_release);
    }
    return r;
  }
  if (old) {
    *old = kold;
    if (is_trampoline(kold)) {  // show the application's handler, not ours
      old->sa_flags = (kold.sa_flags & ~SA_SIGINFO) | (prev_flags & SA_SIGINFO);
      if (prev_flags & SA_SIGINFO)
        old->sa_sigaction = reinterpret_cast<void (*)(int, siginfo_t*, void*)>(prev_fn);
      else
        old->sa_handler = reinterpret_cast<sighandler_t>(prev_fn);
    }
  }
  if (act) set_caught(sig, caught);
  return 0;
}

SignalWatch::SignalWatch()
    : intr_(t_intr_runs.load(std::memory_order_relaxed)),
      restart_(t_restart_runs.load(std::memory_order_relaxed)),
      outer_(t_emulated) {
  t_emulated = true;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  // Handlers queued earlier in this hook (before the call began) count as
  // arrived during it: the call ends (EINTR) or reaches its restart point
  // before it sleeps, where the kernel would have run them first.
  if (int n = t_deferred.load(std::memory_order_relaxed); n > 0) [[unlikely]] {
    for (int i = 0; i < n && i < kMaxDeferred; ++i) {
      if (t_queue[i].flags & SA_RESTART) --restart_;
      else --intr_;
    }
  }
}

SignalWatch::~SignalWatch() {
  t_emulated = outer_;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

void run_deferred_at_restart() {
  if (t_deferred.load(std::memory_order_relaxed) == 0) return;
  // As the application's code: a handler's own socket calls are the
  // program's, and one that siglongjmps out lands at depth 0, outside any
  // emulated call.
  const int depth = std::exchange(t_depth, 0);
  const bool emulated = std::exchange(t_emulated, false);
  run_deferred_signals();
  t_emulated = emulated;
  t_depth = depth;
}

int SignalWatch::check() {
  std::atomic_signal_fence(std::memory_order_seq_cst);
  if (t_intr_runs.load(std::memory_order_relaxed) != intr_) return EINTR;
  uint32_t r = t_restart_runs.load(std::memory_order_relaxed);
  if (r == restart_) return 0;
  restart_ = r;
  return kRestarted;
}

SignalWatch::Sleep::Sleep(const sigset_t* caller_mask, int wake_fd, bool sleeps)
    : mask_(caller_mask) {
  if (!sleeps || !g_caught_bits.load(std::memory_order_acquire)) return;
  if (wake_fd >= 0) {
    prev_fd_ = t_sleep_fd.exchange(wake_fd, std::memory_order_relaxed);
    armed_ = true;
    std::atomic_signal_fence(std::memory_order_seq_cst);  // before the caller's check()
    return;
  }
  sigset_t caught = caught_set();
  if (pthread_sigmask(SIG_BLOCK, &caught, &orig_) != 0) return;
  blocked_ = true;
  if (!mask_) mask_ = &orig_;
}

SignalWatch::Sleep::~Sleep() {
  // A signal that arrived after the sleep ended runs its handler here; the
  // caller's next check() sees it.
  if (armed_) t_sleep_fd.store(prev_fd_, std::memory_order_relaxed);
  if (blocked_) pthread_sigmask(SIG_SETMASK, &orig_, nullptr);
}

int restartable_poll(pollfd* fds, nfds_t n, int timeout_ms, SignalWatch& watch) {
  SignalWatch::Sleep sleep(nullptr, fds[0].fd);
  if (int s = watch.check()) return s;
  timespec ts{timeout_ms / 1000, long(timeout_ms % 1000) * 1000000};
  int r = sys::libc.ppoll(fds, n, timeout_ms < 0 ? nullptr : &ts, sleep.mask());
  if (r >= 0 || errno != EINTR) return 0;
  int s = watch.check();
  return s ? s : EINTR;  // a handler we did not install (before librsock loaded)
}

}  // namespace rsock::socket
