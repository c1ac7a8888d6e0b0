/*
 * comm_backend.h: between the communicator front (comm_tcp.c, which also
 * holds the state every backend shares: rank, world, broken flag, first
 * error) and the NCCL backend (comm_nccl.c, built when CUDA is found).
 */
#ifndef ZT_COMM_BACKEND_H
#define ZT_COMM_BACKEND_H

#include "comm.h"

struct zt_nccl;

/* A communicator whose operations go to an NCCL communicator. */
zt_comm_t *zt__comm_wrap(struct zt_nccl *n, int rank, int world);

int zt__nccl_all_reduce(struct zt_nccl *n, void *buf, size_t count, zt_dtype_t dt, zt_redop_t op,
                        int64_t timeout_ms);
int zt__nccl_reduce_scatter(struct zt_nccl *n, void *send, void *recv, size_t count,
                            zt_dtype_t dt, zt_redop_t op, int64_t timeout_ms);
int zt__nccl_all_gather(struct zt_nccl *n, const void *send, void *recv, size_t count,
                        zt_dtype_t dt, int64_t timeout_ms);
int zt__nccl_broadcast(struct zt_nccl *n, void *buf, size_t count, zt_dtype_t dt, int root,
                       int64_t timeout_ms);
/* Stream order (comm.h, zt_comm_set_stream). */
int zt__nccl_set_stream(struct zt_nccl *n, void *stream);
int zt__nccl_reduce_scatter_async(struct zt_nccl *n, void *send, void *recv, size_t count,
                                  zt_dtype_t dt, zt_redop_t op, int64_t timeout_ms,
                                  uint64_t *ticket);
int zt__nccl_all_gather_async(struct zt_nccl *n, const void *send, void *recv, size_t count,
                              zt_dtype_t dt, int64_t timeout_ms, uint64_t *ticket);
int zt__nccl_join(struct zt_nccl *n, uint64_t ticket);
int zt__nccl_progress(struct zt_nccl *n);
int zt__nccl_settle(struct zt_nccl *n);
void zt__nccl_abort(struct zt_nccl *n);
void zt__nccl_destroy(struct zt_nccl *n);

#endif
