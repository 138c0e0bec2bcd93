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
#pragma once

#include <poll.h>
#include <signal.h>

#include <cstdint>

namespace rsock::socket {

void signals_scan();  // at startup: which signals have handlers already
// Whether an application signal handler runs on this thread now (through
// the trampoline): then nothing that takes a lock may run (_exit from a
// handler must not wait for a lock the interrupted code holds).
bool in_signal_handler();

// sigaction() for the application (same contract): handlers go in through the
// trampoline, queries come back as the application set them.
int signal_action(int sig, const struct sigaction* act, struct sigaction* old);

inline constexpr int kRestarted = -1;

// What signal handlers ran on this thread since construction.
class SignalWatch {
 public:
  SignalWatch();
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
};

// poll() for a blocking socket call: returns 0 when the caller should
// re-check (an fd is ready or the timeout passed), kRestarted when a handler
// with SA_RESTART ran (restart, unless the socket has a timeout), EINTR when
// a handler without SA_RESTART ran. fds[0] must be an eventfd (the stream's
// wake fd): see SignalWatch::Sleep.
int restartable_poll(pollfd* fds, nfds_t n, int timeout_ms, SignalWatch& watch);

}  // namespace rsock::socket
