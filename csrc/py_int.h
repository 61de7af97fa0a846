// Python ints for counts, sizes and ids. pybind11's own int64_t conversion takes True as 1
// and answers an int past 64 bits with "incompatible function arguments"; these say what
// was wrong instead.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

namespace kvc {

inline std::string py_type_name(pybind11::handle obj) {
  return pybind11::str(pybind11::type::of(obj).attr("__name__"));
}

// Any object with __index__ (int, numpy and torch integers) except bool.
inline int64_t py_int(pybind11::handle obj, const char* what) {
  PyObject* o = obj.ptr();
  if (PyLong_CheckExact(o)) {  // the fast path's common case: no __index__ call
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow) return v;
  }
  if (PyBool_Check(o) || !PyIndex_Check(o)) {
    throw pybind11::type_error(std::string(what) + " must be an int, got " + py_type_name(obj) +
                               (PyBool_Check(o) ? " (a bool is not a count; pass 0 or 1 explicitly)." : "."));
  }
  pybind11::object idx = pybind11::reinterpret_steal<pybind11::object>(PyNumber_Index(o));
  if (!idx) throw pybind11::error_already_set();
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
  if (overflow) {
    throw pybind11::value_error(std::string(what) + " = " + std::string(pybind11::str(idx)) +
                                " does not fit in 64 bits; pass a value in [-2^63, 2^63).");
  }
  if (v == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
  return v;
}

}  // namespace kvc
