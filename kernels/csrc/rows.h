// Row helpers shared by the native CPU kernels (cpu_vec.cpp, cpu_amx.cpp): dtype conversions
// that round as torch does, the RoPE re-rotation and patch of one row (form_row), runs of
// consecutive slots, the thread count for a call. Both files are built with -ffp-contract=off
// (no FMA may fuse the rotation's products and sums).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace orbitkv_rows {

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's vectorised float -> bfloat16 conversion (which writes NaN as
// 0xFFFF; its scalar tail writes 0x7FC0, so NaN bits are the one thing torch itself varies on).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__FLT16_MANT_DIG__)
#define ORBITKV_HAS_F16 1
inline float f16_to_f32(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return float(x);
}
inline uint16_t f32_to_f16(float f) {
  _Float16 x = _Float16(f);  // IEEE conversion: round to nearest even
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}
#else
#define ORBITKV_HAS_F16 0
inline float f16_to_f32(uint16_t) { return 0.0f; }
inline uint16_t f32_to_f16(float) { return 0; }
#endif

struct Rope {
  const float* cos;  // [cos_rows, rot_dim / 2]; nullptr: no rotation
  const float* sin;
  int64_t cos_rows;  // 1 (one shift for the chunk) or num_tokens
  int64_t lo, rot_dim;
  int style;  // 0 neox (i with i + half), 1 gptj (2i with 2i + 1)
};

struct Run {
  int64_t t0, t1, block, offset;
};

// Tokens on consecutive slots of one block form a run; negative slots (padding) are skipped.
inline std::vector<Run> make_runs(const int64_t* slots, int64_t n, int64_t block_size) {
  std::vector<Run> runs;
  int64_t i = 0;
  while (i < n) {
    int64_t s = slots[i];
    if (s < 0) {
      ++i;
      continue;
    }
    int64_t j = i + 1;
    while (j < n && slots[j] == s + (j - i) && slots[j] % block_size != 0) ++j;
    runs.push_back({i, j, s / block_size, s % block_size});
    i = j;
  }
  return runs;
}

template <int DT>
struct Conv;
template <>
struct Conv<kF32> {
  using E = uint32_t;
  static float load(E e) {
    float f;
    std::memcpy(&f, &e, 4);
    return f;
  }
  static E store(float f) {
    E e;
    std::memcpy(&e, &f, 4);
    return e;
  }
};
template <>
struct Conv<kBF16> {
  using E = uint16_t;
  static float load(E e) { return bf16_to_f32(e); }
  static E store(float f) { return f32_to_bf16(f); }
};
template <>
struct Conv<kF16> {
  using E = uint16_t;
  static float load(E e) { return f16_to_f32(e); }
  static E store(float f) { return f32_to_f16(f); }
};

// A short row copy, inlined (a libc memcpy call per 256-byte row costs as much as the copy).
template <typename E>
inline void copy_row(E* dst, const E* src, int64_t n) {
  int64_t nbytes = n * int64_t(sizeof(E));
  char* d = reinterpret_cast<char*>(dst);
  const char* s = reinterpret_cast<const char*>(src);
  for (; nbytes >= 64; nbytes -= 64, d += 64, s += 64) __builtin_memcpy(d, s, 64);
  for (; nbytes >= 8; nbytes -= 8, d += 8, s += 8) __builtin_memcpy(d, s, 8);
  for (; nbytes > 0; --nbytes) *d++ = *s++;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define ORBITKV_BF16_FAST 1
// 16 fp32 lanes to bf16, round to nearest even, exactly as f32_to_bf16. vcvtneps2bf16 rounds the
// same way but flushes denormals and quiets NaNs differently, so a vector holding either takes the
// scalar path (never for real KV, which has neither).
inline void store_bf16x16(uint16_t* out, __m512 x) {
  if (_mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80) == 0) {  // QNaN | denormal | SNaN
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(x));
    return;
  }
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, x);
  for (int i = 0; i < 16; ++i) out[i] = f32_to_bf16(tmp[i]);
}

inline __m512 load_bf16x16(const uint16_t* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// form_row for bf16, neox pairs, no patch, half a multiple of 16: the common K row.
inline void rotate_row_bf16_neox(const uint16_t* __restrict x, int64_t half,
                                 const float* __restrict c, const float* __restrict s,
                                 uint16_t* __restrict out) {
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x1 = load_bf16x16(x + i), x2 = load_bf16x16(x + half + i);
    const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
    // Two rounded products and one rounded sum each: no FMA.
    const __m512 o1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
    const __m512 o2 = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
    store_bf16x16(out + i, o1);
    store_bf16x16(out + half + i, o2);
  }
}
#else
#define ORBITKV_BF16_FAST 0
#endif

// One output row (D features of one token and head): rotated band and/or patch, rounded once,
// each feature loaded, computed and stored in one pass.
template <int DT>
void form_row(const typename Conv<DT>::E* __restrict x, int64_t d_count, const Rope* rope,
              int64_t cos_row, const float* __restrict prod, typename Conv<DT>::E* __restrict out) {
  using C = Conv<DT>;
  const bool rotate = rope != nullptr && rope->cos != nullptr;
  const int64_t lo = rotate ? rope->lo : 0;
  const int64_t hi = rotate ? rope->lo + rope->rot_dim : 0;
  // Outside the band: bits copied (no patch) or the patch added.
  if (prod == nullptr) {
    if (lo > 0) copy_row(out, x, lo);
    if (hi < d_count) copy_row(out + hi, x + hi, d_count - hi);
  } else {
    for (int64_t d = 0; d < lo; ++d) out[d] = C::store(C::load(x[d]) + prod[d]);
    for (int64_t d = hi; d < d_count; ++d) out[d] = C::store(C::load(x[d]) + prod[d]);
  }
  if (!rotate) return;
  const int64_t half = rope->rot_dim / 2;
  const float* __restrict c = rope->cos + cos_row * half;
  const float* __restrict s = rope->sin + cos_row * half;
#if ORBITKV_BF16_FAST
  if constexpr (DT == kBF16) {
    if (prod == nullptr && rope->style == 0 && half % 16 == 0) {
      rotate_row_bf16_neox(x + lo, half, c, s, out + lo);
      return;
    }
  }
#endif
  const auto* __restrict xb = x + lo;
  auto* __restrict ob = out + lo;
  const float* __restrict pb = prod != nullptr ? prod + lo : nullptr;
  // neox pairs i with i + half; gptj pairs 2i with 2i + 1.
  const int64_t step = rope->style == 0 ? 1 : 2;
  const int64_t partner = rope->style == 0 ? half : 1;
  if (pb == nullptr) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = C::load(xb[i * step]), x2 = C::load(xb[i * step + partner]);
      const float p = x1 * c[i], q = x2 * s[i];
      const float r = x2 * c[i], t = x1 * s[i];
      ob[i * step] = C::store(p - q);
      ob[i * step + partner] = C::store(r + t);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = C::load(xb[i * step]), x2 = C::load(xb[i * step + partner]);
      const float p = x1 * c[i], q = x2 * s[i];
      const float r = x2 * c[i], t = x1 * s[i];
      const float o1 = p - q, o2 = r + t;
      ob[i * step] = C::store(o1 + pb[i * step]);
      ob[i * step + partner] = C::store(o2 + pb[i * step + partner]);
    }
  }
}

// A V row (or a K row with no rotation): bits copied, or the patch added and rounded once.
template <int DT>
void form_plain_row(const typename Conv<DT>::E* __restrict x, int64_t d_count,
                    const float* __restrict prod, typename Conv<DT>::E* __restrict out) {
  using C = Conv<DT>;
  if (prod == nullptr) {
    copy_row(out, x, d_count);
    return;
  }
  for (int64_t d = 0; d < d_count; ++d) out[d] = C::store(C::load(x[d]) + prod[d]);
}

// A RoPE band [rot_lo, rot_lo + rot_dim) of whole pairs inside the head.
inline bool is_band_ok(int64_t rot_lo, int64_t rot_dim, int64_t head_dim) {
  return rot_lo >= 0 && rot_dim > 0 && rot_dim % 2 == 0 && rot_lo + rot_dim <= head_dim;
}

inline int num_threads_for(int requested, int64_t num_items, int64_t elems) {
  // A parallel region costs a few microseconds, and on a busy machine it waits for the slowest
  // of its threads to be scheduled (a time slice, milliseconds, per layer and chunk: seen as
  // 85-150 ms a request in bench agent at load 15 on 2 cores). One thread copies a chunk of a few
  // hundred tokens (under 512 Ki elements, 1 MiB of bf16) in tens of microseconds.
  if (requested <= 1 || num_items <= 1 || elems < (1 << 19)) return 1;
  return int(requested < num_items ? requested : num_items);
}

}  // namespace orbitkv_rows
