// Completion queues shared by a process's connections (issue 11).
//
// A CQ per connection cost each connection a verbs object, a mapping of the
// device file (vm.max_map_count) and, per completion event, a channel read
// and a re-arm of its own. Here the connections of one device context share
// CQs in groups: the first group has room for 4 connections, each next one
// twice as many, up to 64 (a process with one connection does not pay for
// a CQ sized for thousands).
//
// Why a CQ never overflows: a connection reserves its worst case
// (send_queue_depth + recv_slots + 1: every WR it can have posted) when it
// joins, and a group takes members only while the sum fits the CQ it made.
//
// Who sees a completion: whoever polls the group's CQ (a connection's owner
// in Connection::poll_cq, or the completion hub's reader after an event,
// on_event) takes everything the CQ holds and files each completion in its
// connection's box (an array the connection owns, as deep as its
// reservation, so it cannot overflow either). A connection that got
// completions from someone else's poll is told so (Connection::
// deliver_cq_event: its cq_notify callback wakes its sleepers), exactly as
// the CQ event of its own CQ told it before; so is a connection whose own
// poll took some (its callback alone), as another thread of the program may
// sleep on it (when its poll says so: `tell_self`). A completion of a QP that is no
// member (it left: its QP is destroyed) is dropped.
//
// Arming, lazily: a CQ raises an event only while some thread sleeps on
// events. Every event costs the kernel a tasklet and a wakeup of the
// channel, and us a channel read and a re-arm (ioctl on rxe): two syscalls
// per request and side while a program is busy, when its own loop would
// find the completions anyway. So an event's arm is not renewed
// (on_event) unless a thread is asleep (inside an ArmedSleep); a thread
// that goes to sleep arms every disarmed group first and drains it
// (ArmedSleep: a completion that landed before the arm is filed by that
// drain, one after it raises an event), and a busy thread finds the
// completions by polling: its own connection's (poll), and everyone's in
// the epoll emulation's harvest and spin (poll_disarmed).
// Why no sleep misses a completion: every sleep that waits for completions
// (the socket layer's blocking waits, poll/select and epoll emulation,
// Connection::wait) is an ArmedSleep; a sleeper raises g_sleeping before it
// looks at what is disarmed, and on_event marks its group disarmed before
// it looks at g_sleeping, so either the sleeper arms the group or
// on_event re-arms it (see cq_group.cc). A sleep that includes the hub's
// fd where no ArmedSleep covers it (the progress thread's watch of an
// epoll set that the application polls, an epoll set without a shadow
// instance) holds every CQ armed for good instead (hold_armed).
// Tunable `cq_lazy_arm` = off (default on) holds them armed from the first
// connection on (the old behaviour).

// Isolation stays per connection: a connection keeps its own PD (its ring's
// rkey is valid only on its own QP, docs/TRANSPORT.md); a CQ carries only
// completions of our own WRs, never the peer's data.
//
// Locking: a group's mutex is taken under a stream's lock (poll_cq, leave,
// and on_event through a progress() that reads the hub), under an epoll
// set's lock (on_event from a harvest) or alone, never under cm_hub::mu();
// it takes cm_hub::mu() inside to call the notify callbacks (those may not
// block or take locks). join and trim take g_mu first (docs/DESIGN.md,
// "Lock order").
//
// Groups are never freed (their pointers are the CQs' cq_context, read by
// the hub after an event), so an event for a group whose members all left
// finds an empty group. A group without members for kIdleNs gives its CQ
// back (trim, from the progress thread's tick: after a spike of 10,000
// connections a server would otherwise keep about 160 CQs, some 300 MiB
// of kernel memory on rxe), and the next join makes it a new one. A kept
// kit's QP made ahead holds a place (kit_pool.h), which keeps the group
// from emptying until the kit is trimmed. A fork child forgets them.
#pragma once

#include <cstdint>

struct ibv_context;
struct ibv_comp_channel;
struct ibv_cq;
struct ibv_wc;
struct ibv_qp;

namespace rsock::transport {
class Connection;
}

namespace rsock::transport::cq_group {

struct Group;

// The most members a group takes (the size of the last groups).
constexpr uint32_t kMaxMembers = 64;

// What a connection reserves: every WR it can have posted (send queue and
// receive slots), plus one.
constexpr uint32_t slots_for(uint32_t sq_depth, uint32_t recv_slots) {
  return sq_depth + recv_slots + 1;
}
// Joins `c` to a group of `ctx` with `slots` completions of room (its box,
// `box`, holds as many), creating one on `ch` when none has room; `*slot`
// is its place in the group, which the calls below take (no search per
// poll). nullptr with errno set when no CQ can be made.
// `c` and `box` may be null: a kept kit holds the place for the QP it made
// ahead (kit_pool::warm), which posts nothing until a connection adopts it.
Group* join(ibv_context* ctx, ibv_comp_channel* ch, uint32_t slots, Connection* c, ibv_wc* box,
            uint32_t* slot);
// The connection `c`, with its box `box` (as deep as the place's slots),
// takes over a place a kit held (join with no connection).
void adopt(Group* g, uint32_t slot, Connection* c, ibv_wc* box);
ibv_cq* cq(const Group* g);
// `c`'s QP has this number now (completions are filed by it).
void set_qp(Group* g, uint32_t slot, uint32_t qp_num);
// `c` leaves: destroys its QP `qp` (if any) under the group's lock, drops
// what that QP left in the CQ, files others'; nothing reaches `c` after this.
void leave(Group* g, uint32_t slot, ibv_qp* qp);
// Up to `max` of `c`'s completions, oldest first; drains the CQ when its box
// is empty. A box still holding some afterwards marks `c`
// (cq_event_pending) so that its owner comes back for them.
// `tell_self`: if the CQ held some of `c`'s, its callback runs too (as
// for the other members), for a caller that announces nothing itself.
int poll(Group* g, uint32_t slot, ibv_wc* out, int max, bool tell_self);
// The completion hub read the group's event: drains, notifies; re-arms
// only while some thread sleeps (see "Arming" above).
void on_event(Group* g);
// A sleep that waits for completion events, as a scope around the sleep
// syscall: on entry, every disarmed group is armed and drained; drained()
// says whether that filed any completion (its connections were told; the
// caller should look again rather than sleep). `on` false: no-op. end()
// closes it right after the sleep syscall (else the destructor does).
class ArmedSleep {
 public:
  explicit ArmedSleep(bool on);
  ~ArmedSleep() { end(); }
  void end();
  ArmedSleep(const ArmedSleep&) = delete;
  ArmedSleep& operator=(const ArmedSleep&) = delete;
  bool drained() const { return drained_; }

 private:
  bool on_;
  bool drained_ = false;
};
// Files what the disarmed groups' CQs hold (user space, no syscall: a
// busy thread's look). Skips a group whose lock another thread holds.
void poll_disarmed();
// Every CQ is disarmed now, so no completion raises an event until some
// thread sleeps (a hint, read without locks).
bool all_disarmed();
// Keeps every CQ armed from now on (see "Arming"); idempotent.
void hold_armed();
// ibv_req_notify_cq calls and events read so far (the exit summary).
uint64_t arms();
uint64_t events();
constexpr uint64_t kIdleNs = 5'000'000'000;
// Destroys the CQs of groups without members for kIdleNs (all of them
// with `all`). Cheap when there is none.
void trim(uint64_t now_ns, bool all = false);
// How many groups hold a CQ now (the exit summary, tests).
uint32_t groups();
// In a fork child: the groups are the parent's; forget them.
void after_fork_child();

}  // namespace rsock::transport::cq_group
