/* librsock.h -- what a program (or a test) may ask librsock at run time.
 *
 * Nothing here is needed to use librsock: unmodified programs never call it.
 * It lets a program, a test or a debugging session ask which transport a TCP
 * socket is using right now, with a getsockopt() that is harmless without the
 * library (the kernel answers EOPNOTSUPP for the unknown level):
 *
 *   int t; socklen_t len = sizeof t;
 *   if (getsockopt(fd, SOL_RSOCK, RSOCK_TRANSPORT, &t, &len) == 0 && t == RSOCK_TRANSPORT_RDMA)
 *     ... the byte stream of fd runs over an RDMA queue pair ...
 *
 * Plain C, no dependencies: copy it into a program if that is simpler.
 */
#ifndef LIBRSOCK_H
#define LIBRSOCK_H

/* Far above every kernel SOL_* value (those are < 300). */
#define SOL_RSOCK 0x5253 /* "RS" */

/* int, read-only: one of RSOCK_TRANSPORT_*. */
#define RSOCK_TRANSPORT 1

#define RSOCK_TRANSPORT_TCP 0       /* kernel TCP: not eligible, fell back, or not upgraded */
#define RSOCK_TRANSPORT_UPGRADING 1 /* TCP now; the RDMA rendezvous or switch is running */
#define RSOCK_TRANSPORT_RDMA 2      /* both directions run over RDMA; TCP stays idle */
#define RSOCK_TRANSPORT_BROKEN 3    /* the switch failed after it began: the connection was reset */
#define RSOCK_TRANSPORT_REVERTING 4 /* switching back from RDMA to TCP (the reverse switch) */

/* setsockopt, int value ignored: switch this connection back from RDMA to
 * TCP now (the reverse switch, agreed with the peer; no byte is lost or
 * repeated). Succeeds and does nothing if the socket is not on RDMA, except
 * that a connection waiting to upgrade again (after its RDMA path failed)
 * stops waiting. The connection stays on TCP afterwards. */
#define RSOCK_REVERT 2

/* setsockopt, int value ignored, for tests: make this connection's RDMA
 * path fail as a broken link would (its queue pair goes to the error state
 * without telling the peer). librsock then switches it back to TCP. */
#define RSOCK_DEBUG_FAIL_PATH 3

/* int, read-only: why the connection last stayed on, or went back to, TCP;
 * 0 if it never did. The low byte is the fallback reason (the numbers of
 * rsock-stat's reasons, docs/STATS.md: 6 timeout, 7 negative_cache, 14
 * memlock, 16 path_failed, ...); with 5 (rejected), bits 8-15 carry the
 * peer's reject reason. A connection that is on RDMA now may still answer
 * the reason of an earlier fallback (it upgraded again since). */
#define RSOCK_FALLBACK_REASON 4

/* struct rsock_bytes, read-only: the application bytes this connection has
 * sent and received so far over each transport (what rsock-stat shows per
 * connection). ENOPROTOOPT when statistics are off (config `stats = off`). */
#define RSOCK_BYTES 5
struct rsock_bytes {
  unsigned long long tcp_tx, tcp_rx, rdma_tx, rdma_rx;
};

#endif
