// A backend with address space but no memory: the scheduler's side of a tensor-parallel engine.
//
// With TP >= 2 the scheduler (vLLM's engine core) decides which pages hold blocks and
// every worker maps those pages on its own GPU. The scheduler's allocator runs on this
// backend: the same page bookkeeping, limits and budget as a real one, with nothing
// behind the addresses (PROT_NONE, so a stray read faults instead of returning garbage).
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <map>
#include <mutex>

#include "backend.h"

namespace kvc {

namespace {

class NullBackend final : public Backend {
 public:
  NullBackend(int dev, size_t budget) : budget_(budget) {
    kind = "null";
    device = dev;
    granularity = 2u << 20;
    map_offset_ok_ = true;
  }
  ~NullBackend() override { stop_releaser(); }

  uintptr_t reserve(size_t size) override {
    check_aligned("reserve size", size);
    return reserve_host_va(size, granularity);
  }

  void free_va(uintptr_t ptr, size_t size) noexcept override {
    if (munmap(reinterpret_cast<void*>(ptr), size) != 0) log_warning("munmap failed: " + errno_text(errno));
  }

  Handle create(size_t size) override {
    check_aligned("allocation size", size);
    std::lock_guard<std::mutex> lk(mu_);
    size_t used = physical_.load();
    if (used + size > budget_) {
      throw Error(ErrKind::OutOfMemory, "null backend: " + std::to_string(size) + " B more would exceed the budget of " +
                                            std::to_string(budget_) + " B (" + std::to_string(used) + " B in use)");
    }
    Handle h = next_++;
    sizes_[h] = size;
    physical_.fetch_add(size);
    return h;
  }

  void release(Handle h) noexcept override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = sizes_.find(h);
    if (it == sizes_.end()) {
      log_warning("null release of unknown handle " + std::to_string(h));
      return;
    }
    physical_.fetch_sub(it->second);
    sizes_.erase(it);
  }

  void map(uintptr_t, size_t, Handle h, size_t) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (sizes_.find(h) == sizes_.end()) throw Error(ErrKind::Driver, "null map failed: EINVAL (unknown allocation handle)");
  }
  void unmap(uintptr_t, size_t) override {}
  void set_access(uintptr_t, size_t) override {}
  void memset_zero(uintptr_t, size_t) override {}
  bool creates_zeroed() const override { return true; }

  std::pair<size_t, size_t> mem_info() override {
    size_t used = physical_.load();
    return {used < budget_ ? budget_ - used : 0, budget_};
  }
  void set_host_limit(size_t bytes) override { budget_ = bytes; }
  std::pair<int, int> dlpack_device() const override { return {1, 0}; }

 private:
  std::mutex mu_;
  std::atomic<size_t> budget_;
  Handle next_ = 1;
  std::map<Handle, size_t> sizes_;
};

}  // namespace

std::shared_ptr<Backend> make_null_backend(int device, size_t budget) {
  return std::make_shared<NullBackend>(device, budget);
}

}  // namespace kvc
