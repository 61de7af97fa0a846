// Python module kvcached._vmm (see docs/design.md for the contract).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "backend.h"
#include "dlpack.h"
#include "host_budget.h"
#include "py_int.h"
#include "vtensor.h"

namespace py = pybind11;

namespace kvc {
size_t host_resident_bytes(Backend& b);
void stop_all_prealloc_threads() noexcept;
void bind_allocators(pybind11::module_& m);
}  // namespace kvc

namespace {

using namespace kvc;

PyObject* g_driver_error = nullptr;
PyObject* g_lib_error = nullptr;
PyObject* g_nodev_error = nullptr;
PyObject* g_oom_error = nullptr;
PyObject* g_state_error = nullptr;

size_t as_size(py::handle obj, const char* what) {
  int64_t v = py_int(obj, what);
  if (v < 0) throw_value(std::string(what) + " must be >= 0, got " + std::to_string(v) + ".");
  return static_cast<size_t>(v);
}

struct DLCtx {
  std::shared_ptr<VirtualTensor> keep;  // the mapping lives while torch holds a view
  int64_t shape[1];
  int64_t strides[1];
  DLManagedTensor m;
};

void dl_deleter(DLManagedTensor* self) { delete static_cast<DLCtx*>(self->manager_ctx); }

void capsule_destructor(PyObject* cap) {
  // Only an unconsumed capsule still owns its tensor; consumers rename it.
  if (!PyCapsule_IsValid(cap, "dltensor")) return;
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
  if (m && m->deleter) m->deleter(m);
}

py::capsule to_dlpack(const std::shared_ptr<VirtualTensor>& vt) {
  auto* ctx = new DLCtx();
  ctx->keep = vt;
  ctx->shape[0] = static_cast<int64_t>(vt->size());
  ctx->strides[0] = 1;
  auto dev = vt->backend()->dlpack_device();
  DLTensor& t = ctx->m.dl_tensor;
  t.data = reinterpret_cast<void*>(vt->ptr());
  t.device = {dev.first, dev.second};
  t.ndim = 1;
  t.dtype = {1, 8, 1};
  t.shape = ctx->shape;
  t.strides = ctx->strides;
  t.byte_offset = 0;
  ctx->m.manager_ctx = ctx;
  ctx->m.deleter = dl_deleter;
  PyObject* cap = PyCapsule_New(&ctx->m, "dltensor", capsule_destructor);
  if (!cap) {
    delete ctx;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

PyObject* new_exception(const char* name, PyObject* bases, const char* doc) {
  PyObject* e = PyErr_NewExceptionWithDoc(name, doc, bases, nullptr);
  if (!e) throw py::error_already_set();
  return e;
}

}  // namespace

PYBIND11_MODULE(_vmm, m) {
  m.doc() = "kvcached native VMM core: backends (cuda, hip, host), virtual tensors, page allocator, block pool.";

  py::module_ errors = py::module_::import("kvcached.errors");
  py::object kv_error = errors.attr("KVCachedError");
  py::object exhausted = errors.attr("KVCachePoolExhausted");
  g_state_error = errors.attr("KVCachedStateError").ptr();
  Py_INCREF(g_state_error);
  g_driver_error = new_exception("kvcached._vmm.DriverError", kv_error.ptr(),
                                 "A GPU driver / runtime / OS call failed; the message names the call and the error.");
  g_lib_error = new_exception("kvcached._vmm.LibraryNotFoundError", g_driver_error,
                              "The runtime library (libcuda.so.1, libamdhip64) cannot be opened.");
  g_nodev_error = new_exception("kvcached._vmm.NoDeviceError", g_driver_error,
                                "The runtime library loads but there is no usable device.");
  py::tuple oom_bases = py::make_tuple(py::handle(g_driver_error), exhausted);
  g_oom_error = new_exception("kvcached._vmm.OutOfMemoryError", oom_bases.ptr(),
                              "Physical memory (device, host budget or page limit) is exhausted.");
  m.attr("DriverError") = py::handle(g_driver_error);
  m.attr("LibraryNotFoundError") = py::handle(g_lib_error);
  m.attr("NoDeviceError") = py::handle(g_nodev_error);
  m.attr("OutOfMemoryError") = py::handle(g_oom_error);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = g_driver_error;
      switch (e.kind) {
        case ErrKind::Driver: type = g_driver_error; break;
        case ErrKind::LibraryNotFound: type = g_lib_error; break;
        case ErrKind::NoDevice: type = g_nodev_error; break;
        case ErrKind::OutOfMemory: type = g_oom_error; break;
        case ErrKind::Value: type = PyExc_ValueError; break;
        case ErrKind::State: type = g_state_error; break;
      }
      PyErr_SetString(type, e.what());
    }
  });

  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def(py::init([](const std::string& kind, py::object device_obj, py::object host_limit_bytes,
                       std::optional<std::string> shm_name) {
             int64_t device = py_int(device_obj, "device");
             if (device > INT32_MAX) throw_value("device = " + std::to_string(device) + " is not a device index.");
             size_t limit = as_size(host_limit_bytes, "host_limit_bytes");
             if (shm_name && shm_name->empty()) throw_value("shm_name must not be empty; pass None for the default.");
             py::gil_scoped_release rel;
             return make_backend(kind, static_cast<int>(device), limit, shm_name.value_or(""));
           }),
           py::arg("kind"), py::arg("device") = 0, py::arg("host_limit_bytes") = 0, py::arg("shm_name") = py::none(),
           "host: the budget is shared by every process opening the same /dev/shm segment (shm_name, else "
           "KVCACHED_HOST_SHM_NAME, else kvcached_host_<uid>_<device>); host_limit_bytes > 0 sets it for all of "
           "them, 0 keeps the segment's (physical RAM when new).")
      .def_property_readonly("kind", [](const Backend& b) { return b.kind; })
      .def_property_readonly("device", [](const Backend& b) { return b.device; })
      .def_property_readonly("granularity", [](const Backend& b) { return b.granularity; })
      .def_property_readonly("map_offset_ok", &Backend::map_offset_ok,
                             "True when one physical allocation can be mapped in slices (else one per region).")
      .def("mem_info", [](Backend& b) {
        py::gil_scoped_release rel;
        return b.mem_info();
      })
      .def("physical_bytes", &Backend::physical_bytes,
           "Bytes of live physical allocations, the zero page and memory still waiting for release included.")
      .def("pending_release_bytes", &Backend::pending_release_bytes, py::call_guard<py::gil_scoped_release>(),
           "Bytes unmapped by a shrink whose release is still pending (a background thread releases them "
           "shortly after the shrink returns).")
      .def("flush_releases", &Backend::flush_releases, py::call_guard<py::gil_scoped_release>(),
           "Release what shrinks queued before this call; on return that memory is back with the driver. "
           "PageAllocator.trim and close do it themselves.")
      .def("_pause_releases", &Backend::pause_releases, py::arg("paused"), py::call_guard<py::gil_scoped_release>(),
           "Tests: while paused the background thread leaves queued releases alone (flushes still do them).")
      .def("_set_map_delay_us", &Backend::set_test_map_delay_us, py::arg("us"),
           "Tests (host backend): sleep this long in every map call, as a GPU's driver under load is slow.")
      .def("resident_bytes", [](Backend& b) { return host_resident_bytes(b); },
           "host: bytes of the memfd really backed by RAM; other backends: physical_bytes().")
      .def("set_host_limit", [](Backend& b, py::object bytes) { b.set_host_limit(as_size(bytes, "host limit")); },
           py::arg("bytes"))
      .def_property_readonly("shm_name", &Backend::shm_name,
                             "host: the /dev/shm segment of the shared budget ('/name'); other backends: ''.")
      .def("dlpack_device", &Backend::dlpack_device)
      .def("__repr__", [](const Backend& b) {
        return "<kvcached._vmm.Backend " + b.kind + ":" + std::to_string(b.device) + ">";
      });

  py::class_<VirtualTensor, std::shared_ptr<VirtualTensor>>(m, "VirtualTensor")
      .def(py::init([](std::shared_ptr<Backend> backend, py::object size, py::object unit, py::object zero_chunk) {
             size_t s = as_size(size, "size"), u = as_size(unit, "unit"), z = as_size(zero_chunk, "zero_chunk");
             py::gil_scoped_release rel;
             return std::make_shared<VirtualTensor>(std::move(backend), s, u, z);
           }),
           py::arg("backend"), py::arg("size"), py::arg("unit"), py::arg("zero_chunk") = 0,
           "zero_chunk (unit * 2^k, 0 = unit): largest zero mapping. Larger means fewer driver mappings, "
           "but unbacked writes alias only at equal offsets within a chunk.")
      .def_property_readonly("ptr", &VirtualTensor::ptr)
      .def_property_readonly("zero_chunk", &VirtualTensor::zero_chunk)
      .def_property_readonly("num_zero_mappings", &VirtualTensor::num_zero_mappings)
      .def_property_readonly("size", &VirtualTensor::size)
      .def_property_readonly("unit", &VirtualTensor::unit)
      .def_property_readonly("backend", &VirtualTensor::backend)
      .def("to_dlpack", &to_dlpack)
      .def("__dlpack__", [](const std::shared_ptr<VirtualTensor>& vt, py::args, py::kwargs) { return to_dlpack(vt); })
      .def("__dlpack_device__", [](const VirtualTensor& vt) { return vt.backend()->dlpack_device(); });

  bind_allocators(m);

  m.def("host_shm_default_name", [](py::object device) {
    int64_t d = py_int(device, "device");
    if (d < 0 || d > INT32_MAX) throw_value("device = " + std::to_string(d) + " is not a device index (>= 0).");
    return HostBudget::default_name(static_cast<int>(d));
  }, py::arg("device") = 0,
        "The host budget segment a Backend('host', device) opens: KVCACHED_HOST_SHM_NAME or kvcached_host_<uid>_<device>.");
  m.def("unlink_host_shm", &HostBudget::unlink, py::arg("name"), py::call_guard<py::gil_scoped_release>(),
        "Remove the name of a host budget segment (processes that have it open keep sharing it); False if absent, "
        "KVCachedStateError (nothing removed) if the file of that name is not a host budget segment.");

  m.def("_stop_all_threads", &stop_all_prealloc_threads, py::call_guard<py::gil_scoped_release>());
  // Prealloc threads must be gone before the interpreter (and the drivers) shut down.
  py::module_::import("atexit").attr("register")(m.attr("_stop_all_threads"));
}
