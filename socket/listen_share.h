// A listening socket shared by the processes a fork made (preforked workers).
//
// The rdma_cm listener, and with it every client's rendezvous request, stays
// with the process that called listen() (the owner), while any process that
// inherited the socket may accept its TCP connections. So the owner and its
// fork children share one table, in MAP_SHARED anonymous memory that the
// owner maps together with its rdma_cm listener and fork passes on:
// - a child that accepts a connection publishes it (client IP and port,
//   server port) with the port of the rdma_cm listener it opened for itself
//   (its "side" listener);
// - the owner, holding a request none of its own sockets matches, finds the
//   connection there and answers with a redirect to that port (transport
//   RejectReason::kRedirect);
// - the client sends the same request there, and the child accepts it.
// docs/DESIGN.md, "fork".
//
// The table also names the process whose rdma_cm listener serves the socket
// (its owner): the one that called listen(), then, once that one exited,
// the child that bound the listener's port again (socket/progress.cc,
// take_over).
//
// Slots are seqlocked (a generation and a phase in one word) so that the
// owner never reads a half-written entry; every field is an atomic, shared
// between processes through the mapping.
#pragma once

#include <sys/socket.h>

#include <cstdint>

namespace rsock::socket::listen_share {

struct Table;

// A new, empty table (nullptr without memory). Never unmapped: children may
// still use it after the owner closed its listener.
Table* create();
// The table of a SO_REUSEPORT group: processes that each listen() on one
// address and port, unrelated by fork, find each other through a named
// shared-memory object, /dev/shm/librsock-rp-UID-ADDR-PORT (one per user:
// the kernel groups SO_REUSEPORT sockets of one user only; mode 0600, and
// refused if another user owns it or others may write it). It stays after
// the group ends (about 12 KiB; the next group on that port reuses it).
// nullptr if it cannot be had.
Table* open_group(const sockaddr* addr, uint16_t port);
// The table of connections passed between processes with SCM_RIGHTS
// (socket/holders.h, claim_passed): a server stream that arrived that way
// and became its only holder publishes its side listener here, and the
// listening socket's owner (the process that passed it, typically) looks
// here too. /dev/shm/librsock-pass-UID, one per user, with the checks of
// open_group; mapped once per process. nullptr if it cannot be had.
Table* open_passed();
// A child that accepted: publishes the connection for ttl_ns from now_ns
// (CLOCK_MONOTONIC, the same in every process). Ports in network order,
// side_port in host order. The slot number, or -1 if the table is full.
int publish(Table* t, const sockaddr* client, uint16_t client_port, uint16_t server_port,
            uint16_t side_port, uint64_t now_ns, uint64_t ttl_ns);
// The child's request arrived (or its connection stays on TCP).
void clear(Table* t, int slot);
// The owner: the side port published for this connection by another
// process, 0 if none (or expired).
uint16_t lookup(const Table* t, const sockaddr* client, uint16_t client_port,
                uint16_t server_port, uint64_t now_ns);
// The owner's pid (0: none recorded).
void set_owner(Table* t, int32_t pid);
int32_t owner(const Table* t);
// Listening sockets inherited across exec (docs/DESIGN.md, "Listeners
// inherited across exec"): the image after an exec shares no memory with
// the owner, so it joins through the port's named table (open_group) even
// without SO_REUSEPORT. The process that execs marks the owner's table
// (mark_exec; a named table is never marked: it is the one the new image
// finds); an owner whose table is marked also looks in the named one for
// connections it did not accept.
void mark_exec(Table* t);
bool exec_marked(const Table* t);

}  // namespace rsock::socket::listen_share
