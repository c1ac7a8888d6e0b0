/*
 * quant.h: compressed fp32 vectors for the network: bf16, and int8 with a
 * scale per block (sync.compression, diloco.h).
 *
 * int4: blocks of ZT_Q4_BLOCK values, each its fp32 scale s = max |x| /
 * 7 and the values round(x / s) in [-7, 7], two to a byte (the low
 * nibble first); -8 is refused like int8's -128. Coarse: DiLoCo pairs it
 * with error feedback (diloco.h).
 *
 * int8: blocks of ZT_Q8_BLOCK values, each sent as its fp32 scale s =
 * max |x| / 127 followed by the values round(x / s), in [-127, 127]; the
 * value is q s on arrival, within s / 2 of x. A block holding a value that
 * is not finite is sent with the scale +inf, and arrives as NaN values (the
 * receiver refuses the sum, as it would refuse the uncompressed one).
 * bf16: each value rounded to nearest even in its upper 16 bits.
 *
 * Nothing from the network is trusted: a decode checks the size and every
 * int8 block (a scale that is negative, NaN or so large that q s
 * overflows, an int8 of -128, a block marked not finite whose values are
 * not all zero) and fails with a message naming the block and its sender,
 * before it adds anything. Every 16-bit pattern is some bf16 value (a
 * non-finite one makes the sum non-finite, which the caller refuses).
 */
#ifndef ZT_QUANT_H
#define ZT_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "zt_common.h"

#define ZT_Q8_BLOCK 256
#define ZT_Q4_BLOCK 64

typedef enum { ZT_QUANT_NONE = 0, ZT_QUANT_BF16 = 1, ZT_QUANT_INT8 = 2, ZT_QUANT_INT4 = 3 } zt_quant_t;

/* Bytes of n values encoded (even: a whole number of 16-bit words). */
size_t zt_quant_bytes(zt_quant_t q, size_t n);
/* Encodes x[0, n) into out (zt_quant_bytes(q, n) bytes). */
void zt_quant_encode(zt_quant_t q, const float *x, size_t n, uint8_t *out);
/* Checks in[0, bytes) as n encoded values from `who` (for the message),
 * then adds them to acc[0, n): -1 naming the first bad block, with acc
 * untouched. */
ZT_MUST_CHECK int zt_quant_decode_add(zt_quant_t q, const uint8_t *in, size_t bytes, size_t n,
                                      float *acc, const char *who);

#endif
