#include "vtensor.h"

namespace kvc {

VirtualTensor::VirtualTensor(std::shared_ptr<Backend> backend, size_t size, size_t unit, size_t zero_chunk)
    : backend_(std::move(backend)), size_(size), unit_(unit) {
  if (!backend_) throw_value("VirtualTensor needs a Backend, got None.");
  backend_->check_aligned("VirtualTensor unit", unit);
  if (size == 0 || size % unit) {
    throw_value("VirtualTensor size = " + std::to_string(size) + " B is not a positive multiple of its unit (" +
                std::to_string(unit) + " B); round the size up to whole units.");
  }
  if (zero_chunk == 0) zero_chunk = unit;
  size_t ratio = zero_chunk / unit;
  if (zero_chunk % unit || (ratio & (ratio - 1))) {
    throw_value("zero_chunk = " + std::to_string(zero_chunk) + " B must be the unit (" + std::to_string(unit) +
                " B) times a power of two.");
  }
  // No zero allocation larger than the tensor: it could never be mapped.
  while ((unit << (max_order_ + 1)) <= zero_chunk && (unit << (max_order_ + 1)) <= size) ++max_order_;
  for (unsigned j = 0; j <= max_order_; ++j) zeros_.push_back(backend_->zero_page(unit << j));
  ptr_ = backend_->reserve(size);
  try {
    std::lock_guard<std::mutex> lk(mu_);
    map_zero_locked(0, size);
    // One access call over the whole range: the driver charges per call, not per byte.
    backend_->set_access(ptr_, size);
  } catch (...) {
    std::vector<std::pair<size_t, size_t>> ext(zero_ext_.begin(), zero_ext_.end());
    try {
      if (!ext.empty()) unmap_extents_locked(ext);
    } catch (const std::exception& e) {
      log_warning(std::string("cleanup after a failed VirtualTensor: ") + e.what());
    }
    backend_->free_va(ptr_, size);
    throw;
  }
}

void VirtualTensor::map_zero_locked(size_t off, size_t size) {
  // Largest pieces first, with no alignment: the driver charges per mapping, and any
  // granularity-aligned address takes any allocation, so a run of r units needs at most
  // r / chunk + popcount(r mod chunk) mappings.
  size_t a = off / unit_, b = (off + size) / unit_;
  while (a < b) {
    unsigned j = max_order_;
    while (j > 0 && a + (size_t{1} << j) > b) --j;
    size_t len = unit_ << j;
    backend_->map(ptr_ + a * unit_, len, zeros_[j]->handle, 0);
    zero_ext_[a * unit_] = len;
    a += size_t{1} << j;
  }
}

void VirtualTensor::unmap_extents_locked(const std::vector<std::pair<size_t, size_t>>& ext) {
  std::vector<size_t> sizes;
  for (const auto& e : ext) sizes.push_back(e.second);
  size_t done = 0;
  try {
    backend_->unmap_mappings(ptr_ + ext.front().first, sizes, &done);
  } catch (...) {
    for (size_t i = 0; i < done; ++i) zero_ext_.erase(ext[i].first);
    throw;
  }
  for (const auto& e : ext) zero_ext_.erase(e.first);
}

std::pair<size_t, size_t> VirtualTensor::take_zero(size_t off, size_t size) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = zero_ext_.upper_bound(off);
  std::vector<std::pair<size_t, size_t>> ext;
  if (it != zero_ext_.begin()) {
    --it;
    for (size_t at = it->first; it != zero_ext_.end() && it->first == at && at < off + size; ++it) {
      ext.emplace_back(it->first, it->second);
      at += it->second;
    }
  }
  if (ext.empty() || ext.front().first + ext.front().second <= off ||
      ext.back().first + ext.back().second < off + size) {
    throw_state("take_zero: bytes " + std::to_string(off) + ".." + std::to_string(off + size) +
                " of the tensor are not all backed by the zero page (already mapped?).");
  }
  size_t lo = ext.front().first, hi = ext.back().first + ext.back().second;
  try {
    unmap_extents_locked(ext);
    map_zero_locked(lo, off - lo);
    map_zero_locked(off + size, hi - off - size);
  } catch (...) {
    // Back to zero everywhere in [lo, hi) that lost its mapping, then access for all of it.
    try {
      auto e = zero_ext_.lower_bound(lo);
      for (size_t at = lo; at < hi;) {
        if (e != zero_ext_.end() && e->first == at) {
          at += e->second;
          ++e;
          continue;
        }
        size_t end = (e != zero_ext_.end() && e->first < hi) ? e->first : hi;
        map_zero_locked(at, end - at);
        at = end;
        e = zero_ext_.lower_bound(at);
      }
      backend_->set_access(ptr_ + lo, hi - lo);
    } catch (const std::exception& x) {
      log_warning(std::string("take_zero rollback left part of the range unmapped: ") + x.what());
    }
    throw;
  }
  return {lo, hi};
}

void VirtualTensor::give_zero(size_t off, size_t size) {
  std::lock_guard<std::mutex> lk(mu_);
  map_zero_locked(off, size);
}

size_t VirtualTensor::num_zero_mappings() {
  std::lock_guard<std::mutex> lk(mu_);
  return zero_ext_.size();
}

VirtualTensor::~VirtualTensor() {
  // Allocators unmap their pages back to zero before letting go of us, so the zero
  // extents cover the range; unmap each run of adjacent extents.
  std::lock_guard<std::mutex> lk(mu_);
  while (!zero_ext_.empty()) {
    std::vector<std::pair<size_t, size_t>> run;
    for (auto it = zero_ext_.begin(); it != zero_ext_.end(); ++it) {
      if (!run.empty() && run.back().first + run.back().second != it->first) break;
      run.emplace_back(it->first, it->second);
    }
    try {
      unmap_extents_locked(run);
    } catch (const std::exception& e) {
      log_warning(std::string("VirtualTensor teardown: ") + e.what());
      for (const auto& r : run) zero_ext_.erase(r.first);
    }
  }
  backend_->free_va(ptr_, size_);
}

}  // namespace kvc
