// util/stats*: writer + reader in one process, against a private directory.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "util/stats.h"
#include "util/stats_files.h"
#include "util/stats_reader.h"

using namespace rsock::stats;

namespace {

// A fresh stats root per test; stats are re-initialised into it.
struct StatsDir {
  std::string root;
  std::string udir;
  explicit StatsDir(uint32_t initial_slots = 8) {
    char tmpl[] = "/tmp/rsock-unit-stats.XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    root = tmpl;
    udir = files::uid_dir(root, getuid());
    Options o;
    o.exe = "unit";
    o.dir = root;
    o.initial_slots = initial_slots;
    o.unlink_at_exit = true;
    REQUIRE(init(o).ok());
    REQUIRE(enabled());
  }
  ~StatsDir() {
    shutdown();
    std::string cmd = "rm -rf '" + root + "'";
    (void)!system(cmd.c_str());
  }
  ProcessSnapshot read() {
    std::string why;
    auto s = read_process(udir, getpid(), &why);
    INFO(why);
    REQUIRE(s.ok());
    return *s;
  }
};

sockaddr_in v4(const char* ip, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, ip, &a.sin_addr);
  return a;
}

ConnSlot* open_test_conn(int fd) {
  auto l = v4("127.0.0.1", 1000), p = v4("10.1.2.3", 2000);
  return open_conn(fd, Direction::kClient, reinterpret_cast<sockaddr*>(&l), reinterpret_cast<sockaddr*>(&p));
}

// Two connections at fds 7 and 8 (the cases below read them back by fd).
std::pair<ConnSlot*, ConnSlot*> open_two_test_conns() {
  ConnSlot* a = open_test_conn(7);
  ConnSlot* b = open_test_conn(8);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  return {a, b};
}

void write_bytes(const std::string& path, const void* data, size_t n) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, data, n) == static_cast<ssize_t>(n));
  close(fd);
}

}  // namespace

TEST_CASE("stats: disabled means no-ops") {
  shutdown();
  CHECK(process() == nullptr);
  CHECK(open_test_conn(3) == nullptr);
  close_conn(nullptr);
  set_state(nullptr, ConnState::kEstablished);
  set_fallback(nullptr, FallbackReason::kPolicy);
  count_handshake_error();
}

TEST_CASE("stats: write then read a snapshot") {
  StatsDir d;
  auto [a, b] = open_two_test_conns();
  set_upgraded(a, 0x1234, false, 1000, 5000);
  a->add_tx(Transport::kRdma, 100);
  a->add_tx(Transport::kRdma, 50);
  a->add_rx(Transport::kRdma, 10);
  a->add_credit_stall();
  a->set_ring_fill(5, 6);
  set_fallback(b, FallbackReason::kNoDevice);
  set_direction(b, Direction::kServer);  // (as a received socket learns it)
  b->add_tx(Transport::kTcp, 3);
  count_handshake_error();

  ProcessSnapshot s = d.read();
  CHECK(s.pid == getpid());
  CHECK(s.exe == "unit");
  CHECK(s.conns.size() == 2);
  CHECK(s.conns_seen == 2);
  CHECK(s.conns_upgraded == 1);
  CHECK(s.handshake_errors == 1);
  CHECK(s.fallbacks[static_cast<int>(FallbackReason::kNoDevice)] == 1);
  CHECK(s.total.tx_bytes[1] == 150);
  CHECK(s.total.tx_ops[1] == 2);
  CHECK(s.total.rx_bytes[1] == 10);
  CHECK(s.total.tx_bytes[0] == 3);
  CHECK(s.total.credit_stalls == 1);
  const ConnSnapshot& ca = s.conns[0].info.fd == 7 ? s.conns[0] : s.conns[1];
  CHECK(ca.info.qp_num == 0x1234);
  CHECK(ca.info.transport == static_cast<uint8_t>(Transport::kRdma));
  CHECK(ca.send_ring_fill == 5);
  CHECK(format_endpoint(ca.info.family, ca.info.peer_addr, ca.info.peer_port) == "10.1.2.3:2000");
  CHECK(format_endpoint(ca.info.family, ca.info.local_addr, ca.info.local_port) == "127.0.0.1:1000");
  CHECK(ca.info.direction == static_cast<uint8_t>(Direction::kClient));
  const ConnSnapshot& cb = s.conns[0].info.fd == 8 ? s.conns[0] : s.conns[1];
  CHECK(cb.info.direction == static_cast<uint8_t>(Direction::kServer));

  // Closing keeps the traffic in the process totals and frees the slot.
  close_conn(a);
  s = d.read();
  CHECK(s.conns.size() == 1);
  CHECK(s.total.tx_bytes[1] == 150);
  CHECK(s.closed.tx_bytes[1] == 150);
  // The slot is reused, with zeroed counters and a new generation.
  ConnSlot* c = open_test_conn(9);
  CHECK(c == a);
  s = d.read();
  CHECK(s.conns.size() == 2);
  for (auto& conn : s.conns)
    if (conn.info.fd == 9) {
      CHECK(conn.traffic.tx_bytes[1] == 0);
      CHECK(conn.info.generation == 2);
    }
  close_conn(b);
  close_conn(c);
}

TEST_CASE("stats: switch timings per connection and per process") {
  StatsDir d;
  auto [a, b] = open_two_test_conns();
  set_upgraded(a, 1, false, 4000, 30000);
  set_upgraded(b, 2, false, 9000, 50000);
  // b back on RDMA after a reverse switch: its latest switch, not a new upgrade.
  set_upgraded(b, 3, /*again=*/true, 2000, 0);
  set_upgraded(nullptr, 4, true, 500, 0);  // a connection without a slot still counts
  // Longer than a slot's 32 bits of microseconds: clamped there, exact in the sums.
  set_upgraded(nullptr, 5, true, uint64_t{5} << 32, 0);

  ProcessSnapshot s = d.read();
  CHECK(s.switches == 5);
  CHECK(s.switch_us_sum == 4000 + 9000 + 2000 + 500 + (uint64_t{5} << 32));
  CHECK(s.switch_us_max == uint64_t{5} << 32);
  CHECK(s.upgrade_us_sum == 80000);
  CHECK(s.conns_upgraded == 2);
  for (const auto& c : s.conns) {
    if (c.info.fd == 7) {
      CHECK(c.upgrade_us == 30000);
      CHECK(c.switch_us == 4000);
    } else {
      CHECK(c.upgrade_us == 50000);
      CHECK(c.switch_us == 2000);
    }
  }
  set_upgraded(a, 1, true, uint64_t{1} << 40, 0);
  s = d.read();
  for (const auto& c : s.conns)
    if (c.info.fd == 7) CHECK(c.switch_us == UINT32_MAX);
  // Quicker than a microsecond (or a coarse tick) is 1, never "none yet".
  set_upgraded(b, 2, false, 0, 0);
  s = d.read();
  CHECK(s.switch_us_sum == 4000 + 9000 + 2000 + 500 + (uint64_t{5} << 32) + (uint64_t{1} << 40) + 1);
  CHECK(s.upgrade_us_sum == 80001);
  for (const auto& c : s.conns)
    if (c.info.fd == 8) CHECK((c.switch_us == 1 && c.upgrade_us == 1));
  // A reused slot starts with no timings.
  close_conn(a);
  ConnSlot* c = open_test_conn(9);
  CHECK(c == a);
  s = d.read();
  for (const auto& conn : s.conns)
    if (conn.info.fd == 9) {
      CHECK(conn.upgrade_us == 0);
      CHECK(conn.switch_us == 0);
    }
  close_conn(b);
  close_conn(c);
}

TEST_CASE("stats: growth beyond the initial slots chains extension files") {
  StatsDir d(2);
  std::vector<ConnSlot*> slots;
  for (int i = 0; i < 20; ++i) {
    ConnSlot* s = open_test_conn(100 + i);
    REQUIRE(s != nullptr);
    s->add_tx(Transport::kTcp, 1);
    slots.push_back(s);
  }
  ProcessSnapshot s = d.read();
  CHECK(s.conns.size() == 20);
  CHECK(s.conns_untracked == 0);
  CHECK(s.files == 4);  // 2 + 4 + 8 + 16 slots
  CHECK(s.slots == 30);
  CHECK(s.total.tx_bytes[0] == 20);
  CHECK(access((d.udir + "/" + std::to_string(getpid()) + ".3").c_str(), F_OK) == 0);
  for (ConnSlot* c : slots) close_conn(c);
}

TEST_CASE("stats: seqlock gives consistent descriptive fields") {
  StatsDir d;
  ConnSlot* s = open_test_conn(5);
  REQUIRE(s != nullptr);
  std::atomic<bool> stop{false};
  // Each update writes local and peer port together; a torn read would see
  // them differ.
  std::thread writer([&] {
    for (int i = 0; !stop.load(); ++i) {
      auto l = v4("127.0.0.1", static_cast<uint16_t>(i)), p = v4("10.0.0.1", static_cast<uint16_t>(i));
      set_addresses(s, reinterpret_cast<sockaddr*>(&l), reinterpret_cast<sockaddr*>(&p));
      if (i % 16 == 0) std::this_thread::yield();  // real updates are rare; don't starve the reader
    }
  });
  int checked = 0, torn = 0;
  for (int i = 0; i < 2000; ++i) {
    ProcessSnapshot snap = d.read();
    REQUIRE(snap.conns.size() == 1);
    const SlotInfo& in = snap.conns[0].info;
    if (snap.conns[0].torn) {  // allowed under extreme contention, but must be flagged
      ++torn;
      continue;
    }
    if (in.local_port != in.peer_port && !(in.local_port == 1000 && in.peer_port == 2000))
      FAIL("torn slot: local port ", in.local_port, " peer port ", in.peer_port);
    ++checked;
  }
  stop = true;
  writer.join();
  CHECK(checked + torn == 2000);
  CHECK(torn < 100);
  close_conn(s);
}

TEST_CASE("stats: corrupt and foreign segments give clean errors") {
  char tmpl[] = "/tmp/rsock-unit-bad.XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  std::string dir = tmpl;
  int pid = getpid();
  std::string path = files::segment_path(dir, pid, 0);
  std::string why;

  CHECK(read_process(dir, pid, &why).error() == ENOENT);

  char junk[600];
  memset(junk, 'x', sizeof junk);
  write_bytes(path, junk, sizeof junk);
  auto r = read_process(dir, pid, &why);
  CHECK(r.error() == EPROTO);
  CHECK(why.find("not a librsock stats segment (bad magic)") != std::string::npos);

  SegmentHeader h;
  memset(static_cast<void*>(&h), 0, sizeof h);
  h.magic.store(kMagic);
  h.layout_version = 99;
  write_bytes(path, &h, sizeof h);
  r = read_process(dir, pid, &why);
  CHECK(r.error() == EPROTO);
  CHECK(why.find("layout version 99, this rsock-stat reads version " + std::to_string(rsock::stats::kLayoutVersion)) != std::string::npos);

  h.layout_version = kLayoutVersion;
  h.header_size = sizeof(SegmentHeader);
  h.slot_size = sizeof(ConnSlot);
  h.slot_count = 1000;  // claims more than the file holds
  h.pid = pid;
  write_bytes(path, &h, sizeof h);
  r = read_process(dir, pid, &why);
  CHECK(r.error() == EPROTO);
  CHECK(why.find("slot count 1000 does not fit") != std::string::npos);

  h.slot_count = 0;
  h.magic.store(0);  // writer still creating it
  write_bytes(path, &h, sizeof h);
  CHECK(read_process(dir, pid, &why).error() == EAGAIN);

  write_bytes(path, junk, 5);
  CHECK(read_process(dir, pid, &why).error() == EPROTO);
  CHECK(why.find("too short") != std::string::npos);

  unlink(path.c_str());
  rmdir(dir.c_str());
}

TEST_CASE("stats: file names and start time") {
  int pid = 0;
  uint32_t idx = 0;
  CHECK(files::parse_name("1234", &pid, &idx));
  CHECK(pid == 1234);
  CHECK(idx == 0);
  CHECK(files::parse_name("1234.3", &pid, &idx));
  CHECK(idx == 3);
  CHECK_FALSE(files::parse_name("1234.", &pid, &idx));
  CHECK_FALSE(files::parse_name("abc", &pid, &idx));
  CHECK_FALSE(files::parse_name("0", &pid, &idx));
  CHECK_FALSE(files::parse_name("12.0", &pid, &idx));
  CHECK_FALSE(files::parse_name("12.99", &pid, &idx));
  auto st = files::process_start_time(getpid());
  REQUIRE(st.ok());
  CHECK(*st > 0);
  CHECK(files::pid_alive(getpid()));
  // A zombie (exited, unreaped) is dead for our purposes.
  pid_t z = fork();
  if (z == 0) _exit(0);
  for (int i = 0; i < 200 && files::pid_alive(z); ++i) usleep(5000);
  CHECK_FALSE(files::pid_alive(z));
  int status = 0;
  waitpid(z, &status, 0);
  CHECK_FALSE(files::pid_alive(z));
}

TEST_CASE("stats: stale files of dead processes are removed at init") {
  char tmpl[] = "/tmp/rsock-unit-stale.XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  std::string root = tmpl;
  std::string udir = files::uid_dir(root, getuid());
  REQUIRE(mkdir(udir.c_str(), 0700) == 0);
  // A pid that surely is not running: a child we reaped.
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  int status = 0;
  waitpid(dead, &status, 0);
  std::string stale = files::segment_path(udir, dead, 0);
  std::string stale_ext = files::segment_path(udir, dead, 1);
  write_bytes(stale, "x", 1);
  write_bytes(stale_ext, "x", 1);
  Options o;
  o.exe = "unit";
  o.dir = root;
  REQUIRE(init(o).ok());
  CHECK(access(stale.c_str(), F_OK) != 0);
  CHECK(access(stale_ext.c_str(), F_OK) != 0);
  CHECK(access(files::segment_path(udir, getpid(), 0).c_str(), F_OK) == 0);
  shutdown();
  CHECK(access(files::segment_path(udir, getpid(), 0).c_str(), F_OK) != 0);
  rmdir(udir.c_str());
  rmdir(root.c_str());
}
