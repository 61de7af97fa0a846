// DLPack v0.x structs (dlpack.h, unversioned DLManagedTensor), declared here so the
// build needs no SDK. Consumers (torch.from_dlpack) read the "dltensor" capsule.
#pragma once

#include <cstdint>

namespace kvc {

struct DLDevice {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2, kDLROCM = 10
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLUInt = 1
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

}  // namespace kvc
