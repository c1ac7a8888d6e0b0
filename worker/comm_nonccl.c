/*
 * comm_nonccl.c: the NCCL entry points of comm.h in a build without CUDA:
 * they fail with a message saying so.
 */
#include "comm.h"
#include "zt_common.h"

int zt_comm_nccl_unique_id(char hex[257]) {
  (void)hex;
  return zt_err("this build has no NCCL backend (CUDA was not found at build time)");
}

int zt_comm_nccl_create(int rank, int world, const char *id_hex, int device, int64_t timeout_ms,
                        zt_comm_t **out) {
  (void)rank, (void)world, (void)id_hex, (void)device, (void)timeout_ms, (void)out;
  return zt_err("this build has no NCCL backend (CUDA was not found at build time)");
}
