// The library's entry points as a CPython extension module (``_orbitkv_native``), built into the
// same shared object when the Python headers are there (``native.py``). The scheduler and the
// worker call an op once a request, right after the engine sat idle, on cold caches: there a
// ctypes call costs about 60 us (its argument converters and call machinery are a lot of code to
// fetch again), a METH_FASTCALL function about 25 us (connector/cdc.py's cuts, measured). Each
// function takes the C entry point's arguments in order: an integer for each integer, and for a
// pointer an int (an address), None (NULL) or any object exporting a buffer (bytes, an
// ``array('q')``), which stays held for the call. The GIL is released while the op runs.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

#define ORBITKV_IMPORT extern "C"

ORBITKV_IMPORT int orbitkv_cpu_vec_load(void*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                        int, const void*, const void*, int64_t, const int64_t*,
                                        const float*, const float*, int64_t, int64_t, int64_t, int,
                                        const float*, const float*, int);
ORBITKV_IMPORT int orbitkv_cpu_vec_gather(const void*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          int64_t, int, void*, void*, int64_t, const int64_t*, int);
using ManyLoad = int (*)(int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int, const int64_t*, const int64_t*, const int64_t*,
                         const int64_t*, const int64_t*, const int64_t*, const int64_t*, int64_t,
                         int64_t, int, int);
using StackedLoad = int (*)(int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int, int64_t, const int64_t*, int64_t, int64_t, int, int);
using ManyGather = int (*)(int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int, const int64_t*, const int64_t*, int64_t, const int64_t*,
                           int);
ORBITKV_IMPORT int orbitkv_cpu_vec_load_many(int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                             int64_t, int64_t, int64_t, int, const int64_t*,
                                             const int64_t*, const int64_t*, const int64_t*,
                                             const int64_t*, const int64_t*, const int64_t*,
                                             int64_t, int64_t, int, int);
ORBITKV_IMPORT int orbitkv_cpu_amx_load_many(int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                             int64_t, int64_t, int64_t, int, const int64_t*,
                                             const int64_t*, const int64_t*, const int64_t*,
                                             const int64_t*, const int64_t*, const int64_t*,
                                             int64_t, int64_t, int, int);
ORBITKV_IMPORT int orbitkv_cpu_vec_load_stacked(int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                                int64_t, int64_t, int64_t, int, int64_t,
                                                const int64_t*, int64_t, int64_t, int, int);
ORBITKV_IMPORT int orbitkv_cpu_amx_load_stacked(int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                                int64_t, int64_t, int64_t, int, int64_t,
                                                const int64_t*, int64_t, int64_t, int, int);
ORBITKV_IMPORT int orbitkv_cpu_vec_gather_many(int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                               int64_t, int64_t, int64_t, int, const int64_t*,
                                               const int64_t*, int64_t, const int64_t*, int);
ORBITKV_IMPORT int orbitkv_cpu_amx_gather_many(int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                               int64_t, int64_t, int64_t, int, const int64_t*,
                                               const int64_t*, int64_t, const int64_t*, int);
ORBITKV_IMPORT int64_t orbitkv_cdc_cuts(const int64_t*, const int64_t*, const uint8_t*, int64_t*,
                                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                        uint64_t);
ORBITKV_IMPORT int orbitkv_chunk_keys(const int64_t*, int64_t, const int64_t*, int64_t,
                                      const uint8_t*, int64_t, const uint8_t*, int64_t,
                                      const uint8_t*, int64_t, char*);
ORBITKV_IMPORT int orbitkv_native_version();
// The functions that take Python objects, not an entry point's arguments (pyprompt.cpp).
PyObject* orbitkv_py_chunk_keys(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* orbitkv_py_chunk_prompt(PyObject*, PyObject* const*, Py_ssize_t);

namespace {

constexpr int kMaxArgs = 24;

// One call's arguments as integers (pointers as addresses), with the buffers they hold.
struct Args {
  int64_t v[kMaxArgs] = {};
  Py_buffer views[kMaxArgs];
  int num_views = 0;

  ~Args() {
    for (int i = 0; i < num_views; ++i) PyBuffer_Release(&views[i]);
  }

  // kinds[i]: 'i' an integer (int64 range), 'u' an unsigned 64-bit mask, 'p' a pointer.
  bool parse(const char* name, PyObject* const* args, Py_ssize_t nargs, const char* kinds) {
    Py_ssize_t want = 0;
    while (kinds[want] != '\0') ++want;
    if (nargs != want) {
      PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
      return false;
    }
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      PyObject* a = args[i];
      if (kinds[i] == 'i') {
        v[i] = PyLong_AsLongLong(a);
      } else if (kinds[i] == 'u') {
        v[i] = static_cast<int64_t>(PyLong_AsUnsignedLongLongMask(a));
      } else if (a == Py_None) {
        v[i] = 0;
      } else if (PyLong_Check(a)) {
        v[i] = static_cast<int64_t>(reinterpret_cast<intptr_t>(PyLong_AsVoidPtr(a)));
      } else {
        if (PyObject_GetBuffer(a, &views[num_views], PyBUF_SIMPLE) != 0) return false;
        v[i] = static_cast<int64_t>(reinterpret_cast<intptr_t>(views[num_views].buf));
        ++num_views;
      }
      if (PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s: argument %zd is not a valid %s", name, i,
                     kinds[i] == 'p' ? "pointer" : "integer");
        return false;
      }
    }
    return true;
  }

  template <typename T>
  T* p(int i) const {
    return reinterpret_cast<T*>(static_cast<intptr_t>(v[i]));
  }
  int n(int i) const { return static_cast<int>(v[i]); }
};

PyObject* cpu_vec_load(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Args a;
  if (!a.parse("orbitkv_cpu_vec_load", args, nargs, "piiiiiiippipppiiiippi")) return nullptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = orbitkv_cpu_vec_load(a.p<void>(0), a.v[1], a.v[2], a.v[3], a.v[4], a.v[5], a.v[6], a.n(7),
                            a.p<const void>(8), a.p<const void>(9), a.v[10],
                            a.p<const int64_t>(11), a.p<const float>(12), a.p<const float>(13),
                            a.v[14], a.v[15], a.v[16], a.n(17), a.p<const float>(18),
                            a.p<const float>(19), a.n(20));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

PyObject* cpu_vec_gather(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Args a;
  if (!a.parse("orbitkv_cpu_vec_gather", args, nargs, "piiiiiiippipi")) return nullptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = orbitkv_cpu_vec_gather(a.p<const void>(0), a.v[1], a.v[2], a.v[3], a.v[4], a.v[5], a.v[6],
                              a.n(7), a.p<void>(8), a.p<void>(9), a.v[10],
                              a.p<const int64_t>(11), a.n(12));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

PyObject* load_many(ManyLoad op, const char* name, PyObject* const* args, Py_ssize_t nargs) {
  Args a;
  if (!a.parse(name, args, nargs, "ipiiiiiiipppppppiiii")) return nullptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = op(a.v[0], a.p<const int64_t>(1), a.v[2], a.v[3], a.v[4], a.v[5], a.v[6], a.v[7], a.n(8),
          a.p<const int64_t>(9), a.p<const int64_t>(10), a.p<const int64_t>(11),
          a.p<const int64_t>(12), a.p<const int64_t>(13), a.p<const int64_t>(14),
          a.p<const int64_t>(15), a.v[16], a.v[17], a.n(18), a.n(19));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

PyObject* load_stacked(StackedLoad op, const char* name, PyObject* const* args,
                       Py_ssize_t nargs) {
  Args a;
  if (!a.parse(name, args, nargs, "ipiiiiiiiipiiii")) return nullptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = op(a.v[0], a.p<const int64_t>(1), a.v[2], a.v[3], a.v[4], a.v[5], a.v[6], a.v[7], a.n(8),
          a.v[9], a.p<const int64_t>(10), a.v[11], a.v[12], a.n(13), a.n(14));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

PyObject* gather_many(ManyGather op, const char* name, PyObject* const* args, Py_ssize_t nargs) {
  Args a;
  if (!a.parse(name, args, nargs, "ipiiiiiiippipi")) return nullptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = op(a.v[0], a.p<const int64_t>(1), a.v[2], a.v[3], a.v[4], a.v[5], a.v[6], a.v[7], a.n(8),
          a.p<const int64_t>(9), a.p<const int64_t>(10), a.v[11], a.p<const int64_t>(12),
          a.n(13));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

PyObject* cdc_cuts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Args a;
  if (!a.parse("orbitkv_cdc_cuts", args, nargs, "ppppiiiiiiu")) return nullptr;
  int64_t rc;
  Py_BEGIN_ALLOW_THREADS
  rc = orbitkv_cdc_cuts(a.p<const int64_t>(0), a.p<const int64_t>(1), a.p<const uint8_t>(2),
                        a.p<int64_t>(3), a.v[4], a.v[5], a.v[6], a.v[7], a.v[8], a.v[9],
                        static_cast<uint64_t>(a.v[10]));
  Py_END_ALLOW_THREADS
  return PyLong_FromLongLong(rc);
}

PyObject* chunk_keys(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Args a;
  if (!a.parse("orbitkv_chunk_keys", args, nargs, "pipipipipip")) return nullptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = orbitkv_chunk_keys(a.p<const int64_t>(0), a.v[1], a.p<const int64_t>(2), a.v[3],
                          a.p<const uint8_t>(4), a.v[5], a.p<const uint8_t>(6), a.v[7],
                          a.p<const uint8_t>(8), a.v[9], a.p<char>(10));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(rc);
}

PyObject* native_version(PyObject*, PyObject* const*, Py_ssize_t nargs) {
  if (nargs != 0) {
    PyErr_SetString(PyExc_TypeError, "orbitkv_native_version takes no arguments");
    return nullptr;
  }
  return PyLong_FromLong(orbitkv_native_version());
}

#define ORBITKV_MANY(kind, layout)                                                       \
  PyObject* cpu_##layout##_##kind(PyObject*, PyObject* const* args, Py_ssize_t nargs) { \
    return kind(orbitkv_cpu_##layout##_##kind, "orbitkv_cpu_" #layout "_" #kind, args,  \
                nargs);                                                                   \
  }
ORBITKV_MANY(load_many, vec)
ORBITKV_MANY(load_many, amx)
ORBITKV_MANY(load_stacked, vec)
ORBITKV_MANY(load_stacked, amx)
ORBITKV_MANY(gather_many, vec)
ORBITKV_MANY(gather_many, amx)

#define ORBITKV_METHOD(name, fn) \
  {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fn)), METH_FASTCALL, nullptr}

PyMethodDef kMethods[] = {
    ORBITKV_METHOD("orbitkv_cpu_vec_load", cpu_vec_load),
    ORBITKV_METHOD("orbitkv_cpu_vec_gather", cpu_vec_gather),
    ORBITKV_METHOD("orbitkv_cpu_vec_load_many", cpu_vec_load_many),
    ORBITKV_METHOD("orbitkv_cpu_amx_load_many", cpu_amx_load_many),
    ORBITKV_METHOD("orbitkv_cpu_vec_load_stacked", cpu_vec_load_stacked),
    ORBITKV_METHOD("orbitkv_cpu_amx_load_stacked", cpu_amx_load_stacked),
    ORBITKV_METHOD("orbitkv_cpu_vec_gather_many", cpu_vec_gather_many),
    ORBITKV_METHOD("orbitkv_cpu_amx_gather_many", cpu_amx_gather_many),
    ORBITKV_METHOD("orbitkv_cdc_cuts", cdc_cuts),
    ORBITKV_METHOD("orbitkv_chunk_keys", chunk_keys),
    ORBITKV_METHOD("chunk_keys", orbitkv_py_chunk_keys),
    ORBITKV_METHOD("chunk_prompt", orbitkv_py_chunk_prompt),
    ORBITKV_METHOD("orbitkv_native_version", native_version),
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_orbitkv_native", nullptr, -1, kMethods};

}  // namespace

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__orbitkv_native() {
  return PyModule_Create(&kModule);
}
