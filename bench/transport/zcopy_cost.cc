// rsock_zcopy_cost [--sizes 64,1024,16384,65536] [--iters N] -- inside the
// rxe VM: what zero-copy sending would save and what it would cost, per
// message (issue 14, "RDMA-write from the application's buffer above a size
// threshold, if it helps"). librsock copies each write into its registered
// send ring; zero-copy would post from the application's buffer instead,
// which must then be registered (pinned) first. Prints, per size:
//   copy_hot_ns    memcpy of SIZE bytes from one buffer (in cache: a
//                  program's buffer it just wrote) to the next place in a
//                  512 KiB ring, as a write into the send ring
//   copy_cold_ns   the same from a source that rotates through 64 MiB
//   reg_dereg_us   ibv_reg_mr + ibv_dereg_mr of a SIZE-byte buffer (zero-copy
//                  with no registration cache pays this per write)
//   reg_only_us    ibv_reg_mr alone (a cache that keeps registrations pays it
//                  once per buffer, and pins the program's memory against
//                  its RLIMIT_MEMLOCK)
// A benchmark: it measures, never fails on speed; exit 77 without a device.
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000 + uint64_t(ts.tv_nsec);
}

// The median of `runs` timings of `iters` calls of f, in ns per call.
template <class F>
double median_ns(int runs, int iters, F&& f) {
  std::vector<double> v;
  for (int r = 0; r < runs; r++) {
    uint64_t t0 = now_ns();
    for (int i = 0; i < iters; i++) f(i);
    v.push_back(double(now_ns() - t0) / iters);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> sizes{64, 1024, 16384, 65536};
  int iters = 2000;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--sizes" && i + 1 < argc) {
      sizes.clear();
      for (char* s = std::strtok(argv[++i], ","); s; s = std::strtok(nullptr, ","))
        sizes.push_back(std::strtoul(s, nullptr, 10));
    } else {
      std::fprintf(stderr, "usage: rsock_zcopy_cost [--sizes 64,1024,16384] [--iters N]\n");
      return 2;
    }
  }
  int n = 0;
  ibv_device** devs = ibv_get_device_list(&n);
  if (!devs || n == 0) {
    std::printf("SKIP: no RDMA device\n");
    return 77;
  }
  ibv_context* ctx = ibv_open_device(devs[0]);
  ibv_pd* pd = ctx ? ibv_alloc_pd(ctx) : nullptr;
  if (!pd) {
    std::printf("FAIL: cannot open %s or allocate a PD\n", ibv_get_device_name(devs[0]));
    return 1;
  }
  constexpr size_t kPool = 64 << 20;
  constexpr size_t kRing = 512 << 10;  // the default ring_bytes
  auto* pool = static_cast<char*>(mmap(nullptr, kPool, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0));
  auto* dst = static_cast<char*>(mmap(nullptr, kRing + (1 << 20), PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0));
  if (pool == MAP_FAILED || dst == MAP_FAILED) return 1;
  std::memset(pool, 1, kPool);
  std::printf("device %s, %d iterations per run, 5 runs, median\n", ibv_get_device_name(devs[0]), iters);
  std::printf("%8s %12s %13s %13s %12s\n", "size", "copy_hot_ns", "copy_cold_ns", "reg_dereg_us", "reg_only_us");
  for (size_t s : sizes) {
    if (s == 0 || s > (1 << 20)) continue;
    // The destination moves through a ring like the send ring (writes
    // follow one another in it); the source is the same buffer (hot), or
    // one that moves through 64 MiB (cold).
    const size_t ring_slots = std::max<size_t>(kRing / s, 1);
    const size_t slots = kPool / std::max<size_t>(s, 4096);
    double cold = median_ns(5, iters, [&](int i) {
      std::memcpy(dst + (size_t(i) % ring_slots) * s, pool + (size_t(i) * 7919 % slots) * std::max<size_t>(s, 4096), s);
      asm volatile("" ::: "memory");
    });
    double hot = median_ns(5, iters, [&](int i) {
      std::memcpy(dst + (size_t(i) % ring_slots) * s, pool, s);
      asm volatile("" ::: "memory");
    });
    const int reg_iters = std::max(10, iters / 10);
    bool failed = false;
    double rd = median_ns(5, reg_iters, [&](int i) {
      ibv_mr* mr = ibv_reg_mr(pd, pool + (size_t(i) % slots) * std::max<size_t>(s, 4096), s,
                              IBV_ACCESS_LOCAL_WRITE);
      if (!mr) failed = true;
      else ibv_dereg_mr(mr);
    });
    std::vector<ibv_mr*> mrs(size_t(reg_iters), nullptr);
    double ro = median_ns(1, reg_iters, [&](int i) {
      mrs[size_t(i)] = ibv_reg_mr(pd, pool + (size_t(i) % slots) * std::max<size_t>(s, 4096), s,
                                  IBV_ACCESS_LOCAL_WRITE);
      if (!mrs[size_t(i)]) failed = true;
    });
    for (ibv_mr* mr : mrs)
      if (mr) ibv_dereg_mr(mr);
    if (failed) {
      std::printf("%8zu: ibv_reg_mr failed (RLIMIT_MEMLOCK?)\n", s);
      continue;
    }
    std::printf("%8zu %12.0f %13.0f %13.1f %12.1f\n", s, hot, cold, rd / 1000, ro / 1000);
  }
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(devs);
  return 0;
}
