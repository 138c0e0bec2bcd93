// Ring and credit arithmetic of the transport, free of verbs so that it can be
// unit-tested natively (tests/unit/test_transport_ring.cc). All cursors are
// absolute 64-bit stream positions; a position's place in a ring is pos mod
// size (sizes are powers of two). 2^64 bytes never wrap in practice.
//
// Every value a peer supplies goes through one of the accept_* functions,
// which return false for anything impossible: the caller resets the
// connection, it never indexes memory with an unchecked value.
#pragma once

#include <algorithm>
#include <cstdint>

namespace rsock::transport {

// The sender's view of the peer's receive ring and receive WRs.
class TxWindow {
 public:
  // May a CREDIT go out now, given `owed_slots` receive WRs to return? It
  // needs one peer receive WR; the last one only if the CREDIT returns at
  // least one, so two peers can never both end at zero (docs/TRANSPORT.md).
  bool credit_allowed(uint64_t owed_slots) const {
    uint32_t f = free_slots();
    return f >= 2 || (f == 1 && owed_slots >= 1);
  }
  void init(uint32_t ring_bytes, uint32_t peer_slots) {
    ring_ = ring_bytes;
    head_ = consumed_ = 0;
    peer_slots_ = slots_granted_ = peer_slots;
    slots_used_ = 0;
  }
  uint32_t ring_bytes() const { return ring_; }
  // The peer moved its ring (a RING_ACK we sent marks where): every byte from
  // head() on goes to the new one, at pos mod its size. Bytes before head()
  // stay in the old ring until read, so the window stays consumed + size:
  // the new ring never holds more than `size` unread bytes.
  void resize(uint32_t ring_bytes) { ring_ = ring_bytes; }
  uint64_t head() const { return head_; }
  uint64_t consumed() const { return consumed_; }
  // Bytes we may still write without overwriting unread ones (none while
  // more than a smaller new ring's worth is unread in the old one).
  uint64_t free_bytes() const {
    uint64_t used = head_ - consumed_;
    return used >= ring_ ? 0 : ring_ - used;
  }
  // Bytes writable in one piece at head (a DATA write never wraps).
  uint64_t contiguous() const {
    return std::min<uint64_t>(free_bytes(), ring_ - (head_ & (ring_ - 1)));
  }
  uint64_t offset() const { return head_ & (ring_ - 1); }
  uint32_t free_slots() const { return static_cast<uint32_t>(slots_granted_ - slots_used_); }
  void on_data(uint64_t n) { head_ += n; ++slots_used_; }
  void on_message() { ++slots_used_; }  // CREDIT or CONTROL: a receive WR, no bytes

  // A CreditBlock from the peer: `consumed` may not go back nor pass what we
  // sent; the peer can never have more receive WRs outstanding for us than it
  // announced at setup.
  bool accept_credit(uint64_t consumed, uint64_t slots_total) {
    if (consumed < consumed_ || consumed > head_) return false;
    if (slots_total < slots_granted_ || slots_total - slots_used_ > peer_slots_) return false;
    consumed_ = consumed;
    slots_granted_ = slots_total;
    return true;
  }

 private:
  uint32_t ring_ = 0;
  uint64_t head_ = 0;       // bytes written into the peer's ring
  uint64_t consumed_ = 0;   // bytes the peer reported consumed
  uint32_t peer_slots_ = 0; // receive WRs the peer keeps posted at most
  uint64_t slots_granted_ = 0;
  uint64_t slots_used_ = 0;
};

// The receiver's own ring: [tail, head) holds unread bytes.
class RxWindow {
 public:
  void init(uint32_t ring_bytes, uint32_t slots) {
    ring_ = ring_bytes;
    head_ = tail_ = advertised_ = 0;
    slots_ = slots;
    slots_posted_ = slots_advertised_ = slots;
  }
  uint32_t ring_bytes() const { return ring_; }
  // Bytes from head() on arrive in a ring of this size (the RING_ACK that
  // switches rings is ordered after the last DATA into the old one).
  void resize(uint32_t ring_bytes) { ring_ = ring_bytes; }
  uint64_t head() const { return head_; }
  uint64_t tail() const { return tail_; }
  uint64_t advertised() const { return advertised_; }
  // The peer has used all the credit we gave: it cannot send until our next
  // CREDIT (the signal for a bigger ring).
  bool window_full() const { return head_ >= advertised_ + ring_; }
  uint64_t readable() const { return head_ - tail_; }
  uint64_t offset(uint64_t pos) const { return pos & (ring_ - 1); }

  // DATA of `len` bytes arrived at head: it must fit the credit we gave
  // (head + len <= advertised + ring) and must not wrap.
  bool accept_data(uint64_t len) {
    if (len == 0 || len > ring_) return false;
    if (head_ + len > advertised_ + ring_) return false;
    if (offset(head_) + len > ring_) return false;
    head_ += len;
    return true;
  }
  void consume(uint64_t n) { tail_ += n; }
  void on_repost() { ++slots_posted_; }

  // Credits are batched: a CREDIT goes out once half the ring has been freed
  // or half the receive WRs have been reposted since the last one. A sender
  // blocked on either is thereby always unblocked once we have read everything.
  bool credit_due() const {
    return tail_ - advertised_ >= ring_ / 2 || slots_posted_ - slots_advertised_ >= slots_ / 2;
  }
  bool credit_pending() const { return tail_ != advertised_ || slots_posted_ != slots_advertised_; }
  uint64_t slots_owed() const { return slots_posted_ - slots_advertised_; }
  uint64_t tail_to_advertise() const { return tail_; }
  uint64_t slots_to_advertise() const { return slots_posted_; }
  void on_credit_sent(uint64_t tail, uint64_t slots) {
    advertised_ = tail;
    slots_advertised_ = slots;
  }

 private:
  uint32_t ring_ = 0;
  uint64_t head_ = 0;        // bytes arrived
  uint64_t tail_ = 0;        // bytes consumed by recv()
  uint64_t advertised_ = 0;  // tail last sent to the peer
  uint32_t slots_ = 0;
  uint64_t slots_posted_ = 0;
  uint64_t slots_advertised_ = 0;
};

// The local send ring: [tail, head) is posted but not yet completed. Every
// DATA byte passes through it (inline ones too), so its positions are the
// stream's. Space is reused only once the peer has also *consumed* the bytes
// (retain_from, from its credits): until then they may have to be sent again
// over TCP when the connection switches back (docs/DESIGN.md, "The reverse
// switch"). The peer's ring is never larger than what it granted, so this
// costs no throughput when both rings have the same size.
//
// The ring can move to new memory of another size (resize): bytes from
// switch_pos() on go to the new memory at pos mod its size, older ones stay
// in the old memory (old_offset) until old_held() turns false.
class SendRing {
 public:
  void init(uint32_t bytes) {
    size_ = bytes;
    old_size_ = 0;
    head_ = tail_ = keep_ = switch_ = 0;
  }
  // Only once !old_held() (one move at a time).
  void resize(uint32_t bytes) {
    old_size_ = size_;
    size_ = bytes;
    switch_ = head_;
  }
  uint32_t size() const { return size_; }
  uint64_t switch_pos() const { return switch_; }
  // Bytes before switch_pos() are still needed (not completed or not consumed).
  bool old_held() const { return old_size_ != 0 && floor() < switch_; }
  bool in_old(uint64_t pos) const { return old_size_ != 0 && pos < switch_; }
  uint64_t old_offset(uint64_t pos) const { return pos & (old_size_ - 1); }
  uint32_t old_size() const { return old_size_; }
  void drop_old() { old_size_ = 0; }
  uint64_t head() const { return head_; }
  uint64_t tail() const { return tail_; }
  // The oldest byte still held: neither completed nor consumed yet.
  uint64_t floor() const { return std::min(tail_, keep_); }
  uint64_t free_bytes() const {
    uint64_t used = head_ - std::max(floor(), switch_);
    return used >= size_ ? 0 : size_ - used;
  }
  uint64_t contiguous() const {
    return std::min<uint64_t>(free_bytes(), size_ - (head_ & (size_ - 1)));
  }
  uint64_t offset() const { return head_ & (size_ - 1); }
  uint64_t offset(uint64_t pos) const { return pos & (size_ - 1); }
  void produce(uint64_t n) { head_ += n; }
  // A send completion reports the head at post time (its wr_id).
  bool complete(uint64_t upto) {
    if (upto < tail_ || upto > head_) return false;
    tail_ = upto;
    return true;
  }
  // The peer consumed everything before `pos` (monotonic, <= head).
  void retain_from(uint64_t pos) {
    if (pos > keep_ && pos <= head_) keep_ = pos;
  }

 private:
  uint32_t size_ = 0;
  uint32_t old_size_ = 0;  // 0: no old memory
  uint64_t head_ = 0;
  uint64_t tail_ = 0;
  uint64_t keep_ = 0;
  uint64_t switch_ = 0;
};

}  // namespace rsock::transport
