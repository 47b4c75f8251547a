// Loads that bring every layer at once (paged.load_stacked): load j's layer i is at a constant
// step from its layer 0, so the caller passes one base and one step a load instead of a pointer
// a layer and load, and the jobs of the *_load_many ops are formed here. A step of many layers
// and short chunks otherwise spends more in forming those arrays (Python) than in the copy.
#include <cstddef>
#include <cstdint>
#include <vector>

#define ORBITKV_API extern "C" __attribute__((visibility("default")))

using LoadMany = int (*)(int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int, const int64_t*, const int64_t*, const int64_t*,
                         const int64_t*, const int64_t*, const int64_t*, const int64_t*, int64_t,
                         int64_t, int, int);

ORBITKV_API int orbitkv_cpu_vec_load_many(int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                          int64_t, int64_t, int64_t, int, const int64_t*,
                                          const int64_t*, const int64_t*, const int64_t*,
                                          const int64_t*, const int64_t*, const int64_t*, int64_t,
                                          int64_t, int, int);
ORBITKV_API int orbitkv_cpu_amx_load_many(int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                          int64_t, int64_t, int64_t, int, const int64_t*,
                                          const int64_t*, const int64_t*, const int64_t*,
                                          const int64_t*, const int64_t*, const int64_t*, int64_t,
                                          int64_t, int, int);

namespace {

// loads[f * num_loads + j]: field f of load j; fields k, k_step, v, v_step (bytes), num_tokens,
// slots, cos, sin, cos_rows. Job i * num_loads + j is layer i of load j (layer-major, as the
// per-job form orders them).
int load_stacked(LoadMany op, int64_t num_layers, const int64_t* caches, int64_t num_blocks,
                 int64_t num_heads, int64_t block_size, int64_t head_dim, int64_t stride_block,
                 int64_t stride_head, int dtype, int64_t num_loads, const int64_t* loads,
                 int64_t rot_lo, int64_t rot_dim, int style, int num_threads) {
  if (num_layers < 0 || num_loads < 0) return -1;
  const int64_t num_jobs = num_layers * num_loads;
  const int64_t* f[9];
  for (int i = 0; i < 9; ++i) f[i] = loads + i * num_loads;
  std::vector<int64_t> jobs(8 * static_cast<size_t>(num_jobs));
  int64_t* cache_of = jobs.data();
  int64_t* k_of = cache_of + num_jobs;
  int64_t* v_of = k_of + num_jobs;
  int64_t* n_of = v_of + num_jobs;
  int64_t* slots_of = n_of + num_jobs;
  int64_t* cos_of = slots_of + num_jobs;
  int64_t* sin_of = cos_of + num_jobs;
  int64_t* rows_of = sin_of + num_jobs;
  for (int64_t i = 0; i < num_layers; ++i) {
    for (int64_t j = 0; j < num_loads; ++j) {
      const int64_t at = i * num_loads + j;
      cache_of[at] = caches[i];
      k_of[at] = f[0][j] + i * f[1][j];
      v_of[at] = f[2][j] + i * f[3][j];
      n_of[at] = f[4][j];
      slots_of[at] = f[5][j];
      cos_of[at] = f[6][j];
      sin_of[at] = f[7][j];
      rows_of[at] = f[8][j];
    }
  }
  return op(num_jobs, cache_of, num_blocks, num_heads, block_size, head_dim, stride_block,
            stride_head, dtype, k_of, v_of, n_of, slots_of, cos_of, sin_of, rows_of, rot_lo,
            rot_dim, style, num_threads);
}

}  // namespace

#define ORBITKV_STACKED(name, op)                                                              \
  ORBITKV_API int name(int64_t num_layers, const int64_t* caches, int64_t num_blocks,          \
                       int64_t num_heads, int64_t block_size, int64_t head_dim,                \
                       int64_t stride_block, int64_t stride_head, int dtype, int64_t num_loads, \
                       const int64_t* loads, int64_t rot_lo, int64_t rot_dim, int style,       \
                       int num_threads) {                                                      \
    return load_stacked(op, num_layers, caches, num_blocks, num_heads, block_size, head_dim,   \
                        stride_block, stride_head, dtype, num_loads, loads, rot_lo, rot_dim,   \
                        style, num_threads);                                                   \
  }

ORBITKV_STACKED(orbitkv_cpu_vec_load_stacked, orbitkv_cpu_vec_load_many)
ORBITKV_STACKED(orbitkv_cpu_amx_load_stacked, orbitkv_cpu_amx_load_many)
