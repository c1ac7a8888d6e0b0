/*
 * comm_nonccl.c: the NCCL entry points of comm.h in a build without CUDA
 * (comm/CMakeLists.txt compiles it instead of comm_nccl.c): they fail with
 * a message saying so. No communicator of such a build ever uses the NCCL
 * table, so these three are all it needs; a worker of such a build
 * with a GPU says at start-up that it has no NCCL and registers without
 * it (zt_comm_nccl_available), so its generations use the TCP ring.
 */
#include "comm.h"
#include "zt_common.h"

#define NO_NCCL "this build has no NCCL backend (CUDA was not found at build time)"

int zt_comm_nccl_available(void) {
  zt_err(NO_NCCL);
  return 0;
}

int zt_comm_nccl_unique_id(char hex[257]) {
  (void)hex;
  return zt_err(NO_NCCL);
}

int zt_comm_nccl_create(int rank, int world, const char *id_hex, int device, int64_t timeout_ms,
                        zt_comm_t **out) {
  (void)rank, (void)world, (void)id_hex, (void)device, (void)timeout_ms, (void)out;
  return zt_err(NO_NCCL);
}
