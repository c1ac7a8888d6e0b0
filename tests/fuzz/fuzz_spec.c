/*
 * fuzz_spec.c: the job spec parser (engine/spec.c) and what the scheduler
 * computes from a spec that parses (world sizes, per-rank memory).
 *
 * Input: the spec's JSON text. Property: no crash, no sanitizer report, no
 * leak; a spec that parses has consistent batch numbers (the global batch
 * a multiple of the micro batch, accumulation times ranks times micro batch
 * equal to it) and a memory need that adds up.
 */
#include <stdlib.h>

#include "fuzz_fail.h"
#include "memplan.h"
#include "spec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  zt_spec_t s;
  if (zt_spec_parse(&s, (const char *)data, size) != 0) return 0;
  if (s.global_batch <= 0 || s.global_batch % s.micro_batch != 0) ZT_FUZZ_FAIL();
  if (s.model.n_layer > 64 || (uint64_t)s.model.n_embd * s.model.n_embd > (1ull << 26))
    return 0; /* the layout of a huge model takes too long to be worth it */
  for (int n = 1; n <= 4; n++) {
    int accum;
    if (zt_spec_accum_for_world(&s, n, &accum) == 0 &&
        (long)accum * s.micro_batch * n != s.global_batch)
      ZT_FUZZ_FAIL();
    zt_memplan_need_t need;
    if (zt_memplan_need(&s, n, &need) != 0) continue;
    /* A GPU worker's figures: bf16 storage when the spec asks for it
     * (activations then smaller), else the fp32 ones, plus the fp64 copy a
     * unit's gradient is widened into for NCCL (stages 2-3) and, with
     * overlap_comm, the stream overlap's second slot; a rank's own
     * estimate (zt_memplan_rank) gives the same numbers. */
    uint64_t host0, dev0, acts0, dev_acts;
    if (zt_memplan_rank(&s, n, 0, 4, 0, &host0, &acts0) != 0 ||
        zt_memplan_rank(&s, n, s.overlap_comm, s.bf16 ? 2 : 4, 1, &dev0, &dev_acts) != 0)
      ZT_FUZZ_FAIL();
    if (need.host != ZT_MEMPLAN_BASE_BYTES + need.states + need.activations + need.snapshot ||
        need.device != ZT_MEMPLAN_DEVICE_BASE_BYTES + need.dev_states + need.dev_activations ||
        need.host_with_device != ZT_MEMPLAN_BASE_BYTES + need.states + need.snapshot ||
        need.dev_activations > need.activations || dev0 != need.dev_states ||
        dev_acts != need.dev_activations || acts0 != need.activations || host0 > need.states ||
        (!s.bf16 && (need.dev_activations != need.activations || need.dev_states < host0)))
      ZT_FUZZ_FAIL();
  }
  return 0;
}
