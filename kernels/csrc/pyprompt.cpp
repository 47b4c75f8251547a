// The extension module's functions that take Python objects rather than an entry point's
// arguments (pymodule.cpp registers them): a prompt's chunk keys (connector/chunk_keys.py) and its
// whole layout with keys (connector/chunking.py's chunk_prompt). The scheduler calls one of them
// for every prompt it admits, on cold caches: there building the int64 arrays of runs, splitting
// the output and making the key strings in Python were most of the keying's time, and the
// layout's Python (stretches, cut lists, a bisect and an object a chunk) about 80 us a prompt.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

extern "C" int orbitkv_chunk_keys(const int64_t*, int64_t, const int64_t*, int64_t, const uint8_t*,
                                  int64_t, const uint8_t*, int64_t, const uint8_t*, int64_t, char*);
extern "C" int64_t orbitkv_chunk_layout(const int64_t*, int64_t, const int64_t*, int64_t,
                                        const int64_t*, int64_t, int64_t, int64_t, int,
                                        const uint8_t*, int64_t, int64_t, int64_t, uint64_t,
                                        int64_t*);

namespace {

// A held buffer, released when it goes out of scope.
struct View {
  Py_buffer buffer{};
  bool is_held = false;
  bool get(PyObject* object) {
    is_held = PyObject_GetBuffer(object, &buffer, PyBUF_SIMPLE) == 0;
    return is_held;
  }
  ~View() {
    if (is_held) PyBuffer_Release(&buffer);
  }
};

// A prompt's token ids: an int64 buffer (an array('q')) held as it is, or a list of ints (vLLM's
// prompt_token_ids) converted here. array('q', list) took about 45 ns a token through its generic
// item setter, 80 us for an agent's 1,800-token prompt, most of what keying it cost.
struct Tokens {
  View view;
  std::vector<int64_t> converted;
  const int64_t* data = nullptr;
  int64_t size = 0;
  bool get(PyObject* object) {
    if (PyList_CheckExact(object)) {
      const Py_ssize_t n = PyList_GET_SIZE(object);
      converted.resize(static_cast<size_t>(n));
      PyObject** items = PySequence_Fast_ITEMS(object);
      for (Py_ssize_t i = 0; i < n; ++i) {
        // Ints only: another object's __index__ would run Python code that may resize the list.
        if (!PyLong_Check(items[i])) {
          PyErr_SetString(PyExc_TypeError, "tokens must be ints");
          return false;
        }
        const long long value = PyLong_AsLongLong(items[i]);
        if (value == -1 && PyErr_Occurred()) return false;
        converted[static_cast<size_t>(i)] = value;
      }
      data = converted.data();
      size = static_cast<int64_t>(n);
      return true;
    }
    if (!view.get(object)) return false;
    if (view.buffer.len % 8 != 0) {
      PyErr_SetString(PyExc_ValueError, "tokens must be an int64 buffer or a list of ints");
      return false;
    }
    data = static_cast<const int64_t*>(view.buffer.buf);
    size = static_cast<int64_t>(view.buffer.len / 8);
    return true;
  }
};

// An item's name appended to items (UTF-8); its offset and length in it, or false on an error.
bool append_name(PyObject* name, std::string& items, int64_t* at, int64_t* nbytes) {
  Py_ssize_t size = 0;
  const char* raw = PyUnicode_AsUTF8AndSize(name, &size);
  if (raw == nullptr) return false;
  *at = static_cast<int64_t>(items.size());
  *nbytes = size;
  items.append(raw, static_cast<size_t>(size));
  return true;
}

// The (int, int, name) tuples of a sequence (what: its name in errors, form: a tuple's): tuple i's
// ints as ints[2i], ints[2i + 1], its name appended to bytes (UTF-8) at names[2i], of length
// names[2i + 1] (-1: None, where is_none_allowed). False with an exception set.
bool parse_triples(PyObject* sequence, const char* what, const char* form, bool is_none_allowed,
                   std::vector<int64_t>& ints, std::vector<int64_t>& names, std::string& bytes) {
  const std::string not_a_sequence = std::string(what) + " must be a sequence";
  PyObject* seq = PySequence_Fast(sequence, not_a_sequence.c_str());
  if (seq == nullptr) return false;
  const Py_ssize_t num = PySequence_Fast_GET_SIZE(seq);
  ints.assign(2 * static_cast<size_t>(num), 0);
  names.assign(2 * static_cast<size_t>(num), 0);
  PyObject** triples = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < num; ++i) {
    PyObject* triple = triples[i];
    if (!PyTuple_Check(triple) || PyTuple_GET_SIZE(triple) != 3) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_TypeError, "%s: each must be %s", what, form);
      return false;
    }
    ints[2 * i] = PyLong_AsLongLong(PyTuple_GET_ITEM(triple, 0));
    ints[2 * i + 1] = PyLong_AsLongLong(PyTuple_GET_ITEM(triple, 1));
    PyObject* name = PyTuple_GET_ITEM(triple, 2);
    bool is_ok = !PyErr_Occurred();
    if (is_ok && is_none_allowed && name == Py_None) {
      names[2 * i + 1] = -1;
    } else if (is_ok) {
      is_ok = append_name(name, bytes, &names[2 * i], &names[2 * i + 1]);
    }
    if (!is_ok) {
      Py_DECREF(seq);
      return false;
    }
  }
  Py_DECREF(seq);
  return true;
}

// The keys of num_runs runs over the tokens (spec: orbitkv_chunk_keys's runs) as three lists:
// cids, antecedent hashes (num_runs + 1), exact entry keys (head + cid + ':' + antecedent). None
// with ValueError set when a run lies outside the prompt.
PyObject* key_lists(const Tokens& tokens, const std::vector<int64_t>& spec, int64_t num_runs,
                    const std::string& items, PyObject* const* strings) {
  char *prefix = nullptr, *version = nullptr, *head = nullptr;
  Py_ssize_t prefix_nbytes = 0, version_nbytes = 0, head_nbytes = 0;
  if (PyBytes_AsStringAndSize(strings[0], &prefix, &prefix_nbytes) != 0 ||
      PyBytes_AsStringAndSize(strings[1], &version, &version_nbytes) != 0 ||
      PyBytes_AsStringAndSize(strings[2], &head, &head_nbytes) != 0) {
    return nullptr;
  }
  const int64_t num_tokens = tokens.size;
  std::string out(33 * (2 * static_cast<size_t>(num_runs) + 1), '\0');
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = orbitkv_chunk_keys(tokens.data, num_tokens, spec.data(),
                          num_runs, reinterpret_cast<const uint8_t*>(prefix), prefix_nbytes,
                          reinterpret_cast<const uint8_t*>(items.data()),
                          static_cast<int64_t>(items.size()),
                          reinterpret_cast<const uint8_t*>(version), version_nbytes, &out[0]);
  Py_END_ALLOW_THREADS
  if (rc != 0) {
    PyErr_Format(PyExc_ValueError, "a run lies outside the %lld-token prompt",
                 static_cast<long long>(num_tokens));
    return nullptr;
  }
  PyObject* cids = PyList_New(num_runs);
  PyObject* antecedents = PyList_New(num_runs + 1);
  PyObject* exact_keys = PyList_New(num_runs);
  if (cids == nullptr || antecedents == nullptr || exact_keys == nullptr) {
    Py_XDECREF(cids);
    Py_XDECREF(antecedents);
    Py_XDECREF(exact_keys);
    return nullptr;
  }
  std::string entry(head, static_cast<size_t>(head_nbytes));
  entry.resize(entry.size() + 65, ':');  // cid ':' antecedent
  char* const entry_cid = &entry[static_cast<size_t>(head_nbytes)];
  for (int64_t i = 0; i < 2 * num_runs + 1; ++i) {
    PyObject* key = PyUnicode_DecodeASCII(out.data() + 33 * i, 32, nullptr);
    PyObject* exact = nullptr;
    if (key != nullptr && i < num_runs) {
      std::memcpy(entry_cid, out.data() + 33 * i, 32);
      std::memcpy(entry_cid + 33, out.data() + 33 * (num_runs + i), 32);
      exact = PyUnicode_DecodeASCII(entry.data(), static_cast<Py_ssize_t>(entry.size()), nullptr);
    }
    if (key == nullptr || (i < num_runs && exact == nullptr)) {
      Py_XDECREF(key);
      Py_DECREF(cids);
      Py_DECREF(antecedents);
      Py_DECREF(exact_keys);
      return nullptr;
    }
    if (i < num_runs) {
      PyList_SET_ITEM(cids, i, key);
      PyList_SET_ITEM(exact_keys, i, exact);
    } else {
      PyList_SET_ITEM(antecedents, i - num_runs, key);
    }
  }
  return Py_BuildValue("(NNN)", cids, antecedents, exact_keys);
}

}  // namespace

// chunk_keys(tokens, runs, prefix, version, key_head) -> (cids, antecedents, exact_keys):
// orbitkv_chunk_keys over a list of (start, end, item hash or None) tuples, as strings, and each
// chunk's exact conditioned entry key, key_head + cid + ':' + its antecedent hash
// (keys.conditioned_key).
PyObject* orbitkv_py_chunk_keys(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "chunk_keys takes 5 arguments, got %zd", nargs);
    return nullptr;
  }
  Tokens tokens;
  if (!tokens.get(args[0])) return nullptr;
  std::vector<int64_t> bounds, names;
  std::string items;
  if (!parse_triples(args[1], "chunk_keys: runs", "(start, end, item or None)", true, bounds, names,
                     items)) {
    return nullptr;
  }
  const int64_t num_runs = static_cast<int64_t>(bounds.size() / 2);
  std::vector<int64_t> spec(4 * static_cast<size_t>(num_runs));
  for (int64_t r = 0; r < num_runs; ++r) {
    spec[4 * r] = bounds[2 * r];
    spec[4 * r + 1] = bounds[2 * r + 1];
    spec[4 * r + 2] = names[2 * r];
    spec[4 * r + 3] = names[2 * r + 1];
  }
  return key_lists(tokens, spec, num_runs, items, args + 2);
}

// chunk_prompt(tokens, items, boundaries, anchor_len, chunk_size, is_content, line_end_table,
//              window, min_len, mask, prefix, version, key_head)
//   -> (spans, cids, antecedents, exact_keys)
// tokens: an array('q') or a list of ints; items: a list of (offset, length, name) tuples; boundaries: a list of
// ints; line_end_table: bytes (empty: no line ends). orbitkv_chunk_layout lays the prompt out,
// spans holds its (start, length, kind) tuples (kind: -2 the anchor, -1 text, i the item
// items[i]), and the keys are chunk_keys' of those chunks, an item's chunk named by the item.
// ValueError where the layout or the keys refuse the prompt (chunking.split_spans says why).
PyObject* orbitkv_py_chunk_prompt(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 13) {
    PyErr_Format(PyExc_TypeError, "chunk_prompt takes 13 arguments, got %zd", nargs);
    return nullptr;
  }
  Tokens tokens;
  View table;
  if (!tokens.get(args[0]) || !table.get(args[6])) return nullptr;
  const int64_t n = tokens.size;
  std::vector<int64_t> placed, names;
  std::string item_bytes;
  if (!parse_triples(args[1], "chunk_prompt: items", "(offset, length, name)", false, placed, names,
                     item_bytes)) {
    return nullptr;
  }
  const int64_t num_items = static_cast<int64_t>(placed.size() / 2);
  PyObject* cut_list = PySequence_Fast(args[2], "chunk_prompt: boundaries must be a sequence");
  if (cut_list == nullptr) return nullptr;
  std::vector<int64_t> boundaries(static_cast<size_t>(PySequence_Fast_GET_SIZE(cut_list)));
  for (size_t b = 0; b < boundaries.size(); ++b) {
    boundaries[b] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(cut_list, b));
  }
  Py_DECREF(cut_list);
  const int64_t anchor_len = PyLong_AsLongLong(args[3]), chunk_size = PyLong_AsLongLong(args[4]);
  const int64_t is_content = PyLong_AsLongLong(args[5]), window = PyLong_AsLongLong(args[7]);
  const int64_t min_len = PyLong_AsLongLong(args[8]);
  const uint64_t mask = PyLong_AsUnsignedLongLongMask(args[9]);
  if (PyErr_Occurred()) return nullptr;
  std::vector<int64_t> spans(3 * (static_cast<size_t>(n + num_items) + 1));
  int64_t num_spans;
  Py_BEGIN_ALLOW_THREADS
  num_spans = orbitkv_chunk_layout(
      tokens.data, n, placed.data(), num_items,
      boundaries.data(), static_cast<int64_t>(boundaries.size()), anchor_len, chunk_size,
      is_content != 0, static_cast<const uint8_t*>(table.buffer.buf), table.buffer.len, window,
      min_len, mask, spans.data());
  Py_END_ALLOW_THREADS
  if (num_spans == -2) return PyErr_NoMemory();
  if (num_spans < 0) {
    PyErr_SetString(PyExc_ValueError, "chunk_prompt: the prompt cannot be laid out");
    return nullptr;
  }
  std::vector<int64_t> spec(4 * static_cast<size_t>(num_spans));
  PyObject* span_list = PyList_New(num_spans);
  if (span_list == nullptr) return nullptr;
  for (int64_t s = 0; s < num_spans; ++s) {
    const int64_t start = spans[3 * s], length = spans[3 * s + 1], kind = spans[3 * s + 2];
    spec[4 * s] = start;
    spec[4 * s + 1] = start + length;
    spec[4 * s + 2] = kind >= 0 ? names[2 * kind] : 0;
    spec[4 * s + 3] = kind >= 0 ? names[2 * kind + 1] : -1;
    PyObject* row = Py_BuildValue("(LLL)", static_cast<long long>(start),
                                  static_cast<long long>(length), static_cast<long long>(kind));
    if (row == nullptr) {
      Py_DECREF(span_list);
      return nullptr;
    }
    PyList_SET_ITEM(span_list, s, row);
  }
  PyObject* keys = key_lists(tokens, spec, num_spans, item_bytes, args + 10);
  if (keys == nullptr) {
    Py_DECREF(span_list);
    return nullptr;
  }
  PyObject* out = Py_BuildValue("(NOOO)", span_list, PyTuple_GET_ITEM(keys, 0),
                                PyTuple_GET_ITEM(keys, 1), PyTuple_GET_ITEM(keys, 2));
  Py_DECREF(keys);
  return out;
}
