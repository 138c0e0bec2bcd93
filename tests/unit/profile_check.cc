// The profiling build's counters (util/profile.h with RSOCK_PROFILE): a
// probe that ran is printed by dump() with its count, one that did not is
// not. Its own binary: the rest of the unit tests link the library built
// without the counters, and one program must not mix the two definitions.
#define RSOCK_PROFILE 1
#include "util/profile.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>

int main() {
  using rsock::profile::Probe;
  {
    rsock::profile::Scope a(Probe::kRecv);
  }
  {
    rsock::profile::Scope b(Probe::kRecv);
    rsock::profile::Span s(Probe::kReadWait);
    s.start();
    s.start();  // only the first start counts
  }
  { rsock::profile::Span never(Probe::kSpinTurn); }  // never started: not counted
  int p[2];
  if (pipe(p) != 0) return 2;
  int saved = dup(2);
  dup2(p[1], 2);
  rsock::profile::dump();
  dup2(saved, 2);
  close(p[1]);
  char out[2048] = {};
  ssize_t n = read(p[0], out, sizeof out - 1);
  if (n <= 0) return 2;
  bool ok = strstr(out, "profile: recv      n=2 ") && strstr(out, "profile: read_wait n=1 ") &&
            !strstr(out, "spin_turn") && !strstr(out, "post_send");
  if (!ok) fprintf(stderr, "unexpected profile output:\n%s", out);
  return ok ? 0 : 1;
}
