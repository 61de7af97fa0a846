// A reserved virtual range backed by shared zero memory wherever no real page is mapped.
//
// Zero backing is a set of extents, each one mapping of a shared zero allocation of
// unit * 2^j bytes (j = 0 .. log2(zero_chunk / unit)). With zero_chunk == unit (the
// default) every unit maps the same zero page, so all unbacked writes alias. A larger
// zero_chunk needs up to zero_chunk / unit times fewer mappings (drivers charge per
// mapping), at the price of aliasing only at equal offsets within a chunk and of about
// 2 * zero_chunk bytes of shared zero memory.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "backend.h"

namespace kvc {

class VirtualTensor {
 public:
  VirtualTensor(std::shared_ptr<Backend> backend, size_t size, size_t unit, size_t zero_chunk = 0);
  ~VirtualTensor();
  VirtualTensor(const VirtualTensor&) = delete;
  VirtualTensor& operator=(const VirtualTensor&) = delete;

  // Removes the zero backing of [off, off+size) (whole units, all zero-backed) so real
  // pages can be mapped there. Zero extents that stick out of the range are split and
  // their remainders mapped again. Returns [lo, hi): the range whose access must be set
  // (one call) once the real pages are mapped. On failure the range is zero-backed again.
  std::pair<size_t, size_t> take_zero(size_t off, size_t size);
  // Backs [off, off+size) (whole units, currently unmapped) with zero memory; no access change.
  void give_zero(size_t off, size_t size);

  const std::shared_ptr<Backend>& backend() const { return backend_; }
  uintptr_t ptr() const { return ptr_; }
  size_t size() const { return size_; }
  size_t unit() const { return unit_; }
  size_t zero_chunk() const { return unit_ << max_order_; }
  size_t num_zero_mappings();

 private:
  void map_zero_locked(size_t off, size_t size);  // power-of-two pieces, largest first, recorded as they go
  void unmap_extents_locked(const std::vector<std::pair<size_t, size_t>>& ext);  // contiguous, ascending

  std::shared_ptr<Backend> backend_;
  std::vector<std::shared_ptr<ZeroPage>> zeros_;  // zeros_[j]: unit << j bytes
  uintptr_t ptr_ = 0;
  size_t size_ = 0;
  size_t unit_ = 0;
  unsigned max_order_ = 0;
  std::mutex mu_;
  std::map<size_t, size_t> zero_ext_;  // offset -> length of each zero mapping
};

}  // namespace kvc
