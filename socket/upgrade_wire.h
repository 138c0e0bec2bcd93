// Wire format of the TCP -> RDMA upgrade (socket layer). docs/wire-format.md
// has the same content with the sequence diagram.
//
// 1. Rendezvous (rdma_cm private data, inside transport's SetupBlock payload):
//
//    Request (client -> server, 24 bytes)     Reply (server -> client, 16 bytes)
//    +0  u32 magic 'RSUP' (0x50555352)        +0  u32 magic 'RSUP'
//    +4  u8  version (1)                      +4  u8  version (1)
//    +5  u8  reserved                         +5  u8  reserved[3]
//    +6  u16 client TCP port (network order)  +8  u64 server cookie
//    +8  u16 server TCP port (network order)
//    +10 u8  reserved[6]
//    +16 u64 client cookie
//
//    The IP addresses are not carried: the server requires the rdma_cm
//    source address to equal the TCP peer address, and the client connects
//    to the TCP peer address, so the 4-tuple is (rdma src ip, client port,
//    rdma dst ip, server port). Refusals use transport's reject reasons.
//
// 2. Switch, per direction, sender X -> receiver Y (app control messages over
//    the RDMA connection, ordered with its data):
//    X: stops TCP writes at stream offset N      -> OFFER {u64 N}
//    Y: limits its TCP reads to N                -> READY {}
//    X: writes MARKER into TCP right after byte N:
//       +0 u64 magic 'RSOCKSW1', +8 u64 Y's cookie, +16 u64 N   (24 bytes)
//    Y: drains TCP up to N (staging), reads the marker, checks all 3 fields.
//    X sends stream bytes over RDMA only after it has verified Y's marker in
//    the other direction; Y delivers RDMA bytes only after byte N and a good
//    marker. A bad marker resets the connection.
//
// 3. After the switch: RESET {} (abortive close, SO_LINGER {1,0}).
#pragma once

#include <cstdint>

namespace rsock::socket::wire {

inline constexpr uint32_t kRendezvousMagic = 0x50555352;  // "RSUP"
inline constexpr uint8_t kRendezvousVersion = 1;
inline constexpr uint64_t kMarkerMagic = 0x31575348434f5352ull;  // "RSOCKSW1" little-endian

struct RendezvousRequest {
  uint32_t magic;
  uint8_t version;
  uint8_t reserved0;
  uint16_t client_port;  // network order
  uint16_t server_port;  // network order
  uint8_t reserved1[6];
  uint64_t cookie;
};
static_assert(sizeof(RendezvousRequest) == 24);

struct RendezvousReply {
  uint32_t magic;
  uint8_t version;
  uint8_t reserved[3];
  uint64_t cookie;
};
static_assert(sizeof(RendezvousReply) == 16);

struct Marker {
  uint64_t magic;
  uint64_t cookie;
  uint64_t offset;
};
static_assert(sizeof(Marker) == 24);

// Application control message types (transport::Connection::send_control).
// RESET: the peer closed with SO_LINGER {1, 0}; like a TCP RST, the
// receiver drops what it has not read and reports ECONNRESET.
enum class Control : uint8_t { kOffer = 1, kReady = 2, kReset = 3 };

}  // namespace rsock::socket::wire
