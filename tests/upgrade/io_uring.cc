// rsock_io_uring_test ADDR: a program that sets up io_uring keeps its
// connections on kernel TCP (issue 13: io_uring I/O bypasses the hooks).
// Run preloaded inside the RDMA VM (ctest sets LD_PRELOAD); exit 77 "SKIP"
// without an RDMA device or without liburing.so.2.
//
// 1. An in-process connection upgrades (SOL_RSOCK says rdma on both ends);
//    the client sends 256 KiB, the server reads the first 100,000 bytes.
// 2. io_uring_queue_init, looked up as a program linked with liburing finds
//    it (first definition: librsock's hook, then liburing's).
// 3. When it returns, both ends are on TCP, and the kernel socket holds
//    exactly the bytes the program has not read: the server reads them past
//    every hook, one RECV through the ring and the rest with raw recvfrom
//    syscalls, and they are the right bytes. The other direction also works
//    past the hooks (raw sendto, read by the client).
// 4. A new connection stays on TCP; the stats say io_uring for all three.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <linux/io_uring.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "tests/common/inprocess_pair.h"
#include "util/stats.h"
#include "util/stats_reader.h"

using namespace inprocess;

namespace {

unsigned char pattern(size_t i) { return static_cast<unsigned char>((i * 131 + (i >> 9)) & 0xff); }

// recvfrom straight to the kernel: what an io_uring RECV sees.
ssize_t raw_recv(int fd, void* b, size_t n) {
  return syscall(SYS_recvfrom, fd, b, n, 0, nullptr, nullptr);
}

// liburing's API, declared here (no development headers needed): the ring
// structure is opaque to us, sized generously.
using QueueInit = int (*)(unsigned, void*, unsigned);
using GetSqe = io_uring_sqe* (*)(void*);
using Submit = int (*)(void*);
using WaitCqes = int (*)(void*, io_uring_cqe**, unsigned, void*, void*);

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const char* addr = argc > 1 ? argv[1] : "10.77.0.1";
  skip_without_device();
  if (!dlopen("liburing.so.2", RTLD_NOW | RTLD_GLOBAL)) {
    std::printf("SKIP: no liburing.so.2 (%s)\n", dlerror());
    return 77;
  }
  // As a program linked with liburing would call them: the first definition.
  auto queue_init = reinterpret_cast<QueueInit>(dlsym(RTLD_DEFAULT, "io_uring_queue_init"));
  auto get_sqe = reinterpret_cast<GetSqe>(dlsym(RTLD_DEFAULT, "io_uring_get_sqe"));
  auto submit = reinterpret_cast<Submit>(dlsym(RTLD_DEFAULT, "io_uring_submit"));
  auto wait_cqes = reinterpret_cast<WaitCqes>(dlsym(RTLD_DEFAULT, "io_uring_wait_cqes"));
  CHECK(queue_init && get_sqe && submit && wait_cqes, "liburing symbols missing");
  Dl_info di{};
  CHECK(dladdr(reinterpret_cast<void*>(queue_init), &di) && di.dli_fname &&
            std::strstr(di.dli_fname, "librsock"),
        "io_uring_queue_init is not librsock's hook (%s): not preloaded?",
        di.dli_fname ? di.dli_fname : "?");

  Pair p = connect_to_self(addr);
  const int c = p.client, s = p.server;
  await_rdma(c, s);
  constexpr size_t kTotal = 256 * 1024, kFirst = 100000;
  std::vector<unsigned char> out(kTotal), in(kTotal);
  for (size_t i = 0; i < kTotal; i++) out[i] = pattern(i);
  // 256 KiB fits in the RDMA ring and in the kernel's buffers: no deadlock
  // writing it all before anyone reads.
  for (size_t done = 0; done < kTotal;) {
    ssize_t k = write(c, out.data() + done, kTotal - done);
    CHECK(k > 0, "write: %s", std::strerror(errno));
    done += size_t(k);
  }
  for (size_t got = 0; got < kFirst;) {
    ssize_t k = read(s, in.data() + got, kFirst - got);
    CHECK(k > 0, "read: %s", k < 0 ? std::strerror(errno) : "EOF");
    got += size_t(k);
  }
  std::printf("io_uring: on RDMA, %zu of %zu bytes read through the hooks\n", kFirst, kTotal);

  alignas(64) static unsigned char ring[4096];
  int r = queue_init(8, ring, 0);
  CHECK(r == 0, "io_uring_queue_init: %s", std::strerror(-r));
  CHECK(transport_of(c) == RSOCK_TRANSPORT_TCP && transport_of(s) == RSOCK_TRANSPORT_TCP,
        "after io_uring_queue_init: transports %d %d, want tcp", transport_of(c), transport_of(s));

  // The rest, past every hook: first one RECV through the ring.
  size_t got = kFirst;
  io_uring_sqe* sqe = get_sqe(ring);
  CHECK(sqe, "no sqe");
  std::memset(sqe, 0, sizeof *sqe);
  sqe->opcode = IORING_OP_RECV;
  sqe->fd = s;
  sqe->addr = reinterpret_cast<uint64_t>(in.data() + got);
  sqe->len = uint32_t(kTotal - got);
  sqe->user_data = 42;
  CHECK(submit(ring) == 1, "io_uring_submit");
  io_uring_cqe* cqe = nullptr;
  r = wait_cqes(ring, &cqe, 1, nullptr, nullptr);
  CHECK(r == 0 && cqe && cqe->user_data == 42, "io_uring_wait_cqes: %d", r);
  CHECK(cqe->res > 0, "io_uring RECV: %s", cqe->res < 0 ? std::strerror(-cqe->res) : "EOF");
  size_t via_ring = size_t(cqe->res);
  got += via_ring;
  while (got < kTotal) {
    ssize_t k = raw_recv(s, in.data() + got, kTotal - got);
    CHECK(k > 0, "raw recvfrom: %s", k < 0 ? std::strerror(errno) : "EOF");
    got += size_t(k);
  }
  for (size_t i = 0; i < kTotal; i++)
    CHECK(in[i] == out[i], "byte %zu is 0x%02x, want 0x%02x", i, in[i], out[i]);
  std::printf("io_uring: back on TCP; the kernel socket held the %zu unread bytes in order "
              "(%zu through an io_uring RECV)\n",
              kTotal - kFirst, via_ring);

  // The other direction, past the hooks too.
  const char reply[] = "reply over kernel TCP";
  CHECK(syscall(SYS_sendto, s, reply, sizeof reply, 0, nullptr, 0) == ssize_t(sizeof reply),
        "raw sendto");
  char back[sizeof reply] = {};
  for (size_t k = 0; k < sizeof reply;) {
    ssize_t n = read(c, back + k, sizeof reply - k);
    CHECK(n > 0, "read reply");
    k += size_t(n);
  }
  CHECK(std::memcmp(back, reply, sizeof reply) == 0, "reply differs");

  // New connections stay on TCP.
  int c2 = socket(AF_INET, SOCK_STREAM, 0);
  CHECK(connect(c2, reinterpret_cast<sockaddr*>(&p.addr), sizeof p.addr) == 0, "connect: %s",
        std::strerror(errno));
  int s2 = accept(p.listener, nullptr, nullptr);
  CHECK(s2 >= 0, "accept: %s", std::strerror(errno));
  sleep_ms(1500);
  CHECK(transport_of(c2) == RSOCK_TRANSPORT_TCP && transport_of(s2) == RSOCK_TRANSPORT_TCP,
        "a connection made after io_uring upgraded (transports %d %d)", transport_of(c2),
        transport_of(s2));

  // Each connection says why itself (getsockopt RSOCK_FALLBACK_REASON).
  for (int fd : {c, s, c2, s2}) {
    int why = -1;
    socklen_t wl = sizeof why;
    CHECK(getsockopt(fd, SOL_RSOCK, RSOCK_FALLBACK_REASON, &why, &wl) == 0 &&
              why == int(rsock::stats::FallbackReason::kIoUring),
          "fd %d: RSOCK_FALLBACK_REASON %d, want %d (io_uring)", fd, why,
          int(rsock::stats::FallbackReason::kIoUring));
  }

  std::string dir = rsock::stats::default_root_dir() + "/" + std::to_string(getuid());
  std::string why;
  auto snap = rsock::stats::read_process(dir, getpid(), &why);
  CHECK(snap, "stats: %s", why.c_str());
  uint64_t n = snap->fallbacks[int(rsock::stats::FallbackReason::kIoUring)];
  std::printf("io_uring: fallbacks.io_uring = %llu\n", (unsigned long long)n);
  // c and s switched back, c2 and s2 never upgraded.
  CHECK(n == 4, "fallbacks.io_uring = %llu, want 4", (unsigned long long)n);
  std::printf("io_uring: PASS\n");
  return 0;
}
