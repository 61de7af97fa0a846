// The body the CUDA and HIP backends share: both drive a GPU through the same
// virtual-memory calls (reserve, create, map, set access, unmap, release), differing
// only in names, argument types, error codes and how a call is pointed at the device.
//
// A driver class `Drv` (CudaDriver in backend_cuda.cpp, HipDriver in backend_hip.cpp)
// opens its library at run time, initialises the device in its constructor and
// provides:
//   static constexpr const char* kKind;          // Backend::kind
//   static constexpr int kOutOfMemory, kNoDevice; // error codes with their own ErrKind
//   static constexpr const char* kNoDeviceHint;   // appended to a NoDevice message
//   static constexpr int kQuietError;             // a code `soft` does not log (0: none)
//   static constexpr int kDlpackDevice;           // kDLCUDA 2, kDLROCM 10
//   static constexpr const char* kReserve, ...;   // the call names messages use
//   struct Scope { explicit Scope(Drv&); };       // points this thread at the device for one call
//   std::string error_name(int);
//   int granularity(size_t*), reserve(uintptr_t*, size_t, size_t align), free_va(uintptr_t, size_t),
//       create(Handle*, size_t), release(Handle), map(uintptr_t, size_t, size_t offset, Handle),
//       unmap(uintptr_t, size_t), set_access(uintptr_t, size_t), memset_zero(uintptr_t, size_t),
//       synchronize(), mem_info(size_t* free, size_t* total);   // the driver's status, 0 = success
#pragma once

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "backend.h"

namespace kvc {

// The driver structs both vendors declare alike: CUDA's (cuda.h, CUDA 11.2+, unchanged
// through 13), which ROCm 6+ copies field for field (ROCm 5 ordered hipMemAllocationProp
// differently: backend_hip.cpp declares that one too).
struct MemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE = hipMemLocationTypeDevice = 1
  int id;
};
struct MemAllocationProp {
  int type;                  // CU_MEM_ALLOCATION_TYPE_PINNED = hipMemAllocationTypePinned = 1, @0
  int requestedHandleTypes;  // @4
  MemLocation location;      // @8
  void* win32HandleMetaData;  // @16
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;  // @24
};
static_assert(sizeof(MemAllocationProp) == 32, "CUmemAllocationProp / hipMemAllocationProp (ROCm 6+) layout");
struct MemAccessDesc {
  MemLocation location;
  int flags;  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE = hipMemAccessFlagsProtReadWrite = 3
};

// Pinned memory on device `dev`, every other field zero.
inline MemAllocationProp pinned_on_device(int dev) {
  MemAllocationProp p;
  std::memset(&p, 0, sizeof(p));
  p.type = 1;
  p.location = {1, dev};
  return p;
}
inline MemAccessDesc read_write_on_device(int dev) { return {{1, dev}, 3}; }

// Throws the Error for a failed driver call (no-op on 0).
template <class Drv>
void driver_check(Drv& drv, int r, const char* call) {
  if (r == 0) return;
  std::string msg = std::string(call) + " failed: " + drv.error_name(r) + " (" + std::to_string(r) + ")";
  ErrKind k = ErrKind::Driver;
  if (r == Drv::kOutOfMemory) {
    k = ErrKind::OutOfMemory;
    msg += ": the GPU has no free memory for this page; free blocks, lower the limit, or stop other processes";
  } else if (r == Drv::kNoDevice) {
    k = ErrKind::NoDevice;
    msg += Drv::kNoDeviceHint;
  }
  throw Error(k, msg);
}

template <class Drv>
class DriverBackend final : public Backend {
 public:
  explicit DriverBackend(int dev) : drv_(dev) {
    kind = Drv::kKind;
    device = dev;
    typename Drv::Scope g(drv_);
    check(drv_.granularity(&granularity), Drv::kGranularity);
    probe_map_offset();
  }
  ~DriverBackend() override { stop_releaser(); }

  uintptr_t reserve(size_t size) override {
    check_aligned("reserve size", size);
    typename Drv::Scope g(drv_);
    uintptr_t p = 0;
    check(drv_.reserve(&p, size, granularity), Drv::kReserve);
    return p;
  }
  void free_va(uintptr_t ptr, size_t size) noexcept override {
    typename Drv::Scope g(drv_);
    soft(drv_.free_va(ptr, size), Drv::kFreeVa);
  }
  Handle create(size_t size) override {
    check_aligned("allocation size", size);
    typename Drv::Scope g(drv_);
    Handle h = 0;
    check(drv_.create(&h, size), Drv::kCreate);
    physical_.fetch_add(size);
    std::lock_guard<std::mutex> lk(sizes_lock_);
    sizes_[h] = size;
    return h;
  }
  void release(Handle h) noexcept override {
    typename Drv::Scope g(drv_);
    soft(drv_.release(h), Drv::kRelease);
    std::lock_guard<std::mutex> lk(sizes_lock_);
    auto it = sizes_.find(h);
    if (it != sizes_.end()) {
      physical_.fetch_sub(it->second);
      sizes_.erase(it);
    }
  }
  void map(uintptr_t ptr, size_t size, Handle h, size_t offset) override {
    typename Drv::Scope g(drv_);
    check(drv_.map(ptr, size, offset, h), Drv::kMap);
  }
  void unmap(uintptr_t ptr, size_t size) override {
    typename Drv::Scope g(drv_);
    check(drv_.unmap(ptr, size), Drv::kUnmap);
  }
  void set_access(uintptr_t ptr, size_t size) override {
    typename Drv::Scope g(drv_);
    check(drv_.set_access(ptr, size), Drv::kSetAccess);
  }
  void memset_zero(uintptr_t ptr, size_t size) override {
    typename Drv::Scope g(drv_);
    check(drv_.memset_zero(ptr, size), Drv::kMemset);
    check(drv_.synchronize(), Drv::kSynchronize);
  }
  std::pair<size_t, size_t> mem_info() override {
    typename Drv::Scope g(drv_);
    size_t f = 0, t = 0;
    check(drv_.mem_info(&f, &t), Drv::kMemGetInfo);
    return {f, t};
  }
  std::pair<int, int> dlpack_device() const override { return {Drv::kDlpackDevice, device}; }

 private:
  void check(int r, const char* call) { driver_check(drv_, r, call); }
  void soft(int r, const char* call) noexcept {
    if (r != 0 && r != Drv::kQuietError) {
      log_warning(std::string(call) + " failed: " + drv_.error_name(r) + " (" + std::to_string(r) + ")");
    }
  }

  Drv drv_;
  std::mutex sizes_lock_;
  std::map<Handle, size_t> sizes_;
};

}  // namespace kvc
