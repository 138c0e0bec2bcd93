// Stream: a tracked TCP connection that librsock may move onto RDMA.
//
// Created at connect()/accept() when the connection is eligible (an RDMA
// device exists, config says rdma, peer not in the negative cache). From then
// on the socket's I/O goes through the Stream until it either falls back to
// plain TCP (phase kPlain: hooks pass through again) or completes the switch
// (phase kRdma). Protocol: socket/upgrade_wire.h and docs/DESIGN.md.
//
// Ownership: the Socket owns its Stream while any application fd names it;
// when the last one closes, the Stream is handed to the progress thread,
// which finishes the orderly close (every byte written is delivered) and
// deletes it. Locking: mu_ guards all state; it is held only for nonblocking
// steps, never while sleeping.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <sys/uio.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include <boost/intrusive/list_hook.hpp>
#include <boost/intrusive/set_hook.hpp>

#include "socket/holders.h"
#include "socket/signals.h"
#include "socket/upgrade_wire.h"
#include "transport/connection.h"
#include "util/spin_lock.h"
#include "util/stats_layout.h"
#include "util/status.h"

namespace rsock::socket {

namespace listen_share {
struct Table;
}
class SignalWatch;
class Backlog;

class Socket;

enum class Phase : uint8_t {
  kPending,    // rendezvous running; data still on TCP, every TCP op serialised
  kSwitching,  // RDMA connection up; OFFER/READY/MARKER exchange running
  kRdma,       // both directions switched: data on RDMA, TCP idle (liveness)
  kPlain,      // fell back: the kernel carries everything, hooks pass through
  kBroken,     // the switch failed after bytes were committed: reset
  kReverting,  // reverse switch: RDMA -> TCP, DOWN records, backlog (docs/DESIGN.md)
};

// How a reverse switch treats bytes that arrived over RDMA but were not read.
enum class RevertMode : uint8_t {
  kKeep,     // keep them (staging); the peer resends only what never arrived
  kHandOff,  // drop them; the peer resends from what the application consumed,
             // so no unread byte stays in this process's memory (fork, fd passing)
};
const char* phase_name(Phase p);

// A sleeper without a wake fd (none could be created) sleeps at most this
// long before it looks again.
inline constexpr int kNoWakeSliceMs = 10;

// The calling thread's wake eventfd (created on first use, or taken from
// those exited threads parked; -1 if none could be had): what its blocking calls and
// poll/select emulation sleep on, and what a signal handler that runs
// during such a sleep pokes.
int thread_wake_fd();
// Reads the calling thread's wake fd empty (old pokes), if it has one.
void drain_thread_wake();
// fork child: the forking thread's wake fd is the parent's eventfd (one
// open file): a poke read in one process would be lost to the other.
void thread_wake_after_fork_child();

// Pseudo-errno of a call made while the stream stopped governing the socket
// (it fell back to plain TCP): the caller redoes the call on the kernel.
inline constexpr int kRedoPlain = 1000;

struct EpollWatch;  // readiness.cc

class Stream {
 public:
  Stream(int tcp_fd, bool client, const sockaddr_storage& local, const sockaddr_storage& peer,
         stats::ConnSlot* slot);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // Whether hooks must route I/O here (false once fallen back to kernel TCP).
  bool governs() const { return governs_.load(std::memory_order_acquire); }

  // --- data path (stream_datapath.cc). `nonblock`: O_NONBLOCK or MSG_DONTWAIT.
  Status<size_t> recv(std::span<const iovec> iov, int flags, bool nonblock);
  Status<size_t> send(std::span<const iovec> iov, int flags, bool nonblock);
  Status<int> fionread();
  // How many bytes a nonblocking send would take right now (splice from a
  // pipe reads no more than that: bytes taken from a pipe cannot go back).
  // The error a send would report, or kRedoPlain.
  Status<size_t> send_room();
  // SO_ERROR: a pending reset (reported once); -1 once it was reported, when
  // SO_ERROR must say 0 whatever the TCP socket under it holds.
  int take_error();
  Status<void> shutdown(int how);
  // Current readiness (POLLIN/POLLOUT/POLLRDHUP/POLLHUP/POLLERR subset of
  // `interest` plus POLLHUP/POLLERR), after driving progress.
  // `slept_fd`: a TCP fd the caller's sleep polls for `interest` already
  // (no kernel look at it here: the sleep ends at once if it is ready).
  short poll_events(short interest, bool full = true, int slept_fd = -1);
  // The fds a waiter for `interest` must sleep on; returns how many (<= 3).
  // `cq` (optional): whether the last one is the completion hub (a sleep on
  // it arms the CQs first: transport/cq_group.h, "Arming").
  int wait_fds(short interest, pollfd* out, bool* cq = nullptr);
  // Readiness as it stands, without driving progress (debug checks).
  short peek_events(short interest);
  // Sleeps until poll_events(interest) may have changed, or timeout.
  // Returns 0, or EINTR / kRestarted when a signal handler ran since
  // `signals` was taken (signals.h).
  // `spin_us`: busy-poll this long first on RDMA; 0 when the caller has
  // just done so (spin()).
  int wait(short interest, int timeout_ms, SignalWatch& signals, uint32_t spin_us);
  // The busy-poll alone: true if the stream is ready for `interest` (or left
  // RDMA) within `spin_us`. What a blocking call does before it reads its
  // socket's SO_RCVTIMEO/SO_SNDTIMEO (a syscall), which only a sleep needs.
  bool spin(short interest, uint32_t spin_us);
  // The kernel socket's SO_RCVTIMEO (rcv) or SO_SNDTIMEO in ms, -1: none.
  // Read once and kept (a getsockopt per blocking wait was one syscall in
  // every round trip); the setsockopt hook forgets it when the program sets
  // either. Read every time while another process holds the socket too
  // (its setsockopt is not seen here).
  int socket_timeout(bool rcv);
  // Both known to be none (Socket::default_timeouts()), before first use.
  void timeouts_none() {
    rcvtimeo_ms_.store(-1, std::memory_order_relaxed);
    sndtimeo_ms_.store(-1, std::memory_order_relaxed);
  }
  void timeouts_changed() {
    rcvtimeo_ms_.store(kTimeoutUnknown, std::memory_order_relaxed);
    sndtimeo_ms_.store(kTimeoutUnknown, std::memory_order_relaxed);
  }
  // Held around the application's TCP_NODELAY calls (the setsockopt and
  // getsockopt hooks), so that push_tcp's toggle of it never undoes nor
  // shows through what the application set. A leaf; no allocation.
  // Bounded: a holder keeps it for two or three syscalls, so one that stays
  // taken was inherited by a fork child from a parent's thread that held it
  // at the fork; going on without it risks only that momentary toggle
  // showing, never a hang. Returns whether it was taken (for unlock_nodelay).
  bool lock_nodelay() { return spin_lock_for(nodelay_lock_, kNodelayTurns); }
  void unlock_nodelay(bool taken) {
    if (taken) spin_unlock(nodelay_lock_);
  }
  static constexpr uint32_t kNodelayTurns = 4096;

  // A buffer for calls that must copy through the stream (sendfile, splice):
  // hooks keep their stack frames small and do not call malloc, so it is
  // mmap'd on first use and unmapped with the stream. Held for the whole
  // copy (concurrent sendfiles on one socket take turns, as their sends
  // would under mu_ anyway). Empty when the mapping failed (ENOMEM).
  static constexpr size_t kScratchSize = 64 * 1024;
  class Scratch {
   public:
    explicit Scratch(Stream& s);
    ~Scratch() {
      s_.scratch_mu_.unlock();
      --t_held_locks;  // (signals.h: no deferred handler runs while it is held)
    }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    std::span<std::byte> buf() const { return buf_; }

   private:
    Stream& s_;
    std::span<std::byte> buf_;
  };

  // --- lifecycle (stream.cc), called by rendezvous/progress code.
  // Drives everything that can be done now. Locks mu_ (try_lock if !block).
  // Returns true if readiness may have changed.
  bool advance(bool block = true);
  void start_client();                        // begin rdma_cm connect
  void start_client_locked();
  // The connect() hook only asks, so connect() costs the application no
  // rdma_cm syscalls; the progress thread or the application's next call
  // (advance_locked) starts the rdma_cm connect upgrade_delay_ms after
  // connect(), or as soon as the connection
  // has moved kEarlyStartBytes on TCP: a connection that ends sooner (one
  // request, one reply) never pays for a rendezvous, whose CPU on both ends
  // made connect-to-first-byte 3.5-4x TCP's in the VM.
  static constexpr uint64_t kEarlyStartBytes = 64 * 1024;
  void request_start(uint64_t at_ns) {
    start_at_ns_.store(at_ns ? at_ns : 1, std::memory_order_release);
    want_loop();
  }
  uint64_t start_at_ns() const { return start_at_ns_.load(std::memory_order_acquire); }
  // (A load first: the progress thread asks every stream on every tick, and
  // an exchange would write each one's cache line each time.)
  bool take_start_request(uint64_t now) {
    uint64_t at = start_at_ns_.load(std::memory_order_relaxed);
    return at != 0 && now >= at &&
           start_at_ns_.compare_exchange_strong(at, 0, std::memory_order_acq_rel);
  }
  void drop_start_request() { start_at_ns_.store(0, std::memory_order_release); }
  // Progress thread: when a pending stream with no rendezvous of its own (a
  // client before its deferred start, a server waiting for its client's
  // request) next needs a look: its start, its deadline, or the next look
  // at its holders. 0: every tick (a rendezvous or a flush runs, a start is
  // due now, or the lock is taken). Such a stream ticking every 1 ms cost
  // the VM about 35 clock reads and 9 epoll_waits per connection.
  uint64_t idle_due_ns(uint64_t now);
  // Under mu_, after TCP carried application bytes: a connection that
  // streams starts its deferred rendezvous with the application's next call
  // (advance_locked): bulk transfers should reach RDMA early.
  void start_early_if_streaming() {
    // (Not a late retry's: it waits for a server that is still starting.)
    uint64_t at = start_at_ns_.load(std::memory_order_relaxed);
    if (at > 1 && !late_retried_ && tcp_tx_ + tcp_rx_ >= kEarlyStartBytes)
      start_at_ns_.compare_exchange_strong(at, 1, std::memory_order_acq_rel);
  }
  // false: refused (closed or fallen back since the match), conn destroyed.
  bool attach_accepted(std::unique_ptr<transport::Connection> conn, uint64_t peer_cookie,
                       uint8_t version);
  // Why it last stayed on or went back to TCP: FallbackReason in the low
  // byte, the peer's wire::RejectReason (with kRejected) in the next; 0 if
  // never (getsockopt RSOCK_FALLBACK_REASON).
  uint16_t fallback_code() const { return fallback_code_.load(std::memory_order_relaxed); }
  // Give the socket back to the kernel (peer_reason: see stats::set_fallback).
  void fall_back(stats::FallbackReason reason, uint8_t peer_reason = 0);
  // A server's: the request matched to it could not be accepted (ours:
  // out of resources; peer_gone: the client's request went away). Falls
  // back, unless it waits to upgrade again and the client went: then it
  // waits for the client's next attempt.
  void accept_failed(stats::FallbackReason reason, bool peer_gone);
  // Counts a fallback for rsock-stat and keeps it for fallback_code().
  void note_fallback(stats::FallbackReason reason, uint8_t peer_reason = 0);
  // Called when the last application fd is gone. Returns true when the
  // stream is finished and may be deleted (else keep calling).
  bool linger_done();
  bool tcp_peer_closed();
  // The application closed its last fd. True when nothing is left for the
  // progress thread but deleting the stream (no connection, the kernel
  // ended the TCP stream with the application's close).
  bool orphan();
  // In a fork child: pending -> plain TCP; switching/RDMA -> ECONNRESET on
  // every call (the RDMA state belongs to the parent). Touches no verbs.
  void detach_after_fork();
  bool orphaned() const { return orphaned_; }
  // After the switch the TCP stream must stay silent. The progress thread
  // watches tcp_fd() once on RDMA (tcp_watched) and calls this when it turns
  // readable: bytes there mean a process without our state (a fork child
  // after exec) wrote to the connection, which is then reset at both ends
  // rather than losing those bytes silently. Returns true to watch again.
  bool check_idle_tcp();

  // --- the reverse switch (stream.cc): RDMA back to TCP at exact offsets,
  // agreed with the peer over the TCP stream. Starts it if the stream is on
  // RDMA; returns whether it started.
  bool revert(RevertMode mode, stats::FallbackReason why);
  // Before another process may use the socket (fork, fd passing): starts a
  // kHandOff revert if on RDMA and drives it until the peer's record is in
  // and the backlog is flushed, or until deadline_ns. Returns false if the
  // stream is still bound to this process's RDMA state (the caller decides).
  bool hand_off(uint64_t deadline_ns,
                stats::FallbackReason why = stats::FallbackReason::kHandedOff);
  // A switch in flight (kSwitching) is driven to its end, RDMA or TCP, by
  // this thread, until deadline_ns: whoever hands a connection to another
  // process must see a settled phase first. (Fork and exec drive every
  // switching stream at once instead: both ends may be in this process and
  // the progress thread is held off then; progress.cc.)
  void settle_switch(uint64_t deadline_ns);
  // Before the socket is sent to another process (SCM_RIGHTS): a pending
  // upgrade stays on TCP, a switch in flight is settled, and a connection
  // on RDMA is handed off (hand_off). Bounded by deadline_ns.
  // Upgrading again in the receiver (docs/DESIGN.md): a connection on RDMA
  // or still waiting for its rendezvous is left shared (holders::claim_passed,
  // one holder more for the receiver in flight) instead of plain.
  bool give_away(uint64_t deadline_ns);
  // After the sendmsg that carried it: failed, no receiver will enlist.
  void pass_done(bool failed);
  // exec with fds of the socket kept open (docs/DESIGN.md, "Upgrading again
  // after exec"), under the registry's lock in progress_before_exec: before
  // the hand-offs, a connection on RDMA is to end shared (prepare_pass);
  // after them, a shared slot for the new image, which takes the socket in
  // at these fd numbers when it starts. False: it stays on TCP.
  void prepare_pass();
  bool pass_to_exec(const int* fds, int n);
  // The receiver (recvmsg): a stream for a socket whose sender left it in
  // the passed slot `h`; it enlists and waits, governed, until it is the
  // only holder.
  void adopt_passed(holders::Slot* h);
  // A connection inherited from processes without librsock (socket/inherit.cc),
  // which moved tx/rx stream bytes on it before us: the positions a switch
  // starts from.
  void adopt_inherited(uint64_t tx, uint64_t rx);
  // Adopted so, and waiting for its first request: its positions are the
  // kernel's TCP counts (never on RDMA, never shared).
  bool adopted_first_wait();
  // Server, waiting for a request: whether its positions count only bytes
  // that went through its TCP socket (never on RDMA here, nor passed in
  // from another process), as a client's taken from its kernel's counters
  // do (wire::kRequestKernel). A fork's other holders count their TCP
  // bytes too, so a fork-per-connection server qualifies.
  bool counts_tcp_only();
  // The nonblocking first half of hand_off(). at_exit: the process is
  // exiting (no fallback counted, logged at debug level only).
  // A connection on RDMA whose both directions are over
  // (Connection::finished_both_ways) is left as it is at exit: a switch
  // back would move nothing.
  void start_hand_off(bool at_exit = false,
                      stats::FallbackReason why = stats::FallbackReason::kHandedOff);
  // --- fork (docs/DESIGN.md, "Upgrading again in the new owner"). Under the
  // registry's lock in progress_before_fork, after the hand-offs: the child
  // about to be forked will hold the connection too. A stream waiting for
  // its rendezvous or handed off just now counts itself and the child as
  // holders (socket/holders.h) and waits, governed, until one process is
  // left holding it, which then upgrades it again. False if it cannot (the
  // caller lets a pending one fall back).
  bool share_at_fork();
  // Before the hand-offs of a fork: an upgraded stream's reverse switch is
  // to end shared (enter_shared), not plain.
  void share_after_hand_off();
  // After fork(), in the parent (failed: no child; its count is dropped)
  // and in the child.
  void fork_done(bool failed);
  // Held by more than one process since a fork (waiting for the others to
  // close), or handed off to become so once its reverse switch settles: a
  // fork child keeps it in its registry.
  bool shared_by_fork() const { return shared_.load(std::memory_order_acquire) || share_after_revert_; }
  // This process holds the socket no longer (its last fd closed, exit).
  void release_holders();
  // exec with every fd of the socket close-on-exec: the hold is given up
  // (the slot kept, so that an exec that fails poisons it: exec_failed).
  void release_for_exec();
  void exec_failed();
  bool keep_at_spawn = false;  // progress_before_exec, under the registry's lock
  bool exec_pass = false;      // ... the new image inherits it (pass_to_exec)
  // A server stream that became the only holder: the progress thread makes
  // its next request reachable (its own listener, or a claim in the
  // listening socket's share table), once.
  bool take_claim_request() {
    return claim_wanted_.load(std::memory_order_relaxed) &&
           claim_wanted_.exchange(false, std::memory_order_acq_rel);
  }
  // The share table of the listening socket a server stream was accepted
  // on (socket/listen_share.h), if any: a fork child that becomes its only
  // holder publishes it there.
  void set_listen_table(listen_share::Table* t) { listen_table_ = t; }
  listen_share::Table* listen_table() const { return listen_table_; }

  // Tests: the RDMA path fails as a broken link would (RSOCK_DEBUG_FAIL_PATH).
  void debug_fail_path();
  // The progress thread's loss check (transport/path_quality.h), which may
  // not wait for mu_: the device and port of the RDMA connection and the
  // stream bytes it has moved; false if not on RDMA or mu_ is taken.
  struct PortLook {
    char device[64];
    uint8_t port;
    uint64_t moved;
    uint64_t acked;      // our bytes the device acknowledged (Connection::tx_acked)
    uint64_t in_flight;  // posted and not acknowledged yet
    uint32_t window;     // the peer's ring: the most that can be in flight
  };
  bool look_port(PortLook* out);
  // revert() if mu_ is free right now; whether it started.
  bool try_revert(RevertMode mode, stats::FallbackReason why);
  uint64_t moved_at_loss_check = 0;  // progress thread only, under its lock
  PortLook loss_look{};              // ... the port of its last look
  bool loss_look_valid = false;      // ... loss_look is of this stream on RDMA
  bool loss_busy = false;            // ... it moved bytes since the look before, or was locked
  // Upgrading again after a reverse switch (docs/DESIGN.md, "Upgrading
  // again"): a client's next rendezvous attempt is due (the progress thread
  // then calls start_client()); and whether the stream only waits for one
  // (client: its timer; server: the client's request), which needs no fast
  // tick.
  bool reupgrade_due(uint64_t now) const {
    uint64_t t = reup_at_ns_.load(std::memory_order_acquire);
    return t != 0 && now >= t;
  }
  uint64_t reupgrade_at_ns() const { return reup_at_ns_.load(std::memory_order_acquire); }
  bool claim_requested() const { return claim_wanted_.load(std::memory_order_acquire); }
  bool waits_to_reupgrade() const { return reup_waiting_.load(std::memory_order_acquire); }
  bool tcp_watch_armed = false;  // progress thread only: the one-shot idle-TCP watch is armed
  bool tcp_watched = false;  // progress thread only, under its lock
  bool awaiting = false;     // in the registry's `awaiting` list (under its lock)
  // Matched to a request whose accept the progress thread has not finished
  // (set under the registry's lock, cleared without it): not matched again
  // meanwhile, and a give_away waits for it as for a rendezvous.
  std::atomic<bool> accepting{false};
  size_t reg_index = 0;      // where the registry holds it (under its lock)
  uint64_t next_tick_ns = 0;  // progress thread only: next look while on RDMA
  // The progress thread's schedule (socket/progress.cc, "The registry at
  // scale" in docs/DESIGN.md): a stream that needs a look every tick is on
  // its active list; one that needs a look only at a time (its keepalive on
  // RDMA, an attempt to upgrade again, a wait's end) is in its timer set at
  // loop_due_ns; a settled one (plain, or broken until its close) is in
  // neither. Anything that changes what a stream needs from the thread
  // (a phase, a start or claim request, a retry time, an accepted request,
  // its close) calls want_loop(): it goes on a lock-free stack the thread
  // moves to its active list at its next tick. Under the registry's lock.
  using LoopHook = boost::intrusive::list_member_hook<
      boost::intrusive::link_mode<boost::intrusive::auto_unlink>>;
  using TimerHook = boost::intrusive::set_member_hook<
      boost::intrusive::link_mode<boost::intrusive::auto_unlink>>;
  LoopHook loop_hook;
  TimerHook timer_hook;
  uint64_t loop_due_ns = 0;
  // Any thread, no lock: ask the thread to look at this stream.
  void want_loop();
  std::atomic<bool> loop_wanted{false};  // on the stack (cleared by the thread)
  Stream* wanted_next = nullptr;         // the stack's link

  Phase phase() const { return phase_.load(std::memory_order_acquire); }
  bool client() const { return client_; }
  const sockaddr_storage& peer() const { return peer_; }
  const sockaddr_storage& local() const { return local_; }
  uint64_t cookie() const { return my_cookie_; }
  uint64_t deadline_ns() const { return deadline_ns_; }
  // A connection is attached (the rendezvous has one). A pending server
  // stream's is attached only by the progress thread: read by it, or with
  // it parked (fork, exec, exit: progress.cc).
  bool has_conn() const { return conn_ != nullptr; }
  // The kernel socket: the application's own fd (the one connect() or
  // accept() returned) until the application closes that number; from then
  // on a dup of our own (retire_fd). Any thread; it may change under a
  // reader that holds no lock (both numbers name the same socket until the
  // application's close returns).
  int tcp_fd() const { return tcp_fd_pub_.load(std::memory_order_acquire); }
  // Whether `fd` is the application's number this stream uses (retire_fd
  // is needed before it is closed). Lock-free.
  bool uses_app_fd(int fd) const {
    return tcp_fd() == fd && !tcp_owned_.load(std::memory_order_acquire);
  }
  // The application is about to close `fd` (close, close_range, or dup2
  // onto it) and it is the number this stream uses: the stream takes a dup
  // of its own (in the owned band) and moves its tcp_hub entry there. The
  // caller moves the progress thread's idle-TCP watch. False if fd is not
  // (or no longer) the one this stream uses.
  // `last`: fd is the socket's last name (the connection ends with it).
  bool retire_fd(int fd, bool last);
  // epoll emulation (readiness.cc): while data may come over TCP, the TCP
  // socket is in the tcp_hub (socket/tcp_hub.h). Idempotent, cheap when
  // already there.
  void watch_tcp();
  // tcp_hub, under cm_hub::mu(): the TCP socket fired `events`.
  void tcp_event(uint32_t events);
  stats::ConnSlot* slot() const { return slot_; }
  void wake();              // pokes waiters (sleeper fds, epoll registrations)
  void completion_event();  // cq_hub: pokes only the waiters that need it
  // Blocking calls and the poll/select emulation sleep on their thread's
  // wake eventfd (thread_wake_fd()), entered here for the sleep: one
  // library fd per sleeping thread, none per connection (issue 11: a
  // poll() program with 1000 upgraded sockets under ulimit -n 1024). False
  // when all kSleeperSlots are taken (more threads asleep on this one
  // socket): that sleeper sleeps in kNoWakeSliceMs slices instead. Enter
  // before sleep_begin(): a change after its generation check then finds
  // the fd (both seq_cst).
  bool add_sleeper(int fd);
  void remove_sleeper(int fd);
  // Bumped on every change waiters care about.
  uint64_t generation() const { return gen_.load(std::memory_order_seq_cst); }
  // Edge-triggered epoll (readiness.cc) reports arrivals, not internal
  // changes: the stream position up to which the peer's bytes have arrived
  // (read or not; the kernel socket's queue counts while data may be on
  // TCP), and a count of "send room appeared on RDMA" events.
  uint64_t rx_arrived();
  uint64_t tx_room_events() const { return tx_gen_.load(std::memory_order_acquire); }
  bool on_rdma() const { return phase() == Phase::kRdma; }
  // Waiters announce themselves around sleeping, so that a thread that
  // changes readiness in passing (a recv that also polled the CQ) knows
  // whether anyone needs a poke. sleep_begin(seen) returns false when the
  // generation moved past `seen` (the one the waiter's last look was based
  // on): such a change may have found no sleeper to poke, so the waiter must
  // look again instead of sleeping (it still calls sleep_end()).
  bool sleep_begin(uint64_t seen) {
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    return generation() == seen;
  }
  void sleep_end() { sleepers_.fetch_sub(1, std::memory_order_acq_rel); }

  // epoll's ready lists (readiness.cc): every user-space registration of
  // the socket is in the socket's list (Socket::watches); wake() and the
  // data path's announce push them all onto their sets' ready lists, without
  // a syscall unless a thread sleeps in such a set. `s` is the socket while
  // an application fd names it; release_owner() (the last fd closed) pushes
  // once more, so the sets drop the registrations, and stops the pushes.
  void set_owner(Socket* s) { owner_.store(s, std::memory_order_release); }
  void release_owner();

 private:
  // Under mu_:
  // `full`: also rdma_cm events, timers and CQ re-arming (a syscall or
  // more); the data path's attempts only poll completions (no syscall).
  bool advance_locked(bool full = true);
  void advance_inline(bool full);  // advance_locked() + announce() on a change
  // New generation; pokes the sleepers there are, pushes the epoll
  // registrations. No lock needed.
  void announce();
  void push_watches();  // the socket's epoll registrations (owner_)
  void connect_locked(uint16_t rport);
  void enter_switching();
  bool caches_failure(stats::FallbackReason reason, bool cache) const;
  void log_rendezvous_timeout() const;
  // The kernel socket's free send space, roughly (SIOCOUTQ against SO_SNDBUF).
  size_t tcp_send_space() const;
  void rdma_failed_during_switch();
  void revert_to_tcp(stats::FallbackReason reason, const char* why);
  void begin_close();
  // `cq_drained`: the caller's progress step has just polled the CQ empty,
  // so reading the queued control messages needs no poll of its own.
  void handle_controls(bool cq_drained = false);
  void write_marker();
  void drain_tcp();
  enum class RecordIo : uint8_t { kDone, kAgain, kClosed, kBroken };
  RecordIo read_record(void* rec, size_t size, size_t* done);
  RecordIo write_record(const void* rec, size_t size, size_t* done);
  void push_tcp();
  // `may_return`: the stream may upgrade again once back on TCP (a failed
  // path, or a peer that switched back); not after the application asked,
  // a hand-off to another process, a lossy path, io_uring or exit.
  bool revert_locked(RevertMode mode, stats::FallbackReason why, bool report = true,
                     bool may_return = false);
  bool may_reupgrade() const;
  // Whether a connection back on TCP may still go onto RDMA again: nothing
  // ended, nothing of ours is only in this process's memory.
  bool reupgradable() const;
  // The common start of a later rendezvous: a new cookie, the switch state
  // reset, kPending governing every TCP byte.
  void prepare_reupgrade();
  void begin_reupgrade();
  // The client's next attempt after `delay_ns`, the server's wait for as long
  // as the client's attempts can take.
  void schedule_reupgrade(uint64_t delay_ns);
  void enter_shared();     // waits for the other holders to close
  bool share_for_pass_locked();
  holders::Slot* claim_holders();
  stats::FallbackReason failure_reason() const;
  stats::FallbackReason peer_record_reason() const;
  void become_sole();      // the only holder now: positions from the slot
  void release_holders_locked();
  // A re-upgrade attempt failed for `reason`: true if another is scheduled
  // (the stream stays pending, without a connection).
  bool retry_reupgrade(stats::FallbackReason reason);
  bool late_retry(stats::FallbackReason reason);
  // Waiting to upgrade again, and it cannot be: plain TCP now, quietly.
  void abandon_reupgrade();
  void stay_on_tcp_locked();
  bool advance_revert();
  void finish_revert_peer_gone(const char* why);
  void set_phase(Phase p);
  void break_connection(int err, const char* why);
  size_t copy_staging(std::span<const iovec> iov, bool peek);
  bool tcp_tx_open() const { return !offer_sent_; }
  bool tcp_rx_open() const { return !offer_rcvd_; }
  Status<size_t> try_recv(std::span<const iovec> iov, int flags);
  Status<size_t> try_recv_source(std::span<const iovec> iov, int flags);
  Status<size_t> try_send(std::span<const iovec> iov, int flags);
  // Bytes written while the switch runs (held_): our TCP direction is
  // closed at the OFFER and RDMA may not carry application bytes before the
  // peer's marker is verified, but a kernel socket takes a fresh
  // connection's writes at once. So they are accepted here, up to
  // held_cap_, and go out first on whichever path carries our direction
  // next: RDMA once the switch ends, TCP if it is abandoned.
  bool holds(int flags) const {
    return phase() == Phase::kSwitching && offer_sent_ && !rdma_dead_ && !wr_shut_ && conn_ &&
           held_cap_ > 0 && !(flags & MSG_OOB);
  }
  bool held_pending() const { return held_off_ < held_.size(); }
  // Under mu_: the switch's RDMA connection died after our marker started
  // and the switch cannot end in the peer's reverse switch: our marker is
  // incomplete (the peer cannot have verified it), the peer's TCP ended
  // before its marker, or it speaks no reverse switch. Our writes fail
  // (EPIPE) and what they held is dropped, as a kernel socket's would be.
  bool switch_dead_end() const {
    return rdma_dead_ && out_marker_off_ > 0 &&
           (out_marker_off_ < sizeof out_marker_ || (tcp_eof_ && !verified_) ||
            version_ < wire::kRevertVersion);
  }
  // Under mu_: the switch's RDMA connection died after our whole marker
  // went out and the peer's marker is verified: its record (or its EOF)
  // follows, and maybe_join_revert joins its reverse switch.
  bool join_pending() const {
    return phase() == Phase::kSwitching && rdma_dead_ && verified_ && conn_ && tcp_fd_ >= 0 &&
           out_marker_off_ == sizeof out_marker_ && version_ >= wire::kRevertVersion;
  }
  bool maybe_join_revert();
  size_t hold(std::span<const iovec> iov);
  // Sends what it can of held_; true once it is empty (or can never go:
  // the connection broke, as bytes in a kernel socket's queue would).
  bool flush_held();
  // shutdown(SHUT_WR) deferred during the switch: the FIN, on the path that
  // carries our direction now, after any held bytes.
  void deferred_fin();
  short events_locked(short interest, int slept_fd = -1);
  // Under mu_: everything of the switch that readiness depends on, to tell
  // whether a step changed any of it.
  auto switch_state() const {
    return std::tuple(staging_.size() - staging_off_, tcp_tx_, tcp_rx_, offer_sent_, ready_rcvd_,
                      out_marker_off_, offer_rcvd_, ready_sent_, verified_, in_marker_got_,
                      tcp_eof_, rdma_dead_, plain_when_drained_, down_out_off_, down_in_got_,
                      down_done_, backlog_ != nullptr, return_out_off_, return_in_got_,
                      held_.size() - held_off_);
  }
  // Our side of the reverse switch is written (record, returned bytes,
  // backlog) and the peer's record is in: new bytes may follow on TCP.
  bool revert_settled() const {
    return down_done_ && backlog_ == nullptr && return_out_off_ == return_out_.size() &&
           !held_pending();
  }
  bool revert_out_pending() const {
    return down_out_off_ < sizeof down_out_ || return_out_off_ < return_out_.size() ||
           backlog_ != nullptr || held_pending();
  }

  std::mutex mu_;
  std::atomic<bool> nodelay_lock_{false};  // lock_nodelay(); inside mu_ when both
  std::mutex scratch_mu_;         // held by a Scratch; never together with mu_ taken first
  std::byte* scratch_ = nullptr;  // kScratchSize bytes, mmap'd by the first Scratch
  std::atomic<Phase> phase_{Phase::kPending};
  std::atomic<uint16_t> fallback_code_{0};
  std::atomic<bool> governs_{true};
  std::atomic<uint64_t> gen_{0};
  std::atomic<uint64_t> tx_gen_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<uint64_t> start_at_ns_{0};  // a deferred start is due then (0: none, 1: now)
  std::atomic<Socket*> owner_{nullptr};
  // The kernel socket (tcp_fd()): the application's number, or our own dup
  // once tcp_owned_; -1 once aborted. Written under mu_ (and the progress
  // thread's registry lock, for its idle-TCP watch); tcp_fd_pub_ is the
  // copy for readers without mu_.
  int tcp_fd_;
  std::atomic<int> tcp_fd_pub_;
  std::atomic<bool> tcp_owned_{false};
  void set_tcp_fd(int fd, bool owned) {
    tcp_fd_ = fd;
    tcp_owned_.store(owned, std::memory_order_release);
    tcp_fd_pub_.store(fd, std::memory_order_release);
  }
  // The number of our tcp_hub entry, -1 if none: written under mu_, read
  // without it by watch_tcp's fast path.
  std::atomic<int> hub_fd_{-1};
  // Under mu_: whether data may come over TCP (the tcp_hub entry is wanted).
  bool tcp_hub_wanted() const;
  void unwatch_tcp_locked();
  // The wake fds of the threads asleep on this stream (add_sleeper), -1 in
  // a free slot; poked by every change waiters care about.
  static constexpr int kSleeperSlots = 4;
  std::atomic<int> sleeper_fds_[kSleeperSlots] = {-1, -1, -1, -1};
  void poke_sleepers();
  const bool client_;
  sockaddr_storage local_{}, peer_{};
  stats::ConnSlot* slot_;
  uint64_t my_cookie_ = 0, peer_cookie_ = 0;
  uint8_t version_ = 0;  // the rendezvous version both ends speak (wire::negotiate)
  uint64_t deadline_ns_ = 0;
  uint64_t born_ns_ = 0;  // for the rendezvous timeline in debug logs
  uint64_t switch_ns_ = 0;  // when the latest switch began (RDMA connection up), for rsock-stat
  uint64_t attempt_ns_ = 0;  // client: when its latest rendezvous started (negative cache)
  unsigned long long us_since_start() const;
  bool redirected_ = false;  // the client followed a listener's redirect
  // The client's first rendezvous found no rdma_cm listener and is made
  // once more, at half its window (advance_locked).
  bool late_retried_ = false;
  static constexpr uint64_t kMovedRetryNs = 100'000'000;
  bool adopted_ = false;  // positions from the kernel (adopt_inherited)
  // Under mu_: the connection was on RDMA in this process (or came from
  // another one, whose history is unknown): its positions may count bytes
  // its TCP socket never carried (counts_tcp_only). A fork child's copy
  // keeps its parent's.
  bool rdma_ever_ = false;
  std::unique_ptr<transport::Connection> conn_;
  int err_ = 0;
  bool err_reported_ = false;  // err_ went to the application once
  int report_error();          // under mu_: err_, once

  uint64_t tcp_tx_ = 0, tcp_rx_ = 0;   // application bytes carried by TCP
  // Our direction (tx): OFFER -> READY -> MARKER.
  bool offer_sent_ = false, offer_queued_ = false, ready_rcvd_ = false;
  wire::Marker out_marker_{};
  size_t out_marker_off_ = 0;
  // Peer's direction (rx): OFFER -> READY -> drain to limit -> MARKER check.
  bool offer_rcvd_ = false, ready_queued_ = false, ready_sent_ = false, verified_ = false;
  uint64_t rx_limit_ = 0;
  wire::Marker in_marker_{};
  size_t in_marker_got_ = 0;
  std::vector<std::byte> staging_;      // TCP bytes read ahead of the app
  size_t staging_off_ = 0;
  bool tcp_eof_ = false;                // TCP FIN reached at the peer's offer
  bool rdma_dead_ = false;              // RDMA connection failed mid-switch
  bool plain_when_drained_ = false;     // fell back: plain once staging is read
  bool wr_shut_ = false, rd_shut_ = false;
  bool fin_deferred_ = false;           // shutdown(SHUT_WR) before the switch ended
  bool fin_waits_held_ = false;         // ... and its FIN waits for held_ to go out
  std::vector<std::byte> held_;         // written while switching (holds()), not sent yet
  size_t held_off_ = 0;                 // sent of held_
  size_t held_cap_ = 0;                 // how much the switch may hold (enter_switching)
  bool orphaned_ = false;
  bool close_started_ = false;
  bool closed_second_ = false;  // our FIN went after the peer's (linger_done)
  // The reverse switch.
  wire::DownRecord down_out_{};
  size_t down_out_off_ = 0;
  wire::DownRecord down_in_{};
  size_t down_in_got_ = 0;
  bool down_done_ = false;      // the peer's DOWN (and returned bytes) in: TCP carries both ways
  uint64_t tx_sent_abs_ = 0;    // our stream bytes when the revert began
  Backlog* backlog_ = nullptr;  // to resend on TCP before new data
  // Returned bytes (rendezvous 4, hand-off mode): the peer's pre-switch TCP
  // bytes we drained to reach its marker and the application never read go
  // back to it right after our DOWN, and it sends them again in its backlog,
  // so they reach whichever process has the socket next. return_out_: ours
  // to write; return_in_*: the peer's, read into the front of backlog_.
  std::vector<std::byte> return_out_;
  size_t return_out_off_ = 0;
  bool down_parsed_ = false;    // the peer's DOWN is checked, its returned bytes follow
  size_t return_in_need_ = 0, return_in_got_ = 0;
  uint64_t linger_deadline_ns_ = 0;
  // Upgrading again (docs/DESIGN.md): this kPending is a later rendezvous
  // of a connection that was on RDMA; its failure is quiet (no fallback
  // counted, nothing cached but a lossy path), the stream just stays on TCP.
  bool reup_ = false;
  bool sole_after_share_ = false;  // server: became the only holder (made itself reachable)
  bool reup_allowed_ = false;  // the running reverse switch may end in one
  int reup_tries_ = 0;         // client: attempts made
  std::atomic<uint64_t> reup_at_ns_{0};  // client: the next attempt is due (0: none)
  std::atomic<bool> reup_waiting_{false};
  // Upgrading again in the new owner after fork (share_at_fork). holders_:
  // the slot this process counts its TCP bytes into, while it holds one.
  holders::Slot* holders_ = nullptr;
  std::atomic<bool> shared_{false};   // pending, waiting to be the only holder
  static constexpr int kTimeoutUnknown = -2;
  std::atomic<int> rcvtimeo_ms_{kTimeoutUnknown}, sndtimeo_ms_{kTimeoutUnknown};  // socket_timeout
  bool share_after_revert_ = false;   // handed off at fork: shared once settled
  bool added_at_fork_ = false;        // share_at_fork counted the child
  bool pass_after_revert_ = false;    // give_away: its hand-off ends shared, unclaimed
  int passes_in_flight_ = 0;          // give_away counted a receiver; pass_done follows
  bool count_next_upgrade_ = false;   // an upgrade this process never counted
  uint64_t reap_at_ns_ = 0;           // next look for holders gone (holders::reap)
  std::atomic<bool> claim_wanted_{false};
  listen_share::Table* listen_table_ = nullptr;
  holders::Slot* exec_released_ = nullptr;  // release_for_exec, until exec_failed
  bool exec_passed_ = false;  // ... by pass_to_exec: an exec that fails takes it back
};

// The fallback reason for a connection whose rdma_cm setup failed, and
// whether the peer goes into the negative cache.
std::pair<stats::FallbackReason, bool> setup_fallback(const transport::Connection& c);
// Once per process: the pinned-memory budget is used up (a warning line).
void warn_memlock();
// Once per process: the mapping budget (transport/pinned.h) is used up.
void warn_maps();

// Whether this process can use RDMA at all (a verbs device exists); cached.
bool rdma_available();

// Whether any Stream exists in this process: until then readiness calls go
// straight to the kernel without looking at their fds.
extern std::atomic<int> g_streams_alive;
inline bool streams_exist() { return g_streams_alive.load(std::memory_order_relaxed) > 0; }

}  // namespace rsock::socket
