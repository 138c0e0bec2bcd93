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
  static_assert(w::kRendezvousMinVersion == 1 && w::kRendezvousVersion == 4);
  // This release talking to itself: the reverse switch, redirects and
  // returned bytes are on.
  CHECK(w::negotiate(req(w::kRendezvousMinVersion, w::kRendezvousVersion)) == 4);
  // A release of version 3 (redirects, no returned bytes).
  CHECK(w::negotiate(req(1, 3)) == 3);
  // A release of version 2 (the reverse switch, no redirect).
  CHECK(w::negotiate(req(1, 2)) == 2);
  // A 0.1.0 client: version 1, max_version 0 (its reserved byte).
  CHECK(w::negotiate(req(1, 0)) == 1);
  // A later client that still speaks 1..5: we answer with our highest.
  CHECK(w::negotiate(req(1, 7)) == 4);
  // A later client that dropped what we speak: no common version.
  CHECK(w::negotiate(req(5, 6)) == 0);
  CHECK(w::negotiate(req(0, 0)) == 0);
  CHECK(w::negotiate(req(2, 1)) == 0);  // nonsense range
  CHECK(w::kRevertVersion == 2);
  CHECK(w::kRedirectVersion == 3);
  CHECK(w::kReturnVersion == 4);
}
