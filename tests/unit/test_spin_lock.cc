// util/spin_lock.h: the bounded lock that a fork child may meet taken.
#include <doctest/doctest.h>

#include <atomic>

#include "util/spin_lock.h"

TEST_CASE("spin_lock_for takes a free lock and gives up on one that stays taken") {
  std::atomic<bool> flag{false};
  CHECK(rsock::spin_lock_for(flag, 4096));
  CHECK(flag.load());
  // As a fork child inherits it from a parent's thread that held it: nobody
  // will let go. The second try returns instead of spinning for ever.
  CHECK_FALSE(rsock::spin_lock_for(flag, 4096));
  CHECK(flag.load());
  rsock::spin_unlock(flag);
  CHECK(rsock::spin_lock_for(flag, 0));
}
