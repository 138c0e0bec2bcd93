// Two-process tests of transport/ over Soft-RoCE (run inside tools/rxe-vm).
//   rsock_transport_vmtest <case>
// Cases: stream slowreader halfclose many bidir kill_reader_side kill_writer_side keepalive stall noport reject foreign_rkey hostile ring_move kit_reuse
// Exit 77 with "SKIP: no RDMA device" when the host has no verbs device.
#include <dirent.h>

#include <algorithm>
#include <rdma/rdma_cma.h>

#include <vector>

#include "harness.h"
#include "transport/cq_group.h"
#include "transport/pinned.h"
#include "util/log.h"

using rsock::Ok;
using rsock::Status;
using rsock::config::Tunables;

namespace {

Tunables test_tunables() {
  Tunables t;
  // TCG makes everything 10-50x slower than hardware: generous setup bounds
  // (the bounds themselves are tested by noport).
  t.resolve_timeout_ms = 5000;
  t.connect_timeout_ms = 10000;
  t.spin_us = 50;
  return t;
}

struct FrameHeader {
  uint32_t len;
  uint32_t seq;
  uint64_t sum;
};

// ---------------------------------------------------------------- stream
int stream_case() {
  Tunables tun = test_tunables();
  const char* env = getenv("RSOCK_STREAM_MIB");
  const uint64_t total_target = uint64_t(env ? atoi(env) : 256) << 20;
  constexpr size_t kMaxFrame = 4u << 20;
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto c = accept_one(l);
    check_qp_visible(*c);
    std::vector<char> body(kMaxFrame);
    uint64_t bytes = 0, frames = 0, t0 = rsock::now_ns();
    for (;;) {
      FrameHeader h;
      CHECK(recv_all(*c, &h, sizeof h), "EOF before end frame");
      if (h.len == 0) {
        CHECK(h.sum == bytes, "end frame says %llu bytes, got %llu", (unsigned long long)h.sum,
              (unsigned long long)bytes);
        break;
      }
      CHECK(h.len <= kMaxFrame && h.seq == frames, "bad frame header len %u seq %u", h.len, h.seq);
      CHECK(recv_all(*c, body.data(), h.len), "EOF inside frame");
      CHECK(checksum(body.data(), h.len) == h.sum, "checksum mismatch in frame %u", h.seq);
      bytes += h.len;
      ++frames;
    }
    char x;
    iovec v{&x, 1};
    auto r = c->recv({&v, 1}, false);
    while (!r.ok() && r.error() == EAGAIN) {
      CHECK(c->wait(POLLIN, 10000).ok(), "wait for EOF");
      r = c->recv({&v, 1}, false);
    }
    CHECK(r.ok() && *r == 0, "expected EOF after end frame");
    double s = secs_since(t0);
    const auto& k = c->counters();
    log_line("stream: %llu frames, %.1f MiB in %.2f s = %.1f MiB/s; data recvs %llu, credits sent %llu",
             (unsigned long long)frames, bytes / 1048576.0, s, bytes / 1048576.0 / s,
             (unsigned long long)k.data_recvs, (unsigned long long)k.credits_sent);
    CHECK(k.data_recvs > 0 && k.bytes_received == bytes + frames * sizeof(FrameHeader) + sizeof(FrameHeader),
          "counters disagree: %llu bytes received", (unsigned long long)k.bytes_received);
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    check_qp_visible(*c);
    std::vector<char> body(kMaxFrame);
    Rng sizes(42);
    uint64_t bytes = 0;
    uint32_t seq = 0;
    while (bytes < total_target) {
      size_t len;
      if (seq == 0) len = kMaxFrame;  // the extremes always appear
      else if (seq == 1) len = 1;
      else len = 1 + sizes.next() % (size_t{1} << (sizes.next() % 23));
      Rng data(seq);
      fill(data, body.data(), len);
      FrameHeader h{uint32_t(len), seq, checksum(body.data(), len)};
      iovec v[2] = {{&h, sizeof h}, {body.data(), len}};
      size_t left = sizeof h + len, done = 0;
      while (done < left) {  // two-iovec sends, resumed after partial writes
        iovec cur[2];
        size_t n = 0, skip = done;
        for (auto& e : v) {
          if (skip >= e.iov_len) { skip -= e.iov_len; continue; }
          cur[n++] = {static_cast<char*>(e.iov_base) + skip, e.iov_len - skip};
          skip = 0;
        }
        auto r = c->send({cur, n});
        if (r.ok()) { done += *r; continue; }
        CHECK(r.error() == EAGAIN, "send: %s", std::strerror(r.error()));
        CHECK(c->wait(POLLOUT, 10000).ok(), "wait(POLLOUT)");
      }
      bytes += len;
      ++seq;
    }
    FrameHeader end{0, seq, bytes};
    send_all(*c, &end, sizeof end);
    CHECK(c->shutdown_write().ok(), "shutdown_write");
    const auto& k = c->counters();
    log_line("stream client: %u frames, data WRs %llu in %llu posts (inline %llu), credit stalls %llu, "
             "max_inline %u",
             seq, (unsigned long long)k.data_wrs, (unsigned long long)k.data_posts,
             (unsigned long long)k.inline_wrs,
             (unsigned long long)k.credit_stalls, c->max_inline());
    CHECK(k.data_wrs > 0 && k.bytes_sent >= bytes, "no RDMA writes counted");
    // Frames of up to 4 MiB into a ring of eighth-ring chunks: sends of
    // several chunks went out chained, one post each.
    CHECK(k.data_posts > 0 && k.data_posts < k.data_wrs, "no chained posts: %llu WRs in %llu posts",
          (unsigned long long)k.data_wrs, (unsigned long long)k.data_posts);
    // Wait for the server's EOF check to finish: its close arrives as FIN.
    char x;
    CHECK(!recv_all(*c, &x, 1), "unexpected data from server");
    return 0;
  };
  return run_pair(server, client, tun, 560);
}

// ---------------------------------------------------------------- slowreader
int slowreader_case() {
  Tunables tun = test_tunables();
  tun.ring_bytes = 16 * 1024;
  constexpr size_t kTotal = 4u << 20;
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto c = accept_one(l);
    Rng expect(7);
    std::vector<char> want(4096), got(4096);
    size_t done = 0;
    while (done < kTotal) {
      fill(expect, want.data(), want.size());
      CHECK(recv_all(*c, got.data(), got.size()), "EOF at %zu", done);
      CHECK(std::memcmp(want.data(), got.data(), got.size()) == 0, "data differs at %zu", done);
      done += got.size();
      usleep(1000);  // slow consumer: the writer must stall on credits
    }
    char x;
    CHECK(!recv_all(*c, &x, 1), "expected EOF");
    log_line("slowreader: %zu bytes ok, credits sent %llu", done,
             (unsigned long long)c->counters().credits_sent);
    CHECK(c->counters().credits_sent > 0, "no credit updates were sent");
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    Rng gen(7);
    std::vector<char> buf(4096);
    std::vector<char> big;
    for (size_t i = 0; i < kTotal / 4096; ++i) {
      fill(gen, buf.data(), buf.size());
      big.insert(big.end(), buf.begin(), buf.end());
    }
    uint64_t stalls_before = c->counters().credit_stalls;
    send_all(*c, big.data(), big.size());
    CHECK(c->shutdown_write().ok(), "shutdown_write");
    uint64_t stalls = c->counters().credit_stalls - stalls_before;
    log_line("slowreader client: credit stalls %llu, data WRs %llu", (unsigned long long)stalls,
             (unsigned long long)c->counters().data_wrs);
    CHECK(stalls > 0, "writer never stalled: flow control not exercised");
    CHECK(c->counters().data_wrs > 0, "no RDMA writes");
    c.reset();  // orderly close: waits until everything is acknowledged
    return 0;
  };
  return run_pair(server, client, tun, 300);
}

// ---------------------------------------------------------------- halfclose
int halfclose_case() {
  Tunables tun = test_tunables();
  constexpr size_t kBytes = 1u << 20;
  auto make = [](uint64_t seed) {
    std::vector<char> v(kBytes);
    Rng r(seed);
    fill(r, v.data(), v.size());
    return v;
  };
  auto drain_to_eof = [](rt::Connection& c, size_t expect, uint64_t seed) {
    std::vector<char> got(expect);
    CHECK(recv_all(c, got.data(), expect), "EOF too early");
    std::vector<char> want(expect);
    Rng r(seed);
    fill(r, want.data(), want.size());
    CHECK(got == want, "data mismatch");
    char x;
    CHECK(!recv_all(c, &x, 1), "expected EOF");
    iovec v{&x, 1};
    auto again = c.recv({&v, 1}, false);  // EOF stays EOF
    CHECK(again.ok() && *again == 0, "EOF not sticky");
    CHECK(c.eof(), "eof() false after EOF");
  };
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto c = accept_one(l);
    drain_to_eof(*c, kBytes, 1);  // client -> server, then client's FIN
    // The app control message sent after the data arrives in order, tagged
    // with the stream position it was sent at.
    auto m = c->recv_control();
    CHECK(m.ok(), "no app control message: %d", m.error());
    CHECK(m->type == 7 && m->len == 6 && std::memcmp(m->data, "switch", 6) == 0 &&
              m->stream_pos == kBytes,
          "control type %d len %d pos %llu", m->type, m->len, (unsigned long long)m->stream_pos);
    CHECK(c->recv_control().error() == EAGAIN, "only one control message was sent");
    // Our direction is still open after the peer's half-close.
    auto data = make(2);
    send_all(*c, data.data(), data.size());
    CHECK(c->shutdown_write().ok(), "shutdown_write");
    char x = 0;
    iovec v{&x, 1};
    auto r = c->send({&v, 1});
    CHECK(!r.ok() && r.error() == EPIPE, "send after shutdown_write should be EPIPE");
    CHECK(c->counters().data_wrs > 0 && c->counters().data_recvs > 0, "no RDMA traffic counted");
    c->close().ok();
    uint64_t t0 = rsock::now_ns();
    // wait(POLLIN) returns at once after the peer's FIN: drive progress()
    // (rdma_cm's DISCONNECTED) ourselves.
    while (!c->closed() && secs_since(t0) < 10) {
      (void)c->progress();
      if (!c->closed()) usleep(2000);
    }
    CHECK(c->closed(), "close() did not complete");
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    auto data = make(1);
    send_all(*c, data.data(), data.size());
    const char sw[] = "switch";
    CHECK(c->send_control(7, std::as_bytes(std::span(sw, 6))).ok(), "send_control");
    CHECK(c->shutdown_write().ok(), "shutdown_write");
    CHECK(c->shutdown_write().ok(), "second shutdown_write must be harmless");
    drain_to_eof(*c, kBytes, 2);
    CHECK(c->counters().data_wrs > 0 && c->counters().data_recvs > 0, "no RDMA traffic counted");
    return 0;
  };
  return run_pair(server, client, tun, 200);
}

// ---------------------------------------------------------------- many
// The process's open fds (/proc/self/fd, less the directory's own).
int count_fds() {
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) n++;
  closedir(d);
  return n - 3;  // ".", ".." and the directory itself
}

// A connection has no fd of its own: rdma_cm events of every connection come
// through one channel (cm_hub.h), completions through one channel per device
// context (cq_hub.h). However many connections, the process's fds grow by a
// constant (first use: the channels, the device context's fds).
constexpr int kMaxSharedFds = 8;

int many_case() {
  Tunables tun = test_tunables();
  tun.ring_bytes = 16 * 1024;
  tun.recv_slots = 16;
  tun.send_queue_depth = 32;
  tun.connect_timeout_ms = 60000;
  tun.resolve_timeout_ms = 30000;
  const char* env = getenv("RSOCK_MANY_CONNS");
  const int kConns = env ? atoi(env) : 256;
  constexpr size_t kMsg = 1024;
  auto server = [&](rt::Listener& l, pid_t) -> int {
    std::vector<std::unique_ptr<rt::Connection>> conns;
    std::vector<size_t> echoed;
    uint64_t t0 = rsock::now_ns();
    const int fds0 = count_fds();
    int done = 0;
    while (done < kConns) {
      CHECK(secs_since(t0) < 400, "only %d of %d connections served", done, kConns);
      for (;;) {
        auto r = l.next_request();
        if (!r.ok()) break;
        auto c = l.accept(std::move(r.value()), {});
        CHECK(c.ok(), "accept #%zu: %s", conns.size(), std::strerror(c.error()));
        conns.push_back(std::move(c.value()));
        echoed.push_back(0);
      }
      bool any = false;
      for (size_t i = 0; i < conns.size(); ++i) {
        auto& c = *conns[i];
        auto p = c.progress();
        CHECK(p.ok(), "conn %zu: %s", i, std::strerror(p.error()));
        if (echoed[i] == kMsg) continue;
        if (c.readable() >= kMsg) {
          char buf[kMsg];
          CHECK(recv_all(c, buf, kMsg), "EOF");
          send_all(c, buf, kMsg);
          echoed[i] = kMsg;
          ++done;
          any = true;
        }
      }
      if (!any) usleep(1000);
    }
    // Every connection is alive until the client's FIN: all QPs must show.
    int n = count_rc_qps(getpid());
    log_line("many: %d RC QPs of this server in rdma resource show qp", n);
    CHECK(n == kConns, "expected %d RC QPs, rdma tool shows %d", kConns, n);
    // Shared CQs (transport/cq_group.h): groups of 4, 8, ... 64 connections,
    // not a CQ per connection; the kernel's own listing says so.
    int cqs = count_cqs(getpid());
    log_line("many: %d CQs of this server in rdma resource show cq (%u groups made)", cqs,
             rt::cq_group::groups());
    CHECK(cqs >= 1 && cqs <= kConns / 16 + 4, "%d CQs for %d connections", cqs, kConns);
    CHECK(uint32_t(cqs) == rt::cq_group::groups(), "kernel lists %d CQs, %u groups made", cqs,
          rt::cq_group::groups());
    int grown = count_fds() - fds0;
    log_line("many: the server's fds grew by %d for %d connections", grown, kConns);
    CHECK(grown <= kMaxSharedFds, "server: %d more fds for %d connections", grown, kConns);
    for (auto& c : conns) {
      char x;
      CHECK(!recv_all(*c, &x, 1), "expected EOF");
    }
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    std::vector<std::unique_ptr<rt::Connection>> conns;
    sockaddr_in a = server_addr(port);
    uint64_t t0 = rsock::now_ns();
    const int fds0 = count_fds();
    for (int i = 0; i < kConns; ++i) {  // all setups in flight at once
      auto c = rt::Connection::connect(reinterpret_cast<sockaddr*>(&a), nullptr, {}, tun);
      CHECK(c.ok(), "connect #%d: %s", i, std::strerror(c.error()));
      conns.push_back(std::move(c.value()));
    }
    int est = 0;
    while (est < kConns) {
      est = 0;
      for (auto& c : conns) {
        auto p = c->progress();
        CHECK(p.ok(), "setup failed: %s (reject %d)", std::strerror(p.error()), int(c->reject_reason()));
        est += c->established();
      }
      CHECK(secs_since(t0) < 300, "only %d of %d established", est, kConns);
      usleep(2000);
    }
    log_line("many: %d connections established in %.2f s", kConns, secs_since(t0));
    int grown = count_fds() - fds0;
    log_line("many: the client's fds grew by %d for %d connections", grown, kConns);
    CHECK(grown <= kMaxSharedFds, "client: %d more fds for %d connections", grown, kConns);
    for (int i = 0; i < kConns; ++i) {
      char buf[kMsg];
      std::memset(buf, i & 0xff, kMsg);
      std::memcpy(buf, &i, sizeof i);
      send_all(*conns[i], buf, kMsg);
    }
    for (int i = 0; i < kConns; ++i) {
      char buf[kMsg];
      CHECK(recv_all(*conns[i], buf, kMsg), "EOF on %d", i);
      int j;
      std::memcpy(&j, buf, sizeof j);
      CHECK(j == i && uint8_t(buf[kMsg - 1]) == uint8_t(i & 0xff), "echo mismatch on %d", i);
      CHECK(conns[i]->counters().data_wrs > 0, "no RDMA writes on %d", i);
      CHECK(conns[i]->shutdown_write().ok(), "shutdown_write");
    }
    log_line("many: %d echoes ok after %.2f s", kConns, secs_since(t0));
    CHECK(count_rc_qps(getpid()) == kConns, "RC QPs of the client: %d", count_rc_qps(getpid()));
    const uint64_t t_close = rsock::now_ns();  // before the first group empties
    conns.clear();  // orderly close of all: every QP must be gone afterwards
    int left = count_rc_qps(getpid());
    CHECK(left == 0, "%d RC QPs left after destroying every connection", left);
    // Their kits: the pool keeps kMaxIdle of them (no memlock limit here)
    // and gives every pinned byte back when trimmed.
    CHECK(rt::kit_pool::idle() == rt::kit_pool::kMaxIdle, "%d kits pooled, want %d",
          rt::kit_pool::idle(), rt::kit_pool::kMaxIdle);
    CHECK(rt::pinned::in_use() > 0, "the pooled kits hold no pinned memory");
    rt::kit_pool::trim(0, /*all=*/true);
    CHECK(rt::kit_pool::idle() == 0 && rt::pinned::in_use() == 0,
          "after trimming: %d kits, %llu bytes pinned", rt::kit_pool::idle(),
          (unsigned long long)rt::pinned::in_use());
    // The shared CQs of the groups they left: kept until idle (not yet),
    // then given back (cq_group.h, trim); the kernel lists none after.
    int cqs_before = count_cqs(getpid());
    CHECK(cqs_before >= 1 && uint32_t(cqs_before) == rt::cq_group::groups(),
          "%d CQs listed with every connection closed, %u groups", cqs_before,
          rt::cq_group::groups());
    rt::cq_group::trim(t_close);  // (a clock older than every group's emptying)
    CHECK(count_cqs(getpid()) == cqs_before, "CQs trimmed before they were idle");
    rt::cq_group::trim(0, /*all=*/true);
    CHECK(count_cqs(getpid()) == 0 && rt::cq_group::groups() == 0,
          "after trimming: the kernel lists %d CQs, %u groups hold one", count_cqs(getpid()),
          rt::cq_group::groups());
    log_line("many: all %d QPs released after %.2f s", kConns, secs_since(t0));
    return 0;
  };
  return run_pair(server, client, tun, 500);
}

// ---------------------------------------------------------------- bidir
// Both directions stream at once through a tiny ring and only 4 receive WRs:
// credits and receive-WR accounting must never deadlock (nor RNR: retry 0).
int bidir_one_side(rt::Connection& c, uint64_t seed_out, uint64_t seed_in, size_t total) {
  Rng out(seed_out), in(seed_in);
  std::vector<char> obuf(3000), ibuf(5000), want(5000);
  size_t sent = 0, got = 0, opos = obuf.size(), olen = obuf.size();
  bool fin = false;
  uint64_t t0 = rsock::now_ns();
  while (got < total || !fin) {
    CHECK(secs_since(t0) < 200, "bidir stuck: sent %zu got %zu", sent, got);
    bool moved = false;
    if (sent < total) {
      if (opos == olen) {
        olen = std::min(obuf.size(), total - sent);
        fill(out, obuf.data(), obuf.size());
        opos = 0;
      }
      iovec v{obuf.data() + opos, olen - opos};
      auto r = c.send({&v, 1});
      if (r.ok()) { opos += *r; sent += *r; moved = true; }
      else CHECK(r.error() == EAGAIN, "send %s", std::strerror(r.error()));
    } else if (!fin) {
      CHECK(c.shutdown_write().ok(), "shutdown_write");
      fin = true;
    }
    if (got < total) {
      size_t want_n = std::min(ibuf.size(), total - got);
      iovec v{ibuf.data(), want_n};
      auto r = c.recv({&v, 1}, false);
      if (r.ok()) {
        CHECK(*r > 0, "early EOF at %zu", got);
        // Compare against the peer's generator, chunked as it fills (3000 B).
        for (size_t i = 0; i < *r; ++i, ++got) {
          if (got % 3000 == 0) fill(in, want.data(), 3000);
          CHECK(ibuf[i] == want[got % 3000], "byte %zu differs", got);
        }
        moved = true;
      } else {
        CHECK(r.error() == EAGAIN, "recv %s", std::strerror(r.error()));
      }
    }
    if (!moved) (void)c.wait(POLLIN | POLLOUT, 100);
  }
  char x;
  CHECK(!recv_all(c, &x, 1), "expected EOF");
  const auto& k = c.counters();
  log_line("bidir: %zu bytes each way; credits sent %llu received %llu, stalls %llu", total,
           (unsigned long long)k.credits_sent, (unsigned long long)k.credits_received,
           (unsigned long long)k.credit_stalls);
  CHECK(k.credit_stalls > 0 && k.data_wrs > 0, "flow control not exercised");
  return 0;
}

int bidir_case() {
  Tunables tun = test_tunables();
  tun.ring_bytes = 4096;
  tun.recv_slots = 4;
  tun.send_queue_depth = 8;
  constexpr size_t kTotal = 4u << 20;
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto c = accept_one(l);
    return bidir_one_side(*c, 11, 12, kTotal);
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    return bidir_one_side(*c, 12, 11, kTotal);
  };
  return run_pair(server, client, tun, 300);
}

// ---------------------------------------------------------------- kill
// The peer is SIGKILLed mid-stream; the survivor must see ECONNRESET/EPIPE
// within 2 s. reader_survives: the killed process is the writer.
int kill_case(bool reader_survives) {
  Tunables tun = test_tunables();
  auto server = [&](rt::Listener& l, pid_t client_pid) -> int {
    auto c = accept_one(l);
    check_qp_visible(*c);
    std::vector<char> buf(64 * 1024, 'x');
    uint64_t moved = 0, t_kill = 0;
    for (;;) {
      if (t_kill == 0 && moved >= (4u << 20)) {
        CHECK(kill(client_pid, SIGKILL) == 0, "kill");
        t_kill = rsock::now_ns();
        log_line("kill: peer %d killed after %llu bytes", client_pid, (unsigned long long)moved);
      }
      iovec v{buf.data(), buf.size()};
      auto r = reader_survives ? c->recv({&v, 1}, false) : c->send({&v, 1});
      if (r.ok() && *r > 0) {
        moved += *r;
        continue;
      }
      int err = r.ok() ? 0 : r.error();
      if (err == EAGAIN) {
        auto w = c->wait(reader_survives ? POLLIN : POLLOUT, 100);
        (void)w;
        if (t_kill) CHECK(secs_since(t_kill) < 10, "no error 10 s after the peer died");
        continue;
      }
      CHECK(t_kill != 0, "stream failed before the kill: %s", std::strerror(err));
      double s = secs_since(t_kill);
      log_line("kill: error '%s' %.3f s after the kill", err ? std::strerror(err) : "EOF", s);
      CHECK(err == ECONNRESET || err == EPIPE, "want ECONNRESET/EPIPE, got %d", err);
      CHECK(s <= 2.0, "error took %.3f s (> 2 s)", s);
      return 0;
    }
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    std::vector<char> buf(64 * 1024, 'y');
    for (;;) {  // until killed
      iovec v{buf.data(), buf.size()};
      auto r = reader_survives ? c->send({&v, 1}) : c->recv({&v, 1}, false);
      if (!r.ok() && r.error() == EAGAIN) {
        (void)c->wait(reader_survives ? POLLOUT : POLLIN, 100);
        continue;
      }
      if (!r.ok() || *r == 0) return 3;
    }
  };
  return run_pair(server, client, tun, 120, /*client_killed_ok=*/true);
}

// ---------------------------------------------------------------- keepalive
// The peer's QP dies without a DREQ (as if its host vanished): an idle
// survivor must notice through its keepalive within 2 s.
int keepalive_case() {
  Tunables tun = test_tunables();
  if (getenv("RSOCK_TEST_DEBUG")) rsock::log::set_level(rsock::log::Level::kDebug);
  auto server = [&](rt::Listener& l, pid_t client_pid) -> int {
    auto c = accept_one(l);
    char x;
    CHECK(recv_all(*c, &x, 1), "no byte");
    uint64_t t0 = rsock::now_ns();  // the client breaks its QP right after that byte
    for (;;) {
      auto w = c->wait(POLLIN, 100);
      iovec v{&x, 1};
      auto r = c->recv({&v, 1}, false);
      if (!r.ok() && r.error() == EAGAIN) {
        CHECK(secs_since(t0) < 10, "silent peer not noticed in 10 s (%llu keepalives, %llu completions)",
              (unsigned long long)c->counters().keepalives, (unsigned long long)c->counters().completions);
        continue;
      }
      double s = secs_since(t0);
      log_line("keepalive: %s after %.3f s (%llu keepalives sent)",
               r.ok() ? "EOF" : std::strerror(r.error()), s,
               (unsigned long long)c->counters().keepalives);
      CHECK(!r.ok() && r.error() == ECONNRESET, "want ECONNRESET");
      CHECK(c->counters().keepalives > 0, "noticed without a keepalive?");
      CHECK(s <= 2.0, "took %.3f s (> 2 s)", s);
      (void)w;
      kill(client_pid, SIGKILL);
      return 0;
    }
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    char x = 'k';
    send_all(*c, &x, 1);
    // Let the byte be acknowledged before the QP goes away.
    uint64_t t0 = rsock::now_ns();
    while (secs_since(t0) < 0.2) {
      (void)c->progress();
      usleep(1000);
    }
    CHECK(c->debug_break_silently().ok(), "break");
    pause();  // until the parent's timeout kill: the process (and its cm_id) stays
    return 0;
  };
  return run_pair(server, client, tun, 30, /*client_killed_ok=*/true);
}

// ---------------------------------------------------------------- stall
// The device stops working our send queue while the QP stays in a live state
// (rxe after a link flap; here: SQD): no completion, no error, ever. The
// stall watchdog must fail the connection within stall_timeout_ms + slack.
int stall_case() {
  Tunables tun = test_tunables();
  tun.stall_timeout_ms = 1000;
  auto server = [&](rt::Listener& l, pid_t client_pid) -> int {
    auto c = accept_one(l);
    char x;
    CHECK(recv_all(*c, &x, 1), "no byte");
    auto st = c->debug_stall_sends();
    CHECK(st.ok(), "ibv_modify_qp(SQD): %s", std::strerror(st.ok() ? 0 : st.error()));
    uint64_t t0 = rsock::now_ns();
    x = 's';
    send_all(*c, &x, 1);  // parked in the queue for good
    for (;;) {
      auto w = c->wait(POLLIN, 100);
      (void)w;
      auto p = c->progress();
      if (p.ok()) {
        CHECK(secs_since(t0) < 10, "stalled send queue not noticed in 10 s (%llu completions)",
              (unsigned long long)c->counters().completions);
        continue;
      }
      double s = secs_since(t0);
      log_line("stall: %s after %.3f s (%llu stalls)", std::strerror(p.error()), s,
               (unsigned long long)c->counters().stalls);
      CHECK(p.error() == ETIMEDOUT, "want ETIMEDOUT, got %d", p.error());
      CHECK(c->counters().stalls == 1, "the watchdog did not fire");
      CHECK(s >= 0.9 && s <= 3.0, "took %.3f s (want ~1 s)", s);
      kill(client_pid, SIGKILL);
      return 0;
    }
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    char x = 'k';
    send_all(*c, &x, 1);
    for (;;) {  // stays alive and keeps answering until killed
      (void)c->wait(POLLIN, 100);
      iovec v{&x, 1};
      (void)c->recv({&v, 1}, false);
    }
  };
  return run_pair(server, client, tun, 30, /*client_killed_ok=*/true);
}

// ---------------------------------------------------------------- noport
int noport_case() {
  Tunables tun;  // real default bounds
  sockaddr_in a = server_addr(1);  // rdma_cm TCP port space: nobody listens on 1
  uint64_t t0 = rsock::now_ns();
  auto c = rt::Connection::connect(reinterpret_cast<sockaddr*>(&a), nullptr, {}, tun);
  int err = c.ok() ? 0 : c.error();
  while (err == 0) {
    auto p = c.value()->progress();
    if (!p.ok()) { err = p.error(); break; }
    CHECK(!c.value()->established(), "connected to a port nobody listens on");
    CHECK(secs_since(t0) < 10, "no failure after 10 s");
    pollfd pf{c.value()->fd(), POLLIN, 0};
    poll(&pf, 1, 100);
  }
  double s = secs_since(t0);
  log_line("noport: %s after %.3f s", std::strerror(err), s);
  CHECK(err == ECONNREFUSED || err == ETIMEDOUT, "unexpected error %d", err);
  CHECK(s < 2.0 + tun.resolve_timeout_ms / 1000.0, "failure took %.3f s", s);
  // An address nobody has (same subnet, no neighbour): the kernel's
  // resolution timeout (resolve_timeout_ms, which we pass on; our own guard
  // waits 1.5 s longer) or, had it resolved, the connect's bound
  // (connect_timeout_ms, at least upgrade_timeout_ms) must end it.
  sockaddr_in gone = server_addr(1);
  inet_pton(AF_INET, "10.77.0.99", &gone.sin_addr);
  t0 = rsock::now_ns();
  auto g = rt::Connection::connect(reinterpret_cast<sockaddr*>(&gone), nullptr, {}, tun);
  err = g.ok() ? 0 : g.error();
  while (err == 0) {
    auto p = g.value()->progress();
    if (!p.ok()) { err = p.error(); break; }
    CHECK(secs_since(t0) < 10, "no failure after 10 s");
    pollfd pf{g.value()->fd(), POLLIN, 0};
    poll(&pf, 1, 50);  // no timer fd: deadlines are checked by progress(), called in time
  }
  s = secs_since(t0);
  log_line("unreachable: %s after %.3f s", std::strerror(err), s);
  CHECK(err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH, "unexpected error %d", err);
  CHECK(s < (2 * tun.resolve_timeout_ms + std::max(tun.connect_timeout_ms, tun.upgrade_timeout_ms)) /
                    1000.0 + 0.5,
        "failure took %.3f s", s);
  return 0;
}

// ---------------------------------------------------------------- reject
// Bad magic is rejected with a readable reason; the socket layer's reject
// reaches the peer as ECONNREFUSED + reason; payloads travel both ways.
int raw_bad_magic_connect(uint16_t port) {
  rdma_event_channel* ch = rdma_create_event_channel();
  rdma_cm_id* id;
  CHECK(ch && rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) == 0, "raw id");
  sockaddr_in a = server_addr(port);
  CHECK(rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&a), 5000) == 0, "resolve");
  rdma_cm_event* ev;
  auto expect = [&](rdma_cm_event_type t) {
    CHECK(rdma_get_cm_event(ch, &ev) == 0, "get event");
    CHECK(ev->event == t, "event %s, want %s", rdma_event_str(ev->event), rdma_event_str(t));
  };
  expect(RDMA_CM_EVENT_ADDR_RESOLVED);
  rdma_ack_cm_event(ev);
  CHECK(rdma_resolve_route(id, 5000) == 0, "route");
  expect(RDMA_CM_EVENT_ROUTE_RESOLVED);
  rdma_ack_cm_event(ev);
  ibv_pd* pd = ibv_alloc_pd(id->verbs);
  ibv_cq* cq = ibv_create_cq(id->verbs, 4, nullptr, nullptr, 0);
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap = {1, 1, 1, 1, 0};
  CHECK(pd && cq && rdma_create_qp(id, pd, &qa) == 0, "raw qp");
  char junk[24];
  std::memset(junk, 0x5a, sizeof junk);
  rdma_conn_param p{};
  p.private_data = junk;
  p.private_data_len = sizeof junk;
  p.retry_count = 7;
  CHECK(rdma_connect(id, &p) == 0, "raw connect");
  expect(RDMA_CM_EVENT_REJECTED);
  auto why = rsock::transport::wire::parse_reject(ev->param.conn.private_data,
                                                  ev->param.conn.private_data_len);
  rdma_ack_cm_event(ev);
  CHECK(why == rt::RejectReason::kBadMagic, "reject reason %d, want kBadMagic", int(why));
  rdma_destroy_qp(id);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  rdma_destroy_id(id);
  rdma_destroy_event_channel(ch);
  log_line("reject: bad magic refused with reason kBadMagic");
  return 0;
}

int reject_case() {
  Tunables tun = test_tunables();
  auto bytes = [](const char* s) { return std::span<const std::byte>(reinterpret_cast<const std::byte*>(s), std::strlen(s)); };
  auto server = [&](rt::Listener& l, pid_t) -> int {
    int handled = 0;
    uint64_t t0 = rsock::now_ns();
    std::unique_ptr<rt::Connection> keep;
    while (handled < 2) {
      CHECK(secs_since(t0) < 60, "requests missing");
      auto r = l.next_request();
      if (!r.ok()) {
        pollfd p{l.fd(), POLLIN, 0};
        poll(&p, 1, 100);
        continue;
      }
      std::string pl(reinterpret_cast<const char*>(r->payload().data()), r->payload().size());
      if (pl == "refuse-me") {
        l.reject(std::move(r.value()), rt::RejectReason::kRefused);
      } else {
        CHECK(pl == "hello", "payload '%s'", pl.c_str());
        auto c = l.accept(std::move(r.value()), bytes("world!"));
        CHECK(c.ok(), "accept");
        keep = std::move(c.value());
        wait_established(*keep);
        char x;
        CHECK(!recv_all(*keep, &x, 1), "expected EOF");
      }
      ++handled;
    }
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    raw_bad_magic_connect(port);
    sockaddr_in a = server_addr(port);
    auto c = rt::Connection::connect(reinterpret_cast<sockaddr*>(&a), nullptr, bytes("refuse-me"), tun);
    CHECK(c.ok(), "connect");
    Status<void> st = Ok();
    uint64_t t0 = rsock::now_ns();
    while (st.ok() && secs_since(t0) < 20) {
      pollfd p{c.value()->fd(), POLLIN, 0};
      poll(&p, 1, 100);
      st = c.value()->progress();
    }
    CHECK(!st.ok() && st.error() == ECONNREFUSED, "want ECONNREFUSED, got %d", st.error());
    CHECK(c.value()->reject_reason() == rt::RejectReason::kRefused, "reason %d",
          int(c.value()->reject_reason()));
    log_line("reject: refused by the application with reason kRefused");
    auto ok = connect_to(port, tun, bytes("hello"));
    std::string pl(reinterpret_cast<const char*>(ok->peer_payload().data()), ok->peer_payload().size());
    CHECK(pl == "world!", "accept payload '%s'", pl.c_str());
    CHECK(ok->shutdown_write().ok(), "shutdown");
    return 0;
  };
  return run_pair(server, client, tun, 120);
}


// ---------------------------------------------------------------- foreign_rkey
// Shared by foreign_rkey and hostile. The honest stream: `n` bytes of
// Rng(seed), then EOF; the receiver checks every byte and the EOF.
void send_seeded_and_close(rt::Connection& c, size_t n, uint64_t seed) {
  std::vector<char> data(n);
  Rng r(seed);
  fill(r, data.data(), n);
  send_all(c, data.data(), n);
  CHECK(c.shutdown_write().ok(), "shutdown");
  char x;
  CHECK(!recv_all(c, &x, 1), "unexpected data from server");
}

void expect_seeded_then_eof(rt::Connection& c, size_t n, uint64_t seed, const char* what) {
  std::vector<char> want(n), got(n);
  Rng r(seed);
  fill(r, want.data(), n);
  CHECK(recv_all(c, got.data(), n), "%s: EOF early", what);
  CHECK(std::memcmp(want.data(), got.data(), n) == 0, "%s: bytes differ", what);
  char x;
  CHECK(!recv_all(c, &x, 1), "%s: bytes after the end", what);
}

// Drives the attacker's connection until it ends (the victim reset it).
void wait_ended(rt::Connection& c, double secs, const char* what) {
  uint64_t t0 = rsock::now_ns();
  while (c.progress().ok()) {
    CHECK(secs_since(t0) < secs, "%s: still connected after %.0f s", what, secs);
    (void)c.wait(POLLIN, 100);
  }
}

// The server's end of an attacker's connection: it ends (error or EOF)
// within `secs`, never delivering a byte.
void expect_attacker_gone(rt::Connection& a, double secs) {
  uint64_t t0 = rsock::now_ns();
  for (;;) {
    char x;
    iovec v{&x, 1};
    auto rr = a.recv({&v, 1}, false);
    if ((!rr.ok() && rr.error() != EAGAIN) || (rr.ok() && *rr == 0)) return;
    CHECK(!rr.ok(), "attacker's connection delivered a byte");
    CHECK(secs_since(t0) < secs, "attacker's connection still alive after %.0f s", secs);
    (void)a.wait(POLLIN, 100);
  }
}

// Isolation (docs/TRANSPORT.md): a hostile peer with two connections to one
// process aims an RDMA WRITE through its first QP at the receive ring of its
// second connection, with that ring's real address and rkey. The target's
// device refuses it (the rkey belongs to another PD): the attacking
// connection fails with a remote access error, the victim's stream goes on
// byte-exact, and the server process keeps running.
int foreign_rkey_case() {
  Tunables tun = test_tunables();
  constexpr size_t kBytes = 4u << 20;
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto a = accept_one(l);  // the attacker's QP
    auto b = accept_one(l);  // the victim: its ring is the target
    expect_seeded_then_eof(*b, kBytes, 7, "victim stream");
    // The attacker's connection is gone here too (its peer failed or
    // disconnected): recv reports an error or EOF, within a bounded time.
    expect_attacker_gone(*a, 20);
    log_line("foreign_rkey: server: victim stream intact (%zu bytes), attacker's connection ended",
             kBytes);
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    auto a = connect_to(port, tun);
    auto b = connect_to(port, tun);
    auto st = a->debug_write_foreign(*b);
    CHECK(st.ok(), "post: %s", std::strerror(st.ok() ? 0 : st.error()));
    wait_ended(*a, 10, "foreign write not refused:");
    int wc = a->counters().first_wc_error;
    log_line("foreign_rkey: client: foreign write refused: %s",
             ibv_wc_status_str(ibv_wc_status(wc)));
    CHECK(wc == IBV_WC_REM_ACCESS_ERR, "completion %s, want remote access error",
          ibv_wc_status_str(ibv_wc_status(wc)));
    send_seeded_and_close(*b, kBytes, 7);
    return 0;
  };
  return run_pair(server, client, tun, 120);
}

// After c4 closed (kit_reuse_case): both kept kits get a QP made ahead;
// their CQ group places keep its CQ through a CQ trim, and once the kits
// are trimmed (their QPs destroyed, their places given back) it goes.
int check_warm_again(const Tunables& tun) {
  int made = rt::kit_pool::warm(rt::Connection::inline_wanted(tun), 16);
  CHECK(made == 2, "warm made %d QPs for the two kept kits, want 2", made);
  rt::cq_group::trim(0, /*all=*/true);
  CHECK(rt::cq_group::groups() == 1 && count_cqs(getpid()) == 1,
        "%u CQs (kernel: %d) with two kits holding QPs made ahead, want 1",
        rt::cq_group::groups(), count_cqs(getpid()));
  rt::kit_pool::trim(0, /*all=*/true);
  rt::cq_group::trim(0, /*all=*/true);
  CHECK(rt::cq_group::groups() == 0 && count_cqs(getpid()) == 0,
        "%u CQs (kernel: %d) after trimming the kits, want 0", rt::cq_group::groups(),
        count_cqs(getpid()));
  return 0;
}

// ---------------------------------------------------------------- kit_reuse
// Kits of closed connections serve the next ones (transport/kit_pool.h).
// The client opens c1 and an attacker connection a; c1 streams and closes,
// and on the server its kit (PD, registered rings) goes to the pool.
// The client then opens c2, which must get that kit on the server: the
// same receive ring and rkey, behind a new QP. The attacker then writes
// through its own QP at the ring c1's server end had, with c1's rkey: c2's
// ring now. The device must refuse it as for any other connection (the kit
// kept its own PD), and c2's stream must arrive intact. Then the kit of the
// attacker's connection, one that failed, serves c4 on both ends, and every
// byte is checked. Before c4, both ends trim their emptied shared CQ, so
// c4 also runs on a CQ made again for the same group.
// QPs made ahead (kit_pool::warm, as the progress thread's tick does): c1's
// kept kit gets one on both ends, which c2 takes (a fresh QP number all the
// same); c4's kit was not warmed and c4 makes its QP itself. Once c4
// closes, both kept kits (c2's, warmed once before, and c4's) get a QP
// again; their places hold the CQ group until the kits are trimmed.
int kit_reuse_case() {
  Tunables tun = test_tunables();
  constexpr size_t kBytes = 1u << 20;
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto c1 = accept_one(l);
    auto a = accept_one(l);
    CHECK(!c1->reused_kit() && !a->reused_kit(), "a kit reused with an empty pool");
    expect_seeded_then_eof(*c1, kBytes, 31, "c1");
    c1.reset();  // orderly close: its kit goes to the pool
    CHECK(rt::kit_pool::idle() == 1, "%d kits pooled after c1's close, want 1", rt::kit_pool::idle());
    int made = rt::kit_pool::warm(rt::Connection::inline_wanted(tun), 16);
    CHECK(made == 1, "warm made %d QPs for the one kept kit", made);
    auto c2 = accept_one(l);
    CHECK(c2->reused_kit() && c2->qp_made_ahead(),
          "c2 did not take c1's kit with its QP made ahead (reused %d, ahead %d)",
          int(c2->reused_kit()), int(c2->qp_made_ahead()));
    expect_attacker_gone(*a, 20);  // its write was refused
    expect_seeded_then_eof(*c2, kBytes, 32, "c2 (on c1's kit, attacked)");
    c2.reset();
    a.reset();  // failed: its kit is drained and kept too, and is the newest
    // No connection left: the shared CQ goes too (cq_group.h, trim), and
    // c4's join makes the emptied group a new one.
    rt::cq_group::trim(0, /*all=*/true);
    CHECK(rt::cq_group::groups() == 0, "%u CQs after trimming", rt::cq_group::groups());
    auto c4 = accept_one(l);
    CHECK(rt::cq_group::groups() == 1, "%u CQs for c4", rt::cq_group::groups());
    CHECK(c4->reused_kit() && !c4->qp_made_ahead(), "c4: reused %d (%d pooled), QP ahead %d",
          int(c4->reused_kit()), rt::kit_pool::idle(), int(c4->qp_made_ahead()));
    expect_seeded_then_eof(*c4, kBytes, 33, "c4");
    c4.reset();
    CHECK(check_warm_again(tun) == 0, "server");
    log_line("kit_reuse: server: c2 on c1's kit refused the foreign write, c4 on a reused kit "
             "(%llu reused)", (unsigned long long)rt::kit_pool::reused());
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    auto c1 = connect_to(port, tun);
    auto a = connect_to(port, tun);
    // The first rings, before a stream grows them (a grown ring is freed at
    // close; the kit keeps the first one).
    const uint32_t rkey_a = a->debug_peer_ring().second;
    auto [ring, rkey] = c1->debug_peer_ring();
    send_seeded_and_close(*c1, kBytes, 31);  // returns at the server's EOF
    const uint32_t qp1 = c1->qp_num();
    c1.reset();
    usleep(200'000);  // the server's c1 closes after its EOF reached us
    int made = rt::kit_pool::warm(rt::Connection::inline_wanted(tun), 16);
    CHECK(made == 1, "warm made %d QPs for the one kept kit", made);
    auto c2 = connect_to(port, tun);
    CHECK(c2->reused_kit() && c2->qp_made_ahead() && c2->qp_num() != qp1,
          "c2 did not get c1's kit behind a new QP made ahead (reused %d, ahead %d, qp %u, c1's %u)",
          int(c2->reused_kit()), int(c2->qp_made_ahead()), c2->qp_num(), qp1);
    CHECK(c2->debug_peer_ring() == std::make_pair(ring, rkey),
          "c2's server ring is 0x%llx rkey 0x%x, c1's was 0x%llx rkey 0x%x: not the same kit",
          (unsigned long long)c2->debug_peer_ring().first, c2->debug_peer_ring().second,
          (unsigned long long)ring, rkey);
    auto st = a->debug_write_foreign(ring, rkey);
    CHECK(st.ok(), "post: %s", std::strerror(st.ok() ? 0 : st.error()));
    wait_ended(*a, 10, "foreign write at a reused kit not refused:");
    int wc = a->counters().first_wc_error;
    CHECK(wc == IBV_WC_REM_ACCESS_ERR, "completion %s, want remote access error",
          ibv_wc_status_str(ibv_wc_status(wc)));
    send_seeded_and_close(*c2, kBytes, 32);
    c2.reset();
    a.reset();  // failed: its kit is drained and kept too, and is the newest
    rt::cq_group::trim(0, /*all=*/true);  // (as on the server)
    CHECK(rt::cq_group::groups() == 0 && count_cqs(getpid()) == 0, "%u CQs after trimming",
          rt::cq_group::groups());
    auto c4 = connect_to(port, tun);
    CHECK(c4->reused_kit() && !c4->qp_made_ahead(), "c4: reused %d (%d pooled), QP ahead %d",
          int(c4->reused_kit()), rt::kit_pool::idle(), int(c4->qp_made_ahead()));
    CHECK(c4->debug_peer_ring().second == rkey_a,
          "c4's server ring has rkey 0x%x, not the failed connection's 0x%x",
          c4->debug_peer_ring().second, rkey_a);
    send_seeded_and_close(*c4, kBytes, 33);
    c4.reset();
    CHECK(check_warm_again(tun) == 0, "client");
    log_line("kit_reuse: client: foreign write at the reused kit refused: %s; c4 on the failed "
             "connection's kit", ibv_wc_status_str(ibv_wc_status(wc)));
    return 0;
  };
  return run_pair(server, client, tun, 120);
}

// ---------------------------------------------------------------- ring_move
// Rings that grow and shrink (docs/TRANSPORT.md): with 16 KiB first rings
// and 256 KiB grown ones, an 8 MiB stream makes the receiver offer its
// grown ring and the sender follow; 300 ms idle later the receiver moves
// back and its pinned memory returns to what the connection started with;
// a second stream grows it again. Every byte is checked across the moves.
int ring_move_case() {
  Tunables tun = test_tunables();
  tun.ring_min_bytes = 16 * 1024;
  tun.ring_bytes = 256 * 1024;
  tun.ring_idle_ms = 300;
  constexpr size_t kFirst = 8u << 20, kSecond = 4u << 20;
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto c = accept_one(l);
    uint64_t pinned_start = rt::pinned::in_use();
    CHECK(c->gauges().ring_bytes == 16 * 1024, "first ring %u bytes, want 16 KiB", c->gauges().ring_bytes);
    std::vector<char> want(kFirst), got(kFirst);
    Rng r1(21);
    fill(r1, want.data(), kFirst);
    CHECK(recv_all(*c, got.data(), kFirst), "EOF in the first stream");
    CHECK(std::memcmp(want.data(), got.data(), kFirst) == 0, "first stream differs");
    auto k = c->counters();
    CHECK(k.ring_grows == 1, "ring grew %llu times during the first stream, want 1",
          (unsigned long long)k.ring_grows);
    CHECK(c->gauges().ring_bytes == 256 * 1024, "ring %u bytes after the stream, want 256 KiB",
          c->gauges().ring_bytes);
    uint64_t pinned_grown = rt::pinned::in_use();
    // Idle: the ring goes back (the client answers from its wait()).
    uint64_t t0 = rsock::now_ns();
    while (c->counters().ring_shrinks == 0) {
      CHECK(secs_since(t0) < 20, "ring not given back within 20 s of idleness");
      CHECK(c->progress().ok(), "progress");
      (void)c->wait(POLLIN, 50);
    }
    double idle_s = secs_since(t0);
    CHECK(c->gauges().ring_bytes == 16 * 1024, "ring %u bytes after idling, want 16 KiB",
          c->gauges().ring_bytes);
    CHECK(rt::pinned::in_use() == pinned_start, "pinned %llu bytes after idling, %llu at the start",
          (unsigned long long)rt::pinned::in_use(), (unsigned long long)pinned_start);
    log_line("ring_move: server: grew to 256 KiB (pinned %llu -> %llu bytes), back to 16 KiB "
             "%.2f s after the stream (pinned %llu)", (unsigned long long)pinned_start,
             (unsigned long long)pinned_grown, idle_s, (unsigned long long)rt::pinned::in_use());
    char go = 'g';
    send_all(*c, &go, 1);
    expect_seeded_then_eof(*c, kSecond, 22, "second stream");
    CHECK(c->counters().ring_grows == 2, "ring grew %llu times in all, want 2",
          (unsigned long long)c->counters().ring_grows);
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    auto c = connect_to(port, tun);
    std::vector<char> data(kFirst);
    Rng r1(21);
    fill(r1, data.data(), kFirst);
    send_all(*c, data.data(), kFirst);
    char go = 0;
    CHECK(recv_all(*c, &go, 1) && go == 'g', "no go from the server");
    send_seeded_and_close(*c, kSecond, 22);
    auto k = c->counters();
    log_line("ring_move: client: send ring moved %llu times", (unsigned long long)k.send_ring_moves);
    CHECK(k.send_ring_moves == 3, "send ring moved %llu times, want 3 (up, down, up)",
          (unsigned long long)k.send_ring_moves);
    return 0;
  };
  return run_pair(server, client, tun, 300);
}

// ---------------------------------------------------------------- hostile
// A hostile peer (issue 13): after a valid setup it sends one message that
// breaks a rule of the data path (docs/wire-format.md). Only that connection
// is reset: the server sees ECONNRESET on it within a bounded time, while an
// honest connection from the same client, open throughout, delivers its
// 1 MiB byte-exact and the server process goes on. Runs under ASan/UBSan in
// tests/sanitize like every rdma test.
struct HostileCase {
  const char* name;
  rt::Connection::RawKind kind;
  uint32_t imm;
  std::vector<unsigned char> payload;  // sent as is (its length is the message's)
};

std::vector<HostileCase> hostile_cases() {
  namespace w = rsock::transport::wire;
  using K = rt::Connection::RawKind;
  auto credit = [](uint64_t consumed, uint32_t slots) {
    w::CreditBlock cb{consumed, slots, 0};
    std::vector<unsigned char> v(sizeof cb);
    std::memcpy(v.data(), &cb, sizeof cb);
    return v;
  };
  auto ring = [](uint8_t log2) {
    w::RingBlock b{0x10000, 0x1234, log2, {}};
    std::vector<unsigned char> v(sizeof b);
    std::memcpy(v.data(), &b, sizeof b);
    return v;
  };
  const uint32_t ctl = uint32_t(w::Op::kControl) << w::kOpShift;
  return {
      {"credit_past_sent", K::kSend, w::make_imm(w::Op::kCredit, 0), credit(1ull << 40, 0)},
      {"credit_slots_jump", K::kSend, w::make_imm(w::Op::kCredit, 0), credit(0, 100000)},
      {"credit_short", K::kSend, w::make_imm(w::Op::kCredit, 0), std::vector<unsigned char>(8)},
      {"data_over_credit", K::kWrite, w::make_imm(w::Op::kData, (1u << 28) - 1),
       std::vector<unsigned char>(8, 0xee)},
      {"data_as_send", K::kSend, w::make_imm(w::Op::kData, 8), std::vector<unsigned char>(8)},
      // Wire version 3: a DATA that claims another stream position than the
      // receiver's (what a duplicated write completion looks like).
      {"data_misplaced", K::kWrite, w::make_imm(w::Op::kData, 12345),
       std::vector<unsigned char>(8, 0xee)},
      {"control_len_mismatch", K::kSend, ctl | w::control_value(w::ControlType::kApp, 40),
       std::vector<unsigned char>(4)},
      {"control_too_long", K::kSend, ctl | w::control_value(w::ControlType::kApp, 60),
       std::vector<unsigned char>(60)},
      {"control_unknown_type", K::kSend, ctl | (9u << 8), {}},
      {"fin_with_payload", K::kSend, ctl | w::control_value(w::ControlType::kFin, 2),
       std::vector<unsigned char>(2)},
      {"bad_op", K::kSend, 5u << w::kOpShift, std::vector<unsigned char>(4)},
      {"no_immediate", K::kSendNoImm, 0, std::vector<unsigned char>(16)},
      {"oversize_send", K::kSend, ctl | w::control_value(w::ControlType::kApp, 40),
       std::vector<unsigned char>(200)},
      // The ring move (wire version 2): an answer nobody asked for, a ring
      // of an impossible size.
      {"ring_ack_unasked", K::kSend, ctl | w::control_value(w::ControlType::kRingAck, 8),
       std::vector<unsigned char>(8)},
      {"ring_bad_size", K::kSend, ctl | w::control_value(w::ControlType::kRing, 16), ring(40)},
      {"ring_short", K::kSend, ctl | w::control_value(w::ControlType::kRing, 8),
       std::vector<unsigned char>(8, 1)},
  };
}

int hostile_case() {
  Tunables tun = test_tunables();
  constexpr size_t kBytes = 1u << 20;
  const auto cases = hostile_cases();
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto honest = accept_one(l);
    for (const auto& hc : cases) {
      // Accepted without waiting for ESTABLISHED: the hostile message may
      // arrive with it, and then the reset comes during setup.
      std::unique_ptr<rt::Connection> a;
      uint64_t t0 = rsock::now_ns();
      while (!a) {
        auto req = l.next_request();
        if (req.ok()) {
          auto c = l.accept(std::move(req.value()), {});
          CHECK(c.ok(), "%s: accept: %s", hc.name, std::strerror(c.error()));
          a = std::move(c.value());
          break;
        }
        CHECK(secs_since(t0) < 60, "%s: no connect request", hc.name);
        pollfd p{l.fd(), POLLIN, 0};
        poll(&p, 1, 100);
      }
      t0 = rsock::now_ns();
      int err = 0;
      for (;;) {
        auto st = a->progress();
        if (!st.ok()) {
          err = st.error();
          break;
        }
        if (a->established()) {
          char x;
          iovec v{&x, 1};
          auto r = a->recv({&v, 1}, false);
          if (!r.ok() && r.error() != EAGAIN) {
            err = r.error();
            break;
          }
          CHECK(!(r.ok() && *r > 0), "%s: a byte was delivered", hc.name);
          CHECK(!(r.ok() && *r == 0), "%s: EOF instead of a reset", hc.name);
        }
        CHECK(secs_since(t0) < 10, "%s: connection not reset within 10 s", hc.name);
        pollfd p{a->fd(), POLLIN, 0};
        poll(&p, 1, 100);
      }
      CHECK(err == ECONNRESET, "%s: error %s, want ECONNRESET", hc.name, std::strerror(err));
      log_line("hostile: server: %-22s -> connection reset (%.3f s)", hc.name, secs_since(t0));
    }
    expect_seeded_then_eof(*honest, kBytes, 11, "honest stream");
    log_line("hostile: server: %zu hostile connections reset, the honest one delivered %zu bytes",
             cases.size(), kBytes);
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    auto honest = connect_to(port, tun);
    for (const auto& hc : cases) {
      auto a = connect_to(port, tun);
      auto st = a->debug_post_raw(hc.kind, hc.imm, hc.payload.data(), uint32_t(hc.payload.size()));
      CHECK(st.ok(), "%s: post: %s", hc.name, std::strerror(st.ok() ? 0 : st.error()));
      wait_ended(*a, 15, hc.name);  // the server resets it
    }
    send_seeded_and_close(*honest, kBytes, 11);
    return 0;
  };
  return run_pair(server, client, tun, 180);
}

// A peer of wire version 2 (RSOCK_DEBUG_WIRE_MAX on the client, as an older
// librsock offers): DATA's immediate is its length again, both ways, and
// both ends know the version they run.
int old_wire_case() {
  Tunables tun = test_tunables();
  constexpr size_t kBytes = 4u << 20;
  auto server = [&](rt::Listener& l, pid_t) -> int {
    auto c = accept_one(l);
    CHECK(c->wire_version() == 2, "server runs wire version %u, want 2", c->wire_version());
    char go = 0;
    CHECK(recv_all(*c, &go, 1) && go == 'g', "no go from the client");
    Rng r(31);
    std::vector<char> data(kBytes);
    fill(r, data.data(), kBytes);
    send_all(*c, data.data(), kBytes);
    expect_seeded_then_eof(*c, kBytes, 32, "the client's stream");
    return 0;
  };
  auto client = [&](uint16_t port) -> int {
    setenv("RSOCK_DEBUG_WIRE_MAX", "2", 1);
    auto c = connect_to(port, tun);
    CHECK(c->wire_version() == 2, "client runs wire version %u, want 2", c->wire_version());
    char go = 'g';
    send_all(*c, &go, 1);
    std::vector<char> want(kBytes), got(kBytes);
    Rng r(31);
    fill(r, want.data(), kBytes);
    CHECK(recv_all(*c, got.data(), kBytes), "EOF in the server's stream");
    CHECK(std::memcmp(want.data(), got.data(), kBytes) == 0, "the server's stream differs");
    send_seeded_and_close(*c, kBytes, 32);
    log_line("old_wire: wire version 2 both ways, %zu bytes each way exact, %llu DATA received",
             kBytes, (unsigned long long)c->counters().data_recvs);
    return 0;
  };
  return run_pair(server, client, tun, 120);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s stream|slowreader|halfclose|many|bidir|kill_reader_side|kill_writer_side|keepalive|stall|noport|reject|foreign_rkey|hostile|ring_move|kit_reuse|old_wire\n", argv[0]);
    return 2;
  }
  skip_without_device();
  std::string c = argv[1];
  uint64_t t0 = rsock::now_ns();
  int rc = 2;
  if (c == "stream") rc = stream_case();
  else if (c == "slowreader") rc = slowreader_case();
  else if (c == "halfclose") rc = halfclose_case();
  else if (c == "many") rc = many_case();
  else if (c == "bidir") rc = bidir_case();
  else if (c == "kill_reader_side") rc = kill_case(true);
  else if (c == "kill_writer_side") rc = kill_case(false);
  else if (c == "noport") rc = noport_case();
  else if (c == "keepalive") rc = keepalive_case();
  else if (c == "stall") rc = stall_case();
  else if (c == "reject") rc = reject_case();
  else if (c == "foreign_rkey") rc = foreign_rkey_case();
  else if (c == "hostile") rc = hostile_case();
  else if (c == "ring_move") rc = ring_move_case();
  else if (c == "kit_reuse") rc = kit_reuse_case();
  else if (c == "old_wire") rc = old_wire_case();
  std::printf("%s: %s in %.1f s\n", c.c_str(), rc == 0 ? "PASS" : "FAIL", secs_since(t0));
  return rc;
}
