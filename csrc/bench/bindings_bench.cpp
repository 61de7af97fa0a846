// Python module kvcached._vmm_bench: timings of the raw backend calls, for benchmarks/bench_vmm.py.
// Not part of the shipping _vmm module: setup.py builds it only with KVCACHED_BUILD_BENCH=1.
// Its functions take a kvcached._vmm.Backend (pybind11 shares the type between the two
// modules; kvc::Error is turned into Python exceptions by _vmm's translator).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "backend.h"

namespace py = pybind11;

namespace kvc {
std::map<std::string, std::vector<double>> bench_driver_calls(Backend& b, int64_t num_pages, size_t page_bytes);
std::map<std::string, std::vector<double>> bench_breakdown(Backend& b, int64_t num_units, size_t unit);
}  // namespace kvc

namespace {

size_t as_size(int64_t v, const char* what) {
  if (v < 0) kvc::throw_value(std::string(what) + " must be >= 0, got " + std::to_string(v) + ".");
  return static_cast<size_t>(v);
}

}  // namespace

PYBIND11_MODULE(_vmm_bench, m) {
  m.doc() = "kvcached native benchmarks: per-call latency of a kvcached._vmm.Backend's driver calls.";
  py::module_::import("kvcached._vmm");  // registers Backend and the exception translator

  m.def("bench_driver_calls", [](std::shared_ptr<kvc::Backend> b, int64_t num_pages, int64_t page_bytes) {
    size_t pb = as_size(page_bytes, "page_bytes");
    py::gil_scoped_release rel;
    return kvc::bench_driver_calls(*b, num_pages, pb);
  }, py::arg("backend"), py::arg("num_pages"), py::arg("page_bytes"),
        "Per-call microseconds of reserve, create, map, set_access, unmap, release (and batched variants).");

  m.def("bench_breakdown", [](std::shared_ptr<kvc::Backend> b, int64_t num_units, int64_t unit) {
    size_t u = as_size(unit, "unit");
    py::gil_scoped_release rel;
    return kvc::bench_breakdown(*b, num_units, u);
  }, py::arg("backend"), py::arg("num_units"), py::arg("unit"),
        "Microseconds of zero-page mapping experiments (same vs distinct handles, chunk sizes, threads...).");
}
