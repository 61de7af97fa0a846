#include "backend.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace kvc {

void log_warning(const std::string& msg) noexcept {
  std::fprintf(stderr, "[kvcached._vmm] warning: %s\n", msg.c_str());
}

std::string errno_text(int err) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 32))
  const char* name = strerrorname_np(err);
  if (name) return std::string(name) + " (" + std::to_string(err) + ", " + std::strerror(err) + ")";
#endif
  return std::string(std::strerror(err)) + " (" + std::to_string(err) + ")";
}

[[noreturn]] void throw_errno(const char* call, int err) {
  ErrKind k = (err == ENOMEM || err == ENOSPC) ? ErrKind::OutOfMemory : ErrKind::Driver;
  throw Error(k, std::string(call) + " failed: " + errno_text(err));
}

uintptr_t reserve_host_va(size_t size, size_t align) {
  size_t total = size + align;
  void* p = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw_errno("mmap(reserve)", errno);
  uintptr_t raw = reinterpret_cast<uintptr_t>(p);
  uintptr_t aligned = (raw + align - 1) / align * align;
  if (aligned > raw) munmap(p, aligned - raw);
  size_t tail = raw + total - (aligned + size);
  if (tail) munmap(reinterpret_cast<void*>(aligned + size), tail);
  return aligned;
}

void Backend::unmap_mappings(uintptr_t ptr, const std::vector<size_t>& sizes, size_t* done) {
  size_t total = 0, n = 0;
  for (size_t s : sizes) total += s;
  if (done) *done = 0;
  if (sizes.size() > 1 && range_unmap_.load() >= 0) {
    try {
      unmap(ptr, total);
      range_unmap_.store(1);
      if (done) *done = sizes.size();
      return;
    } catch (const Error& e) {
      if (e.kind != ErrKind::Driver || range_unmap_.load() > 0) throw;
      range_unmap_.store(-1);
    }
  }
  for (size_t s : sizes) {
    unmap(ptr, s);
    ptr += s;
    if (done) *done = ++n;
  }
}

void Backend::probe_map_offset() noexcept {
  // Some drivers only map an allocation from its start (HIP documents "offset must be 0").
  Handle h = 0;
  uintptr_t va = 0;
  try {
    h = create(2 * granularity);
    va = reserve(granularity);
    map(va, granularity, h, granularity);
    unmap(va, granularity);
    map_offset_ok_ = true;
  } catch (const Error&) {
    map_offset_ok_ = false;
  }
  if (va) free_va(va, granularity);
  if (h) release(h);
}

std::shared_ptr<ZeroPage> Backend::zero_page(size_t size) {
  std::lock_guard<std::mutex> lk(zero_mu_);
  auto it = zero_pages_.find(size);
  if (it != zero_pages_.end()) {
    if (auto zp = it->second.lock()) return zp;
  }
  Handle h = create_draining(size);
  if (!creates_zeroed()) {
    // Fresh physical memory is not guaranteed to be zero on GPUs: map it once and clear it.
    uintptr_t va = 0;
    bool mapped = false;
    try {
      va = reserve(size);
      map(va, size, h, 0);
      mapped = true;
      set_access(va, size);
      memset_zero(va, size);
      mapped = false;
      unmap(va, size);
    } catch (...) {
      try {
        if (mapped) unmap(va, size);
      } catch (...) {
      }
      if (va) free_va(va, size);
      release(h);
      throw;
    }
    free_va(va, size);
  }
  auto zp = std::shared_ptr<ZeroPage>(new ZeroPage{this, h, size});
  zero_pages_[size] = zp;
  return zp;
}

ZeroPage::~ZeroPage() { backend->release(handle); }

std::shared_ptr<Backend> make_backend(const std::string& kind, int device, size_t host_limit_bytes,
                                      const std::string& shm_name) {
  if (device < 0) throw_value("device must be >= 0, got " + std::to_string(device) + ".");
  if (kind == "host" || kind == "cpu") return make_host_backend(host_limit_bytes, device, shm_name);
  if (!shm_name.empty()) throw_value("shm_name only applies to the host backend, not '" + kind + "'.");
  if (kind == "null") return make_null_backend(device, host_limit_bytes);
  if (kind == "cuda") return make_cuda_backend(device);
  if (kind == "hip" || kind == "rocm") return make_hip_backend(device);
  throw_value("unknown backend '" + kind + "'; use 'cuda', 'hip', 'host' or 'null'.");
}

}  // namespace kvc
