// CUDA backend: the driver API opened at run time (no SDK needed to build), types
// declared here and in backend_driver.h with the layout of cuda.h (CUDA 11.2+, unchanged through 13).
// The Backend methods are backend_driver.h's, shared with HIP.
#include <dlfcn.h>

#include "backend_driver.h"

namespace kvc {
namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUdeviceptr = unsigned long long;
using CUhandle = unsigned long long;

using CUmemAllocationProp = MemAllocationProp;
using CUmemAccessDesc = MemAccessDesc;

constexpr int kAttrVmmSupported = 102;  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED

struct CudaApi {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuMemGetInfo)(size_t*, size_t*);
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, int);
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemCreate)(CUhandle*, size_t, const CUmemAllocationProp*, unsigned long long);
  CUresult (*cuMemRelease)(CUhandle);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUhandle, unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*cuGetErrorName)(CUresult, const char**);
};

using GetProcV2 = CUresult (*)(const char*, void**, int, unsigned long long, int*);

// Looks up the versioned export first (what cuda.h's macros name), then asks
// cuGetProcAddress for the base name.
void* lookup(void* lib, GetProcV2 gpa, const char* versioned, const char* base) {
  void* p = dlsym(lib, versioned);
  if (!p && gpa) {
    int status = 0;
    if (gpa(base, &p, 12000, 0, &status) != 0) p = nullptr;
  }
  if (!p) {
    throw Error(ErrKind::LibraryNotFound, std::string("libcuda.so.1 has no symbol ") + versioned +
                                              ": the NVIDIA driver is too old for virtual memory management "
                                              "(needs CUDA 11.2+); update the driver.");
  }
  return p;
}

class CudaDriver {
 public:
  static constexpr const char* kKind = "cuda";
  static constexpr int kOutOfMemory = 2;
  static constexpr int kNoDevice = 100;
  static constexpr const char* kNoDeviceHint = ": no usable CUDA device; use backend 'host'";
  static constexpr int kQuietError = 4;  // CUDA_ERROR_DEINITIALIZED: process exit
  static constexpr int kDlpackDevice = 2;
  static constexpr const char* kGranularity = "cuMemGetAllocationGranularity";
  static constexpr const char* kReserve = "cuMemAddressReserve";
  static constexpr const char* kFreeVa = "cuMemAddressFree";
  static constexpr const char* kCreate = "cuMemCreate";
  static constexpr const char* kRelease = "cuMemRelease";
  static constexpr const char* kMap = "cuMemMap";
  static constexpr const char* kUnmap = "cuMemUnmap";
  static constexpr const char* kSetAccess = "cuMemSetAccess";
  static constexpr const char* kMemset = "cuMemsetD8";
  static constexpr const char* kSynchronize = "cuCtxSynchronize";
  static constexpr const char* kMemGetInfo = "cuMemGetInfo";

  explicit CudaDriver(int dev) {
    lib_ = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) {
      const char* e = dlerror();
      std::string why = e ? e : "?";
      lib_ = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
      if (!lib_) throw Error(ErrKind::LibraryNotFound, "cannot open libcuda.so.1 (" + why +
                                                "): no NVIDIA driver on this machine; install it, or use "
                                                "backend 'host' (KVCACHED_BACKEND=host, device 'cpu').");
    }
    auto gpa = reinterpret_cast<GetProcV2>(dlsym(lib_, "cuGetProcAddress_v2"));
#define KVC_SYM(field, versioned, base) api_.field = reinterpret_cast<decltype(api_.field)>(lookup(lib_, gpa, versioned, base))
    KVC_SYM(cuInit, "cuInit", "cuInit");
    KVC_SYM(cuDriverGetVersion, "cuDriverGetVersion", "cuDriverGetVersion");
    KVC_SYM(cuDeviceGetCount, "cuDeviceGetCount", "cuDeviceGetCount");
    KVC_SYM(cuDeviceGet, "cuDeviceGet", "cuDeviceGet");
    KVC_SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute", "cuDeviceGetAttribute");
    KVC_SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain");
    KVC_SYM(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
    KVC_SYM(cuCtxGetCurrent, "cuCtxGetCurrent", "cuCtxGetCurrent");
    KVC_SYM(cuCtxSetCurrent, "cuCtxSetCurrent", "cuCtxSetCurrent");
    KVC_SYM(cuCtxSynchronize, "cuCtxSynchronize", "cuCtxSynchronize");
    KVC_SYM(cuMemGetInfo, "cuMemGetInfo_v2", "cuMemGetInfo");
    KVC_SYM(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity");
    KVC_SYM(cuMemAddressReserve, "cuMemAddressReserve", "cuMemAddressReserve");
    KVC_SYM(cuMemAddressFree, "cuMemAddressFree", "cuMemAddressFree");
    KVC_SYM(cuMemCreate, "cuMemCreate", "cuMemCreate");
    KVC_SYM(cuMemRelease, "cuMemRelease", "cuMemRelease");
    KVC_SYM(cuMemMap, "cuMemMap", "cuMemMap");
    KVC_SYM(cuMemUnmap, "cuMemUnmap", "cuMemUnmap");
    KVC_SYM(cuMemSetAccess, "cuMemSetAccess", "cuMemSetAccess");
    KVC_SYM(cuMemsetD8, "cuMemsetD8_v2", "cuMemsetD8");
    KVC_SYM(cuGetErrorName, "cuGetErrorName", "cuGetErrorName");
#undef KVC_SYM
    driver_check(*this, api_.cuInit(0), "cuInit");
    int count = 0;
    driver_check(*this, api_.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (count == 0) throw Error(ErrKind::NoDevice, "cuDeviceGetCount found no CUDA device; use backend 'host'.");
    if (dev >= count) {
      throw Error(ErrKind::NoDevice, "CUDA device " + std::to_string(dev) + " does not exist (this machine has " +
                                         std::to_string(count) + "); pick cuda:0..cuda:" + std::to_string(count - 1) +
                                         ".");
    }
    driver_check(*this, api_.cuDeviceGet(&cudev_, dev), "cuDeviceGet");
    int vmm = 0;
    driver_check(*this, api_.cuDeviceGetAttribute(&vmm, kAttrVmmSupported, cudev_), "cuDeviceGetAttribute");
    if (!vmm) throw Error(ErrKind::NoDevice, "CUDA device " + std::to_string(dev) + " does not support virtual memory management.");
    driver_check(*this, api_.cuDevicePrimaryCtxRetain(&ctx_, cudev_), "cuDevicePrimaryCtxRetain");
    retained_ = true;
    prop_ = pinned_on_device(dev);
    access_ = read_write_on_device(dev);
  }

  ~CudaDriver() {
    if (retained_) api_.cuDevicePrimaryCtxRelease(cudev_);  // errors at exit are harmless
  }

  // Makes our primary context current for one call; a thread with no context keeps
  // ours (the prealloc thread), a thread with another context gets it back.
  struct Scope {
    CudaDriver& d;
    CUcontext prev = nullptr;
    bool restore = false;
    explicit Scope(CudaDriver& drv) : d(drv) {
      if (d.api_.cuCtxGetCurrent(&prev) != 0) prev = nullptr;
      if (prev != d.ctx_) {
        d.api_.cuCtxSetCurrent(d.ctx_);
        restore = prev != nullptr;
      }
    }
    ~Scope() {
      if (restore) d.api_.cuCtxSetCurrent(prev);
    }
  };

  std::string error_name(CUresult r) {
    const char* name = nullptr;
    if (api_.cuGetErrorName && api_.cuGetErrorName(r, &name) == 0 && name) return name;
    return "CUDA_ERROR_UNKNOWN";
  }

  CUresult granularity(size_t* g) { return api_.cuMemGetAllocationGranularity(g, &prop_, 0); }
  CUresult reserve(uintptr_t* ptr, size_t size, size_t align) {
    CUdeviceptr p = 0;
    CUresult r = api_.cuMemAddressReserve(&p, size, align, 0, 0);
    *ptr = static_cast<uintptr_t>(p);
    return r;
  }
  CUresult free_va(uintptr_t ptr, size_t size) { return api_.cuMemAddressFree(ptr, size); }
  CUresult create(Handle* h, size_t size) {
    CUhandle ch = 0;
    CUresult r = api_.cuMemCreate(&ch, size, &prop_, 0);
    *h = ch;
    return r;
  }
  CUresult release(Handle h) { return api_.cuMemRelease(h); }
  CUresult map(uintptr_t ptr, size_t size, size_t offset, Handle h) { return api_.cuMemMap(ptr, size, offset, h, 0); }
  CUresult unmap(uintptr_t ptr, size_t size) { return api_.cuMemUnmap(ptr, size); }
  CUresult set_access(uintptr_t ptr, size_t size) { return api_.cuMemSetAccess(ptr, size, &access_, 1); }
  CUresult memset_zero(uintptr_t ptr, size_t size) { return api_.cuMemsetD8(ptr, 0, size); }
  CUresult synchronize() { return api_.cuCtxSynchronize(); }
  CUresult mem_info(size_t* free, size_t* total) { return api_.cuMemGetInfo(free, total); }

 private:
  void* lib_ = nullptr;  // never dlclosed: other libraries may share it
  CudaApi api_{};
  CUdevice cudev_ = 0;
  CUcontext ctx_ = nullptr;
  bool retained_ = false;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
};

}  // namespace

std::shared_ptr<Backend> make_cuda_backend(int device) { return std::make_shared<DriverBackend<CudaDriver>>(device); }

}  // namespace kvc
