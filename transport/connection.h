// Connection: one reliable byte stream over an RC QP (rdma_cm, RDMA_PS_TCP).
//
// Everything is nonblocking: calls return Err(EAGAIN) when they would block and
// the caller waits for fd() to become readable or for its notify callback,
// then calls progress(). fd() is the completion channel the shared CQs
// (cq_group.h) of every connection on the device raise their events on (cq_hub.h; -1 until the route is resolved):
// a connection has no fd of its own.
// rdma_cm events arrive through the process's shared channel (cm_hub.h),
// which queues them here and calls the notify callback. Deadlines and
// keepalives are checked by progress(), which the owner calls often enough
// (the socket layer's progress thread ticks; wait() bounds its sleeps).
// Data already buffered does not make fd() readable: check readable() first.
//
// Thread safety: none inside. One thread at a time per Connection (the socket
// layer serialises); different Connections are independent.
//
// Wire format: transport/wire.h and docs/wire-format.md. Design notes:
// docs/TRANSPORT.md.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <rdma/rdma_cma.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "config/tunables.h"
#include "transport/cq_group.h"
#include "transport/kit_pool.h"
#include "transport/ring.h"
#include "transport/pinned.h"
#include "transport/wire.h"
#include "util/status.h"

struct ibv_pd;
struct ibv_cq;
struct ibv_mr;
struct ibv_comp_channel;
struct ibv_wc;

namespace rsock::transport {

using wire::RejectReason;

struct Counters {
  uint64_t bytes_sent = 0;       // stream bytes handed to the QP
  uint64_t bytes_received = 0;   // stream bytes copied out by recv()
  uint64_t data_wrs = 0;         // RDMA_WRITE_WITH_IMM posted
  uint64_t inline_wrs = 0;       // of which inline
  uint64_t data_posts = 0;       // ibv_post_send calls that carried them (chained)
  uint64_t data_recvs = 0;       // DATA completions received
  uint64_t credits_sent = 0;
  uint64_t credits_received = 0;
  uint64_t controls_sent = 0;
  uint64_t controls_received = 0;
  uint64_t keepalives = 0;
  uint64_t stalls = 0;  // stall watchdog fired (stall_timeout_ms)
  uint64_t ring_grows = 0;    // our receive ring moved to its grown size
  uint64_t ring_shrinks = 0;  // ... and back to its first size
  uint64_t send_ring_moves = 0;  // our send ring followed the peer's ring size
  uint64_t credit_stalls = 0;    // send() found no peer credit (bytes or WRs)
  uint64_t completions = 0;      // CQEs polled
  uint64_t cq_events = 0;        // completion channel wakeups
  int first_wc_error = 0;        // ibv_wc_status of the first failed completion (0: none)
};

// An application control message (send_control), with the stream position at
// which it arrived: the number of data bytes the peer had sent before it.
struct ControlMessage {
  uint8_t type = 0;
  uint8_t len = 0;
  uint64_t stream_pos = 0;
  std::byte data[wire::kMaxAppControlBytes] = {};
};

class Listener;

// Keepalives per second the process sends at most (connection.cc): the
// period an idle connection probes its peer with, for its keepalive_ms and
// the process's number of established connections (0: no keepalive).
constexpr uint64_t kKeepaliveRate = 200;
uint64_t keepalive_period_ns(uint32_t keepalive_ms, uint64_t established);
uint64_t keepalive_period_ns(uint32_t keepalive_ms);  // with the process's count

class Connection {
 public:
  // Starts an active open; completes in progress() (established() or an error
  // from progress()). `payload` (<= 32 bytes) reaches the peer in the request.
  static Status<std::unique_ptr<Connection>> connect(const sockaddr* dst, const sockaddr* src,
                                                     std::span<const std::byte> payload,
                                                     const config::Tunables& tun);
  // Orderly if possible: shutdown_write(), waits (bounded by
  // connect_timeout_ms) until every posted byte is acknowledged, disconnects,
  // releases everything. Use close()+closed() to do the same without blocking.
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // What to sleep on for completions: the completion hub's fd, shared by
  // every connection of the process (cq_hub.h; whoever wakes on it calls
  // cq_hub::poll() or progress()); -1 while there is no CQ yet.
  int fd() const;
  // Called (from any thread, under cm_hub::mu(): it must not block or take
  // locks) when an rdma_cm event was queued for this connection.
  // An event queued before this call is handled by the next progress().
  // `cq_fn`, if given, is called instead for completion events (cq_hub), the
  // frequent ones.
  void set_notify(void (*fn)(void*), void* arg, void (*cq_fn)(void*) = nullptr);
  // cm_hub only, under cm_hub::mu().
  void deliver_cm_event(const rdma_cm_event& ev);
  // cq_group only, under cm_hub::mu(): completions of ours were filed in our
  // box by someone else's poll of the shared CQ (`mark`), or taken by our
  // own (the callback alone: another thread may sleep on us).
  void deliver_cq_event(bool mark = true);
  // cq_group only, by our owner: our box still holds completions.
  void mark_cq_backlog() { cq_event_.store(true, std::memory_order_release); }
  // rdma_cm events wait for the next progress() (not poll_completions()).
  bool cm_pending() const { return cm_pending_.load(std::memory_order_acquire); }
  // Completions of ours wait in our box (cq_group.h): the next progress()
  // takes them, which whoever sleeps on this connection next needs (no
  // event keeps the hub's fd readable for them).
  bool cq_event_pending() const { return cq_event_.load(std::memory_order_acquire); }
  // Handles cm events, completions, deadlines and keepalives. Returns the
  // connection's error once it has one (ECONNREFUSED, ETIMEDOUT, ECONNRESET..).
  Status<void> progress();
  // The data path's cheap progress: polls the CQ and flushes what waited for
  // room, without any syscall. Callers still call progress() before they
  // sleep on fd() and from time to time (timers, rdma_cm events, re-arming).
  // `took` (optional): set to whether the poll took any completion.
  Status<void> poll_completions(bool* took = nullptr);

  bool established() const { return state_ == State::kEstablished || state_ == State::kClosing; }
  bool connecting() const { return state_ < State::kEstablished; }
  int error() const { return err_; }
  // Where the setup is (for a timeout's report): "resolving address",
  // "resolving route", "connecting", "accepting", "established", ...
  // Once failed: the step it failed in.
  const char* stage() const {
    static constexpr const char* kNames[] = {"idle", "resolving address", "resolving route",
                                             "connecting", "accepting", "established",
                                             "closing", "closed", "failed"};
    return kNames[static_cast<int>(state_ == State::kError ? failed_in_ : state_)];
  }
  RejectReason reject_reason() const { return reject_reason_; }
  // With reject_reason() kRedirect: the port (host order) to send the same
  // request to.
  uint16_t redirect_port() const { return redirect_port_; }
  // Why connection setup failed (kNone while it has not), for the socket
  // layer's fallback reason and its negative cache.
  enum class SetupFailure : uint8_t {
    kNone,
    kResolve,     // address or route resolution failed or timed out
    kMemlock,     // pinned-memory budget or RLIMIT_MEMLOCK (local)
    kResources,   // PD/CQ/QP/fd creation failed (local)
    kNoListener,  // the CM rejected: nothing listens on the peer's rdma_cm port
    kRejected,    // the peer's librsock rejected: reject_reason() says why
    kTimeout,     // no answer to the connect within connect_timeout_ms
    kConnect,     // any other connect error (unreachable, connect error)
  };
  SetupFailure setup_failure() const { return setup_failure_; }

  // Copies as much as peer credit and the send ring allow; EAGAIN if nothing.
  // EPIPE after shutdown_write() or once the peer closed, the error otherwise.
  Status<size_t> send(std::span<const iovec> iov);
  // Copies out buffered bytes; 0 = end of stream (peer's FIN, all read).
  Status<size_t> recv(std::span<const iovec> iov, bool peek);
  size_t readable() const;
  size_t writable() const;
  bool eof() const { return fin_received_ && rx_.readable() == 0; }
  // The peer's FIN came (its bytes before it may be unread still).
  bool fin_received() const { return fin_received_; }
  // Whether a control message of `type` has arrived and is still unread
  // (polls the CQ first, as recv_control does by default; consumes nothing).
  bool control_queued(uint8_t type);
  // Our FIN went after the peer's had arrived: we closed second (like a
  // kernel socket leaving CLOSE_WAIT).
  bool fin_after_peer() const { return fin_after_peer_; }

  // Half-close: FIN after the last byte sent. Idempotent.
  Status<void> shutdown_write();
  // FIN + CLOSE ("I will read no more"), disconnects once every posted WR is
  // acknowledged. closed() then turns true. Nonblocking; drive with progress().
  Status<void> close();
  bool closed() const { return state_ == State::kClosed || state_ == State::kError; }

  // Application control message, ordered with the data (type is opaque here).
  Status<void> send_control(uint8_t type, std::span<const std::byte> data);
  // EAGAIN if none queued. With none queued it polls the CQ first, unless
  // `poll` is false: for a caller that has just drained it.
  Status<ControlMessage> recv_control(bool poll = true);
  // Control messages wait in the queue (recv_control would return one
  // without polling).
  bool controls_queued() const { return !controls_.empty(); }

  // For tests and simple callers: blocks until POLLIN (readable, EOF, error or
  // a control message) / POLLOUT (established and writable, or error) holds,
  // busy-polling the CQ for spin_us first. ETIMEDOUT after timeout_ms (<0: none).
  Status<void> wait(short events, int timeout_ms);

  std::span<const std::byte> peer_payload() const {
    return {reinterpret_cast<const std::byte*>(peer_.payload), peer_.payload_len};
  }
  uint32_t qp_num() const;
  // The device and port the connection runs on (for the port's counters,
  // path_quality.h); nullptr / 0 while there is no QP.
  const char* device_name() const;
  uint8_t port_num() const;
  const Counters& counters() const { return ctr_; }
  // Ring occupancy and credit, for rsock-stat.
  struct Gauges {
    uint32_t ring_bytes;      // capacity of our receive ring now
    uint32_t send_ring_used;  // bytes in our send ring not yet acknowledged
    uint32_t recv_ring_used;  // bytes in our receive ring not yet read
    uint32_t credit_bytes;    // bytes the peer's ring can take now
  };
  Gauges gauges() const;
  uint64_t tx_position() const { return tx_.head(); }  // stream bytes sent
  uint64_t rx_position() const { return rx_.tail(); }  // stream bytes consumed
  uint64_t rx_arrived() const { return rx_.head(); }   // stream bytes received
  // Stream bytes the device has acknowledged (a signalled send completion
  // retires it and every write before it): tx_position() - tx_acked() is in
  // flight, the measure of a path that is the limit (path_quality.h).
  uint64_t tx_acked() const { return sring_.tail(); }
  uint32_t send_window() const { return tx_.ring_bytes(); }  // the peer's ring now

  // For the socket layer's reverse switch (RDMA back to TCP): the stream
  // bytes still held in the send ring are [retained_from(), tx_position()):
  // everything the peer has not reported consumed. copy_sent copies n of
  // them from stream position `from` (the caller checks the range).
  uint64_t retained_from() const { return sring_.floor(); }
  void copy_sent(uint64_t from, std::byte* out, size_t n) const;
  // Stops at once: no FIN, no linger, a DREQ and the QP in error. The rings
  // stay readable until the Connection is destroyed, which then never blocks.
  void abort();
  // The peer disconnected after its FIN but without CLOSE: it stopped using
  // this connection without closing its socket (a reverse switch after
  // shutdown(SHUT_WR)), so our direction may go on elsewhere.
  bool peer_left_open() const { return disconnected_ && fin_received_ && !close_received_; }
  // The peer's rdma_cm ended the connection (a DISCONNECTED: its process
  // closed or exited, or it disconnected), as opposed to a failure found here
  // (our QP's error, a timeout) with no word from the peer.
  bool peer_disconnected() const { return disconnected_; }
  // Both directions are over: our FIN went and the peer consumed every byte
  // we sent (its last report), and we read everything up to its FIN. A QP
  // that fails now loses nothing (the peer closing its process last, say).
  bool finished_both_ways() const {
    return fin_sent_ && eof() && sring_.floor() == tx_.head();
  }
  uint32_t max_inline() const { return max_inline_; }

  // Tests only: moves the QP to the error state without telling the peer
  // (no DREQ), as if the host had vanished; the peer must notice through its
  // keepalive. The connection is unusable afterwards.
  Status<void> debug_break_silently();
  // Tests only: moves the QP to SQD, so the device stops taking WRs from the
  // send queue while the QP stays alive (what rxe does after a failed
  // transmit); the stall watchdog (stall_timeout_ms) must notice.
  Status<void> debug_stall_sends();
  // Tests only (a hostile peer): posts on this QP an RDMA WRITE of 8 bytes
  // aimed at the receive ring that `other` writes to, with other's rkey, as
  // a peer would that tries to reach another connection's memory. The
  // target's device must refuse it (the rkey belongs to another PD): this
  // connection then fails with IBV_WC_REM_ACCESS_ERR (first_wc_error).
  Status<void> debug_write_foreign(const Connection& other);
  // The same at a ring named by address and rkey: one a closed connection's
  // peer had (debug_peer_ring), whose kit another connection now uses.
  Status<void> debug_write_foreign(uint64_t ring_addr, uint32_t rkey);
  std::pair<uint64_t, uint32_t> debug_peer_ring() const { return {peer_.ring_addr, peer_.ring_rkey}; }
  // The resources came from a closed connection (kit_pool.h).
  bool reused_kit() const { return from_pool_; }
  // Its QP was made ahead, while its kit was kept (kit_pool::warm).
  bool qp_made_ahead() const { return qp_ahead_; }
  // The inline data size a connection asks its QP for under `tun`
  // (kit_pool::warm makes QPs ahead with it).
  static uint32_t inline_wanted(const config::Tunables& tun);
  // The wire version this connection runs (negotiated at setup).
  uint8_t wire_version() const { return peer_.wire_version; }
  // Tests only (a hostile peer): posts one message outside every rule of the
  // data path, no credit or WR accounting: kind kSend is SEND_WITH_IMM of
  // `len` bytes of `payload`, kSendNoImm a SEND without immediate, kWrite
  // RDMA_WRITE_WITH_IMM of `len` bytes to the start of the peer's ring. The
  // bytes go out of this connection's own send ring (overwritten: the
  // connection is not used for data afterwards).
  enum class RawKind : uint8_t { kSend, kSendNoImm, kWrite };
  Status<void> debug_post_raw(RawKind kind, uint32_t imm, const void* payload, uint32_t len);

 private:
  friend class Listener;
  enum class State : uint8_t {
    kIdle, kResolvingAddr, kResolvingRoute, kConnecting, kAccepting,
    kEstablished, kClosing, kClosed, kError,
  };

  State failed_in_ = State::kError;  // the state fail() found (stage())
  bool counted_ = false;             // in g_established (connection.cc)
  void set_state(State s);           // state_ and the count of established ones

  explicit Connection(const config::Tunables& tun);
  Status<void> debug_post(ibv_wr_opcode op, uint32_t imm, uint32_t len, uint64_t remote_addr,
                          uint32_t rkey);
  // connection.cc: setup and teardown
  Status<void> init_fds();
  void handle_queued_cm_events();
  void wait_fds(pollfd* out, int* n) const;
  Status<void> create_resources();
  Status<void> make_kit(ibv_context* ctx);
  static bool kit_reusable(const kit_pool::Kit& k);
  void destroy_resources();
  void fill_setup(wire::SetupBlock* b, wire::SetupKind kind,
                  std::span<const std::byte> payload) const;
  Status<void> handle_cm_event(const rdma_cm_event& ev);
  void on_established(const void* pdata, size_t len);
  Status<void> qp_to(ibv_qp_state state);
  Status<void> set_qp_state(ibv_qp_state state);
  void fail(int err);
  void disconnect();
  void check_timers(uint64_t now);
  uint32_t cq_slots() const { return cq_group::slots_for(sq_depth_, recv_slots_); }  // our share of the shared CQ
  // Polls our completions into the queue of control messages (and the rest).
  void take_controls();
  // connection_datapath.cc: hot path
  // True if any completion was handled. `tell_self`: our completion
  // callback runs if the CQ held some of ours (cq_group.h), for the polls
  // whose caller announces nothing (send/recv's one look, made after the
  // socket layer's step, which announces what changed, has run).
  bool poll_cq(bool tell_self = false);
  void take_cq_event();           // reads the hub if a sleeper left it to us; takes our mark
  bool handle_recv(uint32_t slot, uint32_t imm, bool rdma_imm, uint32_t byte_len);
  bool post_recv(uint32_t slot);
  bool post_credit();
  bool post_control(wire::ControlType type, const void* data, size_t len);
  bool post_keepalive();
  void flush_pending();           // FIN/CLOSE/credit that waited for room
  uint32_t sq_free() const { return sq_depth_ - sq_outstanding_; }
  // DATA's immediate is its stream position (wire version 3). From the
  // negotiated version, which a server knows from the request on (its
  // client's first DATA may come before its ESTABLISHED event).
  bool data_pos() const { return peer_.wire_version >= wire::kDataPosVersion; }
  // Selective signalling: whether the next send WR asks for a completion,
  // and the bookkeeping after posting one and on a send completion.
  bool signal_next(bool force) const;
  void on_posted(bool signaled);
  void on_send_completion();
  bool wait_done(short events) const;
  // Rings that grow and shrink (docs/TRANSPORT.md, "Rings that grow"): a
  // ring's memory; the first ones (home) live as long as the connection,
  // a grown one (big) only while in use.
  struct RingSeg {
    std::byte* mem = nullptr;
    ibv_mr* mr = nullptr;
    uint32_t bytes = 0;
    size_t map = 0;
  };
  bool alloc_seg(RingSeg* seg, uint32_t bytes, bool remote_write);
  void free_seg(RingSeg* seg);
  bool can_move_rx() const;
  bool start_ring_move(RingSeg* to);  // receiver: offer `to` (RING)
  bool post_ring_ack();                // sender: switch to the ring the peer offered
  void maybe_move_send_ring();
  void drop_old_rings();

  config::Tunables tun_;
  State state_ = State::kIdle;
  int err_ = 0;
  RejectReason reject_reason_ = RejectReason::kNone;
  uint16_t redirect_port_ = 0;
  SetupFailure setup_failure_ = SetupFailure::kNone;

  // verbs/cm objects, all owned; destroy_resources() releases each once.
  rdma_cm_id* id_ = nullptr;  // on cm_hub::channel(), context = this
  // PD, the three registered areas and their share of the pinned and
  // mapping budgets (kit_pool.h): a new one or a closed connection's. Its
  // areas: rx_ring, the receive ring, the only REMOTE_WRITE memory; tx_mem,
  // the send ring followed by sq_depth_ control send buffers (local);
  // rbufs, the receive WR buffers (local write).
  kit_pool::Kit kit_;
  ibv_comp_channel* comp_ch_ = nullptr;  // cq_hub's, shared: not ours to destroy
  // The shared CQ's group we are a member of (cq_group.h), and our box of
  // completions filed by whoever polled it (cq_slots() deep).
  cq_group::Group* grp_ = nullptr;
  uint32_t grp_slot_ = 0;  // our place in it
  std::unique_ptr<ibv_wc[]> cq_box_;
  // Created with ibv_create_qp on our own context (transport/fds.h), not
  // with rdma_create_qp: rdma_cm only carries its number, and qp_to() moves
  // it through INIT, RTR and RTS with the attributes rdma_cm computes.
  ibv_qp* qp_ = nullptr;
  bool disconnect_sent_ = false;
  std::atomic<bool> cq_event_{false};  // set by cq_group: completions in our box

  uint32_t ring_bytes_ = 0;
  uint32_t sq_depth_ = 0;
  uint32_t recv_slots_ = 0;
  uint32_t max_inline_ = 0;
  bool from_pool_ = false;  // the resources are a closed connection's (kit_pool.h)
  bool qp_ahead_ = false;   // ... and its QP was made ahead (kit_pool::warm)
  uint32_t sq_outstanding_ = 0;  // posted send WRs not known complete
  uint64_t sq_seq_ = 0;
  // Most send WRs are posted unsignalled: a signalled one's completion
  // retires it and every WR posted before it (an SQ completes in order), so
  // a request/response exchange costs no completion event for the sends.
  // sig_cover_ is a FIFO (capacity sq_depth_) of how many WRs each
  // outstanding signalled WR retires; unsig_run_ counts the unsignalled WRs
  // since the last signalled one.
  std::vector<uint32_t> sig_cover_;
  uint32_t sig_head_ = 0, sig_count_ = 0;
  uint32_t unsig_run_ = 0;

  TxWindow tx_;
  RxWindow rx_;
  SendRing sring_;
  RingSeg rx_home_, rx_big_, tx_home_, tx_big_;  // home: views of kit_.rx_ring/kit_.tx_mem
  RingSeg* rx_cur_ = &rx_home_;   // where DATA from rx_switch_ on lands
  RingSeg* rx_old_ = nullptr;     // bytes before rx_switch_, until read
  RingSeg* rx_next_ = nullptr;    // offered (RING sent), no RING_ACK yet
  uint64_t rx_switch_ = 0;
  RingSeg* tx_cur_ = &tx_home_;   // send ring memory (sring_ positions)
  RingSeg* tx_old_ = nullptr;
  uint32_t big_bytes_ = 0;        // grown ring size; <= ring_bytes_: never grows
  uint32_t full_credits_ = 0;     // CREDITs in a row sent with the peer's window used up
  bool data_seen_ = false;        // DATA since the last check_timers
  uint64_t last_data_ns_ = 0;
  bool ring_ack_pending_ = false; // the peer's RING, not answered yet
  wire::RingBlock peer_next_{};
  wire::PeerSetup peer_;
  std::byte my_payload_[wire::kMaxPayload] = {};
  uint8_t my_payload_len_ = 0;

  uint64_t deadline_ns_ = 0;     // setup / close bound, 0 = none
  uint64_t last_tx_ns_ = 0;      // last WR posted (keepalive when idle)
  uint64_t sig_wait_ns_ = 0;     // since when the oldest signalled WR waits (stall watchdog)
  bool fin_pending_ = false, fin_sent_ = false, fin_received_ = false;
  bool fin_after_peer_ = false;
  bool close_pending_ = false, close_sent_ = false, peer_closed_ = false;
  bool disconnected_ = false;
  bool close_received_ = false;  // the peer's CLOSE: it closed its socket
  std::deque<ControlMessage> controls_;
  Counters ctr_;

  // rdma_cm events queued by cm_hub, under cm_hub::mu(). A connection sees a
  // handful in its life (resolved x2, established/rejected, disconnected,
  // timewait exit); more than fit means something is badly wrong.
  struct QueuedCmEvent {
    rdma_cm_event ev;
    wire::SetupBlock pd;  // ev.param.conn.private_data points here
  };
  static constexpr int kCmQueue = 8;
  QueuedCmEvent cm_q_[kCmQueue];
  uint8_t cm_n_ = 0;
  bool cm_overflow_ = false;
  std::atomic<bool> cm_pending_{false};
  void (*notify_fn_)(void*) = nullptr;
  void (*cq_notify_fn_)(void*) = nullptr;
  void* notify_arg_ = nullptr;
};

}  // namespace rsock::transport
