#include "vtensor.h"

namespace kvc {

VirtualTensor::VirtualTensor(std::shared_ptr<Backend> backend, size_t size, size_t unit)
    : backend_(std::move(backend)), size_(size), unit_(unit) {
  if (!backend_) throw_value("VirtualTensor needs a Backend, got None.");
  backend_->check_aligned("VirtualTensor unit", unit);
  if (size == 0 || size % unit) {
    throw_value("VirtualTensor size = " + std::to_string(size) + " B is not a positive multiple of its unit (" +
                std::to_string(unit) + " B); round the size up to whole units.");
  }
  zero_ = backend_->zero_page(unit);
  ptr_ = backend_->reserve(size);
  size_t done = 0;
  try {
    for (; done < size; done += unit) backend_->map(ptr_ + done, unit, zero_->handle, 0);
    // One access call over the whole range: it dominates the cost of mapping.
    backend_->set_access(ptr_, size);
  } catch (...) {
    try {
      if (done) backend_->unmap_units(ptr_, done, unit);
    } catch (const std::exception& e) {
      log_warning(std::string("cleanup after a failed VirtualTensor: ") + e.what());
    }
    backend_->free_va(ptr_, size);
    throw;
  }
}

void VirtualTensor::map_zero(size_t off, size_t size) {
  for (size_t done = 0; done < size; done += unit_) {
    backend_->map(ptr_ + off + done, unit_, zero_->handle, 0);
  }
}

VirtualTensor::~VirtualTensor() {
  // Every unit holds a mapping (zero page or real page) by the time we get here:
  // allocators unmap their pages back to the zero page before letting go of us.
  try {
    backend_->unmap_units(ptr_, size_, unit_);
  } catch (const std::exception& e) {
    log_warning(std::string("VirtualTensor teardown: ") + e.what());
  }
  backend_->free_va(ptr_, size_);
}

}  // namespace kvc
