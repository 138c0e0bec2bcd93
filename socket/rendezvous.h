// Rendezvous: deciding which TCP connections try RDMA, and pairing the
// rdma_cm connection with the right TCP connection (socket/upgrade_wire.h).
//
// All registries live in the progress thread's state (socket/progress.cc);
// these are the entry points the hooks call.
#pragma once

#include <sys/socket.h>

#include "socket/socket.h"

namespace rsock::socket {

class Stream;

// A tracked socket's connect() was issued (r == 0 or EINPROGRESS): start an
// upgrade if the connection is eligible. Returns the stream, or nullptr.
// `local` (optional): the socket's address, if the caller has it (saves a syscall).
// `at` (optional): stream positions {tx, rx} to start from, for a client's
// connection inherited from a process without librsock that connect()ed
// and exec'd us on it (socat's EXEC:...,nofork, tcpclient;
// adopt_inherited_sockets): its rendezvous starts at once, since the
// server's stream waits upgrade_timeout_ms from its accept, and is flagged
// as counting its kernel's bytes (wire::kRequestKernel).
Stream* start_client_upgrade(Socket* s, int fd, const sockaddr* peer,
                             const sockaddr_storage* local = nullptr,
                             const uint64_t* at = nullptr);
// accept() returned fd on a listener that has an rdma_cm listener.
Stream* start_server_upgrade(Socket* listener, Socket* s, int fd,
                             const sockaddr_storage* local = nullptr,
                             const sockaddr_storage* peer = nullptr);
// fd passing (docs/DESIGN.md, "Upgrading again in the receiver"): before a
// tracked socket goes out with SCM_RIGHTS (after Stream::give_away), and
// once a TCP socket came in that way and is tracked (Socket `s` at `fd`):
// if its sender left it shared, a stream that waits to be its only holder.
void socket_passing(Socket* s);
void adopt_passed(Socket* s, int fd);
// At startup: the connections the previous image of this process left for
// this one at exec (Stream::pass_to_exec) are tracked again at their fd
// numbers and wait to upgrade again. One failing shm_open when there are
// none to find.
void adopt_after_exec();
// At startup, after adopt_after_exec: every TCP listening socket the image
// inherited and nobody tracks yet (systemd socket activation, a master that
// forks and execs its workers, a re-exec) is tracked as a listener and its
// rdma_cm side started, as listen() would; every established TCP connection
// nobody tracks yet (an inetd-style service whose acceptor runs without
// librsock) is adopted as an accepted one (adopt_inherited_connection).
// socket/inherit.cc. A getsockopt per open fd.
void adopt_inherited_sockets();
// An established connection Socket `s` at `fd` (addresses `local` and
// `peer`), accepted by processes without librsock, which moved `tx`/`rx`
// stream bytes on it before us: a server stream at those positions waits
// for its client's request. The
// request reaches the rdma_cm port of the connection's local port, which
// this process binds if nobody has (and keeps while it lives); else the
// process that holds it redirects the request through the port's named
// table, where this one publishes its own side listener.
void adopt_inherited_connection(Socket* s, int fd, const sockaddr_storage& local,
                                const sockaddr_storage& peer, uint64_t tx, uint64_t rx);
// listen() succeeded on a tracked socket: open its rdma_cm listener if the
// config allows RDMA for it. `shared`: a listening socket other processes
// may hold too, which this one did not create (inherited across exec, or
// received with SCM_RIGHTS): it meets them in the port's named table; if
// another process holds the port's rdma_cm listener (the process that
// forked and exec'd us, or sent us the socket), join it as a preforked
// worker would.
void listener_started(Socket* s, int fd, bool shared = false);
// A tracked listening socket `s` is about to go out with SCM_RIGHTS (a
// master handing its listeners to a new process, as HAProxy's reload
// does): as for an exec that keeps it, this process's rdma_cm listener
// looks in the port's named table too, where the receiver publishes the
// connections it accepts, and names this process there for it to watch.
void listener_passing(Socket* s);
// The socket is being freed: drop its rdma_cm listener and hand its stream
// (if any) to the progress thread for an orderly close.
void socket_released(Socket* s);
// The application is about to close fd (close, close_range, dup2/dup3 onto
// it), which may be the number an upgrading or upgraded connection uses for
// its kernel socket: the stream takes its own reference first
// (Stream::retire_fd). One relaxed load when no stream exists.
// `not_vfork`: the caller has already made sure this is no vfork child
// (in_vfork_child() is a getpid syscall).
void fd_closing(int fd, bool not_vfork = false);
// fd_closing() for every tracked fd in [lo, hi].
void fds_closing(unsigned lo, unsigned hi);
// fd is about to be used as a listener (accept, epoll_ctl ADD): if it is
// one this fork child inherited, from now on the child watches the process
// that serves its rdma_cm listener and takes over when that one exits. One
// relaxed load unless such a listener exists.
void listener_in_use(int fd);

// The one rule for addresses handed to rdma_cm: an IPv4-mapped IPv6 address
// (::ffff:a.b.c.d, as dual-stack sockets name IPv4 peers) becomes the plain
// AF_INET address with the same port; rdma_cm binds and resolves IPv4 only
// in that form. Anything else is returned unchanged.
sockaddr_storage cm_address(const sockaddr_storage& a);

// A server stream went back to waiting for its client's request (upgrading
// again): the registry's list of such streams (try_match's candidates) is
// rebuilt at the next request. Lock-free, one atomic increment.
void server_awaits_request();

// Peers that refused or did not answer, skipped for negative_cache_ttl_s.
// `whole_host`: every port of the peer's address (a lossy path concerns the
// host, not one service); a server also refuses such a host's requests.
// `first_short`: the first failure of this peer and port (in the last two
// TTLs) is skipped for kFirstStrikeNs only, the next ones for the whole
// TTL; a failed attempt that started (`attempt_ns`) before the first one
// was recorded is no next one (connections opened together fail together).
// For peer_not_rsock: no rdma_cm listener answered, which is also what a
// socket-activated service looks like while it starts (systemd accepted the
// first connection's TCP and starts the program, which only then opens its
// rdma_cm listener: socket/inherit.cc). With the whole TTL at the first
// miss, its clients stayed on TCP for a minute after every start.
inline constexpr uint64_t kFirstStrikeNs = 2'000'000'000;
bool negative_cache_hit(const sockaddr_storage& peer);
void negative_cache_add(const sockaddr_storage& peer, bool whole_host = false,
                        bool first_short = false, uint64_t attempt_ns = 0);
// A host entered with whole_host (any port), for a server's requests.
bool negative_cache_host(const sockaddr* addr);
// The peer's port (not a whole host's entry) is no longer skipped: a
// client's late retry reached librsock there.
void negative_cache_forget(const sockaddr_storage& peer);

// The progress thread calls fn(arg) (without its own locks held) whenever fd
// is readable; fn must make it unreadable again or it is called every time
// the thread wakes. Used for epoll sets that are polled or nested
// (readiness.cc). unwatch before closing fd.
void progress_watch(int fd, void (*fn)(void*), void* arg);
void progress_unwatch(int fd);

// One line at exit (log level info): connections, upgrades, fallbacks and
// bytes per transport. Tests use it to prove traffic really went over RDMA.
void log_exit_summary();

// fork(): before it, pending upgrades fall back to TCP (reason forked) and the
// registry stays locked until after_fork_parent; the child has no progress
// thread, keeps kernel TCP, and upgraded connections fail there (ECONNRESET).
void progress_before_fork();
// exec (execve and family, posix_spawn): the new program image has none of
// librsock's state. Pending upgrades fall back; every upgraded connection,
// the application's and those still lingering after close, switches back to
// TCP (kHandOff) before the call, bounded by upgrade_timeout_ms. Inherited
// fds are then plain TCP sockets in the new image, and the ones closed on
// exec end with the kernel's FIN after their last byte. If the exec fails,
// the connections simply go on over TCP.
// `replaces`: an exec (this image goes away), not posix_spawn (this process
// goes on; only the spawned image inherits). A connection shared since a
// fork (Stream::share_at_fork) whose every fd here closes on exec is not
// inherited: an exec gives this process's hold up (the others may upgrade
// it), posix_spawn keeps it; any other shared one falls back, which tells
// the others (its new image would move bytes nobody counts).
void progress_before_exec(bool replaces);
// The exec returned (it failed): connections whose hold it gave up are
// poisoned, this process goes on with them uncounted.
void progress_exec_failed();
// exit(): the same hand-off, run from an atexit handler, so that what the
// program wrote before exiting reaches its peer as on kernel TCP (which
// delivers every byte, then the FIN, after the process is gone); on RDMA the
// unacknowledged bytes would die with the QP. Pending upgrades are left
// alone, and nothing is counted as a fallback. Not for _exit() or a fatal
// signal, which run no atexit handlers.
void progress_at_exit();
// The program set up io_uring (liburing's io_uring_queue_init*, io_uring_setup).
// Its reads and writes through the ring reach the kernel sockets past the
// hooks, so from now on the process's connections stay on kernel TCP: pending
// upgrades fall back and every upgraded connection of the application
// switches back (kHandOff, so that no unread byte stays in librsock's
// memory: the peer sends those again on TCP), before the call returns,
// bounded by upgrade_timeout_ms; later connections are not upgraded. All with
// fallback reason io_uring, and one warning line. Idempotent.
void progress_io_uring_started();
// Whether progress_io_uring_started() ran.
bool io_uring_started();
void progress_after_fork_parent(bool failed);
void progress_after_fork_child();

}  // namespace rsock::socket
