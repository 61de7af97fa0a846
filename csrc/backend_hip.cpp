// HIP backend: libamdhip64 opened at run time. Types declared here: ROCm 6+ uses
// CUDA's CUmemAllocationProp layout; ROCm 5 ordered the fields differently.
#include <dlfcn.h>

#include <cstring>

#include "backend.h"

namespace kvc {
namespace {

using hipError = int;
using HipHandle = void*;

struct HipLocation {
  int type;  // hipMemLocationTypeDevice = 1
  int id;
};
struct HipPropV6 {
  int type;                  // hipMemAllocationTypePinned = 1, @0
  int requestedHandleTypes;  // @4
  HipLocation location;      // @8
  void* win32HandleMetaData;  // @16
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
  } allocFlags;  // @24
};
static_assert(sizeof(HipPropV6) == 32, "hipMemAllocationProp (ROCm 6+) layout");
struct HipPropV5 {
  unsigned char compressionType;
  HipLocation location;
  int requestedHandleType;
  int type;
  unsigned short usage;
  void* win32HandleMetaData;
};
struct HipAccessDesc {
  HipLocation location;
  int flags;  // hipMemAccessFlagsProtReadWrite = 3
};

constexpr int kHipOutOfMemory = 2;
constexpr int kHipNoDevice = 100;

struct HipApi {
  hipError (*hipInit)(unsigned);
  hipError (*hipRuntimeGetVersion)(int*);
  hipError (*hipGetDeviceCount)(int*);
  hipError (*hipGetDevice)(int*);
  hipError (*hipSetDevice)(int);
  hipError (*hipDeviceSynchronize)();
  hipError (*hipMemGetInfo)(size_t*, size_t*);
  hipError (*hipMemGetAllocationGranularity)(size_t*, const void*, int);
  hipError (*hipMemAddressReserve)(void**, size_t, size_t, void*, unsigned long long);
  hipError (*hipMemAddressFree)(void*, size_t);
  hipError (*hipMemCreate)(HipHandle*, size_t, const void*, unsigned long long);
  hipError (*hipMemRelease)(HipHandle);
  hipError (*hipMemMap)(void*, size_t, size_t, HipHandle, unsigned long long);
  hipError (*hipMemUnmap)(void*, size_t);
  hipError (*hipMemSetAccess)(void*, size_t, const HipAccessDesc*, size_t);
  hipError (*hipMemset)(void*, int, size_t);
  const char* (*hipGetErrorName)(hipError);
};

class HipBackend final : public Backend {
 public:
  explicit HipBackend(int dev) {
    kind = "hip";
    device = dev;
    const char* names[] = {"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"};
    std::string why;
    for (const char* n : names) {
      lib_ = dlopen(n, RTLD_NOW | RTLD_LOCAL);
      if (lib_) break;
      const char* e = dlerror();
      why += std::string(n) + ": " + (e ? e : "?") + "; ";
    }
    if (!lib_) {
      throw Error(ErrKind::LibraryNotFound, "cannot open the HIP runtime (" + why +
                                                "): install ROCm 6+ or use backend 'host' (KVCACHED_BACKEND=host).");
    }
#define KVC_SYM(name)                                                                                       \
  api_.name = reinterpret_cast<decltype(api_.name)>(dlsym(lib_, #name));                                    \
  if (!api_.name)                                                                                            \
    throw Error(ErrKind::LibraryNotFound, "libamdhip64 has no symbol " #name                                \
                                          ": the ROCm runtime is too old for virtual memory; install ROCm 6+.");
    KVC_SYM(hipGetErrorName);
    KVC_SYM(hipInit);
    KVC_SYM(hipRuntimeGetVersion);
    KVC_SYM(hipGetDeviceCount);
    KVC_SYM(hipGetDevice);
    KVC_SYM(hipSetDevice);
    KVC_SYM(hipDeviceSynchronize);
    KVC_SYM(hipMemGetInfo);
    KVC_SYM(hipMemGetAllocationGranularity);
    KVC_SYM(hipMemAddressReserve);
    KVC_SYM(hipMemAddressFree);
    KVC_SYM(hipMemCreate);
    KVC_SYM(hipMemRelease);
    KVC_SYM(hipMemMap);
    KVC_SYM(hipMemUnmap);
    KVC_SYM(hipMemSetAccess);
    KVC_SYM(hipMemset);
#undef KVC_SYM
    int version = 0;
    if (api_.hipRuntimeGetVersion(&version) == 0) v5_ = version < 60000000;
    // Without a GPU hipInit fails (hipErrorInvalidDevice / hipErrorNoDevice) and
    // hipGetDeviceCount returns hipErrorNoDevice: both mean "no device", not a broken runtime.
    hipError ri = api_.hipInit(0);
    int count = 0;
    hipError r = api_.hipGetDeviceCount(&count);
    if (r != 0 || count == 0) {
      throw Error(ErrKind::NoDevice, "no usable AMD GPU: hipInit returned " + err_name(ri) + " (" + std::to_string(ri) +
                                         "), hipGetDeviceCount " + err_name(r) + " (" + std::to_string(r) +
                                         ", count " + std::to_string(count) + "). The HIP runtime loaded but sees no "
                                         "device; use backend 'host' (KVCACHED_BACKEND=host) or check /dev/kfd access.");
    }
    if (dev >= count) {
      throw Error(ErrKind::NoDevice, "HIP device " + std::to_string(dev) + " does not exist (this machine has " +
                                         std::to_string(count) + ").");
    }
    std::memset(&p6_, 0, sizeof(p6_));
    p6_.type = 1;
    p6_.location = {1, dev};
    std::memset(&p5_, 0, sizeof(p5_));
    p5_.type = 1;
    p5_.location = {1, dev};
    access_.location = {1, dev};
    access_.flags = 3;
    Dev g(this);
    check(api_.hipMemGetAllocationGranularity(&granularity, prop(), 0), "hipMemGetAllocationGranularity");
    probe_map_offset();
  }

  uintptr_t reserve(size_t size) override {
    check_aligned("reserve size", size);
    Dev g(this);
    void* p = nullptr;
    check(api_.hipMemAddressReserve(&p, size, granularity, nullptr, 0), "hipMemAddressReserve");
    return reinterpret_cast<uintptr_t>(p);
  }
  void free_va(uintptr_t ptr, size_t size) noexcept override {
    Dev g(this);
    soft(api_.hipMemAddressFree(reinterpret_cast<void*>(ptr), size), "hipMemAddressFree");
  }
  Handle create(size_t size) override {
    check_aligned("allocation size", size);
    Dev g(this);
    HipHandle h = nullptr;
    check(api_.hipMemCreate(&h, size, prop(), 0), "hipMemCreate");
    physical_.fetch_add(size);
    std::lock_guard<std::mutex> lk(sizes_lock_);
    sizes_[reinterpret_cast<Handle>(h)] = size;
    return reinterpret_cast<Handle>(h);
  }
  void release(Handle h) noexcept override {
    Dev g(this);
    soft(api_.hipMemRelease(reinterpret_cast<HipHandle>(h)), "hipMemRelease");
    std::lock_guard<std::mutex> lk(sizes_lock_);
    auto it = sizes_.find(h);
    if (it != sizes_.end()) {
      physical_.fetch_sub(it->second);
      sizes_.erase(it);
    }
  }
  void map(uintptr_t ptr, size_t size, Handle h, size_t offset) override {
    Dev g(this);
    check(api_.hipMemMap(reinterpret_cast<void*>(ptr), size, offset, reinterpret_cast<HipHandle>(h), 0), "hipMemMap");
  }
  void unmap(uintptr_t ptr, size_t size) override {
    Dev g(this);
    check(api_.hipMemUnmap(reinterpret_cast<void*>(ptr), size), "hipMemUnmap");
  }
  void set_access(uintptr_t ptr, size_t size) override {
    Dev g(this);
    check(api_.hipMemSetAccess(reinterpret_cast<void*>(ptr), size, &access_, 1), "hipMemSetAccess");
  }
  void memset_zero(uintptr_t ptr, size_t size) override {
    Dev g(this);
    check(api_.hipMemset(reinterpret_cast<void*>(ptr), 0, size), "hipMemset");
    check(api_.hipDeviceSynchronize(), "hipDeviceSynchronize");
  }
  std::pair<size_t, size_t> mem_info() override {
    Dev g(this);
    size_t f = 0, t = 0;
    check(api_.hipMemGetInfo(&f, &t), "hipMemGetInfo");
    return {f, t};
  }
  std::pair<int, int> dlpack_device() const override { return {10, device}; }

 private:
  // hipSetDevice for one call; the previous device is restored for the caller's code.
  struct Dev {
    HipBackend* b;
    int prev = -1;
    explicit Dev(HipBackend* be) : b(be) {
      if (b->api_.hipGetDevice(&prev) != 0) prev = -1;
      if (prev != b->device) b->api_.hipSetDevice(b->device);
    }
    ~Dev() {
      if (prev >= 0 && prev != b->device) b->api_.hipSetDevice(prev);
    }
  };

  const void* prop() const { return v5_ ? static_cast<const void*>(&p5_) : static_cast<const void*>(&p6_); }
  std::string err_name(hipError r) {
    const char* n = api_.hipGetErrorName ? api_.hipGetErrorName(r) : nullptr;
    return n ? n : "hipErrorUnknown";
  }
  void check(hipError r, const char* call) {
    if (r == 0) return;
    std::string msg = std::string(call) + " failed: " + err_name(r) + " (" + std::to_string(r) + ")";
    ErrKind k = ErrKind::Driver;
    if (r == kHipOutOfMemory) {
      k = ErrKind::OutOfMemory;
      msg += ": the GPU has no free memory for this page; free blocks, lower the limit, or stop other processes";
    } else if (r == kHipNoDevice) {
      k = ErrKind::NoDevice;
    }
    throw Error(k, msg);
  }
  void soft(hipError r, const char* call) noexcept {
    if (r != 0) log_warning(std::string(call) + " failed: " + err_name(r) + " (" + std::to_string(r) + ")");
  }

  void* lib_ = nullptr;
  HipApi api_{};
  bool v5_ = false;
  HipPropV6 p6_{};
  HipPropV5 p5_{};
  HipAccessDesc access_{};
  std::mutex sizes_lock_;
  std::map<Handle, size_t> sizes_;
};

}  // namespace

std::shared_ptr<Backend> make_hip_backend(int device) { return std::make_shared<HipBackend>(device); }

}  // namespace kvc
