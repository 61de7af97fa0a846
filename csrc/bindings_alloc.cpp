// Python bindings of PageAllocator and BlockPool (a separate file so the two halves
// of the bindings compile in parallel).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "block_pool.h"
#include "page_allocator.h"
#include "py_int.h"

namespace py = pybind11;

namespace kvc {
namespace {

// A list of ints from any sequence, with a clear error for anything else.
std::vector<int64_t> int_list(py::handle obj, const char* what) {
  PyObject* o = obj.ptr();
  // These iterate as small ints (or 1-character strings): b"\x01" would name block 1.
  if (PyBytes_Check(o) || PyByteArray_Check(o) || PyMemoryView_Check(o) || PyUnicode_Check(o)) {
    throw_value(std::string(what) + " must be a list of ints, got " + py_type_name(obj) +
                ": its bytes or characters are not block ids; pass a list such as [3, 4].");
  }
  PyObject* seq = PySequence_Fast(o, "");
  if (!seq) {
    PyErr_Clear();
    throw_value(std::string(what) + " must be a list of ints, got " + py_type_name(obj) + ".");
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* it = items[i];
    if (!PyLong_Check(it) || PyBool_Check(it)) {
      Py_DECREF(seq);
      throw_value(std::string(what) + "[" + std::to_string(i) + "] is not an int (a " +
                  py_type_name(it) + "); pass block or page ids as ints.");
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(it, &overflow);
    if (overflow) {
      Py_DECREF(seq);
      throw_value(std::string(what) + "[" + std::to_string(i) + "] is out of range.");
    }
    out[i] = v;
  }
  Py_DECREF(seq);
  return out;
}

py::list to_pylist(const std::vector<int64_t>& v) {
  py::list l(v.size());
  for (size_t i = 0; i < v.size(); ++i) PyList_SET_ITEM(l.ptr(), static_cast<Py_ssize_t>(i), PyLong_FromLongLong(v[i]));
  return l;
}

std::vector<RegionSpec> parse_regions(py::handle regions) {
  std::vector<RegionSpec> out;
  size_t i = 0;
  if (!py::isinstance<py::iterable>(regions)) {
    throw_value("regions must be a list of (tensor, base, size) or layout.Region, got " + py_type_name(regions) + ".");
  }
  for (py::handle item : regions) {
    int64_t t, base, size;
    try {
      if (py::hasattr(item, "tensor") && py::hasattr(item, "base") && py::hasattr(item, "size")) {
        t = py_int(item.attr("tensor"), "tensor");
        base = py_int(item.attr("base"), "base");
        size = py_int(item.attr("size"), "size");
      } else {
        auto tup = py::reinterpret_borrow<py::sequence>(item);
        if (py::len(tup) != 3) throw py::cast_error();
        t = py_int(tup[0], "tensor");
        base = py_int(tup[1], "base");
        size = py_int(tup[2], "size");
      }
    } catch (const py::cast_error&) {
      throw_value("region " + std::to_string(i) + " must be (tensor, base, size) ints or a layout.Region.");
    } catch (const py::builtin_exception& e) {  // py_int: bool, float, past 64 bits
      throw_value("region " + std::to_string(i) + ": " + e.what());
    } catch (const py::error_already_set&) {
      throw_value("region " + std::to_string(i) + " must be (tensor, base, size) ints or a layout.Region.");
    }
    if (base < 0 || size <= 0) {
      throw_value("region " + std::to_string(i) + ": base must be >= 0 and size > 0, got base=" + std::to_string(base) +
                  ", size=" + std::to_string(size) + ".");
    }
    out.push_back({t, static_cast<size_t>(base), static_cast<size_t>(size)});
    ++i;
  }
  return out;
}

}  // namespace

void bind_allocators(py::module_& m) {
  py::class_<PageAllocator, std::shared_ptr<PageAllocator>>(m, "PageAllocator")
      .def(py::init([](std::shared_ptr<Backend> backend, std::vector<std::shared_ptr<VirtualTensor>> tensors,
                       py::object regions, py::object num_pages, py::object min_reserved, py::object max_reserved,
                       bool prealloc, py::object max_run_pages) {
             int64_t n = py_int(num_pages, "num_pages"), lo = py_int(min_reserved, "min_reserved");
             int64_t hi = py_int(max_reserved, "max_reserved"), run = py_int(max_run_pages, "max_run_pages");
             auto specs = parse_regions(regions);
             py::gil_scoped_release rel;
             return std::make_shared<PageAllocator>(std::move(backend), std::move(tensors), std::move(specs),
                                                    n, lo, hi, prealloc, run);
           }),
           py::arg("backend"), py::arg("tensors"), py::arg("regions"), py::arg("num_pages"),
           py::arg("min_reserved") = 0, py::arg("max_reserved") = 0, py::arg("prealloc") = false,
           py::arg("max_run_pages") = 0,
           "max_run_pages: most pages one physical allocation (run) may hold; 0 = 1 GiB worth, at least 1.")
      .def("alloc_pages", [](PageAllocator& pa, py::object n_obj) {
        int64_t n = py_int(n_obj, "n");
        std::vector<int64_t> out;
        {
          py::gil_scoped_release rel;
          out = pa.alloc_pages(n);
        }
        return to_pylist(out);
      }, py::arg("n"))
      .def("map_pages", [](PageAllocator& pa, py::handle ids) {
        auto v = int_list(ids, "ids");
        py::gil_scoped_release rel;
        pa.map_pages(v);
      }, py::arg("ids"),
           "Map exactly these pages (not in use; reserved ones are taken as they are) and mark them in use. "
           "All-or-nothing: ValueError for an id out of range, in use or repeated; OutOfMemoryError past the "
           "limit or the physical memory.")
      .def("free_pages", [](PageAllocator& pa, py::handle ids) {
        auto v = int_list(ids, "ids");
        py::gil_scoped_release rel;
        pa.free_pages(v);
      }, py::arg("ids"))
      .def("trim", &PageAllocator::trim, py::call_guard<py::gil_scoped_release>())
      .def("set_limit_pages", [](PageAllocator& pa, py::object n_obj) {
        int64_t n = py_int(n_obj, "n");
        py::gil_scoped_release rel;
        return pa.set_limit_pages(n);
      }, py::arg("n"))
      .def("close", &PageAllocator::close, py::call_guard<py::gil_scoped_release>())
      .def("stop_prealloc_thread", &PageAllocator::stop_thread, py::call_guard<py::gil_scoped_release>(),
           "Stop the prealloc thread (joins it); the reserve then changes only on calls.")
      .def("start_prealloc_thread", &PageAllocator::start_thread, py::call_guard<py::gil_scoped_release>(),
           "Start the prealloc thread (again); a no-op while it runs. False once closed.")
      .def_property_readonly("prealloc_running", [](PageAllocator& pa) {
        py::gil_scoped_release rel;
        return pa.thread_running();
      })
      .def("is_in_use", [](PageAllocator& pa, py::object page) {
        int64_t p = py_int(page, "page");
        py::gil_scoped_release rel;
        return pa.is_in_use(p);
      }, py::arg("page"))
      .def("refresh_mem_info", &PageAllocator::refresh_mem_info, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("limit_pages", &PageAllocator::limit_pages)
      .def_property_readonly("num_pages", &PageAllocator::num_pages)
      .def_property_readonly("num_in_use", &PageAllocator::num_in_use)
      .def_property_readonly("num_reserved", &PageAllocator::num_reserved)
      .def_property_readonly("peak_in_use", &PageAllocator::peak_in_use,
                             "Most pages in use at once since creation or reset_peak().")
      .def_property_readonly("pages_mapped_total", &PageAllocator::pages_mapped_total,
                             "Pages mapped since creation (each map of a page counts once).")
      .def_property_readonly("pages_unmapped_total", &PageAllocator::pages_unmapped_total,
                             "Pages unmapped since creation.")
      .def("reset_peak", &PageAllocator::reset_peak, py::call_guard<py::gil_scoped_release>(),
           "Start a new peak window at the pages in use now.")
      .def_property_readonly("min_reserved", &PageAllocator::min_reserved)
      .def_property_readonly("max_reserved", &PageAllocator::max_reserved)
      .def_property_readonly("mapped_bytes", &PageAllocator::mapped_bytes)
      .def_property_readonly("page_bytes", &PageAllocator::page_bytes)
      .def_property_readonly("max_run_pages", &PageAllocator::max_run_pages)
      .def("runs", &PageAllocator::runs, py::call_guard<py::gil_scoped_release>(),
           "Mapped runs as [(first page, pages, pages in use)], ascending: each is one physical allocation per "
           "region, mapped and unmapped whole.")
      .def_property_readonly("closed", &PageAllocator::closed)
      .def_property_readonly("backend", &PageAllocator::backend)
      .def_property_readonly("tensors", &PageAllocator::tensors)
      .def("obtainable_pages", &PageAllocator::obtainable_pages)
      .def("device_tight", &PageAllocator::device_tight,
           "The device's free memory (as last read: refresh_mem_info) is under max_reserved + 1 pages: the "
           "reserve keeps no page mapped ahead of need, and engines give their prefix caches back.")
      .def("phase_times", &PageAllocator::phase_times, py::call_guard<py::gil_scoped_release>(),
           "{step: (total µs, calls)} of the map/unmap steps since creation or reset_phase_times().")
      .def("reset_phase_times", &PageAllocator::reset_phase_times, py::call_guard<py::gil_scoped_release>())
      .def("set_lazy_reserve_ms", [](PageAllocator& pa, py::object ms) {
        int64_t v = py_int(ms, "ms");
        py::gil_scoped_release rel;
        pa.set_lazy_reserve_ms(v);
      }, py::arg("ms"),
           "Lazy reserve for serving engines (0: off): refill the reserve to max_reserved in one run, map the "
           "reserve's shortfall with an inline map, keep freed pages mapped while the load reached them within "
           "the last ms milliseconds.")
      .def_property_readonly("lazy_reserve_ms", &PageAllocator::lazy_reserve_ms);

  py::class_<BlockPool, std::shared_ptr<BlockPool>>(m, "BlockPool")
      .def(py::init([](std::shared_ptr<PageAllocator> pa, py::object bpp, py::object num_blocks) {
             return std::make_shared<BlockPool>(std::move(pa), py_int(bpp, "blocks_per_page"),
                                                py_int(num_blocks, "num_blocks"));
           }),
           py::arg("page_allocator"), py::arg("blocks_per_page"), py::arg("num_blocks"))
      .def("alloc", [](BlockPool& bp, py::handle n) -> py::object {
        auto r = bp.alloc(py_int(n, "n"));
        if (!r) return py::none();
        return to_pylist(*r);
      }, py::arg("n"))
      .def("free", [](BlockPool& bp, py::handle ids) { bp.free(int_list(ids, "ids")); }, py::arg("ids"),
           "Give back allocated or pending blocks; ValueError (nothing freed) for a bad, free or repeated id.")
      .def("free_keeping_pages", [](BlockPool& bp, py::handle ids) {
        return to_pylist(bp.free_keeping_pages(int_list(ids, "ids")));
      }, py::arg("ids"),
           "Free the ids whose page keeps a live (allocated, not pending) block after this call, so no page is "
           "unmapped; mark the others pending and return them in input order: they stay allocated until free() "
           "gives them back. Validates like free (pending ids count as freed already).")
      .def("cancel_pending", [](BlockPool& bp, py::handle ids) { bp.cancel_pending(int_list(ids, "ids")); },
           py::arg("ids"), "Pending blocks back to allocated; ValueError (nothing changed) for an id not pending.")
      .def("available", &BlockPool::available)
      .def("num_allocated", &BlockPool::num_allocated)
      .def("is_allocated", [](const BlockPool& bp, py::object id) { return bp.is_allocated(py_int(id, "id")); },
           py::arg("id"))
      .def_property_readonly("blocks_per_page", &BlockPool::blocks_per_page)
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("num_held_pages", &BlockPool::num_held_pages)
      .def_property_readonly("page_allocator", &BlockPool::page_allocator);

}

}  // namespace kvc
