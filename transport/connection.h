// Connection: one reliable byte stream over an RC QP (rdma_cm, RDMA_PS_TCP).
//
// Everything is nonblocking: calls return Err(EAGAIN) when they would block and
// the caller waits for fd() to become readable, then calls progress(). fd() is
// an internal epoll fd that combines this connection's rdma_cm event channel,
// its CQ completion channel and a timerfd for deadlines and keepalives, so a
// sleeping caller is woken for every state change the connection cares about.
// Data already buffered does not make fd() readable: check readable() first.
//
// Thread safety: none inside. One thread at a time per Connection (the socket
// layer serialises); different Connections are independent.
//
// Wire format: transport/wire.h and docs/wire-format.md. Design notes:
// docs/TRANSPORT.md.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "config/tunables.h"
#include "transport/ring.h"
#include "transport/pinned.h"
#include "transport/wire.h"
#include "util/status.h"

struct rdma_cm_id;
struct rdma_cm_event;
struct rdma_event_channel;
struct ibv_pd;
struct ibv_cq;
struct ibv_mr;
struct ibv_comp_channel;

namespace rsock::transport {

using wire::RejectReason;

struct Counters {
  uint64_t bytes_sent = 0;       // stream bytes handed to the QP
  uint64_t bytes_received = 0;   // stream bytes copied out by recv()
  uint64_t data_wrs = 0;         // RDMA_WRITE_WITH_IMM posted
  uint64_t inline_wrs = 0;       // of which inline
  uint64_t data_recvs = 0;       // DATA completions received
  uint64_t credits_sent = 0;
  uint64_t credits_received = 0;
  uint64_t controls_sent = 0;
  uint64_t controls_received = 0;
  uint64_t keepalives = 0;
  uint64_t credit_stalls = 0;    // send() found no peer credit (bytes or WRs)
  uint64_t completions = 0;      // CQEs polled
  uint64_t cq_events = 0;        // completion channel wakeups
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

  int fd() const { return epfd_; }
  // Handles cm events, completions, deadlines and keepalives. Returns the
  // connection's error once it has one (ECONNREFUSED, ETIMEDOUT, ECONNRESET..).
  Status<void> progress();
  // The data path's cheap progress: polls the CQ and flushes what waited for
  // room, without any syscall. Callers still call progress() before they
  // sleep on fd() and from time to time (timers, rdma_cm events, re-arming).
  Status<void> poll_completions();

  bool established() const { return state_ == State::kEstablished || state_ == State::kClosing; }
  bool connecting() const { return state_ < State::kEstablished; }
  int error() const { return err_; }
  RejectReason reject_reason() const { return reject_reason_; }
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

  // Half-close: FIN after the last byte sent. Idempotent.
  Status<void> shutdown_write();
  // FIN + CLOSE ("I will read no more"), disconnects once every posted WR is
  // acknowledged. closed() then turns true. Nonblocking; drive with progress().
  Status<void> close();
  bool closed() const { return state_ == State::kClosed || state_ == State::kError; }

  // Application control message, ordered with the data (type is opaque here).
  Status<void> send_control(uint8_t type, std::span<const std::byte> data);
  Status<ControlMessage> recv_control();  // EAGAIN if none queued

  // For tests and simple callers: blocks until POLLIN (readable, EOF, error or
  // a control message) / POLLOUT (established and writable, or error) holds,
  // busy-polling the CQ for spin_us first. ETIMEDOUT after timeout_ms (<0: none).
  Status<void> wait(short events, int timeout_ms);

  std::span<const std::byte> peer_payload() const {
    return {reinterpret_cast<const std::byte*>(peer_.payload), peer_.payload_len};
  }
  uint32_t qp_num() const;
  const Counters& counters() const { return ctr_; }
  // Ring occupancy and credit, for rsock-stat.
  struct Gauges {
    uint32_t ring_bytes;      // capacity of each ring
    uint32_t send_ring_used;  // bytes in our send ring not yet acknowledged
    uint32_t recv_ring_used;  // bytes in our receive ring not yet read
    uint32_t credit_bytes;    // bytes the peer's ring can take now
  };
  Gauges gauges() const;
  uint64_t tx_position() const { return tx_.head(); }  // stream bytes sent
  uint64_t rx_position() const { return rx_.tail(); }  // stream bytes consumed
  uint32_t max_inline() const { return max_inline_; }

  // Tests only: moves the QP to the error state without telling the peer
  // (no DREQ), as if the host had vanished; the peer must notice through its
  // keepalive. The connection is unusable afterwards.
  Status<void> debug_break_silently();

 private:
  friend class Listener;
  enum class State : uint8_t {
    kIdle, kResolvingAddr, kResolvingRoute, kConnecting, kAccepting,
    kEstablished, kClosing, kClosed, kError,
  };

  explicit Connection(const config::Tunables& tun);
  // connection.cc: setup and teardown
  Status<void> init_fds();
  Status<void> create_resources();
  void destroy_resources();
  void fill_setup(wire::SetupBlock* b, wire::SetupKind kind,
                  std::span<const std::byte> payload) const;
  Status<void> handle_cm_event(const rdma_cm_event& ev);
  void on_established(const void* pdata, size_t len);
  void fail(int err);
  void disconnect();
  void drain_fd(int fd);
  void update_timer();
  void check_timers(uint64_t now);
  // connection_datapath.cc: hot path
  bool poll_cq();                 // true if any completion was handled
  bool handle_recv(uint32_t slot, uint32_t imm, bool rdma_imm, uint32_t byte_len);
  bool post_recv(uint32_t slot);
  bool post_credit();
  bool post_control(wire::ControlType type, const void* data, size_t len);
  bool post_keepalive();
  void flush_pending();           // FIN/CLOSE/credit that waited for room
  uint32_t sq_free() const { return sq_depth_ - sq_outstanding_; }
  // Selective signalling: whether the next send WR asks for a completion,
  // and the bookkeeping after posting one and on a send completion.
  bool signal_next(bool force) const;
  void on_posted(bool signaled);
  void on_send_completion();
  bool wait_done(short events) const;

  config::Tunables tun_;
  State state_ = State::kIdle;
  int err_ = 0;
  RejectReason reject_reason_ = RejectReason::kNone;
  SetupFailure setup_failure_ = SetupFailure::kNone;
  uint64_t pinned_bytes_ = 0;  // taken from the pinned-memory budget

  // verbs/cm objects, all owned; destroy_resources() releases each once.
  rdma_event_channel* cm_ch_ = nullptr;
  rdma_cm_id* id_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* comp_ch_ = nullptr;
  ibv_cq* cq_ = nullptr;
  bool qp_created_ = false;
  bool disconnect_sent_ = false;
  bool cq_armed_ = false;
  ibv_mr* rx_mr_ = nullptr;    // receive ring: the only REMOTE_WRITE memory
  ibv_mr* tx_mr_ = nullptr;    // send ring + control send buffers (local)
  ibv_mr* rbuf_mr_ = nullptr;  // receive WR buffers (local write)
  std::byte* rx_ring_ = nullptr;
  std::byte* tx_mem_ = nullptr;  // send ring followed by sq_depth_ control buffers
  std::byte* rbufs_ = nullptr;
  size_t rx_map_bytes_ = 0, tx_map_bytes_ = 0, rbuf_map_bytes_ = 0;
  int epfd_ = -1;
  int timerfd_ = -1;

  uint32_t ring_bytes_ = 0;
  uint32_t sq_depth_ = 0;
  uint32_t recv_slots_ = 0;
  uint32_t max_inline_ = 0;
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
  wire::PeerSetup peer_;
  std::byte my_payload_[wire::kMaxPayload] = {};
  uint8_t my_payload_len_ = 0;

  uint64_t deadline_ns_ = 0;     // setup / close bound, 0 = none
  uint64_t last_tx_ns_ = 0;      // last WR posted (keepalive when idle)
  uint64_t timer_armed_ns_ = 0;
  bool fin_pending_ = false, fin_sent_ = false, fin_received_ = false;
  bool close_pending_ = false, close_sent_ = false, peer_closed_ = false;
  bool disconnected_ = false;
  std::deque<ControlMessage> controls_;
  Counters ctr_;
};

}  // namespace rsock::transport
