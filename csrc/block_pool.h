// Blocks over a PageAllocator: page p holds blocks [p*bpp, (p+1)*bpp).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include "page_allocator.h"

namespace kvc {

class BlockPool {
 public:
  BlockPool(std::shared_ptr<PageAllocator> pa, int64_t blocks_per_page, int64_t num_blocks);

  // Called with the GIL held; they release it only when they must wait or map.
  std::optional<std::vector<int64_t>> alloc(int64_t n);
  // Gives back allocated or pending blocks; a page left with no block goes back to the allocator.
  void free(const std::vector<int64_t>& ids);
  // Frees the ids whose page keeps a live (allocated, not pending) block after this call; marks the
  // others pending and returns them in input order. A pending block is still allocated: only free()
  // gives it back, so the caller decides when its page may be unmapped.
  std::vector<int64_t> free_keeping_pages(const std::vector<int64_t>& ids);
  // Pending blocks back to allocated (the caller could not defer their free after all).
  void cancel_pending(const std::vector<int64_t>& ids);

  int64_t available() const;
  int64_t num_allocated() const { return num_allocated_.load(std::memory_order_relaxed); }
  bool is_allocated(int64_t id) const;
  int64_t blocks_per_page() const { return bpp_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_held_pages() const { return held_pages_.load(std::memory_order_relaxed); }
  const std::shared_ptr<PageAllocator>& page_allocator() const { return pa_; }

 private:
  int64_t valid_blocks(int64_t page) const;
  void adopt_page(int64_t page);
  int64_t first_fit(int64_t rest, int64_t& most) const;  // the page a request's next blocks come from
  bool get_pages(int64_t k, std::vector<int64_t>& got);
  void give_pages(const std::vector<int64_t>& pages);
  enum class Accept { Allocated, AllocatedOrPending, Pending };
  void mark_call(const std::vector<int64_t>& ids, Accept accept, const char* what);
  bool push_free(int64_t id);

  std::shared_ptr<PageAllocator> pa_;
  int64_t bpp_, num_blocks_, pool_pages_;
  std::mutex mu_;
  std::vector<uint8_t> allocated_;           // per block: kFree, kAllocated or kPending (block_pool.cpp)
  std::vector<int32_t> used_;                 // blocks in use per page (pending ones too); -1 = page not held
  std::vector<int32_t> pending_;              // pending blocks per page
  std::vector<int32_t> call_count_;           // free_keeping_pages: ids of the call per page (zero between calls)
  std::vector<std::vector<int32_t>> stack_;  // free block offsets within each held page
  std::set<int64_t> partial_;                 // held pages with free blocks, lowest first
  std::atomic<int64_t> free_held_{0}, num_allocated_{0}, held_pages_{0};
};

}  // namespace kvc
