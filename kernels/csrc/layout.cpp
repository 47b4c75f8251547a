// A prompt's chunk layout (connector/chunking.py holds the definition: split_spans and the text
// cuts it takes from connector/cdc.py): the anchor, one chunk per multimodal item, and text runs of
// at most chunk_size cut at the caller's boundaries and, for content-defined chunking, where
// orbitkv_cdc_cuts cuts. The scheduler lays out every prompt it admits, right after the engine sat
// idle: there the Python split (stretches, cut lists, a bisect and an object a chunk) cost about
// 80 us a prompt on cold caches, the cuts' native call only a part of it.
#include <algorithm>
#include <cstdint>
#include <new>
#include <numeric>
#include <vector>

#define ORBITKV_API extern "C" __attribute__((visibility("default")))

ORBITKV_API int64_t orbitkv_cdc_cuts(const int64_t* tokens, const int64_t* bounds,
                                     const uint8_t* table, int64_t* cuts, int64_t n,
                                     int64_t num_stretches, int64_t window, int64_t min_len,
                                     int64_t max_len, int64_t table_len, uint64_t mask);

namespace {

// Appends the text runs of [start, end): cut at the cuts inside it (sorted), at most chunk_size.
void text_runs(std::vector<int64_t>& spans, const std::vector<int64_t>& cuts, int64_t start,
               int64_t end, int64_t chunk_size) {
  auto it = std::upper_bound(cuts.begin(), cuts.end(), start);
  const auto last = std::lower_bound(it, cuts.end(), end);
  int64_t pos = start;
  while (true) {
    const int64_t cut = it == last ? end : *it;
    while (pos < cut) {
      const int64_t length = std::min(chunk_size, cut - pos);
      spans.insert(spans.end(), {pos, length, -1});
      pos += length;
    }
    if (it == last) return;
    ++it;
  }
}

}  // namespace

// Lays out an n-token prompt and writes its chunks to spans, three numbers each: start, length,
// and what it is (-2 the anchor, -1 text, i >= 0 the item items[2 i .. 2 i + 1], its offset and
// length). Items are taken in order of offset (stable; those of length <= 0 only end a text
// stretch, as chunking._text_stretches). boundaries: cut points (any order, those outside (0, n)
// ignored). is_content: also cut as cdc.text_cuts does, with its window, min_len, chunk_size as
// max_len, mask and line-end table (table_len 0: none). spans has room for 3 (n + num_items + 1).
// Returns the number of chunks; -1 for bad arguments (an item overlapping the previous chunk or
// running past the prompt, an anchor outside it), -2 when out of memory.
ORBITKV_API int64_t orbitkv_chunk_layout(const int64_t* tokens, int64_t n, const int64_t* items,
                                         int64_t num_items, const int64_t* boundaries,
                                         int64_t num_boundaries, int64_t anchor_len,
                                         int64_t chunk_size, int is_content, const uint8_t* table,
                                         int64_t table_len, int64_t window, int64_t min_len,
                                         uint64_t mask, int64_t* spans) {
  if (n < 0 || num_items < 0 || num_boundaries < 0 || chunk_size <= 0 || anchor_len < 0 ||
      anchor_len > n) {
    return -1;
  }
  try {
    std::vector<int64_t> order(static_cast<size_t>(num_items));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [items](int64_t a, int64_t b) { return items[2 * a] < items[2 * b]; });
    std::vector<int64_t> cuts;
    for (int64_t b = 0; b < num_boundaries; ++b) {
      if (0 < boundaries[b] && boundaries[b] < n) cuts.push_back(boundaries[b]);
    }
    if (is_content) {
      // The text stretches: between the anchor, the items and the prompt's end.
      std::vector<int64_t> starts, ends;
      int64_t pos = anchor_len;
      for (const int64_t i : order) {
        const int64_t offset = items[2 * i], length = items[2 * i + 1];
        if (offset > pos) {
          starts.push_back(pos);
          ends.push_back(offset);
        }
        int64_t end;
        if (__builtin_add_overflow(offset, length, &end)) end = length > 0 ? INT64_MAX : INT64_MIN;
        pos = std::max(pos, end);
      }
      if (n > pos) {
        starts.push_back(pos);
        ends.push_back(n);
      }
      const int64_t num_stretches = static_cast<int64_t>(starts.size());
      starts.insert(starts.end(), ends.begin(), ends.end());
      std::vector<int64_t> found(static_cast<size_t>(n) + 1);
      const int64_t num_found =
          orbitkv_cdc_cuts(tokens, starts.data(), table, found.data(), n, num_stretches, window,
                           min_len, chunk_size, table_len, mask);
      if (num_found < 0) return num_found;
      cuts.insert(cuts.end(), found.begin(), found.begin() + num_found);
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());

    std::vector<int64_t> out;
    out.reserve(3 * static_cast<size_t>(num_items + 1) + 3 * static_cast<size_t>(n / chunk_size));
    if (anchor_len) out.insert(out.end(), {int64_t{0}, anchor_len, int64_t{-2}});
    int64_t pos = anchor_len;
    for (const int64_t i : order) {
      const int64_t offset = items[2 * i], length = items[2 * i + 1];
      if (length <= 0) continue;
      if (offset < pos || length > n - offset) return -1;
      text_runs(out, cuts, pos, offset, chunk_size);
      out.insert(out.end(), {offset, length, i});
      pos = offset + length;
    }
    text_runs(out, cuts, pos, n, chunk_size);
    std::copy(out.begin(), out.end(), spans);
    return static_cast<int64_t>(out.size() / 3);
  } catch (const std::bad_alloc&) {
    return -2;
  }
}
