// Stream data path: send/recv while pending, switching and on RDMA, with the
// kernel's blocking, timeout, peek and waitall semantics emulated on top of
// nonblocking steps. Every step holds mu_ briefly; sleeping happens in wait().
#include <fcntl.h>
#include <poll.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "socket/backlog.h"
#include "socket/process.h"
#include "socket/signals.h"
#include "socket/stream.h"
#include "transport/cq_group.h"
#include "transport/cq_hub.h"
#include "util/stats.h"
#include "util/adaptive_spin.h"
#include "util/clock.h"
#include "util/profile.h"
#include "util/sys.h"

namespace rsock::socket {

namespace {

uint64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000 + uint64_t(ts.tv_nsec) / 1000000;
}

// SO_RCVTIMEO / SO_SNDTIMEO of the kernel socket, in ms (-1: none).
int socket_timeout_ms(int fd, int opt) {
  timeval tv{};
  socklen_t len = sizeof tv;
  if (sys::libc.getsockopt(fd, SOL_SOCKET, opt, &tv, &len) != 0) return -1;
  if (tv.tv_sec == 0 && tv.tv_usec == 0) return -1;
  return static_cast<int>(tv.tv_sec * 1000 + (tv.tv_usec + 999) / 1000);
}

// The spin of a blocking call's wait, learnt by the thread (spin_us to
// spin_max_us, util/adaptive_spin.h); `timer` spans the call's whole wait.
uint32_t wait_spin_us(WaitTimer& timer) {
  const config::Tunables& t = process_config().tunables;
  return timer.start(t.spin_us, t.spin_max_us);
}

size_t iov_total(std::span<const iovec> iov) {
  size_t n = 0;
  for (auto& v : iov) n += v.iov_len;
  return n;
}

// iov minus its first `skip` bytes, into `out`: at most kIovWindow entries
// of it. Callers that continue a call after partial progress use a window
// rather than a copy of up to UIO_MAXIOV entries (16 KiB): hooks run on the
// application's stack, which may be small. A window only makes a step move
// fewer bytes (a short read, or one more turn of a blocking send's loop).
constexpr size_t kIovWindow = 16;
std::span<const iovec> iov_advance(std::span<const iovec> iov, size_t skip, iovec* out) {
  size_t k = 0;
  for (auto& v : iov) {
    if (k == kIovWindow) break;
    if (skip >= v.iov_len) {
      skip -= v.iov_len;
      continue;
    }
    out[k].iov_base = static_cast<char*>(v.iov_base) + skip;
    out[k].iov_len = v.iov_len - skip;
    skip = 0;
    k++;
  }
  return {out, k};
}

}  // namespace

size_t Stream::copy_staging(std::span<const iovec> iov, bool peek) {
  size_t avail = staging_.size() - staging_off_, done = 0;
  for (auto& v : iov) {
    if (done == avail) break;
    size_t n = std::min(v.iov_len, avail - done);
    std::memcpy(v.iov_base, staging_.data() + staging_off_ + done, n);
    done += n;
  }
  if (!peek) {
    staging_off_ += done;
    if (staging_off_ == staging_.size()) {
      staging_.clear();
      staging_.shrink_to_fit();  // switch-time buffer: give it back
      staging_off_ = 0;
    }
  }
  return done;
}

// One nonblocking receive attempt in the current phase.
Status<size_t> Stream::try_recv(std::span<const iovec> iov, int flags) {
  bool peek = flags & MSG_PEEK;
  Phase p = phase();
  if (p == Phase::kPlain) return Err(kRedoPlain);
  // A reset is reported once, then the socket reads as EOF (like the kernel).
  if (p == Phase::kBroken) return err_ ? Status<size_t>(Err(report_error())) : size_t{0};
  // 1. Bytes the library read ahead of the application come first; then, in
  //    the same call, whatever follows them (the kernel's read returns all
  //    that is queued, not just up to an internal boundary).
  size_t n = copy_staging(iov, peek);
  if (n == 0) return try_recv_source(iov, flags);
  if (plain_when_drained_ && staging_.empty() && !held_pending()) set_phase(Phase::kPlain);
  if (n == iov_total(iov) || rd_shut_) return n;
  // (Rare: only right after a switch.)
  iovec rest[kIovWindow];
  // While peeking, staging is not consumed: what follows it is read as well.
  auto more = try_recv_source(iov_advance(iov, n, rest), flags);
  return n + (more ? *more : 0);
}

// The source after staging: the kernel socket while the peer's direction is
// on TCP, then the RDMA stream.
Status<size_t> Stream::try_recv_source(std::span<const iovec> iov, int flags) {
  bool peek = flags & MSG_PEEK;
  if (rd_shut_) return size_t{0};
  // Switching back: TCP carries the peer's bytes again once its record is in.
  if (phase() == Phase::kReverting && !down_done_)
    return tcp_eof_ ? Status<size_t>(size_t{0}) : Err(EAGAIN);
  // 2. The peer's direction still on TCP: read the kernel socket directly
  //    (under mu_, so an OFFER cannot be processed in the middle).
  if (tcp_rx_open()) {
    msghdr mh{};
    mh.msg_iov = const_cast<iovec*>(iov.data());
    mh.msg_iovlen = iov.size();
    ssize_t r = sys::libc.recvmsg(tcp_fd_, &mh, (flags & (MSG_PEEK | MSG_OOB)) | MSG_DONTWAIT);
    if (r < 0) return Err(errno);
    // The peer's FIN: no switch marker can follow it, so an upgrade again
    // is over, also one whose RDMA connection is being set up (the peer
    // started it, then closed: a fork child that exits at once). Left to
    // that connection's failure, the socket read as upgrading until then.
    if (r == 0 && !peek && reup_ && phase() == Phase::kPending && iov_total(iov) > 0)
      abandon_reupgrade();
    if (r > 0 && !peek) {
      tcp_rx_ += uint64_t(r);
      if (holders_) holders_->rx.fetch_add(uint64_t(r), std::memory_order_relaxed);
      if (slot_) slot_->add_rx(stats::Transport::kTcp, uint64_t(r));
      start_early_if_streaming();
    }
    return size_t(r);
  }
  // 3. Draining to the peer's offer / checking its marker: not yet.
  if (!verified_) return tcp_eof_ ? Status<size_t>(size_t{0}) : Err(EAGAIN);
  // (The peer switched back right after the switch: its record follows.
  // The join may stage its RDMA bytes: they come before anything after.)
  if (maybe_join_revert()) return try_recv(iov, flags);
  if (rdma_dead_ || !conn_) return size_t{0};  // peer went away mid-switch: EOF
  // 4. On RDMA.
  auto r = conn_->recv(iov, peek);
  if (!r) return r.error() == EPIPE ? Status<size_t>(size_t{0}) : r;
  if (*r == 0 && !conn_->eof()) return Err(EAGAIN);
  if (*r > 0 && !peek && slot_) slot_->add_rx(stats::Transport::kRdma, *r);
  return r;
}

Status<size_t> Stream::try_send(std::span<const iovec> iov, int flags) {
  Phase p = phase();
  if (p == Phase::kPlain) return Err(kRedoPlain);
  if (p == Phase::kBroken) return Err(err_ ? report_error() : EPIPE);
  if (wr_shut_) return Err(EPIPE);
  // Switching back: new bytes only after the peer's record and our backlog.
  if (p == Phase::kReverting && !revert_settled()) return Err(EAGAIN);
  if (holds(flags)) {
    size_t n = hold(iov);
    return n ? Status<size_t>(n) : Err(EAGAIN);
  }
  if (held_pending() && !flush_held()) return Err(EAGAIN);  // they go first
  if (tcp_tx_open()) {
    msghdr mh{};
    mh.msg_iov = const_cast<iovec*>(iov.data());
    mh.msg_iovlen = iov.size();
    ssize_t r = sys::libc.sendmsg(tcp_fd_, &mh,
                                  (flags & (MSG_MORE | MSG_OOB)) | MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r < 0) return Err(errno);
    tcp_tx_ += uint64_t(r);
    if (holders_) holders_->tx.fetch_add(uint64_t(r), std::memory_order_relaxed);
    if (slot_) slot_->add_tx(stats::Transport::kTcp, uint64_t(r));
    start_early_if_streaming();
    return size_t(r);
  }
  if (p != Phase::kRdma) {
    if (maybe_join_revert()) return Err(EAGAIN);  // our bytes go on TCP after the records
    return switch_dead_end() ? Err(EPIPE) : Err(EAGAIN);
  }
  auto r = conn_->send(iov);
  if (!r && r.error() == EPIPE && conn_->peer_left_open()) {
    // The peer switched back to TCP after its FIN: our bytes go there. Its
    // record says why (a failed path reads path_failed, rendezvous 5); a
    // hand-off when it is not in yet.
    stats::FallbackReason why = peer_record_reason();
    if (why == stats::FallbackReason::kNone) why = stats::FallbackReason::kReleased;
    if (revert_locked(RevertMode::kKeep, why)) return Err(EAGAIN);
  }
  if (r && *r > 0 && slot_) slot_->add_tx(stats::Transport::kRdma, *r);
  if (!r && r.error() == EAGAIN && slot_)
    slot_->traffic.credit_stalls.fetch_add(1, std::memory_order_relaxed);
  return r;
}

size_t Stream::tcp_send_space() const {
  // SO_SNDBUF counts overhead too: half of it is payload.
  int queued = 0, sndbuf = 0;
  socklen_t l = sizeof sndbuf;
  if (sys::libc.ioctl(tcp_fd_, SIOCOUTQ, &queued) != 0 ||
      sys::libc.getsockopt(tcp_fd_, SOL_SOCKET, SO_SNDBUF, &sndbuf, &l) != 0)
    return 0;
  return sndbuf / 2 > queued ? size_t(sndbuf / 2 - queued) : 0;
}

size_t Stream::hold(std::span<const iovec> iov) {
  size_t room = held_cap_ - std::min(held_cap_, held_.size()), n = 0;
  if (room > 0 && held_.capacity() < held_cap_) held_.reserve(held_cap_);  // once per switch
  for (const iovec& v : iov) {
    size_t take = std::min(v.iov_len, room - n);
    auto* b = static_cast<const std::byte*>(v.iov_base);
    held_.insert(held_.end(), b, b + take);
    n += take;
    if (n == room) break;
  }
  return n;
}

bool Stream::flush_held() {
  while (held_pending()) {
    Phase p = phase();
    std::byte* b = held_.data() + held_off_;
    size_t n = held_.size() - held_off_;
    if (p == Phase::kBroken || switch_dead_end()) {
      held_off_ = held_.size();  // reset: lost, as a kernel socket's queue would be
      break;
    }
    if (p == Phase::kRdma && conn_) {
      iovec v{b, n};
      auto r = conn_->send({&v, 1});
      // (An error: the connection switches back or resets; on TCP they follow.)
      if (!r) return false;
      held_off_ += *r;
      if (slot_) slot_->add_tx(stats::Transport::kRdma, *r);
      continue;
    }
    // On TCP: only once our direction is there again, after any record and
    // backlog of a reverse switch.
    if (!tcp_tx_open() || tcp_fd_ < 0 ||
        (p == Phase::kReverting &&
         (!down_done_ || backlog_ != nullptr || down_out_off_ < sizeof down_out_ ||
          return_out_off_ < return_out_.size())))
      return false;
    ssize_t r = sys::libc.send(tcp_fd_, b, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EAGAIN || errno == EINTR || errno == ENOBUFS) return false;
      held_off_ = held_.size();  // the kernel reports its error to the next call
      break;
    }
    held_off_ += size_t(r);
    tcp_tx_ += uint64_t(r);
    if (holders_) holders_->tx.fetch_add(uint64_t(r), std::memory_order_relaxed);
    if (slot_) slot_->add_tx(stats::Transport::kTcp, uint64_t(r));
  }
  held_.clear();
  held_.shrink_to_fit();  // switch-time buffer: give it back
  held_off_ = 0;
  tx_gen_.fetch_add(1, std::memory_order_acq_rel);  // room appeared (edge-triggered POLLOUT)
  if (fin_waits_held_) {
    fin_waits_held_ = false;
    deferred_fin();
  }
  if (phase() == Phase::kPending && !conn_ && plain_when_drained_ && staging_.empty())
    set_phase(Phase::kPlain);
  return true;
}

void Stream::deferred_fin() {
  if (!fin_deferred_) return;
  if (held_pending()) {
    fin_waits_held_ = true;
    return;
  }
  if (phase() == Phase::kRdma && conn_) (void)conn_->shutdown_write();
  else if (tcp_fd_ >= 0) sys::libc.shutdown(tcp_fd_, SHUT_WR);
}

Status<size_t> Stream::recv(std::span<const iovec> iov, int flags, bool nonblock) {
  const size_t want = iov_total(iov);
  if (want == 0) return size_t{0};
  const bool waitall = (flags & MSG_WAITALL) && !(flags & MSG_PEEK) && !nonblock;
  SignalWatch signals;  // a handler from now on interrupts or restarts the call
  WaitTimer timer;      // from the first attempt that would block
  int timeout = -2;  // read lazily: only a call that has to sleep needs it
  uint64_t deadline = 0;
  size_t got = 0;
  iovec rest[kIovWindow];
  profile::Span waited(profile::Probe::kReadWait);
  for (;;) {
    std::span<const iovec> cur = got ? iov_advance(iov, got, rest) : iov;
    Status<size_t> r = Err(EAGAIN);
    {
      profile::Scope timed(profile::Probe::kRecvStep);
      std::lock_guard lk(mu_);
      advance_inline(false);
      r = try_recv(cur, flags);
    }
    if (!r) waited.start();
    if (r) {
      got += *r;
      if (*r == 0 || !waitall || got == want) return got;
      continue;
    }
    if (r.error() != EAGAIN) return got ? Status<size_t>(got) : r;
    if (nonblock) return got ? Status<size_t>(got) : Err(EAGAIN);
    const uint32_t spin_us = wait_spin_us(timer);
    bool spun = false;
    if (timeout == -2) {
      // (The timeout is read only once the spin did not do: a syscall.)
      if (spin(POLLIN, spin_us)) continue;
      spun = true;
      timeout = socket_timeout(true);
      deadline = timeout < 0 ? 0 : now_ms() + uint64_t(timeout);
    }
    int left = -1;
    if (deadline) {
      uint64_t now = now_ms();
      if (now >= deadline) return got ? Status<size_t>(got) : Err(EAGAIN);
      left = int(deadline - now);
    }
    // A socket with a timeout is never restarted (signal(7)).
    int w = wait(POLLIN, left, signals, spun ? 0 : spin_us);
    if (w == EINTR || (w == kRestarted && timeout >= 0)) return got ? Status<size_t>(got) : Err(EINTR);
    if (w == kRestarted) run_deferred_at_restart();  // (signals.h: then the call goes on)
  }
}

Status<size_t> Stream::send(std::span<const iovec> iov, int flags, bool nonblock) {
  const size_t want = iov_total(iov);
  SignalWatch signals;
  WaitTimer timer;  // from the first attempt that would block
  int timeout = -2;
  uint64_t deadline = 0;
  size_t sent = 0;
  iovec rest[kIovWindow];
  for (;;) {
    std::span<const iovec> cur = sent ? iov_advance(iov, sent, rest) : iov;
    Status<size_t> r = Err(EAGAIN);
    {
      profile::Scope timed(profile::Probe::kSendStep);
      std::lock_guard lk(mu_);
      advance_inline(false);
      r = want ? try_send(cur, flags) : Status<size_t>(size_t{0});
    }
    if (r) {
      sent += *r;
      // A blocking socket sends everything, like the kernel; a nonblocking
      // one returns what fit.
      if (sent == want || nonblock) return sent;
      continue;
    }
    if (r.error() != EAGAIN) return sent ? Status<size_t>(sent) : r;
    if (nonblock) return sent ? Status<size_t>(sent) : Err(EAGAIN);
    const uint32_t spin_us = wait_spin_us(timer);
    bool spun = false;
    if (timeout == -2) {
      // (The timeout is read only once the spin did not do: a syscall.)
      if (spin(POLLOUT, spin_us)) continue;
      spun = true;
      timeout = socket_timeout(false);
      deadline = timeout < 0 ? 0 : now_ms() + uint64_t(timeout);
    }
    int left = -1;
    if (deadline) {
      uint64_t now = now_ms();
      if (now >= deadline) return sent ? Status<size_t>(sent) : Err(EAGAIN);
      left = int(deadline - now);
    }
    int w = wait(POLLOUT, left, signals, spun ? 0 : spin_us);
    if (w == EINTR || (w == kRestarted && timeout >= 0)) return sent ? Status<size_t>(sent) : Err(EINTR);
    if (w == kRestarted) run_deferred_at_restart();  // (signals.h: then the call goes on)
  }
}

int Stream::report_error() {
  err_reported_ = true;
  return std::exchange(err_, 0);
}

int Stream::take_error() {
  std::lock_guard lk(mu_);
  advance_inline(true);
  if (phase() != Phase::kBroken) return 0;
  if (err_) return report_error();
  if (!err_reported_) return 0;
  // The reset was reported already (by a read, a write or SO_ERROR). The
  // TCP socket under it usually saw the same reset: its pending error is
  // the same event, which the kernel too would report only once.
  if (tcp_fd_ >= 0) {
    int k;
    socklen_t kl = sizeof k;
    (void)sys::libc.getsockopt(tcp_fd_, SOL_SOCKET, SO_ERROR, &k, &kl);
  }
  return -1;
}

Status<int> Stream::fionread() {
  std::lock_guard lk(mu_);
  advance_inline(true);
  if (phase() == Phase::kPlain) return Err(kRedoPlain);
  size_t n = staging_.size() - staging_off_;
  if (phase() == Phase::kReverting && !down_done_) {
    // Only staging until the peer's record is in.
  } else if (tcp_rx_open()) {
    int k = 0;
    if (sys::libc.ioctl(tcp_fd_, FIONREAD, &k) == 0) n += size_t(k);
  } else if (verified_ && conn_ && !rdma_dead_) {
    n += conn_->readable();
  }
  return static_cast<int>(std::min<size_t>(n, INT32_MAX));
}

Status<size_t> Stream::send_room() {
  std::lock_guard lk(mu_);
  advance_inline(false);
  Phase p = phase();
  if (p == Phase::kPlain) return Err(kRedoPlain);
  if (p == Phase::kBroken) return Err(err_ ? report_error() : EPIPE);
  if (wr_shut_) return Err(EPIPE);
  if (p == Phase::kReverting && !revert_settled()) return size_t{0};
  if (holds(0)) return held_cap_ - held_.size();
  if (held_pending() && !flush_held()) return size_t{0};
  if (tcp_tx_open()) return tcp_send_space();  // a send that takes less is completed by the caller
  if (p != Phase::kRdma) return size_t{0};
  return conn_->writable();
}

Status<void> Stream::shutdown(int how) {
  std::lock_guard lk(mu_);
  advance_inline(true);
  Phase p = phase();
  if (p == Phase::kPlain) return Err(kRedoPlain);
  if (how != SHUT_RD && how != SHUT_WR && how != SHUT_RDWR) return Err(EINVAL);
  if (how != SHUT_WR) rd_shut_ = true;
  if (how != SHUT_RD && !wr_shut_) {
    wr_shut_ = true;
    // The FIN must come after the last byte on whichever path carries it:
    // on RDMA now, or once the switch has ended (on RDMA, or on TCP after a
    // fallback).
    if (p == Phase::kRdma) (void)conn_->shutdown_write();
    else fin_deferred_ = true;
  }
  // Waiting to upgrade again (no rendezvous running): no new switch can
  // follow a FIN, and the FIN must not wait for one. TCP from here on.
  if (fin_deferred_ && p == Phase::kPending && reup_ && !conn_) abandon_reupgrade();
  // Our direction is on TCP for good: the stream only delivers what it read
  // ahead (an abandoned or reversed switch), or its switch's RDMA connection
  // died before our marker. No switch follows, so nothing else would send
  // the deferred FIN (after the held bytes, if any): the peer waited for its
  // EOF for ever.
  else if (fin_deferred_ && ((p == Phase::kPending && plain_when_drained_ && !conn_) ||
                             (p == Phase::kSwitching && rdma_dead_ && out_marker_off_ == 0)))
    deferred_fin();
  return Ok();
}

short Stream::events_locked(short interest, int slept_fd) {
  short ev = 0;
  Phase p = phase();
  // (Not EOF: the peer's record follows its marker. The join itself is
  // left to advance(): a look at readiness changes nothing.)
  const bool joining = join_pending();
  if (p == Phase::kBroken) return POLLERR | POLLHUP | (interest & (POLLIN | POLLOUT));
  bool staged = staging_.size() > staging_off_;
  if (p == Phase::kReverting && !down_done_) {
    if (staged || rd_shut_) ev |= POLLIN;
    if (tcp_eof_) ev |= POLLIN | POLLRDHUP;
    return ev & short(interest | POLLERR | POLLHUP);
  }
  short kernel = 0;
  if ((tcp_rx_open() || tcp_tx_open()) && tcp_fd_ != slept_fd) {
    pollfd pf{tcp_fd_, short(interest | POLLRDHUP), 0};
    if (sys::libc.poll(&pf, 1, 0) == 1) kernel = pf.revents;
  }
  // Readable.
  if (staged || rd_shut_) ev |= POLLIN;
  if (tcp_rx_open()) {
    ev |= kernel & (POLLIN | POLLRDHUP | POLLHUP | POLLERR);
  } else if (verified_ && !joining) {
    if (rdma_dead_ || !conn_ || conn_->readable() > 0 || conn_->eof() || conn_->error())
      ev |= POLLIN;
    if (rdma_dead_ || !conn_ || conn_->eof()) ev |= POLLRDHUP;
    if (conn_ && conn_->error() && !rdma_dead_) ev |= POLLERR | POLLHUP;
  } else if (tcp_eof_) {
    ev |= POLLIN | POLLRDHUP;
  }
  // Writable.
  if (tcp_tx_open()) {
    ev |= kernel & (POLLOUT | POLLERR | POLLHUP);
  } else if (wr_shut_ || switch_dead_end()) {
    ev |= POLLOUT;  // the write fails at once (EPIPE), as the kernel's does
  } else if (p == Phase::kRdma && conn_->writable() > 0) {
    ev |= POLLOUT;
  } else if (holds(0) && held_.size() < held_cap_) {
    ev |= POLLOUT;  // the switch runs: writes are held (a kernel socket takes them)
  }
  // Our resent or held bytes go first.
  if (backlog_ != nullptr || (held_pending() && !holds(0))) ev &= ~POLLOUT;
  if ((ev & POLLRDHUP) && wr_shut_) ev |= POLLHUP;
  return ev & short(interest | POLLERR | POLLHUP);
}

short Stream::poll_events(short interest, bool full, int slept_fd) {
  std::lock_guard lk(mu_);
  advance_inline(full);
  if (phase() == Phase::kPlain) return -1;
  return events_locked(interest, slept_fd);
}

short Stream::peek_events(short interest) {
  std::lock_guard lk(mu_);
  if (phase() == Phase::kPlain) return -1;
  return events_locked(interest);
}

int Stream::wait_fds(short interest, pollfd* out, bool* cq) {
  int n = 0;
  if (cq) *cq = false;
  std::lock_guard lk(mu_);
  out[n++] = {thread_wake_fd(), POLLIN, 0};
  bool tcp = tcp_rx_open() || tcp_tx_open() ||
             (phase() == Phase::kSwitching && (offer_rcvd_ || ready_rcvd_));
  if (phase() == Phase::kReverting && tcp_fd_ >= 0) {
    // The peer's record (POLLIN), our record and backlog (POLLOUT).
    bool out_pending = revert_out_pending();
    out[n++] = {tcp_fd_, short(interest | POLLIN | POLLRDHUP | (out_pending ? POLLOUT : 0)), 0};
    tcp = false;
  }
  if (tcp) out[n++] = {tcp_fd_, short(interest | POLLRDHUP), 0};
  // Completions: the process's completion hub (last: wait() looks there).
  if (conn_ && !rdma_dead_ && conn_->fd() >= 0) {
    out[n++] = {conn_->fd(), POLLIN, 0};
    if (cq) *cq = true;
  }
  return n;
}

int Stream::socket_timeout(bool rcv) {
  std::atomic<int>& cached = rcv ? rcvtimeo_ms_ : sndtimeo_ms_;
  int v = cached.load(std::memory_order_relaxed);
  if (v != kTimeoutUnknown && !shared_by_fork()) return v;
  v = socket_timeout_ms(tcp_fd(), rcv ? SO_RCVTIMEO : SO_SNDTIMEO);
  cached.store(v, std::memory_order_relaxed);
  return v;
}

bool Stream::spin(short interest, uint32_t spin_us) {
  // Busy-poll on RDMA: a reply usually arrives within microseconds, sooner
  // than a sleep and wakeup would take.
  if (phase() != Phase::kRdma || !spin_us) return false;
  SpinPlace slot(spin_us, process_config().tunables.spin_us);
  if (!slot.us()) return false;  // as many threads spin as there are CPUs
  SpinDeadline end(slot.us());
  do {
    {
      profile::Scope timed(profile::Probe::kSpinTurn);
      std::lock_guard lk(mu_);
      advance_inline(false);  // completions only: no syscall while spinning
      if (phase() != Phase::kRdma || (events_locked(interest) & (interest | POLLERR | POLLHUP)))
        return true;
    }
  } while (!end.passed());
  return false;
}

int Stream::wait(short interest, int timeout_ms, SignalWatch& signals, uint32_t spin_us) {
  if (spin(interest, spin_us)) return 0;
  pollfd fds[3];
  bool on_cq;  // fds[n - 1] is the completion hub
  int n = wait_fds(interest, fds, &on_cq);
  // The wake fd is read only when the sleep saw it readable (below), not
  // before every sleep (a read that found nothing in most round trips): a
  // poke left over from earlier ends this sleep at once, the caller looks
  // again and the next sleep is a real one. A poke that comes after this
  // look ends the sleep like any other.
  uint64_t seen = generation();
  // The look needs no poll() of the TCP socket the sleep watches itself
  // (for interest | POLLRDHUP: POLLERR and POLLHUP come anyway): one
  // syscall fewer per blocking call on a stream still on TCP (a short
  // connection's only read is one).
  int slept_fd = -1;
  for (int i = 1; i < n; i++)
    if (fds[i].fd == tcp_fd() && (fds[i].events & (interest | POLLRDHUP)) == (interest | POLLRDHUP))
      slept_fd = fds[i].fd;
  short ev = poll_events(interest, true, slept_fd);
  if (ev < 0 || (ev & (interest | POLLERR | POLLHUP))) return 0;
  int err = 0;
  // Without a wake fd in the stream's sleepers (none could be created, or
  // every slot is taken) nothing would end the sleep for a change here:
  // sleep in slices and look again.
  const bool slotted = add_sleeper(fds[0].fd);
  if (!slotted && (timeout_ms < 0 || timeout_ms > kNoWakeSliceMs)) timeout_ms = kNoWakeSliceMs;
  if (sleep_begin(seen)) {
    // CQs raise events only while someone sleeps (transport/cq_group.h,
    // "Arming"): armed here, after add_sleeper and sleep_begin. A
    // completion the arm's drain filed (ours pokes fds[0]; another's may
    // be one this thread passes on) ends the wait at once: the caller
    // looks again.
    transport::cq_group::ArmedSleep armed(on_cq);
    if (!armed.drained()) {
      // One sleeping thread of the process watches the completion hub
      // (transport/cq_hub.h); if another does, ours pokes fds[0] through
      // our sleepers' slot (so only a slotted sleeper may leave it out).
      const bool hub = slotted && on_cq;
      const bool watching = !hub || transport::cq_hub::begin_sleep(fds[0].fd);
      for (;;) {
        err = restartable_poll(fds, nfds_t(watching ? n : n - 1), timeout_ms, signals);
        // Woken by the hub alone for other sleepers' completions: passed on,
        // and the sleep goes on unless ours changed (cq_hub::relay). Untimed
        // sleeps only: a timed one would count down what it slept.
        if (!hub || !watching || err != 0 || timeout_ms >= 0 ||
            !transport::cq_hub::relay(fds, nfds_t(n), nfds_t(n - 1)) || generation() != seen)
          break;
      }
      // (Others asleep without the hub: their completions are read now.)
      if (hub && transport::cq_hub::end_sleep() && (fds[n - 1].revents & POLLIN))
        transport::cq_hub::poll();
    }
  }
  sleep_end();
  if (slotted) remove_sleeper(fds[0].fd);
  if (fds[0].fd >= 0 && (fds[0].revents & POLLIN)) {
    uint64_t drain;
    (void)!sys::libc.read(fds[0].fd, &drain, sizeof drain);
  }
  // Woken by the completion hub: the event is read by the next progress()
  // (the caller looks at the CQ first, which needs no syscall), as it was
  // with a channel per connection: reading it here put a syscall between
  // the wakeup and the data (+20 us per round trip in the VM). The mark
  // tells progress() that there is one to read.
  transport::cq_hub::note_if_woken(fds, n);
  return err;
}

}  // namespace rsock::socket
