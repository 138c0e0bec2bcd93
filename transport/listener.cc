// Passive side of connection setup: listen, validate requests, accept/reject.
#include "transport/listener.h"

#include "transport/cm_hub.h"
#include "transport/fds.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <rdma/rdma_cma.h>

#include <cstring>
#include <utility>

#include "util/clock.h"
#include "util/log.h"
#include "util/sys.h"
#include "transport/fork_guard.h"

namespace rsock::transport {

namespace {
void send_reject(rdma_cm_id* id, RejectReason reason, uint16_t port = 0) {
  wire::SetupBlock b{};
  b.magic = wire::kMagic;
  b.version = wire::kWireVersion;
  b.kind = static_cast<uint8_t>(wire::SetupKind::kReject);
  b.reason = static_cast<uint8_t>(reason);
  b.ring_addr = port;
  guarded::rdma_reject(id, &b,
              static_cast<uint8_t>(port ? wire::kRedirectBytes : wire::kRejectBytes));
}
}  // namespace

IncomingRequest::IncomingRequest(IncomingRequest&& o) noexcept : id_(o.id_), setup_(o.setup_) {
  o.id_ = nullptr;
}

IncomingRequest& IncomingRequest::operator=(IncomingRequest&& o) noexcept {
  if (this != &o) {
    this->~IncomingRequest();
    id_ = o.id_;
    setup_ = o.setup_;
    o.id_ = nullptr;
  }
  return *this;
}

IncomingRequest::~IncomingRequest() {
  if (id_ != nullptr) {
    send_reject(id_, RejectReason::kRefused);
    guarded::rdma_destroy_id(id_);
    id_ = nullptr;
  }
}

const sockaddr* IncomingRequest::peer_addr() const {
  return id_ ? rdma_get_peer_addr(id_) : nullptr;
}
const sockaddr* IncomingRequest::local_addr() const {
  return id_ ? rdma_get_local_addr(id_) : nullptr;
}

rdma_event_channel* Listener::spare_channel() {
  own_device_fds();
  rdma_event_channel* ch = guarded::rdma_create_event_channel();
  if (ch == nullptr) return nullptr;
  own_channel(ch);
  int fl = sys::libc.fcntl(ch->fd, F_GETFL);
  if (fl < 0 || sys::libc.fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
    free_spare(ch);
    return nullptr;
  }
  return ch;
}

void Listener::free_spare(rdma_event_channel* ch) {
  if (ch == nullptr) return;
  disown_channel(ch);
  guarded::rdma_destroy_event_channel(ch);
}

Status<std::unique_ptr<Listener>> Listener::listen(const sockaddr* addr, const config::Tunables& tun,
                                                   int backlog, bool v6only,
                                                   rdma_event_channel** spare) {
  std::unique_ptr<Listener> l(new (std::nothrow) Listener(tun));
  if (!l) return Err(ENOMEM);
  const bool lent = spare != nullptr && *spare != nullptr;
  l->ch_ = lent ? std::exchange(*spare, nullptr) : spare_channel();
  if (l->ch_ == nullptr) return Err(errno ? errno : ENODEV);
  // A failure hands a lent channel back (its id, if any, destroyed first):
  // the next attempt uses it again.
  auto fail = [&](int e) -> Status<std::unique_ptr<Listener>> {
    if (lent) {
      if (l->id_) guarded::rdma_destroy_id(std::exchange(l->id_, nullptr));
      *spare = std::exchange(l->ch_, nullptr);
    }
    return Err(e);
  };
  if (guarded::rdma_create_id(l->ch_, &l->id_, l.get(), RDMA_PS_TCP) != 0) return fail(errno);
  if (addr->sa_family == AF_INET6) {
    // Explicit, not the system's net.ipv6.bindv6only: like the TCP socket.
    int afonly = v6only ? 1 : 0;
    if (rdma_set_option(l->id_, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &afonly, sizeof afonly) != 0)
      return fail(errno);
  }
  if (guarded::rdma_bind_addr(l->id_, const_cast<sockaddr*>(addr)) != 0) return fail(errno);
  if (guarded::rdma_listen(l->id_, backlog) != 0) return fail(errno);
  return l;
}

Listener::~Listener() {
  if (id_) guarded::rdma_destroy_id(id_);
  if (ch_) {
    disown_channel(ch_);
    guarded::rdma_destroy_event_channel(ch_);
  }
}

void Listener::abandon_after_fork() {
  if (ch_) {
    disown_channel(ch_);
    guarded::rdma_destroy_event_channel(ch_);  // closes the fd and frees the struct only
    ch_ = nullptr;
  }
}

int Listener::fd() const { return ch_->fd; }

uint16_t Listener::port() const { return ntohs(rdma_get_src_port(id_)); }

Status<IncomingRequest> Listener::next_request() {
  rdma_cm_event* ev;
  while (guarded::rdma_get_cm_event(ch_, &ev) == 0) {
    if (ev->event != RDMA_CM_EVENT_CONNECT_REQUEST) {
      // Events of requests not yet migrated to their connection (e.g. the
      // peer gave up) and of the listening id itself: nothing to do.
      if (ev->event == RDMA_CM_EVENT_DEVICE_REMOVAL && ev->id == id_)
        LOG_WARN("transport: RDMA device removed under a listener");
      rdma_ack_cm_event(ev);
      continue;
    }
    IncomingRequest req;
    req.id_ = ev->id;
    RejectReason why = wire::parse_setup(ev->param.conn.private_data,
                                         ev->param.conn.private_data_len,
                                         wire::SetupKind::kRequest, &req.setup_);
    rdma_ack_cm_event(ev);
    if (why != RejectReason::kNone) {
      LOG_DEBUG("transport: rejecting connect request: reason %d", static_cast<int>(why));
      reject(std::move(req), why);
      continue;
    }
    return req;
  }
  return Err(errno == EAGAIN || errno == EWOULDBLOCK ? EAGAIN : errno);
}

void Listener::reject(IncomingRequest req, RejectReason reason, uint16_t port) {
  if (req.id_ == nullptr) return;
  send_reject(req.id_, reason, port);
  guarded::rdma_destroy_id(req.id_);
  req.id_ = nullptr;
}

void Listener::redirect(IncomingRequest req, uint16_t port) {
  reject(std::move(req), RejectReason::kRedirect, port);
}

Status<std::unique_ptr<Connection>> Listener::accept(IncomingRequest req,
                                                     std::span<const std::byte> payload) {
  if (req.id_ == nullptr || payload.size() > wire::kMaxPayload) return Err(EINVAL);
  std::unique_ptr<Connection> c(new (std::nothrow) Connection(tun_));
  if (!c) return Err(ENOMEM);
  Status<void> s = c->init_fds();
  if (!s) {
    reject(std::move(req), RejectReason::kNoResources);
    return Err(s.error());
  }
  // The id's context names its Connection before any event of it can reach
  // the shared channel (cm_hub delivers by context).
  {
    std::lock_guard lk(cm_hub::mu());
    req.id_->context = c.get();
  }
  if (guarded::rdma_migrate_id(req.id_, cm_hub::channel()) != 0) {
    int e = errno;
    cm_hub::forget(req.id_);
    reject(std::move(req), RejectReason::kNoResources);
    return Err(e);
  }
  // From here the Connection owns the id: it destroys it on any failure.
  c->id_ = req.id_;
  req.id_ = nullptr;
  c->peer_ = req.setup_;
  c->tx_.init(c->peer_.ring_bytes, c->peer_.recv_slots);
  s = c->create_resources();
  if (!s) {
    send_reject(c->id_, RejectReason::kNoResources);
    return Err(s.error());
  }
  wire::SetupBlock b;
  c->fill_setup(&b, wire::SetupKind::kAccept, payload);
  rdma_conn_param p{};
  p.private_data = &b;
  p.private_data_len = static_cast<uint8_t>(wire::kSetupHeaderBytes + payload.size());
  p.retry_count = wire::kRetryCount;
  p.rnr_retry_count = wire::kRnrRetryCount;
  // Our own QP (Connection::qp_): RTR and RTS now, as librdmacm does for a
  // QP it created. (RTS cannot wait for ESTABLISHED: a client that
  // disconnects at once leaves the CM in a state that refuses the
  // transition.) Nothing is sent before ESTABLISHED.
  p.qp_num = c->qp_->qp_num;
  for (ibv_qp_state st : {IBV_QPS_RTR, IBV_QPS_RTS}) {
    if (auto r = c->qp_to(st); !r) {
      send_reject(c->id_, RejectReason::kNoResources);
      return Err(r.error());
    }
  }
  if (guarded::rdma_accept(c->id_, &p) != 0) return Err(errno);
  c->state_ = Connection::State::kAccepting;
  c->deadline_ns_ = now_ns() + uint64_t{tun_.connect_timeout_ms} * 1000000;
  return c;
}

}  // namespace rsock::transport
