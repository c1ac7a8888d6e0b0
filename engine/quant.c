/*
 * quant.c: bf16 and block-scaled int8 encodings of fp32 vectors (see
 * quant.h). Byte order is the machine's (little-endian x86-64 and arm64,
 * the only hosts the ring runs between); a scale is copied with memcpy, so
 * blocks need no alignment.
 */
#include "quant.h"

#include <float.h>
#include <math.h>
#include <string.h>

#define Q8_HEAD 4 /* the fp32 scale before each block's values */

size_t zt_quant_bytes(zt_quant_t q, size_t n) {
  size_t b = n * 4;
  if (q == ZT_QUANT_BF16) b = n * 2;
  if (q == ZT_QUANT_INT8) b = (n + ZT_Q8_BLOCK - 1) / ZT_Q8_BLOCK * Q8_HEAD + n;
  return (b + 1) & ~(size_t)1;
}

static uint16_t to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* a quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}

static void encode_q8(const float *x, size_t n, uint8_t *out) {
  for (size_t at = 0; at < n; at += ZT_Q8_BLOCK) {
    size_t len = n - at < ZT_Q8_BLOCK ? n - at : ZT_Q8_BLOCK;
    float amax = 0, scale;
    int finite = 1;
    for (size_t i = 0; i < len; i++) {
      finite &= isfinite(x[at + i]);
      amax = fmaxf(amax, fabsf(x[at + i]));
    }
    scale = !finite ? INFINITY : amax / 127.0f;
    memcpy(out, &scale, Q8_HEAD);
    int8_t *q = (int8_t *)(out + Q8_HEAD);
    for (size_t i = 0; i < len; i++) {
      float v = finite && scale > 0 ? rintf(x[at + i] / scale) : 0.0f;
      q[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : v);
    }
    out += Q8_HEAD + len;
  }
}

void zt_quant_encode(zt_quant_t q, const float *x, size_t n, uint8_t *out) {
  size_t bytes = zt_quant_bytes(q, n);
  out[bytes - 1] = 0; /* the pad byte, when there is one */
  if (q == ZT_QUANT_INT8) {
    encode_q8(x, n, out);
  } else if (q == ZT_QUANT_BF16) {
    for (size_t i = 0; i < n; i++) {
      uint16_t h = to_bf16(x[i]);
      memcpy(out + 2 * i, &h, 2);
    }
  } else {
    memcpy(out, x, n * 4);
  }
}

/* Every int8 block of in, checked. */
static int check_q8(const uint8_t *in, size_t n, const char *who) {
  for (size_t at = 0, b = 0; at < n; at += ZT_Q8_BLOCK, b++) {
    size_t len = n - at < ZT_Q8_BLOCK ? n - at : ZT_Q8_BLOCK;
    float scale;
    memcpy(&scale, in, Q8_HEAD);
    const int8_t *q = (const int8_t *)(in + Q8_HEAD);
    if (isnan(scale) || scale < 0 || (isfinite(scale) && scale > FLT_MAX / 127.0f))
      return zt_errk(ZT_E_INVALID, "int8 block %zu from %s: scale %g is out of range", b, who,
                     (double)scale);
    for (size_t i = 0; i < len; i++) {
      if (q[i] == -128)
        return zt_errk(ZT_E_INVALID, "int8 block %zu from %s: value -128 at %zu is out of "
                       "range [-127, 127]", b, who, i);
      if (isinf(scale) && q[i] != 0)
        return zt_errk(ZT_E_INVALID, "int8 block %zu from %s: marked not finite, but value %zu "
                       "is %d", b, who, i, q[i]);
    }
    in += Q8_HEAD + len;
  }
  return 0;
}

int zt_quant_decode_add(zt_quant_t q, const uint8_t *in, size_t bytes, size_t n, float *acc,
                        const char *who) {
  if (bytes != zt_quant_bytes(q, n))
    return zt_errk(ZT_E_INVALID, "%zu bytes from %s, expected %zu for %zu values", bytes, who,
                   zt_quant_bytes(q, n), n);
  if (q == ZT_QUANT_INT8) {
    if (check_q8(in, n, who) != 0) return -1;
    for (size_t at = 0; at < n; at += ZT_Q8_BLOCK) {
      size_t len = n - at < ZT_Q8_BLOCK ? n - at : ZT_Q8_BLOCK;
      float scale;
      memcpy(&scale, in, Q8_HEAD);
      const int8_t *v = (const int8_t *)(in + Q8_HEAD);
      for (size_t i = 0; i < len; i++)
        acc[at + i] += isinf(scale) ? NAN : (float)v[i] * scale;
      in += Q8_HEAD + len;
    }
  } else if (q == ZT_QUANT_BF16) {
    for (size_t i = 0; i < n; i++) {
      uint16_t h;
      memcpy(&h, in + 2 * i, 2);
      acc[i] += from_bf16(h);
    }
  } else {
    for (size_t i = 0; i < n; i++) {
      float x;
      memcpy(&x, in + 4 * i, 4);
      acc[i] += x;
    }
  }
  return 0;
}
