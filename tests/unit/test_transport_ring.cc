// Ring and credit arithmetic of transport/ (ring.h) and the setup block
// parser (wire.h): wrap-around, full/empty, batching, bogus peer values.
#include <doctest/doctest.h>

#include <cstring>

#include "transport/ring.h"
#include "transport/wire.h"

using namespace rsock::transport;
namespace w = rsock::transport::wire;

TEST_CASE("transport TxWindow: credit space, wrap-around, full") {
  TxWindow tx;
  tx.init(4096, 8);
  CHECK(tx.free_bytes() == 4096);
  CHECK(tx.contiguous() == 4096);
  CHECK(tx.free_slots() == 8);
  tx.on_data(4000);
  CHECK(tx.free_bytes() == 96);
  CHECK(tx.contiguous() == 96);
  tx.on_data(96);  // ring full: nothing more until the peer reads
  CHECK(tx.free_bytes() == 0);
  CHECK(tx.contiguous() == 0);
  CHECK(tx.offset() == 0);
  REQUIRE(tx.accept_credit(4000, 8));
  CHECK(tx.free_bytes() == 4000);
  CHECK(tx.contiguous() == 4000);  // head is at offset 0 again
  tx.on_data(100);
  REQUIRE(tx.accept_credit(4096, 10));  // two receive WRs reposted
  CHECK(tx.free_bytes() == 4096 - 100);
  CHECK(tx.contiguous() == 4096 - 100);
  CHECK(tx.free_slots() == 10 - 3);
  tx.on_message();
  CHECK(tx.free_slots() == 10 - 4);
}

TEST_CASE("transport TxWindow: contiguous stops at the ring end") {
  TxWindow tx;
  tx.init(4096, 8);
  tx.on_data(3000);
  REQUIRE(tx.accept_credit(3000, 8));
  CHECK(tx.free_bytes() == 4096);
  CHECK(tx.contiguous() == 1096);  // then a second write from offset 0
  tx.on_data(1096);
  CHECK(tx.offset() == 0);
  CHECK(tx.contiguous() == 3000);
}

TEST_CASE("transport TxWindow: bogus credits are refused and change nothing") {
  TxWindow tx;
  tx.init(4096, 8);
  tx.on_data(1000);
  CHECK_FALSE(tx.accept_credit(1001, 8));   // consumed more than we sent
  REQUIRE(tx.accept_credit(500, 8));
  CHECK_FALSE(tx.accept_credit(400, 8));    // consumed went backwards
  CHECK_FALSE(tx.accept_credit(500, 7));    // slots went backwards
  CHECK_FALSE(tx.accept_credit(500, 8 + 2));  // only 1 WR used: at most 1 reposted
  CHECK(tx.accept_credit(500, 9));
  CHECK_FALSE(tx.accept_credit(UINT64_MAX, 9));
  CHECK(tx.consumed() == 500);
  CHECK(tx.free_slots() == 8);
}

TEST_CASE("transport RxWindow: data must fit the advertised credit and not wrap") {
  RxWindow rx;
  rx.init(4096, 8);
  CHECK(rx.readable() == 0);
  CHECK_FALSE(rx.accept_data(0));
  CHECK_FALSE(rx.accept_data(4097));
  REQUIRE(rx.accept_data(4000));
  CHECK_FALSE(rx.accept_data(97));  // would overwrite unread byte 0
  CHECK_FALSE(rx.accept_data(200)); // would wrap past the ring end
  REQUIRE(rx.accept_data(96));      // exactly full
  CHECK(rx.readable() == 4096);
  CHECK_FALSE(rx.accept_data(1));
  rx.consume(4096);
  CHECK(rx.readable() == 0);
  // Read but not yet advertised: the sender does not know, so a write now is bogus.
  CHECK_FALSE(rx.accept_data(1));
  rx.on_credit_sent(rx.tail_to_advertise(), rx.slots_to_advertise());
  CHECK(rx.accept_data(1));
  CHECK(rx.offset(rx.head()) == 1);
}

TEST_CASE("transport RxWindow: credit batching by bytes and by receive WRs") {
  RxWindow rx;
  rx.init(4096, 8);
  CHECK_FALSE(rx.credit_pending());
  REQUIRE(rx.accept_data(3000));
  rx.consume(2047);
  CHECK(rx.credit_pending());
  CHECK_FALSE(rx.credit_due());  // less than half the ring freed
  rx.consume(1);
  CHECK(rx.credit_due());        // half the ring: send one CREDIT
  rx.on_credit_sent(rx.tail_to_advertise(), rx.slots_to_advertise());
  CHECK_FALSE(rx.credit_pending());
  for (int i = 0; i < 3; ++i) rx.on_repost();
  CHECK_FALSE(rx.credit_due());
  rx.on_repost();                // half the receive WRs reposted
  CHECK(rx.credit_due());
  CHECK(rx.slots_to_advertise() == 12);
}

TEST_CASE("transport SendRing: completion cursors are checked") {
  SendRing s;
  s.init(8192);
  CHECK(s.contiguous() == 8192);
  s.produce(8000);
  CHECK(s.free_bytes() == 192);
  CHECK(s.contiguous() == 192);
  CHECK_FALSE(s.complete(8001));
  REQUIRE(s.complete(4000));
  CHECK_FALSE(s.complete(3999));
  CHECK(s.contiguous() == 192);  // up to the end, then offset 0
  s.produce(192);
  CHECK(s.offset() == 0);
  // Completed is not enough: bytes the peer has not consumed are kept for a
  // reverse switch.
  CHECK(s.contiguous() == 0);
  s.retain_from(3000);
  CHECK(s.floor() == 3000);
  CHECK(s.contiguous() == 3000);
  s.retain_from(6000);  // beyond the completions: those bound it now
  CHECK(s.floor() == 4000);
  CHECK(s.contiguous() == 4000);
  s.retain_from(5000);  // never backwards: keep stays at 6000
  CHECK(s.floor() == 4000);
  s.retain_from(9000);  // beyond head: ignored
  CHECK(s.floor() == 4000);
}

namespace {
w::SetupBlock good_block() {
  w::SetupBlock b{};
  b.magic = w::kMagic;
  b.version = w::kWireVersion;
  b.kind = static_cast<uint8_t>(w::SetupKind::kRequest);
  b.payload_len = 5;
  b.ring_addr = 0x10000;
  b.ring_rkey = 0x1234;
  b.ring_log2 = 18;
  b.recv_slots = 64;
  std::memcpy(b.payload, "hello", 5);
  return b;
}
}  // namespace

TEST_CASE("transport wire: setup block parse and validation") {
  w::PeerSetup p;
  auto b = good_block();
  REQUIRE(w::parse_setup(&b, w::kSetupHeaderBytes + 5, w::SetupKind::kRequest, &p) ==
          w::RejectReason::kNone);
  CHECK(p.ring_bytes == 256 * 1024);
  CHECK(p.ring_rkey == 0x1234);
  CHECK(p.payload_len == 5);
  CHECK(std::memcmp(p.payload, "hello", 5) == 0);
  // The CM may pad private data: a longer length is fine.
  CHECK(w::parse_setup(&b, 56, w::SetupKind::kRequest, &p) == w::RejectReason::kNone);

  auto bad = [&](auto mutate, w::RejectReason want, size_t len = 56) {
    auto x = good_block();
    mutate(x);
    w::PeerSetup q;
    CHECK(w::parse_setup(&x, len, w::SetupKind::kRequest, &q) == want);
  };
  bad([](w::SetupBlock& x) { x.magic = 0xdeadbeef; }, w::RejectReason::kBadMagic);
  bad([](w::SetupBlock& x) { x.version = w::kWireVersion + 1; }, w::RejectReason::kBadVersion);
  bad([](w::SetupBlock& x) { x.kind = 2; }, w::RejectReason::kBadSetup);
  bad([](w::SetupBlock& x) { x.ring_log2 = 11; }, w::RejectReason::kBadSetup);
  bad([](w::SetupBlock& x) { x.ring_log2 = 29; }, w::RejectReason::kBadSetup);
  bad([](w::SetupBlock& x) { x.ring_log2 = 255; }, w::RejectReason::kBadSetup);
  bad([](w::SetupBlock& x) { x.recv_slots = 1; }, w::RejectReason::kBadSetup);
  bad([](w::SetupBlock& x) { x.recv_slots = 60000; }, w::RejectReason::kBadSetup);
  bad([](w::SetupBlock& x) { x.payload_len = 33; }, w::RejectReason::kBadSetup);
  bad([](w::SetupBlock& x) { x.ring_addr = 0; }, w::RejectReason::kBadSetup);
  // payload_len says more than was received
  bad([](w::SetupBlock&) {}, w::RejectReason::kBadSetup, w::kSetupHeaderBytes + 4);
  bad([](w::SetupBlock&) {}, w::RejectReason::kBadMagic, 10);
  CHECK(w::parse_setup(nullptr, 56, w::SetupKind::kRequest, &p) == w::RejectReason::kBadMagic);
}

TEST_CASE("transport wire: the wire version is negotiated, highest common one") {
  // A range [lo, hi] (hi 0 = lo, what 0.1.0 sends) against ours.
  CHECK(w::negotiate_wire(w::kWireMinVersion, 0) == w::kWireMinVersion);
  CHECK(w::negotiate_wire(w::kWireMinVersion, w::kWireVersion) == w::kWireVersion);
  CHECK(w::negotiate_wire(1, 250) == w::kWireVersion);  // a newer peer that still speaks ours
  CHECK(w::negotiate_wire(w::kWireVersion + 1, 250) == 0);  // only newer versions
  CHECK(w::negotiate_wire(0, 0) == 0);
  CHECK(w::negotiate_wire(3, 2) == 0);  // an empty range

  // A request from a newer peer with an overlapping range parses and records
  // the choice; the accept the passive side then builds names it.
  auto b = good_block();
  b.version = 1;
  b.max_version = 250;
  w::PeerSetup p;
  REQUIRE(w::parse_setup(&b, 56, w::SetupKind::kRequest, &p) == w::RejectReason::kNone);
  CHECK(p.wire_version == w::kWireVersion);
  // A request that speaks only newer versions is rejected as kBadVersion.
  b.version = w::kWireVersion + 1;
  b.max_version = w::kWireVersion + 3;
  CHECK(w::parse_setup(&b, 56, w::SetupKind::kRequest, &p) == w::RejectReason::kBadVersion);

  // An accept must name one version we speak; its max_version is ignored.
  auto a = good_block();
  a.kind = static_cast<uint8_t>(w::SetupKind::kAccept);
  a.version = w::kWireVersion;
  a.max_version = 7;
  CHECK(w::parse_setup(&a, 56, w::SetupKind::kAccept, &p) == w::RejectReason::kNone);
  CHECK(p.wire_version == w::kWireVersion);
  a.version = w::kWireVersion + 1;
  CHECK(w::parse_setup(&a, 56, w::SetupKind::kAccept, &p) == w::RejectReason::kBadVersion);
  a.version = 0;
  CHECK(w::parse_setup(&a, 56, w::SetupKind::kAccept, &p) == w::RejectReason::kBadVersion);
}

TEST_CASE("transport wire: reject reason and immediates") {
  w::SetupBlock r{};
  r.magic = w::kMagic;
  r.kind = static_cast<uint8_t>(w::SetupKind::kReject);
  r.reason = static_cast<uint8_t>(w::RejectReason::kRefused);
  CHECK(w::parse_reject(&r, w::kRejectBytes) == w::RejectReason::kRefused);
  CHECK(w::parse_reject(&r, 4) == w::RejectReason::kNone);
  r.magic = 1;
  CHECK(w::parse_reject(&r, w::kRejectBytes) == w::RejectReason::kNone);
  CHECK(w::parse_reject(nullptr, 0) == w::RejectReason::kNone);
  // A redirect names a port in the ring_addr field; a short one names none.
  r.magic = w::kMagic;
  r.reason = static_cast<uint8_t>(w::RejectReason::kRedirect);
  r.ring_addr = 20123;
  CHECK(w::parse_reject(&r, w::kRedirectBytes) == w::RejectReason::kRedirect);
  CHECK(w::parse_redirect_port(&r, w::kRedirectBytes) == 20123);
  CHECK(w::parse_redirect_port(&r, w::kRejectBytes) == 0);
  r.reason = static_cast<uint8_t>(w::RejectReason::kRefused);
  CHECK(w::parse_redirect_port(&r, w::kRedirectBytes) == 0);

  uint32_t imm = w::make_imm(w::Op::kData, 1u << 28);
  CHECK(w::imm_op(imm) == 0);
  CHECK(w::imm_value(imm) == 1u << 28);
  imm = w::make_imm(w::Op::kControl, w::control_value(w::ControlType::kApp, 17));
  CHECK(w::imm_op(imm) == 2);
  CHECK(((w::imm_value(imm) >> 8) & 0xff) == 3);
  CHECK((w::imm_value(imm) & 0xff) == 17);
}

TEST_CASE("transport TxWindow: the last peer receive WR only carries a credit that returns WRs") {
  TxWindow tx;
  tx.init(4096, 4);
  CHECK(tx.credit_allowed(0));
  tx.on_message();
  tx.on_message();
  CHECK(tx.credit_allowed(0));  // 2 left
  tx.on_message();
  CHECK(tx.free_slots() == 1);
  CHECK_FALSE(tx.credit_allowed(0));  // would strand both sides at zero
  CHECK(tx.credit_allowed(1));
  tx.on_message();
  CHECK_FALSE(tx.credit_allowed(5));
}

TEST_CASE("transport ring move: the window follows the new ring, never past unread bytes") {
  // Sender and receiver with 4 KiB rings; the receiver offers 16 KiB and
  // the sender's RING_ACK marks position 3000.
  TxWindow tx;
  RxWindow rx;
  tx.init(4096, 64);
  rx.init(4096, 64);
  tx.on_data(3000);
  REQUIRE(rx.accept_data(3000));
  tx.resize(16384);
  rx.resize(16384);
  // 3000 bytes unread in the old ring: the new one takes 16384 - 3000 more,
  // from offset 3000 of the new ring (pos mod size).
  CHECK(tx.free_bytes() == 16384 - 3000);
  CHECK(tx.offset() == 3000);
  tx.on_data(13384);
  REQUIRE(rx.accept_data(13384));
  CHECK(tx.free_bytes() == 0);
  CHECK(rx.window_full());
  CHECK_FALSE(rx.accept_data(1));  // beyond the credit
  // Back to 4 KiB while 16384 bytes are unread: no window at all until the
  // reader is within 4 KiB of the head (the unsigned arithmetic saturates).
  tx.resize(4096);
  rx.resize(4096);
  CHECK(tx.free_bytes() == 0);
  CHECK(tx.contiguous() == 0);
  rx.consume(16384 - 1000);
  REQUIRE(tx.accept_credit(16384 - 1000, 64));
  rx.on_credit_sent(16384 - 1000, 64);
  CHECK(tx.free_bytes() == 4096 - 1000);
  CHECK(tx.offset() == 16384 % 4096);
  CHECK(rx.accept_data(3096));
  CHECK_FALSE(rx.accept_data(1));
}

TEST_CASE("transport SendRing move: old memory is held until completed and consumed") {
  SendRing s;
  s.init(4096);
  s.produce(3000);
  s.resize(16384);
  CHECK(s.switch_pos() == 3000);
  CHECK(s.old_held());
  CHECK(s.in_old(2999));
  CHECK_FALSE(s.in_old(3000));
  CHECK(s.old_offset(2999) == 2999);
  CHECK(s.free_bytes() == 16384);  // nothing in the new memory yet
  CHECK(s.offset() == 3000);
  s.produce(10000);
  CHECK(s.free_bytes() == 16384 - 10000);
  REQUIRE(s.complete(13000));
  CHECK(s.old_held());  // completed, but the peer has not consumed it
  s.retain_from(2999);
  CHECK(s.old_held());
  s.retain_from(3000);
  CHECK_FALSE(s.old_held());
  s.drop_old();
  CHECK_FALSE(s.in_old(0));
  // Back to the small memory while 10000 bytes are held in the big one.
  s.resize(4096);
  CHECK(s.old_held());
  CHECK(s.free_bytes() == 4096);
  s.produce(4096);
  CHECK(s.free_bytes() == 0);
  s.retain_from(13000);
  CHECK_FALSE(s.old_held());  // floor = min(tail 13000, keep 13000) = switch
}

TEST_CASE("transport wire: the ring move is wire version 2") {
  CHECK(w::kWireVersion >= w::kRingMoveVersion);
  CHECK(w::negotiate_wire(1, 0) == 1);  // a 0.1.0 peer: version 1, no ring moves
  CHECK(sizeof(w::RingBlock) <= w::kMaxControlBytes);
}
