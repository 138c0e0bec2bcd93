// Connection setup (rdma_cm state machine), resources, timers and teardown.
// The data path is in connection_datapath.cc.
#include "transport/connection.h"

#include "transport/cm_hub.h"
#include "transport/cq_hub.h"
#include "transport/fds.h"

#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/epoll.h>

#include <utility>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "util/clock.h"
#include "util/log.h"
#include "util/sys.h"
#include "transport/fork_guard.h"

namespace rsock::transport {

namespace {

std::byte* map_bytes(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
}

size_t page_round(size_t n) { return (n + 4095) & ~size_t{4095}; }

// Established connections of the process (keepalive_period_ns).
std::atomic<uint32_t> g_established{0};

uint32_t round_ring(uint32_t want) {
  uint32_t lo = 1u << wire::kMinRingLog2, hi = 1u << wire::kMaxRingLog2;
  want = std::clamp(want, lo, hi);
  return std::bit_ceil(want);
}

// Our own bound on a resolution step: the kernel ends it by itself within
// resolve_timeout_ms (rdma_resolve_addr's timeout; RoCE's route step is a
// work item), with RESOLVED or ERROR. Ours only catches an event that never
// comes, so it leaves room for one that comes late: in a loaded 2-vCPU
// guest, ROUTE_RESOLVED reached us more than 500 ms after the call.
// (The socket layer's upgrade_timeout_ms still bounds the whole rendezvous.)
constexpr uint64_t kResolveSlackNs = 1'500'000'000;
uint64_t resolve_guard_ns(const config::Tunables& t) {
  return uint64_t{t.resolve_timeout_ms} * 1000000 + kResolveSlackNs;
}

}  // namespace

// Every keepalive is a WR, its ACK and a wakeup of the thread that drives
// the connection, on both hosts. At keepalive_ms for every idle connection,
// 1400 idle connections in one process (both ends of 700 pairs in the VM)
// kept two CPUs busy: their setup took 43 s instead of 16 s without
// keepalives, one epoll round trip 2.6 ms instead of 0.9 ms. So the
// process sends at most about kKeepaliveRate of them per second: past
// keepalive_ms x kKeepaliveRate / 1000 connections (100 by default) the
// period grows with their number, and so does the time in which an idle
// connection notices a dead peer. A connection with data in flight notices
// it through its own WRs' retries, whatever the period.
uint64_t keepalive_period_ns(uint32_t keepalive_ms, uint64_t established) {
  if (keepalive_ms == 0) return 0;
  return std::max(uint64_t{keepalive_ms} * 1000000, established * (1000000000 / kKeepaliveRate));
}

uint64_t keepalive_period_ns(uint32_t keepalive_ms) {
  return keepalive_period_ns(keepalive_ms, g_established.load(std::memory_order_relaxed));
}

void Connection::set_state(State s) {
  bool est = s == State::kEstablished;
  if (est != counted_) {
    if (est) g_established.fetch_add(1, std::memory_order_relaxed);
    else g_established.fetch_sub(1, std::memory_order_relaxed);
    counted_ = est;
  }
  state_ = s;
}

Connection::Connection(const config::Tunables& tun) : tun_(tun) {
  ring_bytes_ = round_ring(pinned::initial_ring_bytes(tun));
  big_bytes_ = round_ring(pinned::grown_ring_bytes(tun));
  sq_depth_ = std::clamp<uint32_t>(tun.send_queue_depth, 8, 4096);
  recv_slots_ = std::clamp<uint32_t>(tun.recv_slots, 4, wire::kMaxRecvSlots);
}

// A connection opens no fd of its own until its completion channel: rdma_cm
// events come through the process's shared channel.
Status<void> Connection::init_fds() {
  if (cm_hub::channel() == nullptr) return Err(errno ? errno : ENODEV);
  return Ok();
}

int Connection::fd() const { return grp_ != nullptr ? cq_hub::fd() : -1; }

void Connection::deliver_cq_event(bool mark) {
  if (mark) cq_event_.store(true, std::memory_order_release);
  if (auto* fn = cq_notify_fn_ ? cq_notify_fn_ : notify_fn_) fn(notify_arg_);
}

void Connection::take_cq_event() {
  // Read the hub only when a sleeper saw its fd readable and left the read
  // to us (cq_hub::note_readable): reading on every progress mostly found
  // nothing (redis-benchmark over librsock made 1.5 channel reads per
  // request for 0.76 events). An event still unread keeps the hub's fd
  // readable, so whoever would sleep on it wakes at once and marks it; until
  // then the completions are polled as usual (a CQ is armed while a thread
  // sleeps, and polled otherwise: cq_group.h, "Arming").
  if (!cq_event_.load(std::memory_order_relaxed) && cq_hub::noted()) cq_hub::poll();
  if (cq_event_.load(std::memory_order_relaxed) && cq_event_.exchange(false, std::memory_order_acquire))
    ++ctr_.cq_events;
}

void Connection::set_notify(void (*fn)(void*), void* arg, void (*cq_fn)(void*)) {
  std::lock_guard lk(cm_hub::mu());
  notify_fn_ = fn;
  cq_notify_fn_ = cq_fn;
  notify_arg_ = arg;
}

void Connection::deliver_cm_event(const rdma_cm_event& ev) {
  if (cm_n_ == kCmQueue) {
    cm_overflow_ = true;
  } else {
    QueuedCmEvent& q = cm_q_[cm_n_++];
    q.ev = ev;
    q.pd = {};
    if (ev.param.conn.private_data != nullptr) {
      // Only valid until the hub acknowledges the event.
      size_t len = std::min<size_t>(ev.param.conn.private_data_len, sizeof q.pd);
      std::memcpy(&q.pd, ev.param.conn.private_data, len);
      q.ev.param.conn.private_data = &q.pd;
      q.ev.param.conn.private_data_len = static_cast<uint8_t>(len);
    }
  }
  cm_pending_.store(true, std::memory_order_release);
  if (notify_fn_ != nullptr) notify_fn_(notify_arg_);
}

// One event at a time off the queue, handled without the hub's lock (a
// handler calls into rdma_cm, which may block briefly).
void Connection::handle_queued_cm_events() {
  if (!cm_pending_.load(std::memory_order_acquire)) return;
  for (;;) {
    QueuedCmEvent q;
    {
      std::lock_guard lk(cm_hub::mu());
      if (cm_overflow_) {
        cm_overflow_ = false;
        cm_n_ = 0;
        cm_pending_.store(false, std::memory_order_relaxed);
        LOG_WARN("transport: rdma_cm event queue overflow on qp %u", qp_num());
        fail(ECONNRESET);
        return;
      }
      if (cm_n_ == 0) {
        cm_pending_.store(false, std::memory_order_relaxed);
        return;
      }
      q = cm_q_[0];
      for (int i = 1; i < cm_n_; i++) cm_q_[i - 1] = cm_q_[i];
      cm_n_--;
    }
    if (q.ev.param.conn.private_data != nullptr) q.ev.param.conn.private_data = &q.pd;
    (void)handle_cm_event(q.ev);
  }
}

Status<std::unique_ptr<Connection>> Connection::connect(const sockaddr* dst, const sockaddr* src,
                                                        std::span<const std::byte> payload,
                                                        const config::Tunables& tun) {
  if (dst == nullptr || payload.size() > wire::kMaxPayload) return Err(EINVAL);
  std::unique_ptr<Connection> c(new (std::nothrow) Connection(tun));
  if (!c) return Err(ENOMEM);
  if (auto s = c->init_fds(); !s) return Err(s.error());
  if (!payload.empty()) std::memcpy(c->my_payload_, payload.data(), payload.size());  // data() may be null
  c->my_payload_len_ = static_cast<uint8_t>(payload.size());
  if (guarded::rdma_create_id(cm_hub::channel(), &c->id_, c.get(), RDMA_PS_TCP) != 0) return Err(errno);
  c->set_state(State::kResolvingAddr);
  c->deadline_ns_ = now_ns() + resolve_guard_ns(tun);
  if (guarded::rdma_resolve_addr(c->id_, const_cast<sockaddr*>(src), const_cast<sockaddr*>(dst),
                        static_cast<int>(tun.resolve_timeout_ms)) != 0)
    return Err(errno);
  return c;
}

// A closed connection's kit (kit_pool.h) if one fits, else a new one; then
// a new QP in INIT with the receives posted.
Status<void> Connection::create_resources() {
  if (id_->verbs == nullptr) return Err(ENODEV);
  ibv_context* ctx = own_context(id_->verbs->device);
  if (ctx == nullptr) return Err(errno);
  // The context's one channel (cq_hub.h), not one of our own: no fd per
  // connection.
  comp_ch_ = cq_hub::channel(ctx);
  if (comp_ch_ == nullptr) return Err(errno ? errno : ENOMEM);
  if (kit_pool::take(ctx, ring_bytes_, sq_depth_, recv_slots_, &kit_)) {
    from_pool_ = true;
  } else if (auto s = make_kit(ctx); !s) {
    return s;
  }
  // A shared CQ (cq_group.h): no CQ, no mapping and no re-arm of our own.
  if (!tun_.cq_lazy_arm) cq_group::hold_armed();
  cq_box_.reset(new (std::nothrow) ibv_wc[cq_slots()]);
  if (!cq_box_) return Err(ENOMEM);
  if (kit_.qp && kit_.qp_inline_wanted == inline_wanted(tun_)) {
    // The kept kit's QP made ahead (kit_pool::warm), with its place in a
    // CQ group: ours as they are.
    qp_ = std::exchange(kit_.qp, nullptr);
    grp_ = std::exchange(kit_.grp, nullptr);
    grp_slot_ = kit_.grp_slot;
    max_inline_ = kit_.qp_inline;
    cq_group::adopt(grp_, grp_slot_, this, cq_box_.get());
    qp_ahead_ = true;
    kit_pool::took_qp_ahead();
  } else {
    kit_pool::drop_qp(&kit_);  // (one made for another inline size)
    grp_ = cq_group::join(ctx, comp_ch_, cq_slots(), this, cq_box_.get(), &grp_slot_);
    if (grp_ == nullptr) return Err(errno ? errno : ENOMEM);
    qp_ = kit_pool::new_qp(kit_, cq_group::cq(grp_), inline_wanted(tun_), &max_inline_);
    if (qp_ == nullptr) return Err(errno ? errno : ENOMEM);
    cq_group::set_qp(grp_, grp_slot_, qp_->qp_num);
  }
  // Receives can be posted from INIT on.
  if (auto s = qp_to(IBV_QPS_INIT); !s) return s;
  sig_cover_.assign(sq_depth_, 0);
  rx_.init(ring_bytes_, recv_slots_);
  sring_.init(ring_bytes_);
  rx_home_ = {kit_.rx_ring, kit_.rx_mr, ring_bytes_, kit_.rx_map};
  tx_home_ = {kit_.tx_mem, kit_.tx_mr, ring_bytes_, kit_.tx_map};
  last_data_ns_ = now_ns();
  for (uint32_t i = 0; i < recv_slots_; ++i)
    if (!post_recv(i)) return Err(errno ? errno : ENOMEM);
  uint8_t tmo = wire::kAckTimeoutExp;
  if (rdma_set_option(id_, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &tmo, sizeof tmo) != 0)
    LOG_WARN("transport: cannot set ACK timeout (errno %d); dead peers are noticed late", errno);
  return Ok();
}

// PD per connection (per kit): the receive ring's rkey is then only valid on
// this connection's QP, so a peer can write into its own connection's ring
// and nowhere else (docs/TRANSPORT.md, "Isolation").
Status<void> Connection::make_kit(ibv_context* ctx) {
  kit_.ctx = ctx;
  kit_.ring_bytes = ring_bytes_;  // what the kit is made for (kit_pool::take matches them)
  kit_.sq_depth = sq_depth_;
  kit_.recv_slots = recv_slots_;
  // The mappings first: past their budget nothing else is worth creating.
  if (!kit_.maps) {
    if (!pinned::take_maps()) {
      kit_pool::trim(0, /*all=*/true);  // kept kits hold mappings too: theirs go first
      if (!pinned::take_maps()) return Err(EMFILE);
    }
    kit_.maps = true;
  }
  kit_.pd = ibv_alloc_pd(ctx);
  if (kit_.pd == nullptr) return Err(errno ? errno : ENOMEM);

  kit_.rx_map = ring_bytes_;
  kit_.tx_map = page_round(size_t{ring_bytes_} + size_t{sq_depth_} * wire::kRecvBufBytes);
  kit_.rbuf_map = page_round(size_t{recv_slots_} * wire::kRecvBufBytes);
  // The process's pinned-memory budget (transport/pinned.h): ENOBUFS tells
  // the socket layer that this is the memlock limit, not a broken device.
  uint64_t pin = kit_.rx_map + kit_.tx_map + kit_.rbuf_map;
  if (!pinned::reserve(pin)) {
    kit_pool::trim(0, /*all=*/true);  // kept kits give their memory back first
    if (!pinned::reserve(pin)) return Err(ENOBUFS);
  }
  kit_.pinned = pin;
  kit_.rx_ring = map_bytes(kit_.rx_map);
  kit_.tx_mem = map_bytes(kit_.tx_map);
  kit_.rbufs = map_bytes(kit_.rbuf_map);
  if (!kit_.rx_ring || !kit_.tx_mem || !kit_.rbufs) return Err(ENOMEM);
  kit_.rx_mr = ibv_reg_mr(kit_.pd, kit_.rx_ring, kit_.rx_map,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  kit_.tx_mr = ibv_reg_mr(kit_.pd, kit_.tx_mem, kit_.tx_map, 0);
  kit_.rbuf_mr = ibv_reg_mr(kit_.pd, kit_.rbufs, kit_.rbuf_map, IBV_ACCESS_LOCAL_WRITE);
  if (!kit_.rx_mr || !kit_.tx_mr || !kit_.rbuf_mr) {
    // The kernel's own RLIMIT_MEMLOCK check (the program pinned memory too).
    if (errno == ENOMEM || errno == EAGAIN || errno == EPERM) return Err(ENOBUFS);
    return Err(errno ? errno : ENOMEM);
  }
  return Ok();
}

uint32_t Connection::inline_wanted(const config::Tunables& tun) {
  return std::max<uint32_t>(tun.inline_threshold, wire::kMaxControlBytes);
}

// Whether a closing connection's kit (its QP already destroyed) can serve
// another: complete. (Its completions were the shared CQ's, dropped when
// it left its group: nothing to drain.)
bool Connection::kit_reusable(const kit_pool::Kit& k) {
  return k.ctx && k.pd && k.rx_mr && k.tx_mr && k.rbuf_mr;
}

// rdma_cm computes the attributes of each transition (path, PSNs, MTU, the
// ACK timeout set above); we apply them to our own QP.
Status<void> Connection::qp_to(ibv_qp_state state) {
  ibv_qp_attr a{};
  int mask = 0;
  a.qp_state = state;
  if (rdma_init_qp_attr(id_, &a, &mask) != 0) {
    LOG_DEBUG("transport: qp %u: rdma_init_qp_attr(state %d): errno %d", qp_->qp_num,
              static_cast<int>(state), errno);
    return Err(errno ? errno : EINVAL);
  }
  // ibv_modify_qp returns the error number itself.
  if (int e = ibv_modify_qp(qp_, &a, mask); e != 0) {
    LOG_DEBUG("transport: qp %u: ibv_modify_qp(state %d): %d", qp_->qp_num, static_cast<int>(state), e);
    return Err(e);
  }
  return Ok();
}

void Connection::fill_setup(wire::SetupBlock* b, wire::SetupKind kind,
                            std::span<const std::byte> payload) const {
  std::memset(b, 0, sizeof *b);
  b->magic = wire::kMagic;
  // A request offers our range; an accept names the version chosen from the
  // request's range (parse_setup stored it in peer_).
  if (kind == wire::SetupKind::kRequest) {
    b->version = wire::kWireMinVersion;
    b->max_version = wire::kWireVersion;
    // Tests only: offer at most this version, as an older librsock would
    // (transport.old_wire keeps the older data path tested).
    if (const char* cap = getenv("RSOCK_DEBUG_WIRE_MAX")) {
      int v = atoi(cap);
      if (v >= wire::kWireMinVersion && v < wire::kWireVersion) b->max_version = uint8_t(v);
    }
  } else {
    b->version = peer_.wire_version;
  }
  b->kind = static_cast<uint8_t>(kind);
  b->payload_len = static_cast<uint8_t>(payload.size());
  b->ring_addr = reinterpret_cast<uintptr_t>(kit_.rx_ring);
  b->ring_rkey = kit_.rx_mr->rkey;
  b->ring_log2 = static_cast<uint8_t>(std::countr_zero(ring_bytes_));
  b->recv_slots = static_cast<uint16_t>(recv_slots_);
  if (!payload.empty()) std::memcpy(b->payload, payload.data(), payload.size());
}

Status<void> Connection::handle_cm_event(const rdma_cm_event& ev) {
  switch (ev.event) {
    case RDMA_CM_EVENT_ADDR_RESOLVED:
      if (state_ != State::kResolvingAddr) break;
      if (guarded::rdma_resolve_route(id_, static_cast<int>(tun_.resolve_timeout_ms)) != 0) {
        fail(errno);
        break;
      }
      set_state(State::kResolvingRoute);
      deadline_ns_ = now_ns() + resolve_guard_ns(tun_);
      break;
    case RDMA_CM_EVENT_ROUTE_RESOLVED: {
      if (state_ != State::kResolvingRoute) break;
      if (auto s = create_resources(); !s) {
        setup_failure_ = s.error() == ENOBUFS ? SetupFailure::kMemlock : SetupFailure::kResources;
        fail(s.error());
        break;
      }
      wire::SetupBlock b;
      fill_setup(&b, wire::SetupKind::kRequest, {my_payload_, my_payload_len_});
      rdma_conn_param p{};
      p.private_data = &b;
      p.private_data_len = static_cast<uint8_t>(wire::kSetupHeaderBytes + my_payload_len_);
      p.retry_count = wire::kRetryCount;
      p.rnr_retry_count = wire::kRnrRetryCount;
      p.qp_num = qp_->qp_num;
      if (guarded::rdma_connect(id_, &p) != 0) {
        fail(errno);
        break;
      }
      set_state(State::kConnecting);
      // A server holds a request until its application accepts the TCP
      // connection, for up to upgrade_timeout_ms (docs/DESIGN.md,
      // "Rendezvous"), and so does a listener's owner until a forked worker
      // accepts it: no REP before then is no failure. (With 1 s, clients of
      // a busy preforked server timed out, and cached the peer as one that
      // does not answer.)
      deadline_ns_ = now_ns() + uint64_t{std::max(tun_.connect_timeout_ms, tun_.upgrade_timeout_ms)} * 1000000;
      break;
    }
    case RDMA_CM_EVENT_CONNECT_RESPONSE:
      // Active side, our own QP: rdma_cm hands us the REP; the QP goes to
      // RTR and RTS before rdma_establish sends the RTU.
      if (state_ != State::kConnecting) break;
      // INIT again first, as librdmacm does: before the connect rdma_cm
      // knew no CM and gave default INIT attributes (no remote write access,
      // which the peer's writes into our ring need); now it gives the real
      // ones.
      if (auto s = qp_to(IBV_QPS_INIT); !s) {
        fail(s.error());
        break;
      }
      if (auto s = qp_to(IBV_QPS_RTR); !s) {
        fail(s.error());
        break;
      }
      if (auto s = qp_to(IBV_QPS_RTS); !s) {
        fail(s.error());
        break;
      }
      if (guarded::rdma_establish(id_) != 0) {
        fail(errno ? errno : ECONNRESET);
        break;
      }
      on_established(ev.param.conn.private_data, ev.param.conn.private_data_len);
      break;
    case RDMA_CM_EVENT_ESTABLISHED:
      // Passive side: the RTU arrived (the QP is in RTS since the accept).
      if (state_ == State::kAccepting) on_established(nullptr, 0);
      break;
    case RDMA_CM_EVENT_REJECTED:
      reject_reason_ = wire::parse_reject(ev.param.conn.private_data, ev.param.conn.private_data_len);
      redirect_port_ = wire::parse_redirect_port(ev.param.conn.private_data,
                                                 ev.param.conn.private_data_len);
      LOG_DEBUG("transport: connect rejected (cm status %d, reason %d)", ev.status,
                static_cast<int>(reject_reason_));
      // A reject without our reason comes from the CM itself: nothing
      // listens on the rdma_cm port, i.e. the peer runs no librsock there.
      setup_failure_ = reject_reason_ == RejectReason::kNone ? SetupFailure::kNoListener
                                                             : SetupFailure::kRejected;
      fail(ECONNREFUSED);
      break;
    case RDMA_CM_EVENT_ADDR_ERROR:
      fail(EHOSTUNREACH);
      break;
    case RDMA_CM_EVENT_ROUTE_ERROR:
      fail(ENETUNREACH);
      break;
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_CONNECT_ERROR:
      fail(state_ == State::kConnecting ? ECONNREFUSED : ECONNRESET);
      break;
    case RDMA_CM_EVENT_DISCONNECTED:
      disconnected_ = true;
      disconnect_sent_ = true;  // rdma_cm answered the DREQ already
      // Completions that raced the DREQ (the peer's last data and FIN) are in
      // the CQ ahead of the flush errors: take them before judging.
      while (poll_cq()) {
      }
      if (state_ == State::kError) break;
      if (fin_received_ && (fin_sent_ || state_ == State::kClosing)) {
        set_state(State::kClosed);
      } else if (fin_received_) {
        // Peer closed after its FIN: our unsent direction is dead (EPIPE on send).
        peer_closed_ = true;
        set_state(State::kClosed);
      } else {
        fail(ECONNRESET);
      }
      break;
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
      LOG_WARN("transport: RDMA device removed");
      fail(ECONNRESET);
      break;
    default:  // TIMEWAIT_EXIT, ADDR_CHANGE, ...: nothing to do
      break;
  }
  return Ok();
}

void Connection::on_established(const void* pdata, size_t len) {
  if (pdata != nullptr) {  // active side: the accept carries the peer's ring
    if (wire::parse_setup(pdata, len, wire::SetupKind::kAccept, &peer_) != RejectReason::kNone) {
      LOG_WARN("transport: bad accept private data from peer");
      fail(ECONNRESET);
      return;
    }
    tx_.init(peer_.ring_bytes, peer_.recv_slots);
  }
  set_state(State::kEstablished);
  deadline_ns_ = 0;
  last_tx_ns_ = coarse_now_ns();
  flush_pending();
}

void Connection::fail(int err) {
  if (state_ == State::kError) return;
  if (err == 0) err = ECONNRESET;
  if (state_ < State::kEstablished && setup_failure_ == SetupFailure::kNone) {
    if (state_ == State::kResolvingAddr || state_ == State::kResolvingRoute)
      setup_failure_ = SetupFailure::kResolve;
    else
      setup_failure_ = err == ETIMEDOUT ? SetupFailure::kTimeout : SetupFailure::kConnect;
  }
  LOG_DEBUG("transport: connection qp %u failed: errno %d", qp_num(), err);
  failed_in_ = state_;
  err_ = err;
  set_state(State::kError);
  deadline_ns_ = 0;
  disconnect();
}

void Connection::disconnect() {
  if (disconnect_sent_ || id_ == nullptr || qp_ == nullptr) return;
  disconnect_sent_ = true;
  // What rdma_disconnect does for a QP it created: error state first, so
  // posted WRs flush; then the DREQ ("not connected" is ignored).
  (void)set_qp_state(IBV_QPS_ERR);
  guarded::rdma_disconnect(id_);
}

Status<void> Connection::close() {
  if (!fin_pending_) fin_after_peer_ = fin_received_;  // also when already failed
  if (closed()) return Ok();
  if (state_ < State::kEstablished) {
    fail(ECONNABORTED);
    return Ok();
  }
  if (auto s = shutdown_write(); !s && s.error() != EPIPE) return s;
  close_pending_ = true;
  set_state(State::kClosing);
  deadline_ns_ = now_ns() + uint64_t{tun_.connect_timeout_ms} * 1000000;
  flush_pending();
  return progress();
}

// A bare state change (error, send-queue drain), no attributes.
Status<void> Connection::set_qp_state(ibv_qp_state state) {
  if (qp_ == nullptr) return Err(ENOTCONN);
  ibv_qp_attr a{};
  a.qp_state = state;
  if (int e = ibv_modify_qp(qp_, &a, IBV_QP_STATE); e != 0) return Err(e);  // the errno itself
  return Ok();
}

Status<void> Connection::debug_break_silently() {
  if (auto s = set_qp_state(IBV_QPS_ERR); !s) return s;
  disconnect_sent_ = true;  // flushes are expected now; never send a DREQ
  err_ = ECONNRESET;
  set_state(State::kError);
  return Ok();
}

Status<void> Connection::debug_stall_sends() { return set_qp_state(IBV_QPS_SQD); }

// Tests only: one signalled WR of `len` bytes from the start of our send
// ring memory, outside the data path's accounting (debug_write_foreign,
// debug_post_raw).
Status<void> Connection::debug_post(ibv_wr_opcode op, uint32_t imm, uint32_t len,
                                    uint64_t remote_addr, uint32_t rkey) {
  ibv_sge sge{reinterpret_cast<uint64_t>(kit_.tx_mem), len, kit_.tx_mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = sring_.head();
  wr.sg_list = len ? &sge : nullptr;
  wr.num_sge = len ? 1 : 0;
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad;
  if (ibv_post_send(qp_, &wr, &bad) != 0) return Err(errno);
  on_posted(true);
  return Ok();
}

Status<void> Connection::debug_write_foreign(const Connection& other) {
  if (!other.established()) return Err(ENOTCONN);
  return debug_write_foreign(other.peer_.ring_addr, other.peer_.ring_rkey);
}

Status<void> Connection::debug_write_foreign(uint64_t ring_addr, uint32_t rkey) {
  if (!established()) return Err(ENOTCONN);
  return debug_post(IBV_WR_RDMA_WRITE, 0, 8, ring_addr, rkey);
}

Status<void> Connection::debug_post_raw(RawKind kind, uint32_t imm, const void* payload,
                                        uint32_t len) {
  if (!established()) return Err(ENOTCONN);
  if (len > ring_bytes_) return Err(EMSGSIZE);
  if (len) std::memcpy(kit_.tx_mem, payload, len);
  switch (kind) {
    case RawKind::kSend: return debug_post(IBV_WR_SEND_WITH_IMM, imm, len, 0, 0);
    case RawKind::kSendNoImm: return debug_post(IBV_WR_SEND, 0, len, 0, 0);
    case RawKind::kWrite:
      return debug_post(IBV_WR_RDMA_WRITE_WITH_IMM, imm, len, peer_.ring_addr, peer_.ring_rkey);
  }
  return Err(EINVAL);
}

// --- Rings that grow and shrink ------------------------------------------
// A receiver whose peer keeps using the whole window offers a grown ring
// (RING); the sender answers with RING_ACK at its stream position and writes
// everything after it to the new ring. The receiver reads the old ring up to
// that position, then frees it. An idle connection moves back to its first
// ring the same way. The sender's own send ring follows the size of the
// peer's ring (local only). docs/TRANSPORT.md, "Rings that grow".

bool Connection::alloc_seg(RingSeg* seg, uint32_t bytes, bool remote_write) {
  size_t map = page_round(bytes);
  if (!pinned::reserve_spare(map)) return false;
  std::byte* mem = map_bytes(map);
  if (mem == nullptr) {
    pinned::release(map);
    return false;
  }
  ibv_mr* mr = ibv_reg_mr(kit_.pd, mem, map, remote_write ? IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE : 0);
  if (mr == nullptr) {
    munmap(mem, map);
    pinned::release(map);
    return false;
  }
  *seg = {mem, mr, bytes, map};
  return true;
}

void Connection::free_seg(RingSeg* seg) {
  if (seg->mr) ibv_dereg_mr(seg->mr);
  if (seg->mem) {
    munmap(seg->mem, seg->map);
    pinned::release(seg->map);
  }
  *seg = {};
}

bool Connection::can_move_rx() const {
  return peer_.wire_version >= wire::kRingMoveVersion && state_ == State::kEstablished &&
         rx_old_ == nullptr && rx_next_ == nullptr && !fin_received_;
}

bool Connection::start_ring_move(RingSeg* to) {
  if (to == &rx_big_ && rx_big_.mem == nullptr && !alloc_seg(&rx_big_, big_bytes_, true))
    return false;  // the budget says no: stay as we are
  wire::RingBlock b{};
  b.addr = reinterpret_cast<uintptr_t>(to->mem);
  b.rkey = to->mr->rkey;
  b.log2 = static_cast<uint8_t>(std::countr_zero(to->bytes));
  if (!post_control(wire::ControlType::kRing, &b, sizeof b)) return false;  // again later
  rx_next_ = to;
  return true;
}

bool Connection::post_ring_ack() {
  uint64_t pos = tx_.head();
  if (!post_control(wire::ControlType::kRingAck, &pos, sizeof pos)) return false;
  // From here on every DATA goes to the new ring.
  peer_.ring_addr = peer_next_.addr;
  peer_.ring_rkey = peer_next_.rkey;
  peer_.ring_bytes = 1u << peer_next_.log2;
  tx_.resize(peer_.ring_bytes);
  ring_ack_pending_ = false;
  maybe_move_send_ring();
  return true;
}

void Connection::maybe_move_send_ring() {
  if (tx_old_ != nullptr || qp_ == nullptr) return;  // the last move still drains
  bool want_big = big_bytes_ > ring_bytes_ && peer_.ring_bytes > ring_bytes_;
  if (want_big && tx_cur_ == &tx_home_) {
    if (!alloc_seg(&tx_big_, big_bytes_, false)) return;
    tx_old_ = &tx_home_;
    tx_cur_ = &tx_big_;
  } else if (!want_big && tx_cur_ == &tx_big_) {
    tx_old_ = &tx_big_;
    tx_cur_ = &tx_home_;
  } else {
    return;
  }
  sring_.resize(tx_cur_->bytes);
  ++ctr_.send_ring_moves;
  drop_old_rings();
}

void Connection::drop_old_rings() {
  if (tx_old_ != nullptr && !sring_.old_held()) {
    // Every byte in it is completed and consumed: no WR reads it, and a
    // reverse switch never needs it.
    sring_.drop_old();
    if (tx_old_ == &tx_big_) free_seg(&tx_big_);
    tx_old_ = nullptr;
  }
  if (rx_old_ != nullptr && rx_.tail() >= rx_switch_) {
    if (rx_old_ == &rx_big_) free_seg(&rx_big_);
    rx_old_ = nullptr;
  }
}

void Connection::copy_sent(uint64_t from, std::byte* out, size_t n) const {
  while (n > 0) {
    bool old = tx_old_ != nullptr && sring_.in_old(from);
    const RingSeg* seg = old ? tx_old_ : tx_cur_;
    size_t off = old ? sring_.old_offset(from) : sring_.offset(from);
    size_t k = std::min<size_t>(n, seg->bytes - off);
    if (old) k = std::min<uint64_t>(k, sring_.switch_pos() - from);
    std::memcpy(out, seg->mem + off, k);
    out += k;
    from += k;
    n -= k;
  }
}

void Connection::abort() {
  if (state_ == State::kError) return;
  fail(ECONNABORTED);
}

uint32_t Connection::qp_num() const { return qp_ ? qp_->qp_num : 0; }

const char* Connection::device_name() const {
  return qp_ && id_ && id_->verbs ? ibv_get_device_name(id_->verbs->device) : nullptr;
}

uint8_t Connection::port_num() const { return qp_ && id_ ? id_->port_num : 0; }

Status<void> Connection::progress() {
  if (grp_ != nullptr) {
    take_cq_event();
    while (poll_cq()) {
    }
  }
  // Nobody else reads the shared rdma_cm channel (no progress thread): we do.
  if (!cm_hub::serviced()) cm_hub::poll();
  handle_queued_cm_events();
  if (state_ == State::kAccepting &&
      (ctr_.controls_received | ctr_.credits_received | ctr_.data_recvs) != 0) {
    // The peer sends only once it is established, after its RTU: a message
    // here means our ESTABLISHED event is late (its RTU was lost or is
    // still on its way; the CM resends its REP only seconds later). The QP
    // saw the connection come up, which is what librdmacm asks to be told
    // (IBV_EVENT_COMM_EST); a late ESTABLISHED is then ignored. Before, such
    // a connection timed out in "accepting" on a loaded guest
    // (multiproc.prefork, about one run in three).
    (void)guarded::rdma_notify(id_, IBV_EVENT_COMM_EST);
    on_established(nullptr, 0);
  }
  if (grp_ != nullptr) flush_pending();
  // Setup and close deadlines need the precise clock; the keepalive does not.
  check_timers(deadline_ns_ != 0 ? now_ns() : coarse_now_ns());
  if (state_ == State::kError) return Err(err_);
  return Ok();
}

void Connection::check_timers(uint64_t now) {
  if (deadline_ns_ != 0 && now >= deadline_ns_) {
    if (state_ == State::kClosing && sq_outstanding_ > 0) {
      // Writes the peer's RNIC has not acknowledged: the path is not
      // working (a link flap). An error, not a close: the socket layer can
      // still deliver those bytes over TCP (the reverse switch).
      LOG_DEBUG("transport: close linger expired with %u WRs outstanding: failing", sq_outstanding_);
      fail(ETIMEDOUT);
    } else if (state_ == State::kClosing) {
      LOG_DEBUG("transport: close linger expired, nothing outstanding");
      disconnect();
      set_state(State::kClosed);
      deadline_ns_ = 0;
    } else if (state_ < State::kEstablished) {
      // The event that ends this step may sit unread in the shared channel
      // (the progress thread that reads it has not run yet; see
      // resolve_guard_ns for the late events that made this matter). Read
      // it before giving up. (Only on this rare path: a second read of the
      // channel right after progress()'s own costs one EAGAIN.)
      const State was = state_;
      cm_hub::poll();
      handle_queued_cm_events();
      if (state_ != was) return;  // (its handler set what follows; `now` is old)
      if (deadline_ns_ != 0 && now >= deadline_ns_) fail(ETIMEDOUT);
    }
  }
  if (data_seen_) {
    data_seen_ = false;
    last_data_ns_ = now;
  }
  if (state_ == State::kEstablished) {
    // An idle connection gives its grown ring back; a send ring that could
    // not follow the peer's size yet (budget, or still draining) tries again.
    if (tun_.ring_idle_ms != 0 && rx_cur_ == &rx_big_ && can_move_rx() && rx_.readable() == 0 &&
        now - last_data_ns_ >= uint64_t{tun_.ring_idle_ms} * 1000000) {
      if (start_ring_move(&rx_home_)) LOG_DEBUG("transport: qp %u: idle, receive ring back to %u bytes",
                                                qp_num(), rx_home_.bytes);
    }
    maybe_move_send_ring();
  }
  if (state_ == State::kEstablished && tun_.keepalive_ms != 0 &&
      now - last_tx_ns_ >= keepalive_period_ns(tun_.keepalive_ms) && sig_count_ == 0) {
    post_keepalive();
  }
  // RC completes every WR, with success or an error, within the retry budget
  // (7 x 67 ms): one that waits far longer means the device gave up on the
  // queue without saying so. Seen on rxe after a link flap: the requester
  // parks after a failed transmit and nothing reschedules it, the QP stays in
  // RTS, and both ends wait for credits forever.
  if (state_ == State::kEstablished && sig_count_ > 0 &&
      tun_.stall_timeout_ms != 0 && now > sig_wait_ns_ &&
      now - sig_wait_ns_ >= uint64_t{tun_.stall_timeout_ms} * 1000000) {
    LOG_WARN("transport: qp %u: no send completion for %u ms with %u WRs outstanding; the RDMA "
             "path is stuck", qp_num(), tun_.stall_timeout_ms, sq_outstanding_);
    ++ctr_.stalls;
    fail(ETIMEDOUT);
  }
}

// What wait() sleeps on: the completion channel and, when no progress thread
// reads the shared rdma_cm channel, that too.
void Connection::wait_fds(pollfd* out, int* n) const {
  *n = 0;
  if (int f = fd(); f >= 0) out[(*n)++] = {f, POLLIN, 0};
  if (!cm_hub::serviced() && cm_hub::fd() >= 0) out[(*n)++] = {cm_hub::fd(), POLLIN, 0};
}

bool Connection::wait_done(short events) const {
  if (state_ == State::kError || state_ == State::kClosed) return true;
  if ((events & POLLIN) && (rx_.readable() > 0 || fin_received_ || !controls_.empty())) return true;
  if ((events & POLLOUT) && established() && writable() > 0) return true;
  return false;
}

Status<void> Connection::wait(short events, int timeout_ms) {
  uint64_t start = now_ns();
  uint64_t end = timeout_ms < 0 ? UINT64_MAX : start + uint64_t(timeout_ms) * 1000000;
  // Spin on the CQ alone (no syscalls, not even a clock read: SpinDeadline);
  // progress() and the fd only once the spin budget is spent (the sleep
  // arms the CQs first: cq_group.h, "Arming").
  SpinDeadline spin(tun_.spin_us);
  bool spinning = tun_.spin_us != 0;
  bool slept_ready = true;
  while (!wait_done(events)) {
    if (spinning && grp_ != nullptr && established()) {
      if (!spin.passed()) {
        if (poll_cq()) flush_pending();
        continue;
      }
      spinning = false;
    }
    uint64_t now = now_ns();
    if (slept_ready) {
      (void)progress();
      slept_ready = false;
      continue;
    }
    if (now >= end) return Err(ETIMEDOUT);
    // Bounded by our own deadlines and keepalive: no timer fd wakes us.
    uint64_t until = end;
    if (deadline_ns_ != 0) until = std::min(until, deadline_ns_);
    // (A keepalive is due only with no signalled WR out; with one out, the
    // stall watchdog is what is due.)
    if (state_ == State::kEstablished && sig_count_ == 0 && tun_.keepalive_ms != 0)
      until = std::min(until, last_tx_ns_ + keepalive_period_ns(tun_.keepalive_ms));
    if (state_ == State::kEstablished && sig_count_ > 0 && tun_.stall_timeout_ms != 0)
      until = std::min(until, sig_wait_ns_ + uint64_t{tun_.stall_timeout_ms} * 1000000);
    int ms = until == UINT64_MAX ? -1
                                 : static_cast<int>((std::max(until, now) - now + 999999) / 1000000);
    pollfd p[2];
    int np;
    wait_fds(p, &np);
    // CQs raise events only while someone sleeps (cq_group.h, "Arming").
    // What the arm's drain filed may be ours: look before sleeping.
    cq_group::ArmedSleep armed(grp_ != nullptr);
    if (armed.drained()) {
      slept_ready = true;
      continue;
    }
    int r = sys::libc.poll(p, static_cast<nfds_t>(np), ms);
    if (r < 0 && errno != EINTR) return Err(errno);
    if (r > 0) cq_hub::note_if_woken(p, np);  // progress() reads it
    slept_ready = true;
  }
  return Ok();
}

void Connection::destroy_resources() {
  free_seg(&rx_big_);  // a grown ring lives only while in use
  free_seg(&tx_big_);
  // The QP goes (a QP number must not serve its peer again within the CM's
  // timewait); the rest of the kit goes to the pool for the next
  // connection, or is destroyed. Either way no completion event reaches us
  // after this (forget).
  if (grp_) {
    cq_group::leave(grp_, grp_slot_, qp_);  // destroys the QP: nothing of ours is filed later
    grp_ = nullptr;
  } else if (qp_) {
    ibv_destroy_qp(qp_);
  }
  qp_ = nullptr;
  kit_pool::Kit k = std::exchange(kit_, kit_pool::Kit{});
  kit_pool::drop_qp(&k);  // one made ahead we never took (setup failed before)
  if (tun_.kit_pool > 0 && kit_reusable(k) && kit_pool::give(k, tun_.kit_pool)) k = {};
  kit_pool::destroy(&k);
  comp_ch_ = nullptr;  // the hub's
  if (id_) {
    cm_hub::forget(id_);  // no event is delivered to us after this
    guarded::rdma_destroy_id(id_);
    id_ = nullptr;
  }
}

Connection::~Connection() {
  if (established() && state_ != State::kClosed) {
    (void)close();
    uint64_t end = now_ns() + uint64_t{tun_.connect_timeout_ms} * 1000000;
    while (!closed() && now_ns() < end) {
      pollfd p[2];
      int np;
      wait_fds(p, &np);
      cq_group::ArmedSleep armed(grp_ != nullptr);  // (a drain's find: progress() takes it)
      if (!armed.drained() && sys::libc.poll(p, static_cast<nfds_t>(np), 10) > 0)
        cq_hub::note_if_woken(p, np);
      (void)progress();
    }
  }
  disconnect();
  destroy_resources();
  set_state(State::kClosed);  // (uncounted)
}

}  // namespace rsock::transport
