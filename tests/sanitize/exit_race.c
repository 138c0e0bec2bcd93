// exit_race [ROUNDS]: main returns while another thread is still in
// librsock's hooks. exit() runs the static destructors (__cxa_finalize)
// while that thread goes on, as it does in any program whose threads are not
// joined at exit (and librsock's progress thread never is). A librsock global
// with a destructor frees its storage under the thread's feet: every
// epoll_create1 here enters a new epoll instance in librsock's list of sets,
// which must still be there. Run under the sanitized librsock (run.sh): ASan
// reports a use after free if any such global is destroyed. The report may
// lose the race with the exit itself (status 0), so each round's stderr is
// read here and a sanitizer report in it fails the run. Prints
// "exit_race: N rounds" and exits 0 when no round had one.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void* churn(void* arg) {
  (void)arg;
  // New epoll fds only (a number seen before reuses its set): until the
  // limit, by which time the process has long exited.
  for (;;)
    if (epoll_create1(EPOLL_CLOEXEC) < 0) pause();
  return NULL;
}

static int one_round(void) {
  int p[2];
  if (pipe(p) != 0) return 1;
  pid_t kid = fork();
  if (kid < 0) return 1;
  if (kid == 0) {
    dup2(p[1], 2);
    close(p[0]);
    close(p[1]);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
      rl.rlim_cur = rl.rlim_max > 65536 ? 65536 : rl.rlim_max;
      setrlimit(RLIMIT_NOFILE, &rl);
    }
    pthread_t t;
    if (pthread_create(&t, NULL, churn, NULL) != 0) _exit(2);
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
    exit(0);  // the destructors run while churn() goes on
  }
  close(p[1]);
  static char out[1 << 16];
  size_t len = 0;
  ssize_t r;
  while (len < sizeof out - 1 && (r = read(p[0], out + len, sizeof out - 1 - len)) > 0) len += (size_t)r;
  close(p[0]);
  out[len] = 0;
  int st = 0;
  if (waitpid(kid, &st, 0) != kid) return 1;
  if (strstr(out, "Sanitizer") || strstr(out, "runtime error")) {
    fputs(out, stderr);
    fprintf(stderr, "exit_race: a sanitizer report at exit\n");
    return 1;
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "exit_race: a round's process ended with status 0x%x\n", st);
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 20;
  for (int i = 0; i < rounds; i++)
    if (one_round() != 0) return 1;
  printf("exit_race: %d rounds\n", rounds);
  return 0;
}
