/*
 * store.h: the worker's replica store: checkpoint files over TCP.
 *
 * Every worker runs one, on its ring address (--comm-host) and an
 * ephemeral port it reports at registration. Peers push copies of their
 * checkpoint files into it (PUT) and fetch files from it (GET), one file
 * per connection, each request carrying a ticket the coordinator made for
 * this worker (common/ticket.c), so only members of a job's current
 * generation get anything. Files live under the worker's checkpoint root at
 * the epoch directory the request names (relative), written as name.tmp,
 * fsynced, checked against the declared xxh64, renamed; a PUT that fails
 * any check leaves nothing, and one is answered OK only once the copy is
 * durable and recorded (opts.stored).
 *
 * Wire format (little endian), request:
 *   "ZTS1", op ('P' or 'G'), u16 + ticket, u16 + epoch dir, u16 + file
 *   name, u64 size, 22-byte checksum ("xxh64:" + 16 hex), and for a PUT the
 *   size bytes of the file;
 * reply: u8 status (0 ok; 1 refused: busy, not authorised, a bad request;
 * 2 for a GET: no copy of that file at that size here), u16 + message,
 * and for a GET that succeeded the file's bytes. The client tells these
 * apart (zt_store_get: ZT_E_NOT_FOUND for 2, ZT_E_UNAVAILABLE for 1 or a
 * broken connection, ZT_E_INVALID for bytes that fail the checksum,
 * ZT_E_FAILED for its own disk), so a fetcher knows whether the epoch is
 * bad or only out of reach. Every read and write has a deadline. A connection closed
 * before its first byte is a probe (zt_store_probe) and no error.
 *
 * Nothing from the peer is trusted: the ticket's MAC, expiry (or, for a put
 * ticket without one, that this worker still works on its generation) and scope, the
 * directory's form (exactly <dir>/job_<job>/step_<n>-g<gen> as zt_epoch_parse
 * takes it, under the root, no ".."), the file name's form (zt_epoch_file), the size (at most 1 TiB, and exact) and the
 * checksum are checked, and a refusal names the peer and the file.
 */
#ifndef ZT_STORE_H
#define ZT_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt_io.h"

typedef struct zt_store zt_store_t;

typedef struct {
  const char *host;      /* address to listen on */
  const char *ckpt_root; /* absolute */
  /* The current session credential (tickets are checked with it). */
  void (*session)(void *user, char *buf, size_t n);
  /* The job and generation the worker works on (0, 0: none): a put ticket
   * without an expiry is taken only for those. */
  void (*assignment)(void *user, uint64_t *job, uint64_t *gen);
  /* After a copy was stored by a PUT (durable): dir is relative to the
   * root. Returns 0 once the copy is recorded (reported to the
   * coordinator), or -1 with a message: the PUT is then refused (status
   * 1), so the pusher tries its next target rather than count a copy
   * nobody recorded. The file stays (the report may have arrived though
   * its answer did not); the next registration's inventory counts it or
   * has it deleted. */
  int (*stored)(void *user, uint64_t job, const char *dir, const zt_ckpt_file_t *f);
  void *user;
} zt_store_opts_t;

ZT_MUST_CHECK int zt_store_start(const zt_store_opts_t *o, zt_store_t **out);
/* HOST:PORT of the store. */
const char *zt_store_addr(const zt_store_t *s);
/* Stops accepting, waits for the handlers in flight (at most 66 s: the
 * header's deadline and a transfer's fixed part, which a large file's
 * deadline exceeds by its size at ZT_STORE_MIN_RATE), and frees the store.
 * -1 with a message when some handler still runs after that (a large
 * transfer still within its deadline): the store is then left allocated, and
 * its handlers may still call the opts' callbacks, so the caller must keep
 * whatever those use (the user pointer) alive too, i.e. leak it at exit. */
ZT_MUST_CHECK int zt_store_stop(zt_store_t *s);

/* The slowest pace a transfer may take, in bytes per second. */
#define ZT_STORE_MIN_RATE 20000000ull

/* A client's deadline for moving `bytes`: a fixed part, and the size at
 * ZT_STORE_MIN_RATE. The store gives the data the same pace (and a longer
 * fixed part), so a slow link finishes and a dead one fails. */
int64_t zt_store_transfer_ms(uint64_t bytes);

/* Makes the calling thread's transfers (zt_store_put, zt_store_get) give
 * up within 100 ms once fn(user) returns nonzero, e.g. when the generation
 * they were for is over; NULL: only their deadlines end them. */
void zt_store_abort_when(int (*fn)(void *), void *user);
/* The calling thread's abort condition (fn NULL: none), for a helper
 * thread that works for it to take over with zt_store_abort_when. */
void zt_store_abort_get(int (**fn)(void *), void **user);
/* Pushes the file at `path` (f: its name, size and checksum) as dir/name
 * to the store at addr. */
ZT_MUST_CHECK int zt_store_put(const char *addr, const char *ticket, const char *dir,
                               const char *path, const zt_ckpt_file_t *f, int64_t timeout_ms);
/* Fetches dir/name from the store at addr into `path` (through path.tmp),
 * checking size and checksum against f. The connection must be made
 * within connect_ms (0: the default of 5 s), the whole within timeout_ms. */
ZT_MUST_CHECK int zt_store_get(const char *addr, const char *ticket, const char *dir,
                               const char *path, const zt_ckpt_file_t *f, int64_t connect_ms,
                               int64_t timeout_ms);
/* After the calling thread's zt_store_put or zt_store_get failed: 1 when
 * it never had a connection (the store's machine did not answer in time,
 * or refused), 0 when it failed later. */
int zt_store_unreached(void);

/* What a probe of one store found. */
enum {
  ZT_PROBE_SILENT = 0, /* no answer in time: its machine cannot be reached */
  ZT_PROBE_OK = 1,     /* it accepted */
  ZT_PROBE_REFUSED = 2 /* its machine answered that nothing listens: the zworker is gone */
};

/* Connects to each store at addrs[0..n) at once, within timeout_ms in all,
 * and closes again: reached[i] is a ZT_PROBE_* value for addrs[i]. A store
 * accepts as long as its zworker runs and its machine can be reached, so
 * this tells a rank which peers are cut off from it, and which are gone. */
void zt_store_probe(const char *const *addrs, int n, int64_t timeout_ms, uint8_t *reached);

#endif
