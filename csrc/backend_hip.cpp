// HIP backend: libamdhip64 opened at run time. Types declared here: ROCm 6+ uses
// CUDA's CUmemAllocationProp layout; ROCm 5 ordered the fields differently.
// The Backend methods are backend_driver.h's, shared with CUDA.
#include <dlfcn.h>

#include <cstring>

#include "backend_driver.h"

namespace kvc {
namespace {

using hipError = int;
using HipHandle = void*;

using HipLocation = MemLocation;
using HipPropV6 = MemAllocationProp;  // ROCm 6+: CUDA's layout (backend_driver.h)
struct HipPropV5 {
  unsigned char compressionType;
  HipLocation location;
  int requestedHandleType;
  int type;
  unsigned short usage;
  void* win32HandleMetaData;
};
using HipAccessDesc = MemAccessDesc;

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

void* va(uintptr_t ptr) { return reinterpret_cast<void*>(ptr); }
HipHandle hip_handle(Handle h) { return reinterpret_cast<HipHandle>(h); }

class HipDriver {
 public:
  static constexpr const char* kKind = "hip";
  static constexpr int kOutOfMemory = 2;
  static constexpr int kNoDevice = 100;
  static constexpr const char* kNoDeviceHint = "";
  static constexpr int kQuietError = 0;  // every failure is logged
  static constexpr int kDlpackDevice = 10;
  static constexpr const char* kGranularity = "hipMemGetAllocationGranularity";
  static constexpr const char* kReserve = "hipMemAddressReserve";
  static constexpr const char* kFreeVa = "hipMemAddressFree";
  static constexpr const char* kCreate = "hipMemCreate";
  static constexpr const char* kRelease = "hipMemRelease";
  static constexpr const char* kMap = "hipMemMap";
  static constexpr const char* kUnmap = "hipMemUnmap";
  static constexpr const char* kSetAccess = "hipMemSetAccess";
  static constexpr const char* kMemset = "hipMemset";
  static constexpr const char* kSynchronize = "hipDeviceSynchronize";
  static constexpr const char* kMemGetInfo = "hipMemGetInfo";

  explicit HipDriver(int dev) : device_(dev) {
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
      throw Error(ErrKind::NoDevice, "no usable AMD GPU: hipInit returned " + error_name(ri) + " (" +
                                         std::to_string(ri) + "), hipGetDeviceCount " + error_name(r) + " (" +
                                         std::to_string(r) + ", count " + std::to_string(count) +
                                         "). The HIP runtime loaded but sees no device; use backend 'host' "
                                         "(KVCACHED_BACKEND=host) or check /dev/kfd access.");
    }
    if (dev >= count) {
      throw Error(ErrKind::NoDevice, "HIP device " + std::to_string(dev) + " does not exist (this machine has " +
                                         std::to_string(count) + ").");
    }
    p6_ = pinned_on_device(dev);
    std::memset(&p5_, 0, sizeof(p5_));
    p5_.type = 1;
    p5_.location = {1, dev};
    access_ = read_write_on_device(dev);
  }

  // hipSetDevice for one call; the previous device is restored for the caller's code.
  struct Scope {
    HipDriver& d;
    int prev = -1;
    explicit Scope(HipDriver& drv) : d(drv) {
      if (d.api_.hipGetDevice(&prev) != 0) prev = -1;
      if (prev != d.device_) d.api_.hipSetDevice(d.device_);
    }
    ~Scope() {
      if (prev >= 0 && prev != d.device_) d.api_.hipSetDevice(prev);
    }
  };

  std::string error_name(hipError r) {
    const char* n = api_.hipGetErrorName ? api_.hipGetErrorName(r) : nullptr;
    return n ? n : "hipErrorUnknown";
  }

  hipError granularity(size_t* g) { return api_.hipMemGetAllocationGranularity(g, prop(), 0); }
  hipError reserve(uintptr_t* ptr, size_t size, size_t align) {
    void* p = nullptr;
    hipError r = api_.hipMemAddressReserve(&p, size, align, nullptr, 0);
    *ptr = reinterpret_cast<uintptr_t>(p);
    return r;
  }
  hipError free_va(uintptr_t ptr, size_t size) { return api_.hipMemAddressFree(va(ptr), size); }
  hipError create(Handle* h, size_t size) {
    HipHandle hh = nullptr;
    hipError r = api_.hipMemCreate(&hh, size, prop(), 0);
    *h = reinterpret_cast<Handle>(hh);
    return r;
  }
  hipError release(Handle h) { return api_.hipMemRelease(hip_handle(h)); }
  hipError map(uintptr_t ptr, size_t size, size_t offset, Handle h) {
    return api_.hipMemMap(va(ptr), size, offset, hip_handle(h), 0);
  }
  hipError unmap(uintptr_t ptr, size_t size) { return api_.hipMemUnmap(va(ptr), size); }
  hipError set_access(uintptr_t ptr, size_t size) { return api_.hipMemSetAccess(va(ptr), size, &access_, 1); }
  hipError memset_zero(uintptr_t ptr, size_t size) { return api_.hipMemset(va(ptr), 0, size); }
  hipError synchronize() { return api_.hipDeviceSynchronize(); }
  hipError mem_info(size_t* free, size_t* total) { return api_.hipMemGetInfo(free, total); }

 private:
  const void* prop() const { return v5_ ? static_cast<const void*>(&p5_) : static_cast<const void*>(&p6_); }

  int device_;
  void* lib_ = nullptr;
  HipApi api_{};
  bool v5_ = false;
  HipPropV6 p6_{};
  HipPropV5 p5_{};
  HipAccessDesc access_{};
};

}  // namespace

std::shared_ptr<Backend> make_hip_backend(int device) { return std::make_shared<DriverBackend<HipDriver>>(device); }

}  // namespace kvc
