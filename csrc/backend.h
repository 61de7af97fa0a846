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
class DeferredRelease;  // deferred_release.cpp

// What releasing a PageAllocator's handles off its path reports back to it: the time the
// releases took (so the allocator's phase counters show where shrinking's time went, now
// that most of it is spent after the call returns), and the free physical memory read
// after them, which is the allocator's cached figure (obtainable_pages): a figure read
// while the handles were still held must not outlive their release.
struct ReleaseReport {
  std::atomic<int64_t> background_ns{0}, background_calls{0};  // released by the background thread
  std::atomic<int64_t> flushed_ns{0}, flushed_calls{0};        // released by a caller that flushed

  // Reads the backend's free memory and keeps it unless a reading started later was kept
  // first (the releaser's reading after a release and a caller's taken before it race).
  void refresh(Backend& b) noexcept;
  size_t free_bytes() const { return free_.load(std::memory_order_relaxed); }

 private:
  std::mutex mu_;
  uint64_t started_ = 0, kept_ = 0;  // readings begun, the newest one kept
  std::atomic<size_t> free_{0};
};

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
  // Tests: the host backend sleeps this long in each map call, as slow as a GPU's driver under load.
  virtual void set_test_map_delay_us(int64_t) {
    throw_value("a map delay is a test hook of the host backend, not '" + kind + "'.");
  }
  // Host: the /dev/shm segment holding the budget shared between processes; others: "".
  virtual std::string shm_name() const { return ""; }
  virtual std::pair<int, int> dlpack_device() const = 0;

  // Bytes of live allocations: handles queued by release_later count until really released.
  size_t physical_bytes() const { return physical_.load(std::memory_order_relaxed); }

  // Deferred release (deferred_release.cpp): `hs`, `bytes` in all, are handles no mapping
  // uses any more; a background thread releases them (driver release costs ~50 us per
  // 128 MiB allocation on an H200, the larger part of a shrink); `hs` is emptied. False
  // when nothing was queued (the releaser is stopped or cannot start), `hs` left as it
  // was: the caller releases them itself.
  bool release_later(std::vector<Handle>& hs, size_t bytes, const std::shared_ptr<ReleaseReport>& report);
  // Releases everything queued before the call (here, inline) and waits for the batch the
  // background thread holds: on return that memory is back with the driver.
  void flush_releases() noexcept;
  // Bytes queued or being released (0 before anything was deferred).
  size_t pending_release_bytes();
  // create(); when it runs out of memory while released handles are pending (or were
  // released meanwhile), flushes them and tries once more. Adds the time spent flushing to *drain_us.
  Handle create_draining(size_t size, double* drain_us = nullptr);
  // Flushes and stops the background thread for good; later release_later calls return
  // false. Subclass destructors call it first (the thread calls virtual release), and so
  // does stop_all_prealloc_threads at interpreter exit, before the drivers shut down.
  void stop_releaser() noexcept;
  // Tests: while paused the thread leaves queued releases alone (a flush still does them),
  // so what is pending at a given moment does not depend on thread timing.
  void pause_releases(bool on);

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
  DeferredRelease* releaser(bool make);  // made on first use, so a backend that never defers has no thread
  std::mutex rel_make_mu_;
  // shared_ptr: its deleter is bound where it is made, so Backend's destructor (inline, like
  // every virtual: see unmap_units) needs no DeferredRelease symbols in kvcached._vmm_bench.
  std::shared_ptr<DeferredRelease> rel_;
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
