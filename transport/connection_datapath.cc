// The data path: send/recv copies, WR posting, completion handling, credits.
// Every peer-supplied value is checked by TxWindow/RxWindow (ring.h) or here
// before it is used; a bogus one resets the connection.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "util/clock.h"
#include "transport/connection.h"
#include "util/log.h"
#include "util/profile.h"

namespace rsock::transport {

namespace {
constexpr uint64_t kRecvTag = uint64_t{1} << 63;  // wr_id of receive WRs: tag | slot
constexpr size_t kMaxInlineStack = 256;
constexpr int kPollBatch = 16;
constexpr int kMaxChain = 8;  // data WRs per post (the stack holds them: 8 x (128 + 16) bytes)
constexpr size_t kMaxControlQueue = 256;  // unread app control messages before we call it abuse

// Walks a span of iovecs as one byte sequence.
struct IovCursor {
  std::span<const iovec> iov;
  size_t idx = 0, off = 0;
  size_t remaining() const {
    size_t r = 0;
    for (size_t i = idx; i < iov.size(); ++i) r += iov[i].iov_len;
    return r - off;
  }
  // Copies n bytes between the iovecs and `buf` (to_iov selects direction).
  void copy(std::byte* buf, size_t n, bool to_iov) {
    while (n > 0 && idx < iov.size()) {
      size_t take = std::min(n, iov[idx].iov_len - off);
      auto* p = static_cast<std::byte*>(iov[idx].iov_base) + off;
      if (to_iov)
        std::memcpy(p, buf, take);
      else
        std::memcpy(buf, p, take);
      buf += take;
      n -= take;
      off += take;
      if (off == iov[idx].iov_len) {
        ++idx;
        off = 0;
      }
    }
  }
};
}  // namespace

bool Connection::post_recv(uint32_t slot) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(kit_.rbufs + size_t{slot} * wire::kRecvBufBytes),
              static_cast<uint32_t>(wire::kRecvBufBytes), kit_.rbuf_mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = kRecvTag | slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad;
  return ibv_post_recv(qp_, &wr, &bad) == 0;
}

// CREDIT and CONTROL messages are SEND_WITH_IMM from the per-SQ-slot buffer
// after the send ring (inline when the device allows, which rxe does).
static bool post_small_send(ibv_qp* qp, ibv_mr* mr, std::byte* buf, const void* data, size_t len,
                            uint32_t imm, uint64_t wr_id, bool may_inline, bool signaled) {
  if (len) std::memcpy(buf, data, len);  // FIN/CLOSE pass no data (nullptr)
  ibv_sge sge{reinterpret_cast<uintptr_t>(buf), static_cast<uint32_t>(len), mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = IBV_WR_SEND_WITH_IMM;
  wr.imm_data = htonl(imm);
  wr.sg_list = len ? &sge : nullptr;
  wr.num_sge = len ? 1 : 0;
  wr.send_flags = (signaled ? IBV_SEND_SIGNALED : 0) | (may_inline ? IBV_SEND_INLINE : 0);
  ibv_send_wr* bad;
  return ibv_post_send(qp, &wr, &bad) == 0;
}

// Signalled: every kSignalEvery-th WR; every WR once the send ring is half
// full or the SQ nearly so (a sender that runs out of either must have a
// completion coming that frees it); and whatever the caller forces (CLOSE,
// keepalive: they need to know when all is done).
constexpr uint32_t kSignalEvery = 16;

bool Connection::signal_next(bool force) const {
  return force || unsig_run_ + 1 >= kSignalEvery || sring_.free_bytes() < sring_.size() / 2 ||
         sq_free() <= kSignalEvery + 2;
}

void Connection::on_posted(bool signaled) {
  ++sq_outstanding_;
  ++sq_seq_;
  if (!signaled) {
    ++unsig_run_;
    return;
  }
  sig_cover_[(sig_head_ + sig_count_) % sq_depth_] = unsig_run_ + 1;
  if (sig_count_ == 0) sig_wait_ns_ = coarse_now_ns();
  ++sig_count_;
  unsig_run_ = 0;
}

void Connection::on_send_completion() {
  uint32_t cover = 1;
  if (sig_count_ > 0) {
    cover = sig_cover_[sig_head_];
    sig_head_ = (sig_head_ + 1) % sq_depth_;
    --sig_count_;
    // The queue moves: the next signalled WR's wait starts now.
    if (sig_count_ > 0) sig_wait_ns_ = coarse_now_ns();
  }
  sq_outstanding_ -= std::min(cover, sq_outstanding_);
}

// A CREDIT sent while the peer had used its whole window, several times in
// a row: the peer streams and waits for us, so a bigger ring would let it
// keep going (TCP's receive autotuning, in spirit).
constexpr uint32_t kGrowAfter = 4;

bool Connection::post_credit() {
  if (sq_free() < 1 || !tx_.credit_allowed(rx_.slots_owed())) return false;
  bool full = rx_.window_full();
  wire::CreditBlock cb{rx_.tail_to_advertise(), static_cast<uint32_t>(rx_.slots_to_advertise()), 0};
  std::byte* buf = kit_.tx_mem + ring_bytes_ + (sq_seq_ % sq_depth_) * wire::kRecvBufBytes;
  bool sig = signal_next(false);
  if (!post_small_send(qp_, kit_.tx_mr, buf, &cb, sizeof cb, wire::make_imm(wire::Op::kCredit, 0),
                       sring_.head(), max_inline_ >= sizeof cb, sig)) {
    fail(ECONNRESET);
    return false;
  }
  rx_.on_credit_sent(cb.consumed, rx_.slots_to_advertise());
  full_credits_ = full ? full_credits_ + 1 : 0;
  tx_.on_message();
  on_posted(sig);
  ++ctr_.credits_sent;
  last_tx_ns_ = coarse_now_ns();
  return true;
}

// Two peer receive WRs and two SQ slots must remain so that a CREDIT can
// always follow (docs/TRANSPORT.md, "Credits").
bool Connection::post_control(wire::ControlType type, const void* data, size_t len) {
  if (sq_free() < 2 || tx_.free_slots() < 2) return false;
  std::byte* buf = kit_.tx_mem + ring_bytes_ + (sq_seq_ % sq_depth_) * wire::kRecvBufBytes;
  uint32_t imm = wire::make_imm(wire::Op::kControl, wire::control_value(type, uint32_t(len)));
  // FIN and CLOSE are signalled: the close waits for every WR to complete.
  bool sig = signal_next(type != wire::ControlType::kApp);
  if (!post_small_send(qp_, kit_.tx_mr, buf, data, len, imm, sring_.head(), max_inline_ >= len,
                       sig)) {
    fail(ECONNRESET);
    return false;
  }
  tx_.on_message();
  on_posted(sig);
  ++ctr_.controls_sent;
  last_tx_ns_ = coarse_now_ns();
  return true;
}

// Zero-length RDMA WRITE: needs no receive WR and no rkey check on the peer,
// but its ACK proves the peer's QP alive; a dead peer yields RETRY_EXC_ERR.
bool Connection::post_keepalive() {
  if (sq_free() < 1) return false;
  ibv_send_wr wr{};
  wr.wr_id = sring_.head();
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = peer_.ring_addr;
  wr.wr.rdma.rkey = peer_.ring_rkey;
  ibv_send_wr* bad;
  if (ibv_post_send(qp_, &wr, &bad) != 0) {
    fail(ECONNRESET);
    return false;
  }
  on_posted(true);
  ++ctr_.keepalives;
  last_tx_ns_ = coarse_now_ns();
  return true;
}

void Connection::flush_pending() {
  if (!established() || state_ == State::kClosed) return;
  if (ring_ack_pending_) post_ring_ack();
  if (rx_.credit_due()) post_credit();
  // Grow for a peer that streams faster than one window per CREDIT round
  // trip, and for one that filled the ring while our application does not
  // read: a first ring must not make a program that writes a lot before it
  // reads block sooner than the grown ring would (the kernel buffers that
  // much too).
  bool stuffed = rx_.window_full() && rx_.readable() >= rx_.ring_bytes();
  if ((full_credits_ >= kGrowAfter || stuffed) && rx_cur_ == &rx_home_ &&
      big_bytes_ > ring_bytes_ && can_move_rx()) {
    full_credits_ = 0;  // (tried again after as many, if the budget said no)
    if (start_ring_move(&rx_big_))
      LOG_DEBUG("transport: qp %u: streaming, offering a %u-byte receive ring", qp_num(), big_bytes_);
  }
  if (tx_old_ != nullptr || rx_old_ != nullptr) drop_old_rings();
  if (fin_pending_ && !fin_sent_ && post_control(wire::ControlType::kFin, nullptr, 0))
    fin_sent_ = true;
  if (close_pending_ && fin_sent_ && !close_sent_ &&
      post_control(wire::ControlType::kClose, nullptr, 0))
    close_sent_ = true;
  if (state_ == State::kClosing && close_sent_ && sq_outstanding_ == 0) {
    // Everything we posted is acknowledged by the peer's RNIC: nothing is lost
    // by moving the QP to error now.
    disconnect();
    state_ = State::kClosed;
    deadline_ns_ = 0;
  }
}

bool Connection::handle_recv(uint32_t slot, uint32_t imm, bool rdma_imm, uint32_t byte_len) {
  const std::byte* buf = kit_.rbufs + size_t{slot} * wire::kRecvBufBytes;
  uint32_t value = wire::imm_value(imm);
  switch (static_cast<wire::Op>(wire::imm_op(imm))) {
    case wire::Op::kData:
      // Version 3: a DATA must start where our stream stands (wire.h).
      if (data_pos() && value != wire::data_pos_value(rx_.head())) {
        LOG_WARN("transport: qp %u: DATA of %u bytes for stream position %u, ours is %u (mod "
                 "2^29): a duplicated or misplaced write completion; resetting the connection",
                 qp_num(), byte_len, value, wire::data_pos_value(rx_.head()));
        return false;
      }
      if (!rdma_imm || fin_received_ || !rx_.accept_data(data_pos() ? byte_len : value)) return false;
      ++ctr_.data_recvs;
      data_seen_ = true;
      return true;
    case wire::Op::kCredit: {
      if (rdma_imm || byte_len != sizeof(wire::CreditBlock)) return false;
      wire::CreditBlock cb;
      std::memcpy(&cb, buf, sizeof cb);
      if (!tx_.accept_credit(cb.consumed, cb.slots)) return false;
      sring_.retain_from(tx_.consumed());
      ++ctr_.credits_received;
      return true;
    }
    case wire::Op::kControl: {
      uint32_t type = (value >> 8) & 0xff, len = value & 0xff;
      if (rdma_imm || value >> 16 || len != byte_len || len > wire::kMaxControlBytes) return false;
      ++ctr_.controls_received;
      switch (static_cast<wire::ControlType>(type)) {
        case wire::ControlType::kFin:
          if (fin_received_ || len != 0) return false;
          fin_received_ = true;
          return true;
        case wire::ControlType::kClose:
          if (len != 0) return false;
          peer_closed_ = true;
          close_received_ = true;
          return true;
        case wire::ControlType::kRing: {
          // The peer offers a new ring for our DATA: one at a time, only
          // from a peer that speaks the ring move.
          wire::RingBlock b;
          if (len != sizeof b || ring_ack_pending_ || peer_.wire_version < wire::kRingMoveVersion)
            return false;
          std::memcpy(&b, buf, sizeof b);
          if (b.addr == 0 || b.log2 < wire::kMinRingLog2 || b.log2 > wire::kMaxRingLog2 ||
              b.reserved[0] || b.reserved[1] || b.reserved[2])
            return false;
          peer_next_ = b;
          ring_ack_pending_ = true;  // answered by flush_pending, ordered after our DATA so far
          return true;
        }
        case wire::ControlType::kRingAck: {
          // Every DATA before this went to the old ring: it must end exactly
          // where our head is.
          uint64_t pos;
          if (len != sizeof pos || rx_next_ == nullptr) return false;
          std::memcpy(&pos, buf, sizeof pos);
          if (pos != rx_.head()) return false;
          rx_old_ = rx_cur_;
          rx_cur_ = std::exchange(rx_next_, nullptr);
          rx_switch_ = pos;
          rx_.resize(rx_cur_->bytes);
          if (rx_cur_ == &rx_big_) ++ctr_.ring_grows;
          else ++ctr_.ring_shrinks;
          return true;
        }
        case wire::ControlType::kApp: {
          if (len < 1 || controls_.size() >= kMaxControlQueue) return false;
          ControlMessage m;
          m.type = static_cast<uint8_t>(buf[0]);
          m.len = static_cast<uint8_t>(len - 1);
          m.stream_pos = rx_.head();
          std::memcpy(m.data, buf + 1, len - 1);
          controls_.push_back(m);
          return true;
        }
      }
      return false;
    }
  }
  return false;
}

Status<void> Connection::poll_completions(bool* took) {
  bool any = false;
  if (grp_ != nullptr && established()) {
    while (poll_cq()) any = true;
    if (any) flush_pending();
  }
  if (took) *took = any;
  if (state_ == State::kError) return Err(err_);
  return Ok();
}

bool Connection::poll_cq(bool tell_self) {
  profile::Scope timed(profile::Probe::kPollCq);
  ibv_wc wc[kPollBatch];
  if (grp_ == nullptr) return false;
  int n = cq_group::poll(grp_, grp_slot_, wc, kPollBatch, tell_self);  // ours only
  if (n <= 0) return false;
  ctr_.completions += uint64_t(n);
  for (int i = 0; i < n; ++i) {
    const ibv_wc& w = wc[i];
    bool is_recv = (w.wr_id & kRecvTag) != 0;
    if (!is_recv) on_send_completion();
    if (w.status != IBV_WC_SUCCESS) {
      // Flushes after a disconnect are expected; anything else (retry
      // exceeded = dead peer, RNR = accounting bug, protection errors) resets.
      if (w.status == IBV_WC_WR_FLUSH_ERR && (disconnected_ || disconnect_sent_)) continue;
      if (!ctr_.first_wc_error) ctr_.first_wc_error = int(w.status);
      if (state_ != State::kError)
        LOG_DEBUG("transport: qp %u completion error %s", qp_num(), ibv_wc_status_str(w.status));
      if (state_ != State::kClosed) fail(ECONNRESET);
      continue;
    }
    if (!is_recv) {
      sring_.complete(w.wr_id);
      continue;
    }
    auto slot = static_cast<uint32_t>(w.wr_id & ~kRecvTag);
    if (state_ == State::kError || state_ == State::kClosed) continue;
    bool ok = (w.wc_flags & IBV_WC_WITH_IMM) &&
              handle_recv(slot, ntohl(w.imm_data), w.opcode == IBV_WC_RECV_RDMA_WITH_IMM,
                          w.byte_len);
    if (!ok) {
      LOG_WARN("transport: qp %u: invalid message from peer (imm 0x%x), resetting", qp_num(),
               ntohl(w.imm_data));
      fail(ECONNRESET);
      continue;
    }
    if (!post_recv(slot)) {
      fail(ECONNRESET);
      continue;
    }
    rx_.on_repost();
  }
  return true;
}

size_t Connection::readable() const { return rx_.readable(); }

Connection::Gauges Connection::gauges() const {
  return {rx_cur_->bytes, static_cast<uint32_t>(sring_.size() - sring_.free_bytes()),
          static_cast<uint32_t>(rx_.readable()), static_cast<uint32_t>(tx_.free_bytes())};
}

size_t Connection::writable() const {
  if (!established() || state_ != State::kEstablished || fin_pending_ || peer_closed_) return 0;
  if (sq_free() < 2 || tx_.free_slots() < 2) return 0;
  return std::min(tx_.free_bytes(), sring_.free_bytes());
}

Status<size_t> Connection::send(std::span<const iovec> iov) {
  if (state_ == State::kError) return Err(err_);
  if (fin_pending_ || peer_closed_ || state_ == State::kClosing || state_ == State::kClosed)
    return Err(EPIPE);
  if (!established()) return Err(EAGAIN);
  IovCursor cur{iov};
  size_t left = cur.remaining();
  if (left == 0) return size_t{0};
  if (writable() == 0 && poll_cq(/*tell_self=*/true)) flush_pending();
  if (state_ == State::kError) return Err(err_);

  const size_t inline_limit = std::min<size_t>({tun_.inline_threshold, max_inline_, kMaxInlineStack});
  const uint64_t max_chunk = std::max<uint64_t>(tx_.ring_bytes() / 8, 4096);
  // The chunks of one call go to the device as one chained post: on rxe
  // every ibv_post_send is a doorbell syscall (and the requester's run in
  // the caller), so a 16 KiB write into a 64 KiB ring (two ring/8 chunks)
  // or a wrapping one costs one, not two. Each WR's bookkeeping is done as
  // it is built, since the next one's position, signalling and credit
  // depend on it; a failed post fails the connection, and the bytes of the
  // WRs before the one the device refused are the ones reported sent.
  ibv_sge sges[kMaxChain];
  ibv_send_wr wrs[kMaxChain];
  size_t total = 0;
  while (left > 0 && state_ != State::kError) {
    int k = 0;
    while (k < kMaxChain && left > 0) {
      if (sq_free() < 2 || tx_.free_slots() < 2 || tx_.contiguous() == 0) {
        ++ctr_.credit_stalls;
        break;
      }
      size_t n = std::min<uint64_t>({left, tx_.contiguous(), max_chunk, sring_.contiguous()});
      if (n == 0) break;  // local ring full: wait for completions and credits
      // Every byte goes through the send ring, inline ones too: it is the
      // copy a reverse switch resends from (SendRing). Inline data is read
      // from there by the post itself; the rest by the device.
      std::byte* dst = tx_cur_->mem + sring_.offset();
      cur.copy(dst, n, false);
      sring_.produce(n);
      sges[k] = {reinterpret_cast<uintptr_t>(dst), static_cast<uint32_t>(n), tx_cur_->mr->lkey};
      ibv_send_wr& wr = wrs[k];
      wr = {};
      if (n <= inline_limit) {
        wr.send_flags = IBV_SEND_INLINE;
        ++ctr_.inline_wrs;
      }
      bool sig = signal_next(false);
      if (sig) wr.send_flags |= IBV_SEND_SIGNALED;
      wr.wr_id = sring_.head();
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.imm_data = htonl(wire::make_imm(wire::Op::kData, data_pos()
                                                              ? wire::data_pos_value(tx_.head())
                                                              : static_cast<uint32_t>(n)));
      wr.sg_list = &sges[k];
      wr.num_sge = 1;
      wr.wr.rdma.remote_addr = peer_.ring_addr + tx_.offset();
      wr.wr.rdma.rkey = peer_.ring_rkey;
      if (k > 0) wrs[k - 1].next = &wr;
      ++k;
      tx_.on_data(n);
      on_posted(sig);
      left -= n;
    }
    if (k == 0) break;
    ibv_send_wr* bad = nullptr;
    int posted;
    {
      profile::Scope timed(profile::Probe::kPostSend);
      posted = ibv_post_send(qp_, &wrs[0], &bad);
    }
    int ok = k;
    ++ctr_.data_posts;
    if (posted != 0) {
      ok = 0;
      while (ok < k && &wrs[ok] != bad) ++ok;
      fail(ECONNRESET);
    }
    for (int i = 0; i < ok; ++i) {
      ++ctr_.data_wrs;
      ctr_.bytes_sent += sges[i].length;
      total += sges[i].length;
    }
    if (k < kMaxChain) break;  // stopped by credit or ring space, or done
  }
  if (total > 0) {
    last_tx_ns_ = coarse_now_ns();
    return total;
  }
  if (state_ == State::kError) return Err(err_);
  return Err(EAGAIN);
}

Status<size_t> Connection::recv(std::span<const iovec> iov, bool peek) {
  if (rx_.readable() == 0 && grp_ != nullptr && poll_cq(/*tell_self=*/true)) flush_pending();
  uint64_t avail = rx_.readable();
  if (avail == 0) {
    if (fin_received_) return size_t{0};
    if (state_ == State::kError) return Err(err_);
    if (state_ == State::kClosed) return size_t{0};
    return Err(EAGAIN);
  }
  IovCursor cur{iov};
  size_t n = std::min<uint64_t>(avail, cur.remaining());
  uint64_t pos = rx_.tail();
  size_t done = 0;
  while (done < n) {
    uint64_t p = pos + done;
    // Bytes before a ring move's position are in the old ring.
    const RingSeg* seg = rx_old_ != nullptr && p < rx_switch_ ? rx_old_ : rx_cur_;
    uint64_t off = p & (seg->bytes - 1);
    uint64_t take = std::min<uint64_t>(n - done, seg->bytes - off);
    if (seg == rx_old_) take = std::min(take, rx_switch_ - p);
    cur.copy(seg->mem + off, take, true);
    done += take;
  }
  if (!peek) {
    rx_.consume(n);
    ctr_.bytes_received += n;
    if (rx_old_ != nullptr) drop_old_rings();
    if (rx_.credit_due()) flush_pending();
  }
  return n;
}

Status<void> Connection::shutdown_write() {
  // (Recorded also when the connection has failed: the order of the two
  // ends' closes is what the socket layer's TCP close follows.)
  if (!fin_pending_) fin_after_peer_ = fin_received_;
  if (state_ == State::kError) return Err(err_);
  if (!established()) return Err(ENOTCONN);
  fin_pending_ = true;
  flush_pending();
  return Ok();
}

Status<void> Connection::send_control(uint8_t type, std::span<const std::byte> data) {
  if (data.size() > wire::kMaxAppControlBytes) return Err(EMSGSIZE);
  if (state_ == State::kError) return Err(err_);
  if (fin_pending_ || peer_closed_ || state_ != State::kEstablished) {
    return established() ? Err(EPIPE) : Err(EAGAIN);
  }
  std::byte buf[wire::kMaxControlBytes];
  buf[0] = std::byte{type};
  if (!data.empty()) std::memcpy(buf + 1, data.data(), data.size());  // data() may be null
  if (!post_control(wire::ControlType::kApp, buf, data.size() + 1)) {
    if (state_ == State::kError) return Err(err_);
    if (poll_cq(/*tell_self=*/true)) flush_pending();
    if (!post_control(wire::ControlType::kApp, buf, data.size() + 1))
      return state_ == State::kError ? Err(err_) : Err(EAGAIN);
  }
  return Ok();
}

void Connection::take_controls() {
  if (grp_ != nullptr && poll_cq(/*tell_self=*/true)) flush_pending();
}

bool Connection::control_queued(uint8_t type) {
  take_controls();
  for (const ControlMessage& m : controls_)
    if (m.type == type) return true;
  return false;
}

Status<ControlMessage> Connection::recv_control(bool poll) {
  if (controls_.empty() && poll) take_controls();
  if (controls_.empty()) return state_ == State::kError ? Err(err_) : Err(EAGAIN);
  ControlMessage m = controls_.front();
  controls_.pop_front();
  return m;
}

}  // namespace rsock::transport
