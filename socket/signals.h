// Which signal handlers ask for SA_RESTART, so that a blocking socket call
// librsock emulates (an upgraded socket's recv/send/accept) is restarted or
// interrupted exactly as the kernel's would be (signal(7)).
//
// preload/ reports every sigaction()/signal() of the application here;
// the state before librsock was loaded is read once at startup.
#pragma once

#include <poll.h>
#include <signal.h>

namespace rsock::socket {

void signals_scan();                                  // at startup
void signal_handler_set(int sig, const struct sigaction& sa);
void signal_handler_set_bsd(int sig, sighandler_t h, bool restart);

// poll() for a blocking socket call: returns 0 when the caller should
// re-check (an fd is ready or the timeout passed), kRestarted when a handler
// with SA_RESTART ran (restart, unless the socket has a timeout), EINTR when
// a handler without SA_RESTART ran.
inline constexpr int kRestarted = -1;
int restartable_poll(pollfd* fds, nfds_t n, int timeout_ms);

// For an emulated poll/select/epoll_wait that is about to sleep: blocks the
// caught signals until the call returns, so that one arriving while the
// emulation runs user-space code between sleeps stays pending and ends the
// next sleep with EINTR (its handler runs inside ppoll), as the kernel's
// in-call signal check would, instead of being handled unnoticed while the
// call goes on sleeping. engage() returns the mask to sleep with: the
// caller's (ppoll/pselect/epoll_pwait) or the thread's original one.
class SignalHold {
 public:
  SignalHold() = default;
  SignalHold(const SignalHold&) = delete;
  SignalHold& operator=(const SignalHold&) = delete;
  ~SignalHold();
  const sigset_t* engage(const sigset_t* caller_mask);
  // The mask any sleep must use: engage()'s once engaged, else the caller's.
  const sigset_t* sleep_mask(const sigset_t* caller_mask) {
    return engaged_ ? engage(caller_mask) : caller_mask;
  }

 private:
  bool engaged_ = false;
  sigset_t orig_;
};

}  // namespace rsock::socket
