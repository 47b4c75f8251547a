// Content-defined cut points of a prompt's text (connector/cdc.py holds the definition and the
// numpy reference): one pass over the token ids where numpy takes a dozen, since the scheduler
// chunks every prompt it admits, on the engine's critical path.
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace {

constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kM2 = 0x94D049BB133111EBULL;
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kP = 0x100000001B3ULL;

inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= kM1;
  x ^= x >> 27;
  x *= kM2;
  return x ^ (x >> 31);
}

}  // namespace

#define ORBITKV_API extern "C" __attribute__((visibility("default")))

// Writes every cut of the prompt to cuts (room for n + 1), ascending and distinct, and returns how
// many:
// - in each text stretch [bounds[s], bounds[num_stretches + s]), the chunk ends
//   cdc.content_cuts walks to (the stretch's end included) over the candidate ends of
//   cdc.candidate_ends(cdc.window_hashes(...));
// - after every token i < n - 1 whose id ends a line: table[clip(id + 1, 0, table_len - 1)] != 0
//   (table_len 0: no line ends).
// -1: bad arguments (sizes, a stretch outside the prompt); -2: no memory for the marks.
// The caller hands positions, not a byte per token: the scheduler turns them into a list without
// a numpy pass (each costs tens of microseconds on the cold caches it runs on).
ORBITKV_API int64_t orbitkv_cdc_cuts(const int64_t* tokens, const int64_t* bounds,
                                     const uint8_t* table, int64_t* cuts, int64_t n,
                                     int64_t num_stretches, int64_t window, int64_t min_len,
                                     int64_t max_len, int64_t table_len, uint64_t mask) {
  if (n < 0 || window < 1 || min_len < 1 || max_len < min_len || table_len < 0) return -1;
  std::vector<uint8_t> marks;
  try {
    marks.assign(2 * static_cast<size_t>(n + 1), 0);
  } catch (const std::bad_alloc&) {
    return -2;
  }
  uint8_t* is_cut = marks.data();
  uint8_t* is_candidate = is_cut + n + 1;  // is_candidate[e]: a chunk may end after token e - 1
  is_candidate[0] = 0;
  uint64_t power = 1;  // P**window, for the token leaving the window
  for (int64_t j = 0; j < window; ++j) power *= kP;
  uint64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    sum = sum * kP + mix(static_cast<uint64_t>(tokens[i]) + kGolden);
    if (i >= window) sum -= mix(static_cast<uint64_t>(tokens[i - window]) + kGolden) * power;
    is_candidate[i + 1] = (mix(sum) & mask) == 0;
  }
  for (int64_t s = 0; s < num_stretches; ++s) {
    const int64_t end = bounds[num_stretches + s];
    int64_t pos = bounds[s];
    if (pos < 0 || end > n || pos > end) return -1;
    while (pos < end) {
      const int64_t limit = pos + max_len < end ? pos + max_len : end;
      int64_t cut = limit;
      for (int64_t e = pos + min_len; e < limit; ++e) {
        if (is_candidate[e]) {
          cut = e;
          break;
        }
      }
      is_cut[cut] = 1;
      pos = cut;
    }
  }
  if (table_len > 0) {
    for (int64_t i = 0; i + 1 < n; ++i) {
      const int64_t t = tokens[i];
      // numpy's id + 1 wraps at INT64_MAX, and is clipped to the first entry as a negative is.
      const int64_t at =
          (t < 0 || t == INT64_MAX) ? 0 : (t + 1 >= table_len ? table_len - 1 : t + 1);
      if (table[at]) is_cut[i + 1] = 1;
    }
  }
  int64_t num_cuts = 0;
  for (int64_t e = 0; e <= n; ++e) {
    if (is_cut[e]) cuts[num_cuts++] = e;
  }
  return num_cuts;
}
