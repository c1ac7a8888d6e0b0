/*
 * comm_nonccl.c: the NCCL entry points of comm.h in a build without CUDA:
 * they fail with a message saying so.
 */
#include "comm.h"
#include "comm_backend.h"
#include "zt_common.h"

int zt_comm_nccl_available(void) {
  zt_err("this build has no NCCL backend (CUDA was not found at build time)");
  return 0;
}

int zt_comm_nccl_unique_id(char hex[257]) {
  (void)hex;
  return zt_err("this build has no NCCL backend (CUDA was not found at build time)");
}

int zt_comm_nccl_create(int rank, int world, const char *id_hex, int device, int64_t timeout_ms,
                        zt_comm_t **out) {
  (void)rank, (void)world, (void)id_hex, (void)device, (void)timeout_ms, (void)out;
  return zt_err("this build has no NCCL backend (CUDA was not found at build time)");
}

/* Never reached without NCCL (no communicator ever has an NCCL side), but
 * the front links against them. */
int zt__nccl_all_reduce(struct zt_nccl *n, void *buf, size_t count, zt_dtype_t dt, zt_redop_t op,
                        int64_t timeout_ms) {
  (void)n, (void)buf, (void)count, (void)dt, (void)op, (void)timeout_ms;
  return zt_err("no NCCL backend in this build");
}
int zt__nccl_reduce_scatter(struct zt_nccl *n, void *send, void *recv, size_t count,
                            zt_dtype_t dt, zt_redop_t op, int64_t timeout_ms) {
  (void)n, (void)send, (void)recv, (void)count, (void)dt, (void)op, (void)timeout_ms;
  return zt_err("no NCCL backend in this build");
}
int zt__nccl_all_gather(struct zt_nccl *n, const void *send, void *recv, size_t count,
                        zt_dtype_t dt, int64_t timeout_ms) {
  (void)n, (void)send, (void)recv, (void)count, (void)dt, (void)timeout_ms;
  return zt_err("no NCCL backend in this build");
}
int zt__nccl_broadcast(struct zt_nccl *n, void *buf, size_t count, zt_dtype_t dt, int root,
                       int64_t timeout_ms) {
  (void)n, (void)buf, (void)count, (void)dt, (void)root, (void)timeout_ms;
  return zt_err("no NCCL backend in this build");
}
int zt__nccl_set_stream(struct zt_nccl *n, void *stream) {
  (void)n, (void)stream;
  return zt_err("no NCCL backend in this build");
}
int zt__nccl_reduce_scatter_async(struct zt_nccl *n, void *send, void *recv, size_t count,
                                  zt_dtype_t dt, zt_redop_t op, int64_t timeout_ms,
                                  uint64_t *ticket) {
  (void)n, (void)send, (void)recv, (void)count, (void)dt, (void)op, (void)timeout_ms, (void)ticket;
  return zt_err("no NCCL backend in this build");
}
int zt__nccl_all_gather_async(struct zt_nccl *n, const void *send, void *recv, size_t count,
                              zt_dtype_t dt, int64_t timeout_ms, uint64_t *ticket) {
  (void)n, (void)send, (void)recv, (void)count, (void)dt, (void)timeout_ms, (void)ticket;
  return zt_err("no NCCL backend in this build");
}
int zt__nccl_join(struct zt_nccl *n, uint64_t ticket) {
  (void)n, (void)ticket;
  return zt_err("no NCCL backend in this build");
}
int zt__nccl_progress(struct zt_nccl *n) {
  (void)n;
  return 0;
}
int zt__nccl_settle(struct zt_nccl *n) {
  (void)n;
  return 0;
}
void zt__nccl_abort(struct zt_nccl *n) { (void)n; }
void zt__nccl_destroy(struct zt_nccl *n) { (void)n; }
