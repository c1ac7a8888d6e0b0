/*
 * cub/device/device_radix_sort.cuh of the CPU stand-in (kernels/cuda/sim/;
 * docs/gpu.md, "The CPU stand-in"). Tests only.
 *
 * cub::DeviceRadixSort::SortPairs with CUB's protocol: a call with
 * d_temp_storage == NULL only sets temp_storage_bytes; a call with storage
 * of at least that size sorts. The sort is a stable sort on bits
 * [begin_bit, end_bit) of the keys (signed and floating-point keys in
 * CUB's order), so its results are CUB's. Every buffer must be device
 * memory; the temporary storage is overwritten (0xff), as CUB would.
 */
#ifndef ZT_SIM_CUB_DEVICE_RADIX_SORT_CUH
#define ZT_SIM_CUB_DEVICE_RADIX_SORT_CUH

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <vector>

#include "zt_sim.h"

namespace cub {

namespace zt_sim_detail {

/* The unsigned image of a key whose order is CUB's order of the key. CUB
 * sorts -0.0 and +0.0 as one key (a stable sort keeps their input order). */
template <typename K>
static inline uint64_t radix_bits(K k) {
  static_assert(std::is_arithmetic<K>::value && sizeof(K) <= 8, "radix sort of this key type");
  typedef typename std::conditional<
      sizeof(K) == 1, uint8_t,
      typename std::conditional<sizeof(K) == 2, uint16_t,
                                typename std::conditional<sizeof(K) == 4, uint32_t,
                                                          uint64_t>::type>::type>::type U;
  U u;
  memcpy(&u, &k, sizeof u);
  const U top = (U)((U)1 << (8 * sizeof(U) - 1));
  if (std::is_floating_point<K>::value && u == top) u = 0; /* -0.0 as +0.0 */
  if (std::is_floating_point<K>::value)
    u = (u & top) ? (U)~u : (U)(u | top);
  else if (std::is_signed<K>::value)
    u = (U)(u ^ top);
  return u;
}

static inline size_t temp_bytes_for(size_t n, size_t key, size_t value) {
  /* Double buffers for keys and values plus room for histograms, rounded
   * like CUB's allocations. */
  return ((n * (key + value) + 4096) + 255) & ~(size_t)255;
}

}  // namespace zt_sim_detail

struct DeviceRadixSort {
  template <typename KeyT, typename ValueT, typename NumItemsT>
  static cudaError_t SortPairs(void *d_temp_storage, size_t &temp_storage_bytes,
                               const KeyT *d_keys_in, KeyT *d_keys_out,
                               const ValueT *d_values_in, ValueT *d_values_out,
                               NumItemsT num_items, int begin_bit = 0,
                               int end_bit = sizeof(KeyT) * 8, cudaStream_t stream = 0) {
    size_t n = num_items > 0 ? (size_t)num_items : 0;
    size_t need = zt_sim_detail::temp_bytes_for(n, sizeof(KeyT), sizeof(ValueT));
    if (!d_temp_storage) {
      temp_storage_bytes = need;
      return cudaSuccess;
    }
    if (temp_storage_bytes < need || begin_bit < 0 || end_bit > (int)(8 * sizeof(KeyT)) ||
        !zt_sim::valid_stream(stream))
      return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    if (zt_sim::capturing(stream)) /* into the graph: the same call at each launch */
      return zt_sim::capture(stream, "cub::DeviceRadixSort::SortPairs", [=](cudaStream_t s) {
        size_t bytes = temp_storage_bytes;
        cudaError_t e = SortPairs(d_temp_storage, bytes, d_keys_in, d_keys_out, d_values_in,
                                  d_values_out, num_items, begin_bit, end_bit, s);
        if (e != cudaSuccess) zt_sim::fatal("graph launch: cub::DeviceRadixSort::SortPairs failed");
      });
    zt_sim::stream_work(stream);
    zt_sim::require_device_memory(d_temp_storage, temp_storage_bytes,
                                  "cub::DeviceRadixSort::SortPairs temporary storage");
    zt_sim::require_device_memory(d_keys_in, n * sizeof(KeyT), "SortPairs d_keys_in");
    zt_sim::require_device_memory(d_keys_out, n * sizeof(KeyT), "SortPairs d_keys_out");
    zt_sim::require_device_memory(d_values_in, n * sizeof(ValueT), "SortPairs d_values_in");
    zt_sim::require_device_memory(d_values_out, n * sizeof(ValueT), "SortPairs d_values_out");
    zt_sim::device_access access("cub::DeviceRadixSort::SortPairs");
    std::vector<KeyT> keys(d_keys_in, d_keys_in + n);
    std::vector<ValueT> values(d_values_in, d_values_in + n);
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), (size_t)0);
    if (end_bit > begin_bit) {
      int width = end_bit - begin_bit;
      uint64_t mask = width >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << width) - 1);
      std::vector<uint64_t> digit(n);
      for (size_t i = 0; i < n; i++)
        digit[i] = (zt_sim_detail::radix_bits(keys[i]) >> begin_bit) & mask;
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return digit[a] < digit[b]; });
    }
    memset(d_temp_storage, 0xff, temp_storage_bytes);
    for (size_t i = 0; i < n; i++) {
      d_keys_out[i] = keys[order[i]];
      d_values_out[i] = values[order[i]];
    }
    return cudaSuccess;
  }
};

}  // namespace cub

#endif
