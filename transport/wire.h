// Wire format of the librsock RDMA transport (version 1, negotiated). docs/wire-format.md
// has the same description with rationale; keep the two in sync.
//
// Connection setup (rdma_cm, RDMA_PS_TCP). The private data of the connect
// request (rdma_connect) and of the reply (rdma_accept) is one SetupBlock, all
// integers little-endian:
//
//   off size field
//     0  4   magic        0x4b535231 ("1RSK" in memory order)
//     4  1   version      request: the lowest wire version the sender speaks
//                         (kWireMinVersion); accept: the version chosen
//     5  1   kind         1 = request, 2 = accept, 3 = reject
//     6  1   payload_len  0..32 bytes of opaque payload that follow at offset 24
//     7  1   reason       reject reason (RejectReason), 0 otherwise
//     8  8   ring_addr    virtual address of the sender's receive ring
//    16  4   ring_rkey    rkey of that ring (REMOTE_WRITE, nothing else)
//    20  1   ring_log2    ring size = 1 << ring_log2 (12..28)
//    21  1   max_version  request: the highest wire version the sender speaks
//                         (kWireVersion); 0 = the same as `version` (0.1.0
//                         sends 0); accept and reject: 0
//    22  2   recv_slots   receive WRs the sender keeps posted for this peer
//    24  32  payload      opaque, for the socket layer's upgrade handshake
//
// 24 + 32 = 56 bytes: exactly the RDMA_PS_TCP limit for a connect request on
// IB and RoCE (the CM keeps 36 of the REQ's 92 bytes for its IP header), so
// the ring descriptor always travels in the request and no extra message after
// ESTABLISHED is needed. Only 24 + payload_len bytes are sent. A reject
// carries the first 8 bytes (kind = 3, reason set); a redirect (reason 7)
// carries 16, with the rdma_cm port to send the same request to in bytes
// 8-9 (little-endian, the ring_addr field).
//
// Data phase. Each side owns a receive ring (one MR, the only memory the peer
// may write) and a small array of 64-byte receive buffers. Every message that
// consumes one of the peer's receive WRs carries a 32-bit immediate:
//
//   imm = op << 29 | value
//   op 0 DATA    RDMA_WRITE_WITH_IMM, placed at the receiver's ring offset
//                (stream position mod ring size); never wraps (the sender
//                splits at the ring end). Wire versions 1 and 2: value = its
//                length (1..2^28 bytes). Version 3: value = the stream
//                position of its first byte mod 2^29, and the length is the
//                completion's byte_len; a DATA that does not start exactly
//                where the receiver's stream stands (a duplicated or
//                misplaced completion: rxe under heavy retransmission
//                delivers one now and then) resets the connection instead of
//                passing bytes the write never placed.
//   op 1 CREDIT  SEND_WITH_IMM, value 0, 16-byte CreditBlock payload:
//                u64 consumed  (stream bytes the receiver has consumed, absolute)
//                u32 slots     (receive WRs ever posted for the peer, absolute)
//                u32 reserved
//   op 2 CONTROL SEND_WITH_IMM, value = type << 8 | len, payload len bytes
//                (len <= kMaxControlBytes): type 1 FIN (no more data after the
//                bytes already sent), 2 CLOSE (sender will read no more),
//                3 APP (payload[0] = application type, rest its data);
//                wire version 2 adds the ring move:
//                4 RING (16-byte RingBlock: the receiver offers a new receive
//                  ring: u64 addr, u32 rkey, u8 log2 (12..28), 3 reserved
//                  zero bytes); at most one outstanding, sent only to a peer
//                  that negotiated version >= 2,
//                5 RING_ACK (u64 pos: the sender's stream position; every
//                  DATA before this message went to the old ring, every one
//                  after it goes to the new one, at pos mod its size). The
//                  receiver frees the old ring once it has read up to pos.
// A keepalive is a zero-length RDMA_WRITE without immediate: it consumes no
// receive WR on the peer, the peer's RNIC acknowledges it, and a dead peer
// makes it fail with a retry-exceeded completion.
//
// Ordering: RC delivers WRs in order, so FIN/CLOSE/APP after DATA are seen
// after the data; the receiver processes receive completions in CQ order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace rsock::transport::wire {

inline constexpr uint32_t kMagic = 0x4b535231;
// The wire versions this build speaks. The accepting end picks the highest
// one both ends speak (negotiate_wire) and says it in its accept; a request
// with none in common is rejected with kBadVersion (docs/VERSIONS.md).
inline constexpr uint8_t kWireMinVersion = 1;
inline constexpr uint8_t kWireVersion = 3;
inline constexpr uint8_t kRingMoveVersion = 2;  // RING / RING_ACK (rings grow and shrink)
inline constexpr uint8_t kDataPosVersion = 3;   // DATA's immediate: its stream position
inline constexpr size_t kMaxPayload = 32;          // opaque setup payload
inline constexpr size_t kSetupHeaderBytes = 24;    // SetupBlock without payload
inline constexpr size_t kRejectBytes = 8;          // magic..reason
inline constexpr size_t kRedirectBytes = 16;       // + the port, in the ring_addr field
inline constexpr uint32_t kMinRingLog2 = 12;       // 4 KiB
inline constexpr uint32_t kMaxRingLog2 = 28;       // 256 MiB: DATA length must fit 29 bits
inline constexpr size_t kRecvBufBytes = 64;        // each receive WR's buffer
inline constexpr size_t kMaxControlBytes = 48;     // CONTROL payload limit
inline constexpr size_t kMaxAppControlBytes = kMaxControlBytes - 1;
inline constexpr uint16_t kMaxRecvSlots = 1024;

// rdma_cm / QP parameters both sides use (docs/wire-format.md).
// ACK timeout exponent: 4.096 us * 2^14 = 67 ms per try. Without it rdma_cm on
// RoCE uses ~0.5-1 s per try and a silently dead peer takes many seconds.
inline constexpr uint8_t kAckTimeoutExp = 14;
// 6, not 7: IB gives 7 no special meaning for the transport retry count, but
// rxe (and some firmware) treats 7 as "retry forever", which would turn a
// vanished peer into a hang. 7 tries x 67 ms ~ 0.5 s.
inline constexpr uint8_t kRetryCount = 6;
// Receive WRs are accounted for (credits), so an RNR NAK means a bug: with no
// RNR retries it surfaces as an error completion instead of a silent stall.
inline constexpr uint8_t kRnrRetryCount = 0;

enum class SetupKind : uint8_t { kRequest = 1, kAccept = 2, kReject = 3 };

// Reason codes a reject carries; the active side reports them (reject_reason()).
enum class RejectReason : uint8_t {
  kNone = 0,
  kBadMagic = 1,     // not a librsock peer
  kBadVersion = 2,   // librsock with another wire version
  kBadSetup = 3,     // ring descriptor out of range
  kNoResources = 4,  // passive side could not allocate the connection
  kRefused = 5,      // the socket layer refused (reject(req, ...))
  kTimeout = 6,      // request not accepted in time
  kRedirect = 7,     // send the same request to the port the reject names
  kLossyPath = 8,    // the path between us loses packets: RDMA would do worse than TCP
};

struct SetupBlock {
  uint32_t magic;
  uint8_t version;
  uint8_t kind;
  uint8_t payload_len;
  uint8_t reason;
  uint64_t ring_addr;
  uint32_t ring_rkey;
  uint8_t ring_log2;
  uint8_t max_version;
  uint16_t recv_slots;
  uint8_t payload[kMaxPayload];
};
static_assert(sizeof(SetupBlock) == 56, "RDMA_PS_TCP connect private data limit");
static_assert(offsetof(SetupBlock, payload) == kSetupHeaderBytes);

enum class Op : uint32_t { kData = 0, kCredit = 1, kControl = 2 };
enum class ControlType : uint8_t { kFin = 1, kClose = 2, kApp = 3, kRing = 4, kRingAck = 5 };

struct RingBlock {
  uint64_t addr;
  uint32_t rkey;
  uint8_t log2;
  uint8_t reserved[3];
};
static_assert(sizeof(RingBlock) == 16);

inline constexpr uint32_t kOpShift = 29;
inline constexpr uint32_t kValueMask = (1u << kOpShift) - 1;

constexpr uint32_t make_imm(Op op, uint32_t value) {
  return (static_cast<uint32_t>(op) << kOpShift) | (value & kValueMask);
}
constexpr uint32_t imm_op(uint32_t imm) { return imm >> kOpShift; }
constexpr uint32_t imm_value(uint32_t imm) { return imm & kValueMask; }
// DATA's immediate value (wire version 3): where it starts in the stream.
constexpr uint32_t data_pos_value(uint64_t stream_pos) {
  return static_cast<uint32_t>(stream_pos) & kValueMask;
}
constexpr uint32_t control_value(ControlType t, uint32_t len) {
  return (static_cast<uint32_t>(t) << 8) | len;
}

struct CreditBlock {
  uint64_t consumed;
  uint32_t slots;
  uint32_t reserved;
};
static_assert(sizeof(CreditBlock) == 16);

// Result of parsing a peer's setup block (request or accept).
struct PeerSetup {
  uint8_t wire_version = 0;  // request: the one chosen for it; accept: the peer's choice
  uint64_t ring_addr = 0;
  uint32_t ring_rkey = 0;
  uint32_t ring_bytes = 0;
  uint16_t recv_slots = 0;
  uint8_t payload_len = 0;
  uint8_t payload[kMaxPayload] = {};
};

// The highest version in both a peer's range [lo, hi] (hi 0 = lo: what
// 0.1.0 sends) and ours [our_lo, our_hi]; 0 if there is none. Both the wire
// format and the socket layer's rendezvous are negotiated this way.
constexpr uint8_t negotiate_version(uint8_t lo, uint8_t hi, uint8_t our_lo, uint8_t our_hi) {
  if (hi == 0) hi = lo;
  if (lo == 0 || hi < lo) return 0;
  uint8_t top = hi < our_hi ? hi : our_hi;
  uint8_t bottom = lo > our_lo ? lo : our_lo;
  return top >= bottom ? top : 0;
}

// The wire version for a peer that speaks [lo, hi].
constexpr uint8_t negotiate_wire(uint8_t lo, uint8_t hi) {
  return negotiate_version(lo, hi, kWireMinVersion, kWireVersion);
}

// Validates every field; on failure returns the reason to reject with.
// `len` is the private data length the CM reported (may include CM padding).
// A request's version range is negotiated; an accept must carry a version
// this build speaks (the one the peer chose from our range).
inline RejectReason parse_setup(const void* data, size_t len, SetupKind expect,
                                PeerSetup* out) {
  SetupBlock b{};
  if (data == nullptr || len < kSetupHeaderBytes) return RejectReason::kBadMagic;
  std::memcpy(&b, data, len < sizeof b ? len : sizeof b);
  if (b.magic != kMagic) return RejectReason::kBadMagic;
  uint8_t v = expect == SetupKind::kRequest ? negotiate_wire(b.version, b.max_version)
                                            : negotiate_wire(b.version, b.version);
  if (v == 0) return RejectReason::kBadVersion;
  if (b.kind != static_cast<uint8_t>(expect)) return RejectReason::kBadSetup;
  if (b.payload_len > kMaxPayload || kSetupHeaderBytes + b.payload_len > len)
    return RejectReason::kBadSetup;
  if (b.ring_log2 < kMinRingLog2 || b.ring_log2 > kMaxRingLog2) return RejectReason::kBadSetup;
  if (b.recv_slots < 2 || b.recv_slots > kMaxRecvSlots) return RejectReason::kBadSetup;
  if (b.ring_addr == 0) return RejectReason::kBadSetup;
  out->wire_version = v;
  out->ring_addr = b.ring_addr;
  out->ring_rkey = b.ring_rkey;
  out->ring_bytes = 1u << b.ring_log2;
  out->recv_slots = b.recv_slots;
  out->payload_len = b.payload_len;
  std::memcpy(out->payload, b.payload, b.payload_len);
  return RejectReason::kNone;
}

// Reads the reason out of a reject's private data; kNone if it is not ours.
inline RejectReason parse_reject(const void* data, size_t len) {
  SetupBlock b{};
  if (data == nullptr || len < kRejectBytes) return RejectReason::kNone;
  std::memcpy(&b, data, kRejectBytes);
  if (b.magic != kMagic || b.kind != static_cast<uint8_t>(SetupKind::kReject))
    return RejectReason::kNone;
  return static_cast<RejectReason>(b.reason);
}

// The port a kRedirect reject names, 0 if none.
inline uint16_t parse_redirect_port(const void* data, size_t len) {
  SetupBlock b{};
  if (parse_reject(data, len) != RejectReason::kRedirect || len < kRedirectBytes) return 0;
  std::memcpy(&b, data, kRedirectBytes);
  return static_cast<uint16_t>(b.ring_addr);
}

}  // namespace rsock::transport::wire
