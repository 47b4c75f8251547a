// A prompt's chunk keys (store/keys.py holds the definition: prompt_cids and antecedent_hashes;
// connector/chunk_keys.py the wrapper): the cid of every chunk and the antecedent hash of every
// prefix of them, in one call. The scheduler keys every prompt it admits on the engine's critical
// path, right after the engine sat idle: there each of Python's two hashes a chunk costs a join
// and a call on cold caches, several microseconds each. xxHash is the library Python's xxhash
// wraps (third_party/xxhash.h, v0.8), so the digests are the same.
#include <cstdint>
#include <cstring>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "third_party/xxhash.h"

namespace {

constexpr int64_t kStride = 33;  // a key's 32 hex characters and the '\n' after it

inline void put_u64(XXH3_state_t* h, uint64_t value) {
  uint8_t le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<uint8_t>(value >> (8 * i));
  XXH3_128bits_update(h, le, 8);
}

// A field: its one-byte tag, its length as a little-endian u64, its bytes (keys._field).
inline void put_field(XXH3_state_t* h, char tag, const void* data, uint64_t nbytes) {
  XXH3_128bits_update(h, &tag, 1);
  put_u64(h, nbytes);
  if (nbytes) XXH3_128bits_update(h, data, nbytes);
}

// xxhash's hexdigest: the canonical (big-endian) 16 bytes, lowercase.
inline void put_hex(XXH128_hash_t hash, char* out) {
  static const char kHex[] = "0123456789abcdef";
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, hash);
  for (int i = 0; i < 16; ++i) {
    out[2 * i] = kHex[canon.digest[i] >> 4];
    out[2 * i + 1] = kHex[canon.digest[i] & 15];
  }
}

}  // namespace

#define ORBITKV_API extern "C" __attribute__((visibility("default")))

// Writes the keys to out as 32 hex characters each, one '\n' between two (room for
// (2 num_runs + 1) * 33 - 1 bytes; Python splits them in one call): the cid of each of the num_runs
// chunks, then the antecedent hash of the first i cids for i in 0..num_runs.
// runs[4 r .. 4 r + 3]: the chunk's start and end in tokens, and for an item's chunk the offset
// and length of its hash in items (UTF-8), a length of -1 for text. prefix: a cid's fixed fields
// (keys._cid_prefix_bytes); version: keys._VERSION_FIELD. Returns 0, or -1 for a run outside the
// prompt or an item hash outside items (nothing useful is written then).
ORBITKV_API int orbitkv_chunk_keys(const int64_t* tokens, int64_t num_tokens, const int64_t* runs,
                                   int64_t num_runs, const uint8_t* prefix, int64_t prefix_nbytes,
                                   const uint8_t* items, int64_t items_nbytes,
                                   const uint8_t* version, int64_t version_nbytes, char* out) {
  if (num_tokens < 0 || num_runs < 0 || prefix_nbytes < 0 || items_nbytes < 0 ||
      version_nbytes < 0) {
    return -1;
  }
  XXH3_state_t state;
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t start = runs[4 * r], end = runs[4 * r + 1];
    const int64_t item_at = runs[4 * r + 2], item_nbytes = runs[4 * r + 3];
    if (start < 0 || end <= start || end > num_tokens) return -1;
    const uint64_t length = static_cast<uint64_t>(end - start);
    XXH3_128bits_reset(&state);
    XXH3_128bits_update(&state, prefix, static_cast<size_t>(prefix_nbytes));
    put_u64(&state, length);
    if (item_nbytes < 0) {
      put_field(&state, 'T', tokens + start, 8 * length);
    } else {
      if (item_at < 0 || item_nbytes > items_nbytes - item_at) return -1;
      // The whole chunk is one placeholder run: no text before it, none after (keys.chunk_cid).
      put_field(&state, 'T', nullptr, 0);
      put_u64(&state, length);
      put_field(&state, 'M', items + item_at, static_cast<uint64_t>(item_nbytes));
      put_field(&state, 'T', nullptr, 0);
    }
    put_hex(XXH3_128bits_digest(&state), out + kStride * r);
    out[kStride * r + 32] = '\n';
  }
  // An antecedent hashes the cids joined without separators: fed one at a time.
  char* antecedents = out + kStride * num_runs;
  for (int64_t i = 0; i <= num_runs; ++i) {
    XXH3_128bits_reset(&state);
    XXH3_128bits_update(&state, version, static_cast<size_t>(version_nbytes));
    XXH3_128bits_update(&state, "A", 1);
    put_u64(&state, static_cast<uint64_t>(i));
    for (int64_t c = 0; c < i; ++c) XXH3_128bits_update(&state, out + kStride * c, 32);
    put_hex(XXH3_128bits_digest(&state), antecedents + kStride * i);
    if (i < num_runs) antecedents[kStride * i + 32] = '\n';
  }
  return 0;
}
