// One interface over the CUDA driver, the HIP runtime and host memory (memfd + mmap).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"

namespace kvc {

using Handle = uint64_t;  // a physical allocation (CUmemGenericAllocationHandle, hip handle, host offset)

class Backend;

// The shared zero page: one physical allocation of `size` bytes mapped at many addresses.
struct ZeroPage {
  Backend* backend;
  Handle handle;
  size_t size;
  ~ZeroPage();
};

class Backend {
 public:
  virtual ~Backend() = default;

  std::string kind;
  int device = 0;
  size_t granularity = 0;

  // Virtual address space.
  virtual uintptr_t reserve(size_t size) = 0;
  virtual void free_va(uintptr_t ptr, size_t size) noexcept = 0;
  // Physical memory.
  virtual Handle create(size_t size) = 0;
  virtual void release(Handle h) noexcept = 0;
  // Mapping. `offset` into the allocation must be 0 unless map_offset_ok.
  virtual void map(uintptr_t ptr, size_t size, Handle h, size_t offset) = 0;
  virtual void unmap(uintptr_t ptr, size_t size) = 0;
  virtual void set_access(uintptr_t ptr, size_t size) = 0;
  virtual void memset_zero(uintptr_t ptr, size_t size) = 0;
  // True when create() always returns zeroed memory (host: fresh or hole-punched memfd).
  virtual bool creates_zeroed() const { return false; }

  virtual std::pair<size_t, size_t> mem_info() = 0;
  virtual void set_host_limit(size_t) {
    throw_value("set_host_limit only applies to the host backend, not '" + kind + "'.");
  }
  // Host: the /dev/shm segment holding the budget shared between processes; others: "".
  virtual std::string shm_name() const { return ""; }
  virtual std::pair<int, int> dlpack_device() const = 0;

  size_t physical_bytes() const { return physical_.load(std::memory_order_relaxed); }
  bool map_offset_ok() const { return map_offset_ok_; }

  // Unmaps [ptr, ptr+size) made of mappings of `unit` bytes each: one call when the
  // driver accepts a range spanning several mappings, else one call per unit.
  // (Inline, like check_aligned and every virtual: the benchmark module kvcached._vmm_bench
  // calls them and needs Backend's type info, which a non-inline virtual would keep in backend.cpp.)
  void unmap_units(uintptr_t ptr, size_t size, size_t unit) {
    if (size <= unit || range_unmap_.load() < 0) {
      for (size_t off = 0; off < size; off += unit) unmap(ptr + off, unit);
      return;
    }
    try {
      unmap(ptr, size);
      range_unmap_.store(1);
      return;
    } catch (const Error& e) {
      if (e.kind != ErrKind::Driver || range_unmap_.load() > 0) throw;
      range_unmap_.store(-1);  // this driver wants one call per mapping; remember it
    }
    for (size_t off = 0; off < size; off += unit) unmap(ptr + off, unit);
  }
  // The same for adjacent mappings of any sizes starting at ptr; *done counts the
  // mappings gone (all of them on success).
  void unmap_mappings(uintptr_t ptr, const std::vector<size_t>& sizes, size_t* done = nullptr);

  std::shared_ptr<ZeroPage> zero_page(size_t size);

  void check_aligned(const char* what, size_t value) const {
    if (value == 0 || value % granularity) {
      throw_value(std::string(what) + " = " + std::to_string(value) + " B is not a positive multiple of the " +
                  kind + " mapping granularity (" + std::to_string(granularity) + " B); round it up.");
    }
  }

 protected:
  void probe_map_offset() noexcept;
  std::atomic<size_t> physical_{0};
  bool map_offset_ok_ = false;

 private:
  std::atomic<int> range_unmap_{0};  // 0 unknown, 1 works, -1 refused
  std::mutex zero_mu_;
  std::map<size_t, std::weak_ptr<ZeroPage>> zero_pages_;
};

// shm_name "" = KVCACHED_HOST_SHM_NAME, else kvcached_host_<uid>_<device>.
std::shared_ptr<Backend> make_backend(const std::string& kind, int device, size_t host_limit_bytes,
                                      const std::string& shm_name = "");
std::shared_ptr<Backend> make_host_backend(size_t limit, int device = 0, const std::string& shm_name = "");
std::shared_ptr<Backend> make_cuda_backend(int device);
// Address space without memory, `budget` bytes of pretend physical memory (see backend_null.cpp).
std::shared_ptr<Backend> make_null_backend(int device, size_t budget);
std::shared_ptr<Backend> make_hip_backend(int device);
size_t host_resident_bytes(Backend& b);

// Host helpers shared by the host and null backends.
std::string errno_text(int err);
[[noreturn]] void throw_errno(const char* call, int err);
uintptr_t reserve_host_va(size_t size, size_t align);  // PROT_NONE, aligned to `align`

}  // namespace kvc
