/* fork_after_listen ADDR [ROUNDS] -- a process that listen()s and fork()s at
 * once, as a preforking server's master does, must leave its child a working
 * process: the child starts a thread, allocates, creates an rdma_cm-backed
 * listener of its own and exits. Each round runs in a fresh process (a fork
 * child of the test), so that listen() there starts librsock's progress
 * thread anew and the fork lands while that thread is starting up.
 *
 * What it guards: a fork in that window copied the allocator lock held by
 * the starting thread (under AddressSanitizer: its start-up allocates), and
 * the child hung in its first allocation or thread start (socket/progress.cc,
 * ensure_thread and g_loop_mu). Plain glibc forgives it, so the round that
 * can fail is the one under the sanitizers (tests/sanitize/run.sh); the rdma
 * label runs it plain as well. A child that does not finish within 20 s is a
 * hang: reported, killed, and the test fails. Exit 77 without the address. */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void* touch(void* arg) {
  /* Allocations of the sizes a thread's start-up and a program make. */
  for (int i = 0; i < 64; i++) free(malloc((size_t)(16 << (i % 10))));
  return arg;
}

static int listen_on(const char* addr) {
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  if (inet_pton(AF_INET, addr, &a.sin_addr) != 1) return -1;
  int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) return -1;
  if (bind(s, (struct sockaddr*)&a, sizeof a) < 0 || listen(s, 8) < 0) {
    close(s);
    return -1;
  }
  return s;
}

/* Waits up to `sec` seconds for `pid`; its wait status, or -1 (then killed). */
static int wait_bounded(pid_t pid, int sec) {
  for (int ms = 0; ms < sec * 1000; ms += 10) {
    int st;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) return st;
    if (r < 0 && errno != EINTR) return -1;
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return -1;
}

static int worker(const char* addr) {
  pthread_t t;
  if (pthread_create(&t, NULL, touch, NULL) != 0) return 3;
  pthread_join(t, NULL);
  touch(NULL);
  int s = listen_on(addr); /* its own listener (and progress thread) */
  if (s < 0) return 4;
  close(s);
  return 0;
}

static int master(const char* addr) {
  int s = listen_on(addr);
  if (s < 0) return 2;
  pid_t w = fork(); /* at once: the progress thread may still be starting */
  if (w == 0) _exit(worker(addr));
  if (w < 0) return 5;
  int st = wait_bounded(w, 20);
  close(s);
  if (st == -1) return 10; /* the worker hung */
  return WIFEXITED(st) ? WEXITSTATUS(st) : 11;
}

int main(int argc, char** argv) {
  const char* addr = argc > 1 ? argv[1] : "10.77.0.1";
  int rounds = argc > 2 ? atoi(argv[2]) : 40;
  int probe = listen_on(addr);
  if (probe < 0) {
    printf("SKIP: cannot listen on %s: %s\n", addr, strerror(errno));
    return 77;
  }
  close(probe);
  int hung = 0, failed = 0;
  for (int i = 0; i < rounds; i++) {
    pid_t m = fork();
    if (m == 0) _exit(master(addr));
    int st = wait_bounded(m, 40);
    int rc = st == -1 ? 10 : WIFEXITED(st) ? WEXITSTATUS(st) : 11;
    if (rc == 10) hung++;
    else if (rc != 0) failed++;
    if (rc != 0) printf("round %d: %s (%d)\n", i, rc == 10 ? "a child hung" : "failed", rc);
  }
  printf("fork_after_listen: %d rounds, %d hung, %d failed\n", rounds, hung, failed);
  return hung || failed ? 1 : 0;
}
