// Wire format of the TCP -> RDMA upgrade (socket layer). docs/wire-format.md
// has the same content with the sequence diagram.
//
// 1. Rendezvous (rdma_cm private data, inside transport's SetupBlock payload):
//
//    Request (client -> server, 24 bytes)     Reply (server -> client, 16 bytes)
//    +0  u32 magic 'RSUP' (0x50555352)        +0  u32 magic 'RSUP'
//    +4  u8  version: lowest spoken (1)       +4  u8  version: the one chosen
//    +5  u8  max_version (3; 0 = version)     +5  u8  reserved[3]
//    +6  u16 client TCP port (network order)  +8  u64 server cookie
//    +8  u16 server TCP port (network order)
//    +10 u8  flags: bit 0 "again" (the client upgrades again: its stream
//            positions count bytes that did not go through its TCP socket)
//    +11 u8  reserved[5]
//    +16 u64 client cookie
//
//    The IP addresses are not carried: the server requires the rdma_cm
//    source address to equal the TCP peer address, and the client connects
//    to the TCP peer address, so the 4-tuple is (rdma src ip, client port,
//    rdma dst ip, server port). Refusals use transport's reject reasons.
//    Versions are negotiated: the server picks the highest version both
//    speak (min(max_version, its own highest), if >= both lowest) and says
//    it in the reply. 0.1.0 sends version 1 with max_version 0 and checks
//    that the reply says 1, so it interoperates with later releases.
//    Version 2 adds the reverse switch (section 4). Version 3 clients follow
//    a redirect (transport reject reason 7 naming another rdma_cm port:
//    send the same request there; socket/listen_share.h); a server
//    redirects only requests whose max_version is >= 3.
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

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "transport/wire.h"

namespace rsock::socket::wire {

inline constexpr uint32_t kRendezvousMagic = 0x50555352;  // "RSUP"
inline constexpr uint8_t kRendezvousVersion = 6;     // the highest we speak
inline constexpr uint8_t kRendezvousMinVersion = 1;  // the lowest we speak
inline constexpr uint8_t kRevertVersion = 2;         // the first with the reverse switch
inline constexpr uint8_t kRedirectVersion = 3;       // the first that follows a redirect
inline constexpr uint8_t kReturnVersion = 4;         // the first that returns unread TCP bytes
inline constexpr uint8_t kPathRecordVersion = 5;     // the first whose DOWN record can say "my path failed"
inline constexpr uint8_t kKernelFlagVersion = 6;     // the first that heeds the request flag kernel
// The most of its own pre-switch TCP bytes a peer may ask us to send again
// (a DOWN record's `resume` below our switch offset). They are what the
// peer's librsock drained from its kernel socket to reach our marker and the
// application had not read: at most the kernel's socket buffers (a few MiB).
inline constexpr uint64_t kMaxReturnBytes = 64ull << 20;
inline constexpr uint64_t kMarkerMagic = 0x31575348434f5352ull;  // "RSOCKSW1" little-endian

// RendezvousRequest::flags. kRequestAgain: the client's connection was on
// RDMA before (or waited while another process held it), so its positions
// count bytes its kernel's TCP counters do not. A server that took its own
// positions from those counters (a connection adopted from a process
// without librsock) refuses such a request while it waits for its first.
inline constexpr uint8_t kRequestAgain = 1;
// kRequestKernel: the client's positions came from its kernel's TCP
// counters (a client connection adopted from a process without librsock,
// which cannot know whether bytes ever went another way). A server whose
// own positions may count bytes that did not go through its TCP socket (the
// connection was on RDMA in its process, or was passed in from another
// process) refuses it (Stream::counts_tcp_only).
inline constexpr uint8_t kRequestKernel = 2;

struct RendezvousRequest {
  uint32_t magic;
  uint8_t version;       // the lowest version the client speaks
  uint8_t max_version;   // the highest (0: the same as version)
  uint16_t client_port;  // network order
  uint16_t server_port;  // network order
  uint8_t flags;         // kRequestAgain, kRequestKernel; 0 from clients before them
  uint8_t reserved1[5];
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

inline constexpr uint64_t kDownMagic = 0x314e444b434f5352ull;  // "RSOCKDN1" little-endian
// Version 5: the writer switches back because its RDMA path failed or
// performs badly (path_failed, lossy_path, slow_path), so the path is what
// the reader reports too, not a hand-off ("released"). Same record.
inline constexpr uint64_t kDownPathMagic = 0x3150444b434f5352ull;  // "RSOCKDP1"

// Whether `n` bytes at `p` are a DOWN record's magic (n == 8) or its start
// (n < 8) in a stream of rendezvous `version`; `path`: it says the writer's
// path failed.
inline bool down_magic(const void* p, size_t n, uint8_t version, bool* path = nullptr) {
  if (std::memcmp(p, &kDownMagic, n) == 0) {
    if (path) *path = false;
    return true;
  }
  if (version < kPathRecordVersion || std::memcmp(p, &kDownPathMagic, n) != 0) return false;
  if (path) *path = true;
  return true;
}

struct DownRecord {
  uint64_t magic;
  uint64_t cookie;
  uint64_t resume;
  uint64_t sent;
};
static_assert(sizeof(DownRecord) == 32);

// The version a server speaks with the sender of `rq`, 0 if none.
inline uint8_t negotiate(const RendezvousRequest& rq) {
  return transport::wire::negotiate_version(rq.version, rq.max_version, kRendezvousMinVersion,
                                            kRendezvousVersion);
}

// Application control message types (transport::Connection::send_control).
// RESET: the peer closed with SO_LINGER {1, 0}; like a TCP RST, the
// receiver drops what it has not read and reports ECONNRESET.
enum class Control : uint8_t { kOffer = 1, kReady = 2, kReset = 3 };

}  // namespace rsock::socket::wire
