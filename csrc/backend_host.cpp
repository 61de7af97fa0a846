// Host backend: the GPU VMM semantics on CPU memory. Physical memory is one memfd
// (ranges handed out by an offset allocator, holes punched on release), a
// reservation is a PROT_NONE anonymous mapping, and a map is MAP_SHARED|MAP_FIXED
// of a memfd range, so one range mapped at many addresses truly aliases.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>

#include "backend.h"
#include "host_budget.h"

namespace kvc {
namespace {

[[noreturn]] void throw_invalid(const char* call, const std::string& why) {
  throw Error(ErrKind::Driver, std::string(call) + " failed: EINVAL (" + why + ")");
}

class HostBackend final : public Backend {
 public:
  HostBackend(int dev, size_t limit, const std::string& shm_name)
      : budget_(HostBudget::open(shm_name.empty() ? HostBudget::default_name(dev) : shm_name, limit)) {
    kind = "host";
    device = dev;
    granularity = 2u << 20;  // as on GPUs, so alignment errors show up here too
    fd_ = static_cast<int>(memfd_create("kvcached_host_pool", MFD_CLOEXEC));
    if (fd_ < 0) throw_errno("memfd_create", errno);
    map_offset_ok_ = true;
  }
  ~HostBackend() override {
    stop_releaser();
    if (fd_ >= 0) close(fd_);
  }

  uintptr_t reserve(size_t size) override {
    check_aligned("reserve size", size);
    return reserve_host_va(size, granularity);
  }

  void free_va(uintptr_t ptr, size_t size) noexcept override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = mapped_.lower_bound(ptr);
      while (it != mapped_.end() && it->first < ptr + size) it = mapped_.erase(it);
    }
    if (munmap(reinterpret_cast<void*>(ptr), size) != 0) log_warning("munmap failed: " + errno_text(errno));
  }

  Handle create(size_t size) override {
    check_aligned("allocation size", size);
    std::lock_guard<std::mutex> lk(mu_);
    budget_->reserve(size, "host create");
    size_t off;
    try {
      off = take_range(size);
    } catch (...) {
      budget_->give_back(size);
      throw;
    }
    allocs_[off] = size;
    physical_.fetch_add(size);
    return off + 1;
  }

  void release(Handle h) noexcept override {
    std::lock_guard<std::mutex> lk(mu_);
    size_t off = h - 1;
    auto it = allocs_.find(off);
    if (h == 0 || it == allocs_.end()) {
      log_warning("host release of unknown handle " + std::to_string(h));
      return;
    }
    size_t size = it->second;
    allocs_.erase(it);
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off),
                  static_cast<off_t>(size)) != 0) {
      log_warning("fallocate(PUNCH_HOLE) failed: " + errno_text(errno));
    }
    give_range(off, size);
    physical_.fetch_sub(size);
    budget_->give_back(size);
  }

  void set_test_map_delay_us(int64_t us) override {
    if (us < 0) throw_value("the map delay must be >= 0 us, got " + std::to_string(us) + ".");
    map_delay_us_ = us;
  }

  void map(uintptr_t ptr, size_t size, Handle h, size_t offset) override {
    if (int64_t d = map_delay_us_.load()) std::this_thread::sleep_for(std::chrono::microseconds(d));
    std::lock_guard<std::mutex> lk(mu_);
    auto it = allocs_.find(h - 1);
    if (h == 0 || it == allocs_.end()) throw_invalid("host map", "unknown allocation handle");
    if (offset % granularity || size % granularity || ptr % granularity || offset + size > it->second)
      throw_invalid("host map", "range outside the allocation or misaligned");
    auto next = mapped_.lower_bound(ptr);
    if (next != mapped_.end() && next->first < ptr + size) throw_invalid("host map", "address already mapped");
    if (next != mapped_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second > ptr) throw_invalid("host map", "address already mapped");
    }
    void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd_,
                   static_cast<off_t>(it->first + offset));
    if (p == MAP_FAILED) {
      int err = errno;
      if (err == ENOMEM) {
        throw Error(ErrKind::OutOfMemory, "mmap(map) failed: " + errno_text(err) +
                                              ": the process may have reached vm.max_map_count (each mapped unit is "
                                              "one mapping); use the contiguous layout, larger pages, or raise "
                                              "/proc/sys/vm/max_map_count");
      }
      throw_errno("mmap(map)", err);
    }
    mapped_[ptr] = size;
  }

  void unmap(uintptr_t ptr, size_t size) override {
    std::lock_guard<std::mutex> lk(mu_);
    // Like cuMemUnmap: only whole mappings, and the range must be fully mapped.
    if (!covered(ptr, size)) throw_invalid("host unmap", "range is not a run of whole mappings");
    void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) throw_errno("mmap(unmap)", errno);
    auto it = mapped_.lower_bound(ptr);
    while (it != mapped_.end() && it->first < ptr + size) it = mapped_.erase(it);
  }

  void set_access(uintptr_t ptr, size_t size) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!covered(ptr, size)) throw_invalid("host set_access", "range is not fully mapped");
    }
    if (mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE) != 0) throw_errno("mprotect", errno);
  }

  bool creates_zeroed() const override { return true; }
  void memset_zero(uintptr_t ptr, size_t size) override { std::memset(reinterpret_cast<void*>(ptr), 0, size); }

  std::pair<size_t, size_t> mem_info() override { return budget_->info(); }

  void set_host_limit(size_t bytes) override { budget_->set_budget(bytes); }

  std::string shm_name() const override { return budget_->name(); }

  std::pair<int, int> dlpack_device() const override { return {1, 0}; }

  size_t resident_bytes() {
    struct stat st;
    if (fstat(fd_, &st) != 0) throw_errno("fstat", errno);
    return static_cast<size_t>(st.st_blocks) * 512;
  }

 private:
  // [ptr, ptr+size) is exactly a run of whole, adjacent mappings.
  bool covered(uintptr_t ptr, size_t size) const {
    auto it = mapped_.find(ptr);
    uintptr_t at = ptr;
    while (it != mapped_.end() && it->first == at && at < ptr + size) {
      at += it->second;
      ++it;
    }
    return at == ptr + size;
  }

  size_t take_range(size_t size) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      size_t off = it->first, len = it->second;
      free_.erase(it);
      if (len > size) free_[off + size] = len - size;
      return off;
    }
    size_t off = end_;
    if (ftruncate(fd_, static_cast<off_t>(end_ + size)) != 0) throw_errno("ftruncate", errno);
    end_ += size;
    return off;
  }

  void give_range(size_t off, size_t size) {
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + size == next->first) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += size;
        return;
      }
    }
    free_[off] = size;
  }

  std::shared_ptr<HostBudget> budget_;  // shared with the other processes (and backends) of this segment
  int fd_ = -1;
  std::atomic<int64_t> map_delay_us_{0};  // set_test_map_delay_us
  std::mutex mu_;
  size_t end_ = 0;
  std::map<size_t, size_t> free_;     // offset -> length of free memfd ranges
  std::map<size_t, size_t> allocs_;   // offset -> length of live allocations
  std::map<uintptr_t, size_t> mapped_;  // address -> length of live mappings
};

}  // namespace

std::shared_ptr<Backend> make_host_backend(size_t limit, int device, const std::string& shm_name) {
  return std::make_shared<HostBackend>(device, limit, shm_name);
}

size_t host_resident_bytes(Backend& b) {
  auto* h = dynamic_cast<HostBackend*>(&b);
  return h ? h->resident_bytes() : b.physical_bytes();
}

}  // namespace kvc
