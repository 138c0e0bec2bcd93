// Signal handlers versus the blocking calls librsock emulates (an upgraded
// socket's recv/send, poll/select/epoll_wait over upgraded sockets): they
// must return EINTR, or restart (SA_RESTART), exactly where the kernel's
// would (signal(7)).
//
// The kernel checks for a signal inside the call, so one that arrives at any
// moment of it interrupts it. An emulated call spends part of its time in
// user space between sleeps; a handler that runs there would go unnoticed,
// and the call would sleep on. So preload/ installs every handler of the
// application through signal_action(), which puts a trampoline in front of
// it: the trampoline counts, per thread, how many handlers ran (with and
// without SA_RESTART) before calling the application's handler unchanged.
// An emulated call snapshots the counts (SignalWatch) and compares them
// before and after every sleep. sigaction() queries still return the
// application's own handler and flags.
//
// Why not simply block the signals for the whole call: a process-directed
// signal (alarm(), kill) goes to a thread that does not block it, so it
// would run on some other thread and the call would never see it. The
// window between the last check and the sleep is closed without blocking:
// while a thread is about to sleep, the trampoline also writes to an eventfd
// that is in the sleep's set (a stream's wake fd), so the sleep ends at once.
// Only a sleep on kernel fds alone (no such eventfd) blocks the caught
// signals for that window instead.
//
// Handlers without SA_RESTART for asynchronous signals are deferred while the
// thread runs librsock's code (t_depth > 0): the trampoline counts them and
// ends the sleep as above, and queues the call; the outermost hook runs them
// as it returns (run_deferred_signals), when none of librsock's state is
// held any more. The kernel runs a handler before the interrupted call
// returns too, so the program sees the same order. The reason: programs
// time reads out with alarm() and a handler that siglongjmps (read() is
// async-signal-safe, so that is defined). Run inside librsock, such a
// handler skipped every destructor of the call it left: the hooks' depth
// stayed raised (every later call of that thread went straight to the
// kernel, past its RDMA stream), and so did the sleep's registrations (the
// completion hub's watcher among them: other threads' sleeps no longer
// woke). glibc's signal() installs its handlers with SA_RESTART, so those
// are deferred as well, but only inside an emulated call (a SignalWatch's
// life), whose restart point runs them (run_deferred_at_restart) before it
// sleeps again: in a call passed through to the kernel they would wait for
// the call to end, which with SA_RESTART may be never. Such a call runs at
// depth 0 anyway (KernelCall, preload/hook.h): nothing is deferred there.
// Synchronous signals (faults, and SIGABRT, which abort() raises again),
// profiling signals (they want the interrupted context) and any beyond the
// queue's room run at once, as before. What a deferred handler that
// siglongjmps still leaves behind: from a restart point, the socket
// reference its hook held (the socket's memory, never its connection).
#pragma once

#include <poll.h>
#include <signal.h>

#include <atomic>
#include <cstdint>

namespace rsock::socket {

// Depth of librsock's own code on this thread: the hooks' recursion guard
// (preload/hook.h), kept here because the trampoline reads it. (constinit on
// these: without it every access from another file first tests for a TLS
// init function, several times per hook.)
extern constinit thread_local int t_depth __attribute__((tls_model("initial-exec")));
// Handlers deferred on this thread (above), waiting for depth 0.
extern constinit thread_local std::atomic<int> t_deferred __attribute__((tls_model("initial-exec")));
// Runs the deferred handlers, oldest first. Only at depth 0, and not while
// t_held_locks > 0 (a lock held across a whole call, Stream::Scratch's):
// they wait for the hook's end then.
void run_deferred_signals();
// At an emulated call's restart point (after a sleep that a SA_RESTART
// handler ended, nothing of the sleep or the socket's lock held): runs the
// deferred handlers as if at depth 0, and the call goes on.
void run_deferred_at_restart();
extern constinit thread_local int t_held_locks __attribute__((tls_model("initial-exec")));
// A fork child has its parent's thread-local queue: its handlers ran, or
// will run, in the parent.
void forget_deferred_signals();

void signals_scan();  // at startup: which signals have handlers already
// Whether an application signal handler runs on this thread now (through
// the trampoline): then nothing that takes a lock may run (_exit from a
// handler must not wait for a lock the interrupted code holds).
bool in_signal_handler();

// sigaction() for the application (same contract): handlers go in through the
// trampoline, queries come back as the application set them.
int signal_action(int sig, const struct sigaction* act, struct sigaction* old);

inline constexpr int kRestarted = -1;

// What signal handlers ran on this thread since construction. Its life is
// an emulated call's (deferral of SA_RESTART handlers, above).
class SignalWatch {
 public:
  SignalWatch();
  ~SignalWatch();
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;
  // EINTR if a handler without SA_RESTART ran since construction;
  // kRestarted if only SA_RESTART ones ran since the last call that said
  // so; else 0.
  int check();

  // Surrounds one sleep, from before the caller's check(): a handler that
  // runs after the check must end the sleep at once. With `wake_fd` (an
  // eventfd the sleep waits on) the trampoline writes to it; without (-1),
  // the caught signals stay blocked until the sleep's mask unblocks them.
  class Sleep {
   public:
    // `sleeps` false: a zero-timeout call, which needs nothing.
    Sleep(const sigset_t* caller_mask, int wake_fd, bool sleeps = true);
    ~Sleep();
    Sleep(const Sleep&) = delete;
    Sleep& operator=(const Sleep&) = delete;
    // The mask to sleep with: the caller's (ppoll/pselect/epoll_pwait's
    // argument) or the thread's own; null when nothing was blocked.
    const sigset_t* mask() const { return mask_; }

   private:
    bool blocked_ = false;
    int prev_fd_ = -1;
    bool armed_ = false;
    sigset_t orig_;
    const sigset_t* mask_;
  };

 private:
  uint32_t intr_;
  uint32_t restart_;
  bool outer_;  // this thread was in an emulated call already
};

// poll() for a blocking socket call: returns 0 when the caller should
// re-check (an fd is ready or the timeout passed), kRestarted when a handler
// with SA_RESTART ran (restart, unless the socket has a timeout), EINTR when
// a handler without SA_RESTART ran. fds[0] must be an eventfd (the stream's
// wake fd): see SignalWatch::Sleep.
int restartable_poll(pollfd* fds, nfds_t n, int timeout_ms, SignalWatch& watch);

}  // namespace rsock::socket
