// Listener: passive rdma_cm endpoint (RDMA_PS_TCP). Nonblocking like
// Connection: wait for fd() (its rdma_cm event channel, O_NONBLOCK) to become
// readable, then call next_request() until EAGAIN. Requests whose setup block
// has a wrong magic/version/ring are rejected here with a reason code and
// never surface. Thread safety: one thread at a time per Listener.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <memory>
#include <span>

#include "config/tunables.h"
#include "transport/connection.h"
#include "transport/wire.h"
#include "util/status.h"

struct rdma_cm_id;
struct rdma_event_channel;

namespace rsock::transport {

// A connect request that is neither accepted nor rejected yet. Move-only;
// dropping one rejects it (reason kRefused) so the peer fails promptly.
class IncomingRequest {
 public:
  IncomingRequest() = default;
  IncomingRequest(IncomingRequest&& o) noexcept;
  IncomingRequest& operator=(IncomingRequest&& o) noexcept;
  ~IncomingRequest();
  std::span<const std::byte> payload() const {
    return {reinterpret_cast<const std::byte*>(setup_.payload), setup_.payload_len};
  }
  bool valid() const { return id_ != nullptr; }
  // Peer and local addresses (sockaddr_in / sockaddr_in6) of the request.
  const sockaddr* peer_addr() const;
  const sockaddr* local_addr() const;

 private:
  friend class Listener;
  rdma_cm_id* id_ = nullptr;
  wire::PeerSetup setup_;
};

class Listener {
 public:
  // v6only: an AF_INET6 address serves IPv6 requests only (as the TCP
  // socket's IPV6_V6ONLY); otherwise a `::` listener takes IPv4 ones too.
  // spare: an event channel from spare_channel() to use instead of a new
  // one (taken on success, left in *spare on failure), so that a listener
  // opened in the progress thread creates no fd there (docs/DESIGN.md,
  // "Library fds").
  static Status<std::unique_ptr<Listener>> listen(const sockaddr* addr, const config::Tunables& tun,
                                                  int backlog = 1024, bool v6only = false,
                                                  rdma_event_channel** spare = nullptr);
  // An rdma_cm event channel for a later listen(): nonblocking, its fd in
  // the owned band. nullptr on failure. free_spare: one never used.
  static rdma_event_channel* spare_channel();
  static void free_spare(rdma_event_channel* ch);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  int fd() const;
  uint16_t port() const;  // host order, useful after binding port 0
  // Next valid connect request; EAGAIN if none is pending.
  Status<IncomingRequest> next_request();
  // Allocates the connection, answers with our ring and `payload` (<= 32
  // bytes). The returned Connection becomes established() via progress().
  Status<std::unique_ptr<Connection>> accept(IncomingRequest req, std::span<const std::byte> payload);
  void reject(IncomingRequest req, RejectReason reason) { reject(std::move(req), reason, 0); }
  // Rejects with kRedirect: the client sends the same request to `port`
  // (host order) on the same address.
  void redirect(IncomingRequest req, uint16_t port);
  // In a fork child: close this process's copy of the parent's channel and
  // leak the object (its ids are the parent's; the child never touches them).
  void abandon_after_fork();

 private:
  Listener(const config::Tunables& tun) : tun_(tun) {}
  // A reject; a redirect names `port` too.
  void reject(IncomingRequest req, RejectReason reason, uint16_t port);
  config::Tunables tun_;
  rdma_event_channel* ch_ = nullptr;
  rdma_cm_id* id_ = nullptr;
};

}  // namespace rsock::transport
