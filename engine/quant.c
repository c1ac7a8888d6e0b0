/*
 * quant.c: bf16 and block-scaled int8 and int4 encodings of fp32 vectors (see
 * quant.h). Byte order is the machine's (little-endian x86-64 and arm64,
 * the only hosts the ring runs between); a scale is copied with memcpy, so
 * blocks need no alignment.
 */
#include "quant.h"

#include <float.h>
#include <math.h>
#include <string.h>

#define Q8_HEAD 4 /* the fp32 scale before each block's values */

/* A block-scaled integer encoding: values per block, the largest value
 * (the scale is max |x| / qmax) and the bits of one value. */
typedef struct {
  size_t block;
  int qmax, bits;
} qfmt;

static qfmt fmt_of(zt_quant_t q) {
  return q == ZT_QUANT_INT4 ? (qfmt){ZT_Q4_BLOCK, 7, 4} : (qfmt){ZT_Q8_BLOCK, 127, 8};
}

/* Bytes of one block of len values. */
static size_t block_bytes(qfmt f, size_t len) { return Q8_HEAD + (len * (size_t)f.bits + 7) / 8; }

size_t zt_quant_bytes(zt_quant_t q, size_t n) {
  size_t b = n * 4;
  if (q == ZT_QUANT_BF16) b = n * 2;
  if (q == ZT_QUANT_INT8 || q == ZT_QUANT_INT4) {
    qfmt f = fmt_of(q);
    size_t whole = n / f.block, rest = n % f.block;
    b = whole * block_bytes(f, f.block) + (rest ? block_bytes(f, rest) : 0);
  }
  return (b + 1) & ~(size_t)1;
}

/* Value i of a block's packed values (sign-extended). */
static int get_q(qfmt f, const uint8_t *v, size_t i) {
  if (f.bits == 8) return (int8_t)v[i];
  int x = (v[i / 2] >> (4 * (i % 2))) & 0xf;
  return x >= 8 ? x - 16 : x;
}

static void put_q(qfmt f, uint8_t *v, size_t i, int x) {
  if (f.bits == 8) {
    v[i] = (uint8_t)(int8_t)x;
    return;
  }
  if (i % 2 == 0) v[i / 2] = 0;
  v[i / 2] |= (uint8_t)((x & 0xf) << (4 * (i % 2)));
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

static void encode_blocks(qfmt f, const float *x, size_t n, uint8_t *out) {
  const float qmax = (float)f.qmax;
  for (size_t at = 0; at < n; at += f.block) {
    size_t len = n - at < f.block ? n - at : f.block;
    float amax = 0, scale;
    int finite = 1;
    for (size_t i = 0; i < len; i++) {
      finite &= isfinite(x[at + i]);
      amax = fmaxf(amax, fabsf(x[at + i]));
    }
    scale = !finite ? INFINITY : amax / qmax;
    memcpy(out, &scale, Q8_HEAD);
    uint8_t *q = out + Q8_HEAD;
    for (size_t i = 0; i < len; i++) {
      float v = finite && scale > 0 ? rintf(x[at + i] / scale) : 0.0f;
      put_q(f, q, i, (int)(v > qmax ? qmax : v < -qmax ? -qmax : v));
    }
    out += block_bytes(f, len);
  }
}

void zt_quant_encode(zt_quant_t q, const float *x, size_t n, uint8_t *out) {
  size_t bytes = zt_quant_bytes(q, n);
  out[bytes - 1] = 0; /* the pad byte, when there is one */
  if (q == ZT_QUANT_INT8 || q == ZT_QUANT_INT4) {
    encode_blocks(fmt_of(q), x, n, out);
  } else if (q == ZT_QUANT_BF16) {
    for (size_t i = 0; i < n; i++) {
      uint16_t h = to_bf16(x[i]);
      memcpy(out + 2 * i, &h, 2);
    }
  } else {
    memcpy(out, x, n * 4);
  }
}

/* Every block of in, checked. */
static int check_blocks(qfmt f, const uint8_t *in, size_t n, const char *who) {
  const char *name = f.bits == 8 ? "int8" : "int4";
  for (size_t at = 0, b = 0; at < n; at += f.block, b++) {
    size_t len = n - at < f.block ? n - at : f.block;
    float scale;
    memcpy(&scale, in, Q8_HEAD);
    const uint8_t *q = in + Q8_HEAD;
    if (isnan(scale) || scale < 0 || (isfinite(scale) && scale > FLT_MAX / (float)f.qmax))
      return zt_errk(ZT_E_INVALID, "%s block %zu from %s: scale %g is out of range", name, b, who,
                     (double)scale);
    for (size_t i = 0; i < len; i++) {
      int v = get_q(f, q, i);
      if (v < -f.qmax)
        return zt_errk(ZT_E_INVALID, "%s block %zu from %s: value %d at %zu is out of "
                       "range [%d, %d]", name, b, who, v, i, -f.qmax, f.qmax);
      if (isinf(scale) && v != 0)
        return zt_errk(ZT_E_INVALID, "%s block %zu from %s: marked not finite, but value %zu "
                       "is %d", name, b, who, i, v);
    }
    in += block_bytes(f, len);
  }
  return 0;
}

int zt_quant_decode_add(zt_quant_t q, const uint8_t *in, size_t bytes, size_t n, float *acc,
                        const char *who) {
  if (bytes != zt_quant_bytes(q, n))
    return zt_errk(ZT_E_INVALID, "%zu bytes from %s, expected %zu for %zu values", bytes, who,
                   zt_quant_bytes(q, n), n);
  if (q == ZT_QUANT_INT8 || q == ZT_QUANT_INT4) {
    qfmt f = fmt_of(q);
    if (check_blocks(f, in, n, who) != 0) return -1;
    for (size_t at = 0; at < n; at += f.block) {
      size_t len = n - at < f.block ? n - at : f.block;
      float scale;
      memcpy(&scale, in, Q8_HEAD);
      for (size_t i = 0; i < len; i++)
        acc[at + i] += isinf(scale) ? NAN : (float)get_q(f, in + Q8_HEAD, i) * scale;
      in += block_bytes(f, len);
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
