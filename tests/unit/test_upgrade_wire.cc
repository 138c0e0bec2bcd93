// The rendezvous version negotiation (socket/upgrade_wire.h): a server picks
// the highest version both ends speak; 0.1.0 peers (version 1, max_version 0)
// keep working with later releases.
#include <doctest/doctest.h>

#include "socket/upgrade_wire.h"

namespace w = rsock::socket::wire;

namespace {
w::RendezvousRequest req(uint8_t lo, uint8_t hi) {
  w::RendezvousRequest r{};
  r.magic = w::kRendezvousMagic;
  r.version = lo;
  r.max_version = hi;
  return r;
}
}  // namespace

TEST_CASE("rendezvous: versions are negotiated") {
  static_assert(w::kRendezvousMinVersion == 1 && w::kRendezvousVersion == 6);
  // This release talking to itself: the reverse switch, redirects,
  // returned bytes, records that say a failed path and the kernel flag are on.
  CHECK(w::negotiate(req(w::kRendezvousMinVersion, w::kRendezvousVersion)) == 6);
  // A release of version 5 (records that say a failed path; the request's
  // kernel flag unknown to it).
  CHECK(w::negotiate(req(1, 5)) == 5);
  // A release of version 4 (returned bytes, every record "RSOCKDN1").
  CHECK(w::negotiate(req(1, 4)) == 4);
  // A release of version 3 (redirects, no returned bytes).
  CHECK(w::negotiate(req(1, 3)) == 3);
  // A release of version 2 (the reverse switch, no redirect).
  CHECK(w::negotiate(req(1, 2)) == 2);
  // A 0.1.0 client: version 1, max_version 0 (its reserved byte).
  CHECK(w::negotiate(req(1, 0)) == 1);
  // A later client that still speaks 1..8: we answer with our highest.
  CHECK(w::negotiate(req(1, 8)) == 6);
  // A later client that dropped what we speak: no common version.
  CHECK(w::negotiate(req(7, 8)) == 0);
  CHECK(w::negotiate(req(0, 0)) == 0);
  CHECK(w::negotiate(req(2, 1)) == 0);  // nonsense range
  CHECK(w::kRevertVersion == 2);
  CHECK(w::kRedirectVersion == 3);
  CHECK(w::kReturnVersion == 4);
  CHECK(w::kPathRecordVersion == 5);
  CHECK(w::kKernelFlagVersion == 6);
}

TEST_CASE("reverse switch: the record says whether the writer's path failed (version 5)") {
  const char dn[] = "RSOCKDN1", dp[] = "RSOCKDP1", other[] = "RSOCKSW1";
  bool path = true;
  // "RSOCKDN1": a hand-off or a request, in every version with the switch.
  CHECK(w::down_magic(dn, 8, 2, &path));
  CHECK(!path);
  CHECK(w::down_magic(dn, 8, 5, &path));
  CHECK(!path);
  // "RSOCKDP1": the writer's path failed; a stranger's bytes before 5.
  CHECK(w::down_magic(dp, 8, 5, &path));
  CHECK(path);
  CHECK(!w::down_magic(dp, 8, 4, &path));
  CHECK(!w::down_magic(other, 8, 5));
  // The start of either record: look again when the rest is in.
  CHECK(w::down_magic(dp, 6, 4));  // "RSOCKD" is both
  CHECK(w::down_magic(dp, 7, 5));
  CHECK(!w::down_magic(dp, 7, 4));
  CHECK(!w::down_magic(other, 6, 5));
  uint64_t m = 0;
  std::memcpy(&m, dp, 8);
  CHECK(m == w::kDownPathMagic);
  std::memcpy(&m, dn, 8);
  CHECK(m == w::kDownMagic);
}
