// The spin budget a thread learns from its waits (util/adaptive_spin.h):
// long only while most recent waits ended within spin_max_us, never above
// it, back to spin_us soon after the peer goes quiet.
#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "util/adaptive_spin.h"

using rsock::SpinPolicy;

namespace {
constexpr uint32_t kBase = 20, kMax = 200;
constexpr uint64_t kUs = 1000;
}  // namespace

TEST_CASE("adaptive spin: no history, spin_us") {
  SpinPolicy p;
  CHECK(p.budget_us(kBase, kMax) == kBase);
  CHECK(p.budget_us(0, kMax) == 0);
}

TEST_CASE("adaptive spin: waits shorter than spin_max_us buy a spin of twice their length") {
  SpinPolicy p;
  int rounds = 0;
  while (p.budget_us(kBase, kMax) == kBase) {
    p.record(60 * kUs, kMax);
    REQUIRE(++rounds <= 6);  // 6 short waits lift the hit rate past one half
  }
  CHECK(rounds == 6);
  CHECK(p.budget_us(kBase, kMax) == 121);  // 2 x 60 us (+1 for the rounding)
  // Longer short waits: the spin follows, capped at spin_max_us.
  for (int i = 0; i < 50; i++) p.record(150 * kUs, kMax);
  CHECK(p.budget_us(kBase, kMax) == kMax);
  // Very short waits: never below spin_us.
  for (int i = 0; i < 50; i++) p.record(2 * kUs, kMax);
  CHECK(p.budget_us(kBase, kMax) == kBase);
}

TEST_CASE("adaptive spin: a peer that goes quiet is back to spin_us after a few long waits") {
  SpinPolicy p;
  for (int i = 0; i < 100; i++) p.record(100 * kUs, kMax);
  REQUIRE(p.budget_us(kBase, kMax) == kMax);  // 2 x 100 us, capped
  int misses = 0;
  while (p.budget_us(kBase, kMax) != kBase) {
    p.record(5000 * kUs, kMax);  // idle: the spin would only have burnt CPU
    REQUIRE(++misses <= 6);
  }
  CHECK(misses == 6);
  // Half short, half long: the hit rate hovers around one half.
  SpinPolicy q;
  for (int i = 0; i < 100; i++) q.record((i % 2 ? 80 : 3000) * kUs, kMax);
  CHECK(q.hit_rate() >= SpinPolicy::kOne / 2 - 20);
  CHECK(q.hit_rate() <= SpinPolicy::kOne / 2 + 20);
  // Mostly long: spin_us.
  SpinPolicy r;
  for (int i = 0; i < 100; i++) r.record((i % 4 ? 3000 : 80) * kUs, kMax);
  CHECK(r.budget_us(kBase, kMax) == kBase);
}

TEST_CASE("adaptive spin: spin_max_us at or below spin_us fixes the spin (the old behaviour)") {
  SpinPolicy p;
  for (int i = 0; i < 100; i++) p.record(10 * kUs, kMax);
  CHECK(p.budget_us(kBase, kBase) == kBase);
  CHECK(p.budget_us(kBase, 0) == kBase);
  CHECK(p.budget_us(50, 40) == 50);
}

TEST_CASE("adaptive spin: a wait exactly at spin_max_us counts as short, one above as long") {
  SpinPolicy p;
  for (int i = 0; i < 20; i++) p.record(kMax * kUs, kMax);
  CHECK(p.budget_us(kBase, kMax) == kMax);
  SpinPolicy q;
  for (int i = 0; i < 20; i++) q.record(kMax * kUs + 1, kMax);
  CHECK(q.budget_us(kBase, kMax) == kBase);
}

TEST_CASE("adaptive spin: one spinning thread per CPU, one fewer spins longer") {
  using rsock::SpinPlace;
  const int cpus = SpinPlace::cpus();
  REQUIRE(cpus >= 1);
  {
    SpinPlace none(0, kBase);  // no spin asked: no place taken
    CHECK(none.us() == 0);
  }
  {
    // Short spins do not use up the longer ones' places.
    std::vector<std::unique_ptr<SpinPlace>> shorts;
    for (int i = 0; i < cpus - 1; i++) shorts.push_back(std::make_unique<SpinPlace>(kBase, kBase));
    SpinPlace longer(kMax, kBase);
    CHECK(longer.us() == (cpus > 1 ? kMax : kBase));
  }
  // The longer spins: one fewer than the CPUs.
  std::vector<std::unique_ptr<SpinPlace>> held;
  for (int i = 0; i < cpus - 1; i++) {
    held.push_back(std::make_unique<SpinPlace>(kMax, kBase));
    CHECK(held.back()->us() == kMax);
  }
  {
    // The last CPU's place: spin_us, also for a thread that asked for more.
    SpinPlace last(kMax, kBase);
    CHECK(last.us() == kBase);
    // Every CPU has a spinner: the next thread sleeps at once.
    SpinPlace one_too_many(kBase, kBase);
    CHECK(one_too_many.us() == 0);
    SpinPlace longer_too_many(kMax, kBase);
    CHECK(longer_too_many.us() == 0);
  }
  // A place comes free: a spin of spin_us gets it, as a longer one would.
  {
    SpinPlace base(kBase, kBase);
    CHECK(base.us() == kBase);
  }
  if (!held.empty()) {  // (one CPU: never a longer spin)
    held.pop_back();
    SpinPlace again(kMax, kBase);
    CHECK(again.us() == kMax);
  }
  held.clear();
}

TEST_CASE("adaptive spin: a fork child's places are all free") {
  using rsock::SpinPlace;
  const int cpus = SpinPlace::cpus();
  std::vector<std::unique_ptr<SpinPlace>> held;  // the parent's spinning threads at the fork
  for (int i = 0; i < cpus; i++) held.push_back(std::make_unique<SpinPlace>(kMax, kBase));
  {
    SpinPlace none(kBase, kBase);
    CHECK(none.us() == 0);
  }
  SpinPlace::after_fork_child();
  {
    SpinPlace mine(kMax, kBase);
    CHECK(mine.us() == (cpus > 1 ? kMax : kBase));
  }
  // (In a child these would never be released; here they are, below zero:
  // put the counts back where they were before they were taken.)
  held.clear();
  SpinPlace::after_fork_child();
}
