// The pinned-memory budget (transport/pinned.h): what an ordinary user's
// 8 MiB RLIMIT_MEMLOCK allows, and that the budget is never overdrawn.
#include <doctest/doctest.h>

#include "transport/pinned.h"

using namespace rsock::transport;

TEST_CASE("pinned: an 8 MiB memlock limit fits 128 upgraded sockets with 16 KiB rings") {
  pinned::set_limit_for_tests(8u << 20);
  CHECK(pinned::budget() == 6u << 20);  // a quarter stays the program's
  uint32_t ring = pinned::ring_bytes_for(512 * 1024);
  CHECK(ring == 16 * 1024);
  uint64_t per = pinned::connection_bytes(ring, 128, 64);
  CHECK(per <= 48 * 1024);  // the per-idle-connection target of issue 11
  uint64_t base = pinned::in_use();
  int n = 0;
  while (pinned::fits(rsock::config::Tunables{}) && pinned::reserve(per)) n++;
  CHECK(n >= 128);
  CHECK(pinned::in_use() <= pinned::budget());
  CHECK_FALSE(pinned::reserve(per));
  CHECK_FALSE(pinned::fits(rsock::config::Tunables{}));
  pinned::release(per * uint64_t(n));
  CHECK(pinned::in_use() == base);
  CHECK(pinned::fits(rsock::config::Tunables{}));
}

TEST_CASE("pinned: the configured ring size without a limit, a smaller one under a larger limit") {
  pinned::set_limit_for_tests(pinned::kUnlimited);
  CHECK(pinned::budget() == pinned::kUnlimited);
  CHECK(pinned::ring_bytes_for(512 * 1024) == 512 * 1024);
  CHECK(pinned::reserve(uint64_t{1} << 40));
  pinned::release(uint64_t{1} << 40);
  pinned::set_limit_for_tests(64u << 20);  // 48 MiB budget: 96 KiB per ring -> 64 KiB
  CHECK(pinned::ring_bytes_for(512 * 1024) == 64 * 1024);
  CHECK(pinned::ring_bytes_for(32 * 1024) == 32 * 1024);  // never above the configured size
  pinned::set_limit_for_tests(pinned::kUnlimited);
}

TEST_CASE("pinned: rings start small and grow within a spare quarter of the budget") {
  rsock::config::Tunables t;
  pinned::set_limit_for_tests(pinned::kUnlimited);
  CHECK(pinned::initial_ring_bytes(t) == 64 * 1024);
  CHECK(pinned::grown_ring_bytes(t) == 512 * 1024);
  pinned::set_limit_for_tests(8u << 20);  // 6 MiB budget
  CHECK(pinned::initial_ring_bytes(t) == 16 * 1024);
  CHECK(pinned::grown_ring_bytes(t) == 256 * 1024);
  uint64_t base = pinned::in_use();
  // reserve_spare keeps a quarter of the budget free; reserve does not.
  uint64_t spare = pinned::budget() - pinned::budget() / 4 - base;
  CHECK(pinned::reserve_spare(spare));
  CHECK_FALSE(pinned::reserve_spare(4096));
  CHECK(pinned::reserve(4096));
  pinned::release(spare + 4096);
  CHECK(pinned::in_use() == base);
  pinned::set_limit_for_tests(pinned::kUnlimited);
}

TEST_CASE("pinned: connections stop taking memory mappings at 7/8 of vm.max_map_count") {
  pinned::set_max_map_count_for_tests(800);  // 700 for librsock: 175 connections
  int n = 0;
  while (pinned::maps_fit() && pinned::take_maps()) n++;
  CHECK(n == 700 / int(pinned::kMapsPerConnection));
  CHECK_FALSE(pinned::take_maps());
  CHECK_FALSE(pinned::maps_fit());
  pinned::give_maps();
  CHECK(pinned::maps_fit());
  CHECK(pinned::take_maps());
  for (int i = 0; i < n; i++) pinned::give_maps();
  pinned::set_max_map_count_for_tests(65530);  // the default: thousands fit
  int m = 0;
  while (m < 10000 && pinned::take_maps()) m++;
  CHECK(m == 10000);
  for (int i = 0; i < m; i++) pinned::give_maps();
  pinned::set_max_map_count_for_tests(0);
}
