// CUDA backend: the driver API opened at run time (no SDK needed to build), types
// declared here with the layout of cuda.h (CUDA 11.2+, unchanged through 13).
#include <dlfcn.h>

#include <cstring>

#include "backend.h"

namespace kvc {
namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUdeviceptr = unsigned long long;
using CUhandle = unsigned long long;

struct CUmemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE = 1
  int id;
};
struct CUmemAllocationProp {
  int type;                  // CU_MEM_ALLOCATION_TYPE_PINNED = 1, @0
  int requestedHandleTypes;  // @4
  CUmemLocation location;    // @8
  void* win32HandleMetaData;  // @16
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;  // @24
};
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
};

constexpr int kErrOutOfMemory = 2;
constexpr int kErrNoDevice = 100;
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

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int dev) {
    kind = "cuda";
    device = dev;
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
    check(api_.cuInit(0), "cuInit");
    int count = 0;
    check(api_.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (count == 0) throw Error(ErrKind::NoDevice, "cuDeviceGetCount found no CUDA device; use backend 'host'.");
    if (dev >= count) {
      throw Error(ErrKind::NoDevice, "CUDA device " + std::to_string(dev) + " does not exist (this machine has " +
                                         std::to_string(count) + "); pick cuda:0..cuda:" + std::to_string(count - 1) +
                                         ".");
    }
    check(api_.cuDeviceGet(&cudev_, dev), "cuDeviceGet");
    int vmm = 0;
    check(api_.cuDeviceGetAttribute(&vmm, kAttrVmmSupported, cudev_), "cuDeviceGetAttribute");
    if (!vmm) throw Error(ErrKind::NoDevice, "CUDA device " + std::to_string(dev) + " does not support virtual memory management.");
    check(api_.cuDevicePrimaryCtxRetain(&ctx_, cudev_), "cuDevicePrimaryCtxRetain");
    retained_ = true;
    std::memset(&prop_, 0, sizeof(prop_));
    prop_.type = 1;
    prop_.location = {1, dev};
    access_.location = {1, dev};
    access_.flags = 3;
    Ctx g(this);
    check(api_.cuMemGetAllocationGranularity(&granularity, &prop_, 0), "cuMemGetAllocationGranularity");
    probe_map_offset();
  }

  ~CudaBackend() override {
    if (retained_) api_.cuDevicePrimaryCtxRelease(cudev_);  // errors at exit are harmless
  }

  uintptr_t reserve(size_t size) override {
    check_aligned("reserve size", size);
    Ctx g(this);
    CUdeviceptr p = 0;
    check(api_.cuMemAddressReserve(&p, size, granularity, 0, 0), "cuMemAddressReserve");
    return static_cast<uintptr_t>(p);
  }
  void free_va(uintptr_t ptr, size_t size) noexcept override {
    Ctx g(this);
    soft(api_.cuMemAddressFree(ptr, size), "cuMemAddressFree");
  }
  Handle create(size_t size) override {
    check_aligned("allocation size", size);
    Ctx g(this);
    CUhandle h = 0;
    check(api_.cuMemCreate(&h, size, &prop_, 0), "cuMemCreate");
    physical_.fetch_add(size);
    sizes_lock_.lock();
    sizes_[h] = size;
    sizes_lock_.unlock();
    return h;
  }
  void release(Handle h) noexcept override {
    Ctx g(this);
    soft(api_.cuMemRelease(h), "cuMemRelease");
    std::lock_guard<std::mutex> lk(sizes_lock_);
    auto it = sizes_.find(h);
    if (it != sizes_.end()) {
      physical_.fetch_sub(it->second);
      sizes_.erase(it);
    }
  }
  void map(uintptr_t ptr, size_t size, Handle h, size_t offset) override {
    Ctx g(this);
    check(api_.cuMemMap(ptr, size, offset, h, 0), "cuMemMap");
  }
  void unmap(uintptr_t ptr, size_t size) override {
    Ctx g(this);
    check(api_.cuMemUnmap(ptr, size), "cuMemUnmap");
  }
  void set_access(uintptr_t ptr, size_t size) override {
    Ctx g(this);
    check(api_.cuMemSetAccess(ptr, size, &access_, 1), "cuMemSetAccess");
  }
  void memset_zero(uintptr_t ptr, size_t size) override {
    Ctx g(this);
    check(api_.cuMemsetD8(ptr, 0, size), "cuMemsetD8");
    check(api_.cuCtxSynchronize(), "cuCtxSynchronize");
  }
  std::pair<size_t, size_t> mem_info() override {
    Ctx g(this);
    size_t f = 0, t = 0;
    check(api_.cuMemGetInfo(&f, &t), "cuMemGetInfo");
    return {f, t};
  }
  std::pair<int, int> dlpack_device() const override { return {2, device}; }

 private:
  // Makes our primary context current for one call; a thread with no context keeps
  // ours (the prealloc thread), a thread with another context gets it back.
  struct Ctx {
    CudaBackend* b;
    CUcontext prev = nullptr;
    bool restore = false;
    explicit Ctx(CudaBackend* be) : b(be) {
      if (b->api_.cuCtxGetCurrent(&prev) != 0) prev = nullptr;
      if (prev != b->ctx_) {
        b->api_.cuCtxSetCurrent(b->ctx_);
        restore = prev != nullptr;
      }
    }
    ~Ctx() {
      if (restore) b->api_.cuCtxSetCurrent(prev);
    }
  };

  std::string err_name(CUresult r) {
    const char* name = nullptr;
    if (api_.cuGetErrorName && api_.cuGetErrorName(r, &name) == 0 && name) return name;
    return "CUDA_ERROR_UNKNOWN";
  }
  void check(CUresult r, const char* call) {
    if (r == 0) return;
    std::string msg = std::string(call) + " failed: " + err_name(r) + " (" + std::to_string(r) + ")";
    ErrKind k = ErrKind::Driver;
    if (r == kErrOutOfMemory) {
      k = ErrKind::OutOfMemory;
      msg += ": the GPU has no free memory for this page; free blocks, lower the limit, or stop other processes";
    } else if (r == kErrNoDevice) {
      k = ErrKind::NoDevice;
      msg += ": no usable CUDA device; use backend 'host'";
    }
    throw Error(k, msg);
  }
  void soft(CUresult r, const char* call) noexcept {
    if (r != 0 && r != 4 /* DEINITIALIZED: process exit */) {
      log_warning(std::string(call) + " failed: " + err_name(r) + " (" + std::to_string(r) + ")");
    }
  }

  void* lib_ = nullptr;  // never dlclosed: other libraries may share it
  CudaApi api_{};
  CUdevice cudev_ = 0;
  CUcontext ctx_ = nullptr;
  bool retained_ = false;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::mutex sizes_lock_;
  std::map<CUhandle, size_t> sizes_;
};

}  // namespace

std::shared_ptr<Backend> make_cuda_backend(int device) { return std::make_shared<CudaBackend>(device); }

}  // namespace kvc
