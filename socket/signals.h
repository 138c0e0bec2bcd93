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

}  // namespace rsock::socket
