// The keepalive period (transport/connection.h): keepalive_ms for a handful
// of connections, then growing with their number so that the process sends
// at most kKeepaliveRate probes a second (10,000 idle connections must not
// keep a CPU busy probing).
#include <doctest/doctest.h>

#include "transport/connection.h"

using namespace rsock::transport;

TEST_CASE("keepalive: keepalive_ms up to keepalive_ms x rate connections, then the rate caps it") {
  constexpr uint64_t kMs = 1000000;
  CHECK(keepalive_period_ns(500, 0) == 500 * kMs);
  CHECK(keepalive_period_ns(500, 1) == 500 * kMs);
  CHECK(keepalive_period_ns(500, 100) == 500 * kMs);  // 200 probes/s
  CHECK(keepalive_period_ns(500, 1000) == 5000 * kMs);
  CHECK(keepalive_period_ns(500, 20000) == 100000 * kMs);
  for (uint64_t n : {1, 10, 100, 101, 1000, 20000, 1000000})
    CHECK(double(n) * 1e9 / double(keepalive_period_ns(500, n)) <= double(kKeepaliveRate));
  CHECK(keepalive_period_ns(0, 20000) == 0);  // keepalive off stays off
  CHECK(keepalive_period_ns(60000, 1000) == 60000 * kMs);
}
