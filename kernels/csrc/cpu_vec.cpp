// Fused load / gather for vLLM's CPU_VEC paged KV cache, one pass over the data.
//
// Page layout, per (block, head): K transposed ([D][block_size]) then V as rows ([block_size][D]).
// A load computes, per token and head, round(R x + p) with R the RoPE re-rotation of the band
// [lo, lo + rot_dim) and p an optional precomputed fp32 patch product row, exactly as the torch
// reference (kernels/relocate.py rotate_and_patch) does:
//   x1' = fp32(x1*c) - fp32(x2*s),  x2' = fp32(x2*c) + fp32(x1*s)   (two rounded products, one
//   rounded sum: this file must be compiled with -ffp-contract=off so no FMA fuses them),
//   then + p (one rounded fp32 add), then one round-to-nearest-even to the cache dtype.
// Features outside the band with no patch are copied bit for bit.
//
// Work is split over (run, head) items, a run being tokens on consecutive slots of one block; each
// output element is computed by the same arithmetic whatever the thread count, so the bytes do not
// depend on it. Rows are formed token-major in a small per-thread buffer (in L1), then transposed
// into the page in 8x8 tiles.

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "rows.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using namespace orbitkv_rows;

struct Geometry {
  int64_t num_blocks, num_heads, block_size, head_dim;
  int64_t stride_block, stride_head;  // elements; a page is contiguous within (block, head)
};

// 8x8 transpose of 16-bit elements: dst[c][r] = src[r][c] (strides in elements).
inline void transpose8x8_u16(const uint16_t* src, int64_t src_stride, uint16_t* dst,
                             int64_t dst_stride) {
#if defined(__SSE2__)
  __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 0 * src_stride));
  __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 1 * src_stride));
  __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * src_stride));
  __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 3 * src_stride));
  __m128i r4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 4 * src_stride));
  __m128i r5 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 5 * src_stride));
  __m128i r6 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 6 * src_stride));
  __m128i r7 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 7 * src_stride));
  __m128i a0 = _mm_unpacklo_epi16(r0, r1), a1 = _mm_unpackhi_epi16(r0, r1);
  __m128i a2 = _mm_unpacklo_epi16(r2, r3), a3 = _mm_unpackhi_epi16(r2, r3);
  __m128i a4 = _mm_unpacklo_epi16(r4, r5), a5 = _mm_unpackhi_epi16(r4, r5);
  __m128i a6 = _mm_unpacklo_epi16(r6, r7), a7 = _mm_unpackhi_epi16(r6, r7);
  __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 0 * dst_stride), _mm_unpacklo_epi64(b0, b4));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 1 * dst_stride), _mm_unpackhi_epi64(b0, b4));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * dst_stride), _mm_unpacklo_epi64(b1, b5));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 3 * dst_stride), _mm_unpackhi_epi64(b1, b5));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 4 * dst_stride), _mm_unpacklo_epi64(b2, b6));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 5 * dst_stride), _mm_unpackhi_epi64(b2, b6));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 6 * dst_stride), _mm_unpacklo_epi64(b3, b7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 7 * dst_stride), _mm_unpackhi_epi64(b3, b7));
#else
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 8 rows x 32 columns of 16-bit elements, transposed: dst[c][0..8) = src[0..8)[c]. The unpack
// stages work within 128-bit lanes, so one pass transposes the four 8x8 tiles of the 8x32 block.
inline void transpose8x32_u16(const uint16_t* src, int64_t src_stride, uint16_t* dst,
                              int64_t dst_stride) {
  __m512i r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  __m512i a[8], b[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm512_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    b[4 * i + 0] = _mm512_unpacklo_epi32(a[4 * i + 0], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi32(a[4 * i + 0], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi32(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi32(a[4 * i + 1], a[4 * i + 3]);
  }
  // Within each lane, row j of the 8x8 tile is the column (8 * lane + j) of the block.
  __m512i c[8];
  for (int i = 0; i < 4; ++i) {
    c[2 * i] = _mm512_unpacklo_epi64(b[i], b[4 + i]);
    c[2 * i + 1] = _mm512_unpackhi_epi64(b[i], b[4 + i]);
  }
  for (int j = 0; j < 8; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (0 + j) * dst_stride),
                     _mm512_castsi512_si128(c[j]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (8 + j) * dst_stride),
                     _mm512_extracti32x4_epi32(c[j], 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (16 + j) * dst_stride),
                     _mm512_extracti32x4_epi32(c[j], 2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (24 + j) * dst_stride),
                     _mm512_extracti32x4_epi32(c[j], 3));
  }
}
#define ORBITKV_WIDE_TRANSPOSE 1
#else
#define ORBITKV_WIDE_TRANSPOSE 0
#endif

// 4x4 transpose of 32-bit elements.
inline void transpose4x4_u32(const uint32_t* src, int64_t src_stride, uint32_t* dst,
                             int64_t dst_stride) {
#if defined(__SSE2__)
  __m128 r0 = _mm_loadu_ps(reinterpret_cast<const float*>(src + 0 * src_stride));
  __m128 r1 = _mm_loadu_ps(reinterpret_cast<const float*>(src + 1 * src_stride));
  __m128 r2 = _mm_loadu_ps(reinterpret_cast<const float*>(src + 2 * src_stride));
  __m128 r3 = _mm_loadu_ps(reinterpret_cast<const float*>(src + 3 * src_stride));
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + 0 * dst_stride), r0);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + 1 * dst_stride), r1);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + 2 * dst_stride), r2);
  _mm_storeu_ps(reinterpret_cast<float*>(dst + 3 * dst_stride), r3);
#else
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
#endif
}

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols (bit copies).
template <typename E>
void transpose(const E* src, int64_t src_stride, E* dst, int64_t dst_stride, int64_t rows,
               int64_t cols) {
  constexpr int64_t kTile = sizeof(E) == 2 ? 8 : 4;
  int64_t r0 = 0;
  for (; r0 + kTile <= rows; r0 += kTile) {
    int64_t c0 = 0;
#if ORBITKV_WIDE_TRANSPOSE
    if constexpr (sizeof(E) == 2) {
      for (; c0 + 32 <= cols; c0 += 32)
        transpose8x32_u16(reinterpret_cast<const uint16_t*>(src + r0 * src_stride + c0),
                          src_stride, reinterpret_cast<uint16_t*>(dst + c0 * dst_stride + r0),
                          dst_stride);
    }
#endif
    for (; c0 + kTile <= cols; c0 += kTile) {
      if constexpr (sizeof(E) == 2) {
        transpose8x8_u16(reinterpret_cast<const uint16_t*>(src + r0 * src_stride + c0), src_stride,
                         reinterpret_cast<uint16_t*>(dst + c0 * dst_stride + r0), dst_stride);
      } else {
        transpose4x4_u32(reinterpret_cast<const uint32_t*>(src + r0 * src_stride + c0), src_stride,
                         reinterpret_cast<uint32_t*>(dst + c0 * dst_stride + r0), dst_stride);
      }
    }
    for (; c0 < cols; ++c0)
      for (int64_t r = r0; r < r0 + kTile; ++r) dst[c0 * dst_stride + r] = src[r * src_stride + c0];
  }
  for (; r0 < rows; ++r0)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_stride + r0] = src[r0 * src_stride + c];
}

#if ORBITKV_BF16_FAST
// 16 fp32 lanes to 16 bf16 (as store_bf16x16), kept in a register.
inline __m256i to_bf16x16(__m512 x) {
  if (_mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80) == 0) return (__m256i)_mm512_cvtneps_pbh(x);
  alignas(32) uint16_t tmp[16];
  store_bf16x16(tmp, x);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
}

// rows[r] holds features [0, 16) of token r (r < 8); writes feature f of the 8 tokens to
// dst + f * dst_stride (16 bytes each). In-lane unpacks: lane 0 carries features 0-7, lane 1 8-15.
inline void store_transposed_8x16(const __m256i* rows, uint16_t* dst, int64_t dst_stride) {
  __m256i a[8], b[8], c[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_epi16(rows[2 * i], rows[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_epi16(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    b[4 * i + 0] = _mm256_unpacklo_epi32(a[4 * i + 0], a[4 * i + 2]);
    b[4 * i + 1] = _mm256_unpackhi_epi32(a[4 * i + 0], a[4 * i + 2]);
    b[4 * i + 2] = _mm256_unpacklo_epi32(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm256_unpackhi_epi32(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    c[2 * i] = _mm256_unpacklo_epi64(b[i], b[4 + i]);
    c[2 * i + 1] = _mm256_unpackhi_epi64(b[i], b[4 + i]);
  }
  for (int j = 0; j < 8; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * dst_stride), _mm256_castsi256_si128(c[j]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (8 + j) * dst_stride),
                     _mm256_extracti128_si256(c[j], 1));
  }
}

// K rows of 8 consecutive tokens (bf16, neox, the whole row rotated, no patch), rotated and written
// straight into their page columns: no staging buffer, no separate transpose pass. One check per
// 16 features of 8 tokens sends a group holding a denormal or NaN to the exact scalar rounding.
template <bool kPerToken>
inline void rotate8_bf16_neox_to_page(const uint16_t* __restrict x, int64_t row_stride,
                                      int64_t half, const float* c, const float* s,
                                      int64_t cos_stride, uint16_t* __restrict page,
                                      int64_t block_size) {
  for (int64_t i = 0; i < half; i += 16) {
    __m512 o1[8], o2[8];
    __mmask16 special = 0;
    __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
    for (int r = 0; r < 8; ++r) {
      if constexpr (kPerToken) {
        cv = _mm512_loadu_ps(c + r * cos_stride + i);
        sv = _mm512_loadu_ps(s + r * cos_stride + i);
      }
      const uint16_t* xr = x + r * row_stride;
      const __m512 x1 = load_bf16x16(xr + i), x2 = load_bf16x16(xr + half + i);
      o1[r] = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
      o2[r] = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
      special |= _mm512_fpclass_ps_mask(o1[r], 0x01 | 0x20 | 0x80);
      special |= _mm512_fpclass_ps_mask(o2[r], 0x01 | 0x20 | 0x80);
    }
    __m256i b1[8], b2[8];
    if (special == 0) {
      for (int r = 0; r < 8; ++r) {
        b1[r] = (__m256i)_mm512_cvtneps_pbh(o1[r]);
        b2[r] = (__m256i)_mm512_cvtneps_pbh(o2[r]);
      }
    } else {
      for (int r = 0; r < 8; ++r) {
        b1[r] = to_bf16x16(o1[r]);
        b2[r] = to_bf16x16(o2[r]);
      }
    }
    store_transposed_8x16(b1, page + i * block_size, block_size);
    store_transposed_8x16(b2, page + (half + i) * block_size, block_size);
  }
}
#endif

// Tokens per tile: a tile's K rows for every head stay in L1 until they are transposed.
constexpr int64_t kTileTokens = 16;

template <int DT>
void load_impl(void* cache, const Geometry& g, const void* k_ptr, const void* v_ptr,
               int64_t num_tokens, const int64_t* slots, const Rope& rope, const float* prod_k,
               const float* prod_v, int threads) {
  using E = typename Conv<DT>::E;
  E* cache_e = static_cast<E*>(cache);
  const E* k = static_cast<const E*>(k_ptr);
  const E* v = static_cast<const E*>(v_ptr);
  const int64_t H = g.num_heads, D = g.head_dim, bs = g.block_size, row = H * D;
  std::vector<Run> runs = make_runs(slots, num_tokens, bs);
  // Split long runs into tiles: the unit of work, read token-major (sequential in memory).
  std::vector<Run> tiles;
  tiles.reserve(runs.size() + num_tokens / kTileTokens + 1);
  for (const Run& r : runs)
    for (int64_t t0 = r.t0; t0 < r.t1; t0 += kTileTokens)
      tiles.push_back({t0, t0 + kTileTokens < r.t1 ? t0 + kTileTokens : r.t1, r.block,
                       r.offset + (t0 - r.t0)});
  const int64_t num_tiles = int64_t(tiles.size());
  const int nt = num_threads_for(threads, num_tiles, num_tokens * row);
  const Rope* rp = rope.cos != nullptr ? &rope : nullptr;
  const bool is_direct = ORBITKV_BF16_FAST && DT == kBF16 && rp != nullptr && prod_k == nullptr &&
                         rope.style == 0 && rope.lo == 0 && rope.rot_dim == D && D % 32 == 0;
  // One tile's work; a one-thread call (a short load) runs it outside any OpenMP region and
  // without zero-filling its scratch: per call, those cost more than a few tokens' bytes.
  auto process = [&](int64_t i, E* scratch_data) {
      const Run& tile = tiles[i];
      const int64_t len = tile.t1 - tile.t0;
      E* block = cache_e + tile.block * g.stride_block;
      // The common K case goes straight to the page 8 tokens at a time; the rest is staged.
      const int64_t direct = is_direct ? len / 8 * 8 : 0;
#if ORBITKV_BF16_FAST
      if constexpr (DT == kBF16) {
        // Token groups outer, heads inner: the source rows are read in memory order.
        for (int64_t j = 0; j < direct; j += 8) {
          for (int64_t h = 0; h < H; ++h) {
            const int64_t t = tile.t0 + j;
            const int64_t cos_row = rope.cos_rows > 1 ? t : 0;
            const float* c = rope.cos + cos_row * (D / 2);
            const float* sn = rope.sin + cos_row * (D / 2);
            uint16_t* page = block + h * g.stride_head + tile.offset + j;
            if (rope.cos_rows > 1) {
              rotate8_bf16_neox_to_page<true>(k + t * row + h * D, row, D / 2, c, sn, D / 2, page, bs);
            } else {
              rotate8_bf16_neox_to_page<false>(k + t * row + h * D, row, D / 2, c, sn, 0, page, bs);
            }
          }
        }
      }
#endif
      for (int64_t j = 0; j < len; ++j) {
        const int64_t t = tile.t0 + j;
        const int64_t cos_row = rope.cos_rows > 1 ? t : 0;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t at = t * row + h * D;
          E* page_v = block + h * g.stride_head + bs * D;
          form_plain_row<DT>(v + at, D, prod_v != nullptr ? prod_v + at : nullptr,
                             page_v + (tile.offset + j) * D);
          if (j < direct) continue;
          E* row_k = scratch_data + (h * kTileTokens + j) * D;
          const float* pk = prod_k != nullptr ? prod_k + at : nullptr;
          if (rp != nullptr) {
            form_row<DT>(k + at, D, rp, cos_row, pk, row_k);
          } else {
            form_plain_row<DT>(k + at, D, pk, row_k);
          }
        }
      }
      if (direct < len) {
        for (int64_t h = 0; h < H; ++h)
          transpose<E>(scratch_data + (h * kTileTokens + direct) * D, D,
                       block + h * g.stride_head + tile.offset + direct, bs, len - direct, D);
      }
  };
  const int64_t scratch_len = H * kTileTokens * D;
  if (nt <= 1) {
    std::unique_ptr<E[]> scratch(new E[scratch_len]);
    for (int64_t i = 0; i < num_tiles; ++i) process(i, scratch.get());
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    std::unique_ptr<E[]> scratch(new E[scratch_len]);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_tiles; ++i) process(i, scratch.get());
  }
}

template <typename E>
void gather_impl(const void* cache, const Geometry& g, void* k_ptr, void* v_ptr,
                 int64_t num_tokens, const int64_t* slots, int threads) {
  const E* cache_e = static_cast<const E*>(cache);
  E* k = static_cast<E*>(k_ptr);
  E* v = static_cast<E*>(v_ptr);
  const int64_t H = g.num_heads, D = g.head_dim, bs = g.block_size, row = H * D;
  const std::vector<Run> runs = make_runs(slots, num_tokens, bs);
  const int64_t num_items = int64_t(runs.size()) * H;
  const int nt = num_threads_for(threads, num_items, num_tokens * row);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t item = 0; item < num_items; ++item) {
    const Run& run = runs[item / H];
    const int64_t h = item % H;
    const int64_t len = run.t1 - run.t0;
    const E* page_k = cache_e + run.block * g.stride_block + h * g.stride_head;
    const E* page_v = page_k + bs * D;
    // K page [D][bs] -> rows [len][D] with row stride H*D.
    transpose<E>(page_k + run.offset, bs, k + run.t0 * row + h * D, row, D, len);
    for (int64_t j = 0; j < len; ++j)
      std::memcpy(v + (run.t0 + j) * row + h * D, page_v + (run.offset + j) * D, D * sizeof(E));
  }
}

bool check_geometry(const Geometry& g, int64_t num_tokens, const int64_t* slots) {
  if (g.num_blocks <= 0 || g.num_heads <= 0 || g.block_size <= 0 || g.head_dim <= 0) return false;
  const int64_t num_slots = g.num_blocks * g.block_size;
  for (int64_t i = 0; i < num_tokens; ++i)
    if (slots[i] >= num_slots) return false;
  return true;
}

bool is_load_dtype(int dtype) {
  return dtype == kF32 || dtype == kBF16 || (dtype == kF16 && ORBITKV_HAS_F16);
}

// load_impl for a dtype code (one is_load_dtype accepts).
void load_dtype(int dtype, void* cache, const Geometry& g, const void* k, const void* v,
                int64_t num_tokens, const int64_t* slots, const Rope& rope, const float* prod_k,
                const float* prod_v, int threads) {
  if (dtype == kF32) {
    load_impl<kF32>(cache, g, k, v, num_tokens, slots, rope, prod_k, prod_v, threads);
  } else if (dtype == kBF16) {
    load_impl<kBF16>(cache, g, k, v, num_tokens, slots, rope, prod_k, prod_v, threads);
  } else {
    load_impl<kF16>(cache, g, k, v, num_tokens, slots, rope, prod_k, prod_v, threads);
  }
}

// gather_impl for an element size of 2 or 4 bytes.
void gather_size(int element_size, const void* cache, const Geometry& g, void* k, void* v,
                 int64_t num_tokens, const int64_t* slots, int threads) {
  if (element_size == 2) {
    gather_impl<uint16_t>(cache, g, k, v, num_tokens, slots, threads);
  } else {
    gather_impl<uint32_t>(cache, g, k, v, num_tokens, slots, threads);
  }
}

}  // namespace

#define ORBITKV_API extern "C" __attribute__((visibility("default")))


// 0 on success; -1 bad geometry or slot past the cache end; -2 unsupported dtype.
ORBITKV_API int orbitkv_cpu_vec_load(void* cache, int64_t num_blocks, int64_t num_heads, int64_t block_size,
                         int64_t head_dim, int64_t stride_block, int64_t stride_head, int dtype,
                         const void* k, const void* v, int64_t num_tokens, const int64_t* slots,
                         const float* cos, const float* sin, int64_t cos_rows, int64_t rot_lo,
                         int64_t rot_dim, int style, const float* prod_k, const float* prod_v,
                         int num_threads) {
  const Geometry g{num_blocks, num_heads, block_size, head_dim, stride_block, stride_head};
  if (!check_geometry(g, num_tokens, slots)) return -1;
  if (cos != nullptr && !is_band_ok(rot_lo, rot_dim, head_dim)) return -1;
  if (!is_load_dtype(dtype)) return -2;
  const Rope rope{cos, sin, cos_rows, rot_lo, rot_dim, style};
  load_dtype(dtype, cache, g, k, v, num_tokens, slots, rope, prod_k, prod_v, num_threads);
  return 0;
}

// Whole tokens back to contiguous k, v [num_tokens, H, D]; negative slots are left untouched.
ORBITKV_API int orbitkv_cpu_vec_gather(const void* cache, int64_t num_blocks, int64_t num_heads,
                           int64_t block_size, int64_t head_dim, int64_t stride_block,
                           int64_t stride_head, int element_size, void* k, void* v,
                           int64_t num_tokens, const int64_t* slots, int num_threads) {
  const Geometry g{num_blocks, num_heads, block_size, head_dim, stride_block, stride_head};
  if (!check_geometry(g, num_tokens, slots)) return -1;
  if (element_size != 2 && element_size != 4) return -2;
  gather_size(element_size, cache, g, k, v, num_tokens, slots, num_threads);
  return 0;
}

// Many loads in one call: job j writes num_tokens[j] tokens from ks[j], vs[j] (contiguous
// [n, H, D]) at slots[j] into caches[j] (each a pointer as int64), all of one geometry, dtype and
// RoPE band, job j's cos/sin tables coss[j], sins[j] (0: no rotation) of cos_rows[j] rows. A step
// loads every layer of every chunk this way: one call instead of one per layer and chunk, each
// of which, between two layers' compute, starts with cold caches. Every slot is checked before
// anything is written. Jobs write disjoint slots, so large steps run them in parallel; each
// element's arithmetic is the same whatever the thread count.
ORBITKV_API int orbitkv_cpu_vec_load_many(int64_t num_jobs, const int64_t* caches, int64_t num_blocks,
                              int64_t num_heads, int64_t block_size, int64_t head_dim,
                              int64_t stride_block, int64_t stride_head, int dtype,
                              const int64_t* ks, const int64_t* vs, const int64_t* num_tokens,
                              const int64_t* slots, const int64_t* coss, const int64_t* sins,
                              const int64_t* cos_rows, int64_t rot_lo, int64_t rot_dim, int style,
                              int num_threads) {
  const Geometry g{num_blocks, num_heads, block_size, head_dim, stride_block, stride_head};
  int64_t total = 0;
  for (int64_t j = 0; j < num_jobs; ++j) {
    const auto* job_slots = reinterpret_cast<const int64_t*>(slots[j]);
    if (num_tokens[j] < 0 || !check_geometry(g, num_tokens[j], job_slots)) return -1;
    if (coss[j] != 0 && !is_band_ok(rot_lo, rot_dim, head_dim)) return -1;
    total += num_tokens[j];
  }
  if (!is_load_dtype(dtype)) return -2;
  const int nt = num_threads_for(num_threads, num_jobs, total * num_heads * head_dim);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(dynamic)
  for (int64_t j = 0; j < num_jobs; ++j) {
    const Rope rope{reinterpret_cast<const float*>(coss[j]), reinterpret_cast<const float*>(sins[j]),
                    cos_rows[j], rot_lo, rot_dim, style};
    void* cache = reinterpret_cast<void*>(caches[j]);
    const void* k = reinterpret_cast<const void*>(ks[j]);
    const void* v = reinterpret_cast<const void*>(vs[j]);
    const auto* job_slots = reinterpret_cast<const int64_t*>(slots[j]);
    // Inside the jobs' parallel loop a job runs on its thread alone.
    const int threads = nt > 1 ? 1 : num_threads;
    load_dtype(dtype, cache, g, k, v, num_tokens[j], job_slots, rope, nullptr, nullptr, threads);
  }
  return 0;
}

// The same tokens (slots) of many caches back to contiguous ks[j], vs[j] [num_tokens, H, D]: a
// step's saves from every layer in one call.
ORBITKV_API int orbitkv_cpu_vec_gather_many(int64_t num_jobs, const int64_t* caches, int64_t num_blocks,
                                int64_t num_heads, int64_t block_size, int64_t head_dim,
                                int64_t stride_block, int64_t stride_head, int element_size,
                                const int64_t* ks, const int64_t* vs, int64_t num_tokens,
                                const int64_t* slots, int num_threads) {
  const Geometry g{num_blocks, num_heads, block_size, head_dim, stride_block, stride_head};
  if (!check_geometry(g, num_tokens, slots)) return -1;
  if (element_size != 2 && element_size != 4) return -2;
  const int nt = num_threads_for(num_threads, num_jobs, num_jobs * num_tokens * num_heads * head_dim);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t j = 0; j < num_jobs; ++j) {
    const void* cache = reinterpret_cast<const void*>(caches[j]);
    void* k = reinterpret_cast<void*>(ks[j]);
    void* v = reinterpret_cast<void*>(vs[j]);
    gather_size(element_size, cache, g, k, v, num_tokens, slots, nt > 1 ? 1 : num_threads);
  }
  return 0;
}

ORBITKV_API int orbitkv_native_version() { return 8; }
