// Load into and gather from vLLM's CPU_AMX paged KV cache (bf16, packed for AMX tiles), many
// layers and chunks in one call.
//
// Page layout, per (block, head), in bf16 elements (t = 16 tokens or features, bs = block_size,
// D = head_dim; kernels/paged_layout.py builds the same views):
//   K: [bs / t][D / 2][t][2]  K[tok, d] at (tok / t) * t * D + (d / 2) * 2t + (tok % t) * 2 + d % 2
//      (VNNI pairs: one 32-bit word holds features 2j and 2j + 1 of one token)
//   V: [D / t][bs / 2][t][2]  V[tok, d] at bs * D + (d / t) * t * bs + (tok / 2) * 2t + (d % t) * 2
//      + tok % 2  (one word holds feature d of tokens 2p and 2p + 1)
// A token's K row is a column of 32-bit words (a transpose); its V row is every other bf16 of
// D / t runs of 2t. A gather copies bits, never converts them: the bytes equal the torch
// reference's (kernels/paged_amx.py gather_amx). A load forms each K row as the CPU_VEC load
// does (rows.h form_row: the same re-rotation, rounded once) and packs it, V bits as they are.

#include <cstdint>
#include <cstring>
#include <memory>

#include "rows.h"

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

using namespace orbitkv_rows;

constexpr int64_t kTile = 16;

struct AmxGeometry {
  int64_t num_blocks, num_heads, block_size, head_dim;
  int64_t stride_block, stride_head;  // elements; a (block, head) page is contiguous
};

// One feature group of a token's V row: the low (`odd` 0) or high halves of 16 words at `pairs`.
// Reads only the 16 words: an odd token's last half is the page's last element.
inline void take_halves_16(const uint16_t* pairs, int64_t odd, uint16_t* dst) {
#if defined(__AVX512BW__)
  __m512i words = _mm512_loadu_si512(pairs);
  if (odd) words = _mm512_srli_epi32(words, 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(words));
#else
  for (int64_t i = 0; i < kTile; ++i) dst[i] = pairs[2 * i + odd];
#endif
}

#if defined(__AVX512F__)
#define ORBITKV_AMX_WIDE 1
// 16 x 16 transpose of 32-bit words: dst[c][r] = src[r][c] (strides in words). Within each
// 128-bit lane a 4 x 4 transpose per group of 4 rows (unpacks), then the 4 x 4 grid of lanes.
inline void transpose16x16_u32(const uint32_t* src, int64_t src_stride, uint32_t* dst,
                               int64_t dst_stride) {
  __m512i u[4][4];  // u[G][k], lane L: column 4L + k of rows 4G .. 4G + 3
  for (int G = 0; G < 4; ++G) {
    const uint32_t* r = src + 4 * G * src_stride;
    const __m512i a = _mm512_loadu_si512(r), b = _mm512_loadu_si512(r + src_stride);
    const __m512i c = _mm512_loadu_si512(r + 2 * src_stride);
    const __m512i d = _mm512_loadu_si512(r + 3 * src_stride);
    const __m512i t0 = _mm512_unpacklo_epi32(a, b), t1 = _mm512_unpackhi_epi32(a, b);
    const __m512i t2 = _mm512_unpacklo_epi32(c, d), t3 = _mm512_unpackhi_epi32(c, d);
    u[G][0] = _mm512_unpacklo_epi64(t0, t2);
    u[G][1] = _mm512_unpackhi_epi64(t0, t2);
    u[G][2] = _mm512_unpacklo_epi64(t1, t3);
    u[G][3] = _mm512_unpackhi_epi64(t1, t3);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i p0 = _mm512_shuffle_i32x4(u[0][k], u[1][k], 0x44);
    const __m512i p1 = _mm512_shuffle_i32x4(u[0][k], u[1][k], 0xEE);
    const __m512i p2 = _mm512_shuffle_i32x4(u[2][k], u[3][k], 0x44);
    const __m512i p3 = _mm512_shuffle_i32x4(u[2][k], u[3][k], 0xEE);
    _mm512_storeu_si512(dst + k * dst_stride, _mm512_shuffle_i32x4(p0, p2, 0x88));
    _mm512_storeu_si512(dst + (4 + k) * dst_stride, _mm512_shuffle_i32x4(p0, p2, 0xDD));
    _mm512_storeu_si512(dst + (8 + k) * dst_stride, _mm512_shuffle_i32x4(p1, p3, 0x88));
    _mm512_storeu_si512(dst + (12 + k) * dst_stride, _mm512_shuffle_i32x4(p1, p3, 0xDD));
  }
}
#else
#define ORBITKV_AMX_WIDE 0
#endif

// K rows of tokens [tok0, tok0 + len) of one page (row stride `row`): whole tile groups are
// transposed 16 x 16 words at a time, the ends of a run word by word.
void gather_page_k(const uint32_t* k_words, int64_t half, int64_t tok0, int64_t len, uint16_t* k,
                   int64_t row) {
  const int64_t row_words = row / 2;
  int64_t i = 0;
  while (i < len) {
    const int64_t tok = tok0 + i;
    uint32_t* k_row = reinterpret_cast<uint32_t*>(k + i * row);
    const uint32_t* group = k_words + (tok / kTile) * kTile * half;
#if ORBITKV_AMX_WIDE
    if (tok % kTile == 0 && i + kTile <= len) {
      for (int64_t j = 0; j < half; j += kTile)
        transpose16x16_u32(group + j * kTile, kTile, k_row + j, row_words);
      i += kTile;
      continue;
    }
#endif
    const uint32_t* col = group + tok % kTile;
    for (int64_t j = 0; j < half; ++j) k_row[j] = col[j * kTile];
    ++i;
  }
}

// V rows of tokens [tok0, tok0 + len) of one page: both tokens of a shared word at once where the
// run holds them.
void gather_page_v(const uint16_t* v_page, int64_t D, int64_t bs, int64_t tok0, int64_t len,
                   uint16_t* v, int64_t row) {
  int64_t i = 0;
  while (i < len) {
    const int64_t tok = tok0 + i;
    const uint16_t* pairs = v_page + (tok / 2) * 2 * kTile;
    const bool is_pair = tok % 2 == 0 && i + 1 < len;
    for (int64_t f = 0; f < D; f += kTile) {
      take_halves_16(pairs + f * bs, tok % 2, v + i * row + f);
      if (is_pair) take_halves_16(pairs + f * bs, 1, v + (i + 1) * row + f);
    }
    i += is_pair ? 2 : 1;
  }
}

// One (block, head) page's tokens [tok0, tok0 + len) into rows k, v (row stride `row`).
void gather_page(const uint16_t* page, const AmxGeometry& g, int64_t tok0, int64_t len,
                 uint16_t* k, uint16_t* v, int64_t row) {
  gather_page_k(reinterpret_cast<const uint32_t*>(page), g.head_dim / 2, tok0, len, k, row);
  gather_page_v(page + g.block_size * g.head_dim, g.head_dim, g.block_size, tok0, len, v, row);
}

// One feature group of a token's V row into its half of 16 words at `pairs` (the other token's
// halves untouched).
inline void put_halves_16(const uint16_t* src, int64_t odd, uint16_t* pairs) {
#if defined(__AVX512BW__)
  __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  if (odd) words = _mm512_slli_epi32(words, 16);
  _mm512_mask_storeu_epi16(pairs, odd ? 0xAAAAAAAAu : 0x55555555u, words);
#else
  for (int64_t i = 0; i < kTile; ++i) pairs[2 * i + odd] = src[i];
#endif
}

// One token of one head: K row `k` (already formed) and V row `v` into the page.
void put_token(uint16_t* page, const AmxGeometry& g, int64_t tok, const uint16_t* k,
               const uint16_t* v) {
  const int64_t D = g.head_dim, bs = g.block_size, half = D / 2;
  uint32_t* col = reinterpret_cast<uint32_t*>(page) + (tok / kTile) * kTile * half + tok % kTile;
  const uint32_t* k_words = reinterpret_cast<const uint32_t*>(k);
  for (int64_t j = 0; j < half; ++j) col[j * kTile] = k_words[j];
  uint16_t* pairs = page + bs * D + (tok / 2) * 2 * kTile;
  for (int64_t f = 0; f < D; f += kTile) put_halves_16(v + f, tok % 2, pairs + f * bs);
}

bool is_geometry_ok(const AmxGeometry& g) {
  return g.num_blocks > 0 && g.num_heads > 0 && g.block_size > 0 && g.head_dim > 0 &&
         g.block_size % (2 * kTile) == 0 && g.head_dim % (2 * kTile) == 0;
}

// Every slot below the cache end (padding, -1, allowed where `is_padding_ok`).
bool are_slots_ok(const AmxGeometry& g, int64_t n, const int64_t* slots, bool is_padding_ok) {
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] >= g.num_blocks * g.block_size || (slots[i] < 0 && !is_padding_ok)) return false;
  return true;
}

}  // namespace

#define ORBITKV_API extern "C" __attribute__((visibility("default")))

// The arguments of orbitkv_cpu_vec_gather_many (element_size 2: bf16).
// Tokens at `slots` (no padding, each < num_blocks * block_size) of every cache: job j writes K
// and V rows [num_tokens, num_heads, head_dim] at ks[j], vs[j]. block_size and head_dim are
// multiples of 32. Returns 0, or -1 for a geometry or slot it refuses, -2 for another element
// size (nothing written then).
ORBITKV_API int orbitkv_cpu_amx_gather_many(int64_t num_jobs, const int64_t* caches,
                                            int64_t num_blocks, int64_t num_heads,
                                            int64_t block_size, int64_t head_dim,
                                            int64_t stride_block, int64_t stride_head,
                                            int element_size, const int64_t* ks,
                                            const int64_t* vs, int64_t num_tokens,
                                            const int64_t* slots, int num_threads) {
  const AmxGeometry g{num_blocks, num_heads, block_size, head_dim, stride_block, stride_head};
  if (!is_geometry_ok(g) || !are_slots_ok(g, num_tokens, slots, false)) return -1;
  if (element_size != 2) return -2;
  const int64_t row = num_heads * head_dim;
  const int64_t num_items = num_jobs * num_heads;
  const int nt = num_threads_for(num_threads, num_items, num_items * num_tokens * head_dim);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t j = item / num_heads, h = item % num_heads;
    const uint16_t* cache = reinterpret_cast<const uint16_t*>(caches[j]);
    uint16_t* k = reinterpret_cast<uint16_t*>(ks[j]) + h * head_dim;
    uint16_t* v = reinterpret_cast<uint16_t*>(vs[j]) + h * head_dim;
    int64_t i = 0;
    while (i < num_tokens) {
      // A run of consecutive slots in one block reads one page.
      const int64_t s = slots[i], block = s / block_size, tok0 = s % block_size;
      int64_t len = 1;
      while (i + len < num_tokens && slots[i + len] == s + len && tok0 + len < block_size) ++len;
      const uint16_t* page = cache + block * stride_block + h * stride_head;
      gather_page(page, g, tok0, len, k + i * row, v + i * row, row);
      i += len;
    }
  }
  return 0;
}

// Many unpatched bf16 loads in one call, the arguments of orbitkv_cpu_vec_load_many: job j writes num_tokens[j]
// tokens of ks[j], vs[j] ([n, H, D]) at slots[j] (-1: skipped) of caches[j], K re-rotated by job j's
// cos/sin tables (0: none) of cos_rows[j] rows over the band [rot_lo, rot_lo + rot_dim). Every
// slot is checked before anything is written. Returns 0, or -1 (a geometry, slot or band it
// refuses), -2 (not bf16): nothing written then.
ORBITKV_API int orbitkv_cpu_amx_load_many(int64_t num_jobs, const int64_t* caches,
                                          int64_t num_blocks, int64_t num_heads,
                                          int64_t block_size, int64_t head_dim,
                                          int64_t stride_block, int64_t stride_head,
                                          int dtype, const int64_t* ks, const int64_t* vs,
                                          const int64_t* num_tokens, const int64_t* slots,
                                          const int64_t* coss, const int64_t* sins,
                                          const int64_t* cos_rows, int64_t rot_lo,
                                          int64_t rot_dim, int style, int num_threads) {
  const AmxGeometry g{num_blocks, num_heads, block_size, head_dim, stride_block, stride_head};
  if (!is_geometry_ok(g)) return -1;
  int64_t total = 0;
  for (int64_t j = 0; j < num_jobs; ++j) {
    const auto* job_slots = reinterpret_cast<const int64_t*>(slots[j]);
    if (num_tokens[j] < 0 || !are_slots_ok(g, num_tokens[j], job_slots, true)) return -1;
    if (coss[j] != 0 && !is_band_ok(rot_lo, rot_dim, head_dim)) return -1;
    total += num_tokens[j];
  }
  if (dtype != kBF16) return -2;
  const int64_t row = num_heads * head_dim;
  const int nt = num_threads_for(num_threads, num_jobs, total * row);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::unique_ptr<uint16_t[]> k_row(new uint16_t[head_dim]);
#pragma omp for schedule(dynamic)
    for (int64_t j = 0; j < num_jobs; ++j) {
      const Rope rope{reinterpret_cast<const float*>(coss[j]),
                      reinterpret_cast<const float*>(sins[j]), cos_rows[j], rot_lo, rot_dim, style};
      const Rope* rp = rope.cos != nullptr ? &rope : nullptr;
      uint16_t* cache = reinterpret_cast<uint16_t*>(caches[j]);
      const uint16_t* k = reinterpret_cast<const uint16_t*>(ks[j]);
      const uint16_t* v = reinterpret_cast<const uint16_t*>(vs[j]);
      const auto* job_slots = reinterpret_cast<const int64_t*>(slots[j]);
      for (int64_t t = 0; t < num_tokens[j]; ++t) {
        const int64_t s = job_slots[t];
        if (s < 0) continue;
        const int64_t cos_row = rope.cos_rows > 1 ? t : 0;
        uint16_t* block = cache + (s / block_size) * stride_block;
        for (int64_t h = 0; h < num_heads; ++h) {
          const int64_t at = t * row + h * head_dim;
          const uint16_t* k_formed = k + at;
          if (rp != nullptr) {
            form_row<kBF16>(k + at, head_dim, rp, cos_row, nullptr, k_row.get());
            k_formed = k_row.get();
          }
          put_token(block + h * stride_head, g, s % block_size, k_formed, v + at);
        }
      }
    }
  }
  return 0;
}
