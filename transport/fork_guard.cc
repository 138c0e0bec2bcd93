#include "transport/fork_guard.h"

#include <pthread.h>

namespace rsock::transport::fork_guard {

namespace {
// glibc's default rwlock prefers readers: a thread already inside a region
// may enter another one while fork() waits, without deadlocking.
pthread_rwlock_t g_lock = PTHREAD_RWLOCK_INITIALIZER;
}  // namespace

Shared::Shared() { pthread_rwlock_rdlock(&g_lock); }
Shared::~Shared() { pthread_rwlock_unlock(&g_lock); }

void lock_for_fork() { pthread_rwlock_wrlock(&g_lock); }
void unlock_parent() { pthread_rwlock_unlock(&g_lock); }
void reinit_child() { pthread_rwlock_init(&g_lock, nullptr); }

}  // namespace rsock::transport::fork_guard
