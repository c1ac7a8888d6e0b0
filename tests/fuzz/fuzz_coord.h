/*
 * fuzz_coord.h: one real coordinator inside a fuzzing process.
 *
 * The fuzz targets for the gRPC handlers (fuzz_rpc.c) and the HTTP routes
 * (fuzz_http.c) need a coordinator with state to act on: this builds the
 * real thing (zt_coord: a SQLite file in a temporary directory, the loaded
 * members and jobs, a libuv loop for the work it queues) with one
 * registered worker and one job, and hands requests to the real entry
 * points as in-process calls. Every ZT_FUZZ_RESET inputs it is torn down
 * and built again, so what fuzzed requests accumulate (jobs, events) stays
 * bounded.
 */
#ifndef ZT_FUZZ_COORD_H
#define ZT_FUZZ_COORD_H

#include <stddef.h>
#include <stdint.h>

#include "coord.h"

#define ZT_FUZZ_TOKEN "fuzz-token"
#define ZT_FUZZ_RESET 2000

/* The coordinator for this input (built on first use). */
zt_coord_t *zt_fuzz_coord(void);
/* After each input: runs the loop's queued work, answers held calls. */
void zt_fuzz_coord_done(void);

/* The registered worker's id and session credential. */
uint64_t zt_fuzz_worker_id(void);
const char *zt_fuzz_session(void);

/* One gRPC method through the real dispatcher, as an in-process call;
 * returns the status, and the reply in *resp (malloc'd, may be NULL). */
int zt_fuzz_rpc(const char *method, const uint8_t *req, size_t len, int with_token,
                uint8_t **resp, size_t *resp_len);

#endif
