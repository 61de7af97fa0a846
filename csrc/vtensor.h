// A reserved virtual range backed by the shared zero page wherever no real page is mapped.
#pragma once

#include <memory>

#include "backend.h"

namespace kvc {

class VirtualTensor {
 public:
  VirtualTensor(std::shared_ptr<Backend> backend, size_t size, size_t unit);
  ~VirtualTensor();
  VirtualTensor(const VirtualTensor&) = delete;
  VirtualTensor& operator=(const VirtualTensor&) = delete;

  // Replace the zero page by nothing over [off, off+size) (units), ready for real pages.
  void unmap_zero(size_t off, size_t size) { backend_->unmap_units(ptr_ + off, size, unit_); }
  // Map the zero page at every unit of [off, off+size) (no access change).
  void map_zero(size_t off, size_t size);

  const std::shared_ptr<Backend>& backend() const { return backend_; }
  uintptr_t ptr() const { return ptr_; }
  size_t size() const { return size_; }
  size_t unit() const { return unit_; }

 private:
  std::shared_ptr<Backend> backend_;
  std::shared_ptr<ZeroPage> zero_;
  uintptr_t ptr_ = 0;
  size_t size_ = 0;
  size_t unit_ = 0;
};

}  // namespace kvc
