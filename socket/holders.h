// Holders: which processes hold a connection that fork() shared, and how
// many bytes all of them moved on it (docs/DESIGN.md, "Upgrading again in the
// new owner").
//
// A connection handed off at fork() (or still waiting for its rendezvous
// then) is a plain TCP socket in two processes. It may go onto RDMA again
// only in a process that is its only holder, and only from the exact stream
// positions: so every holder counts its TCP bytes into a slot here, and
// drops its holder count when its last fd of the socket closes. The slots
// live in the per-user table below (claim_passed: an image the child execs
// finds them by inode), or, without it, in one MAP_SHARED mapping made before
// the first fork that needs one and inherited by every child (claim; 64 KiB,
// 2048 slots); a process tree whose slots are all taken keeps further shared
// connections on TCP.
//
// A holder that stops counting (it went plain: a shutdown, a wait that ran
// out, a receiver or exec'd image that cannot take part) poisons the slot, and no holder upgrades from it again. A holder
// that dies without closing (_exit, a signal: the kernel closes its fds)
// is found by its pid (kPids of them are kept; a holder past those is only
// counted): the first process to see it gone takes its count off. Lock-free;
// any thread.
#pragma once

#include <atomic>
#include <cstdint>

namespace rsock::socket::holders {

inline constexpr int kPids = 4;

struct Slot {
  std::atomic<int32_t> holders;  // processes holding the socket; 0: free
  std::atomic<int32_t> poisoned;  // some holder moved bytes it did not count
  std::atomic<uint64_t> tx, rx;   // stream positions: bytes each way, by all
  std::atomic<int32_t> pids[kPids];  // holders by pid (0: none), as far as they fit
};

// Before fork(), in the process that forks: a free slot holding one (this
// process) at positions tx/rx; nullptr if none (no mapping, all taken).
Slot* claim(uint64_t tx, uint64_t rx);
// One more holder (the child about to be forked: add; the child names itself
// with enlist once it runs), or one fewer (a fork that failed, a process whose
// last fd closed: release, which frees the slot when the count reaches zero
// and takes this process's pid off).
void add(Slot* s);
void enlist(Slot* s);
void release(Slot* s);
void poison(Slot* s);
inline bool sole(const Slot* s) { return s->holders.load(std::memory_order_acquire) == 1; }
// Takes the counts of holders whose process is gone off the slot (a kill(0)
// per other pid; a pid found alive is trusted for 100 ms, process-wide, so
// that thousands of connections shared with one child, as at a redis
// BGSAVE, cost one syscall per look, not one each). now_ns: CLOCK_MONOTONIC.
// Whether this process is the only holder now.
bool reap(Slot* s, uint64_t now_ns);
inline bool poisoned(const Slot* s) { return s->poisoned.load(std::memory_order_acquire) != 0; }
// Slots in use (tests).
int in_use();

// --- Passed connections (fd passing; docs/DESIGN.md, "Upgrading again in
// the receiver"). A socket sent with SCM_RIGHTS reaches a process that
// shares no memory with the sender (Node's cluster workers are fork+exec'd),
// so these slots live in a per-user named mapping,
// /dev/shm/librsock-held-v1-UID (mode 0600, refused if another user owns it or
// others may write it; 1024 slots, 80 KiB, left for the next
// program), keyed by the socket's inode, which every process holding the
// socket sees alike. Same Slot, same calls as above; only how one is found
// differs.
//
// The sender, before its message goes out: a slot for the socket with
// inode `ino` holding one (this process) at positions tx/rx, its role
// (client: the end that connected); nullptr if the table cannot be had or
// is full. An older slot with the same inode is freed: that socket is gone
// (inodes are reused only after the last close), so nobody holds it.
Slot* claim_passed(uint64_t ino, bool client, uint64_t tx, uint64_t rx);
// The receiver: the slot the sender claimed for the socket with inode
// `ino`, nullptr if none (a sender without librsock, or one that kept it on
// TCP); *client: its role.
Slot* find_passed(uint64_t ino, bool* client);
// Whether `s` is a passed slot (a fork's slot cannot be found by a receiver).
bool is_passed(const Slot* s);
// One holder fewer that never enlisted (a message that did not go out).
void drop(Slot* s);
// exec (docs/DESIGN.md, "Upgrading again after exec"): the image this
// process is about to exec takes the socket in at these fd numbers (at most
// kExecFds are kept). unmark_exec: the exec failed.
inline constexpr int kExecFds = 4;
void mark_exec(Slot* s, const int* fds, int n);
void unmark_exec(Slot* s);
// In the new image, at startup: the next slot its previous image marked,
// from *cursor on (start at 0), taken (unmarked); its inode, role and fd
// numbers (-1: none). nullptr when there are no more.
Slot* take_exec(int* cursor, uint64_t* ino, bool* client, int fds[kExecFds]);

}  // namespace rsock::socket::holders
