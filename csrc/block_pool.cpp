#include <Python.h>  // only for the GIL; pybind11 is kept out of this file (build time)

#include "block_pool.h"

#include <algorithm>

namespace kvc {
namespace {

// Drops the GIL for a scope (the caller holds it: every BlockPool method is called from Python).
class NoGil {
 public:
  NoGil() : state_(PyEval_SaveThread()) {}
  ~NoGil() { PyEval_RestoreThread(state_); }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  PyThreadState* state_;
};

// Takes a mutex without ever blocking while holding the GIL (a thread that holds the
// mutex may be waiting for the GIL); the GIL is dropped only when the lock is contended.
class Lock {
 public:
  explicit Lock(std::mutex& m) : lk_(m, std::try_to_lock) {
    if (!lk_.owns_lock()) {
      NoGil rel;
      lk_.lock();
    }
  }
  std::unique_lock<std::mutex> lk_;
};

}  // namespace

BlockPool::BlockPool(std::shared_ptr<PageAllocator> pa, int64_t blocks_per_page, int64_t num_blocks)
    : pa_(std::move(pa)), bpp_(blocks_per_page), num_blocks_(num_blocks) {
  if (!pa_) throw_value("BlockPool needs a PageAllocator, got None.");
  if (blocks_per_page <= 0 || blocks_per_page > (1 << 30)) {
    throw_value("blocks_per_page must be in [1, 2^30], got " + std::to_string(blocks_per_page) + ".");
  }
  if (num_blocks <= 0) throw_value("num_blocks must be positive, got " + std::to_string(num_blocks) + ".");
  pool_pages_ = num_blocks / bpp_ + (num_blocks % bpp_ != 0);  // num_blocks + bpp - 1 could overflow
  if (pool_pages_ > pa_->num_pages()) {
    throw_value(std::to_string(num_blocks) + " blocks at " + std::to_string(bpp_) + " per page need " +
                std::to_string(pool_pages_) + " pages, but the PageAllocator has " + std::to_string(pa_->num_pages()) +
                "; lower num_blocks or give the allocator more pages.");
  }
  allocated_.assign(num_blocks, 0);
  used_.assign(pool_pages_, -1);
  stack_.resize(pool_pages_);
}

int64_t BlockPool::valid_blocks(int64_t page) const { return std::min(bpp_, num_blocks_ - page * bpp_); }

void BlockPool::adopt_page(int64_t page) {
  int64_t v = valid_blocks(page);
  auto& st = stack_[page];
  st.resize(v);
  for (int64_t i = 0; i < v; ++i) st[i] = static_cast<int32_t>(v - 1 - i);  // pop gives the lowest block
  used_[page] = 0;
  partial_.insert(page);
  free_held_.fetch_add(v, std::memory_order_relaxed);
  held_pages_.fetch_add(1, std::memory_order_relaxed);
}

// Gets k pages; false (nothing taken) if the allocator cannot hand them out now.
bool BlockPool::get_pages(int64_t k, std::vector<int64_t>& got) {
  std::vector<int64_t> pages;
  if (!pa_->try_take_reserved(k, pages)) {
    try {
      NoGil rel;
      pages = pa_->alloc_pages(k);
    } catch (const Error& e) {
      if (e.kind == ErrKind::OutOfMemory) return false;
      throw;
    }
  }
  got = std::move(pages);
  return true;
}

void BlockPool::give_pages(const std::vector<int64_t>& pages) {
  if (pages.empty() || pa_->try_return(pages)) return;
  NoGil rel;
  pa_->free_pages(pages);
}

std::optional<std::vector<int64_t>> BlockPool::alloc(int64_t n) {
  if (n < 0) throw_value("alloc(n) needs n >= 0, got " + std::to_string(n) + ".");
  std::vector<int64_t> out;
  if (n == 0) return out;
  Lock lock(mu_);
  if (n > num_blocks_ - num_allocated_.load()) return std::nullopt;
  std::vector<int64_t> fresh;  // pages taken in this call, returned if we still fall short
  while (free_held_.load() < n) {
    int64_t missing = n - free_held_.load();
    int64_t k = (missing + bpp_ - 1) / bpp_;
    std::vector<int64_t> got;
    bool ok = get_pages(k, got);
    bool useless = false;
    for (int64_t p : got) {
      if (p >= pool_pages_) useless = true;  // the allocator is shared and ran past our pages
    }
    if (!ok || useless) {
      std::vector<int64_t> back = fresh;
      back.insert(back.end(), got.begin(), got.end());
      for (int64_t p : fresh) {
        partial_.erase(p);
        free_held_.fetch_sub(valid_blocks(p));
        held_pages_.fetch_sub(1);
        used_[p] = -1;
        stack_[p].clear();
      }
      give_pages(back);
      return std::nullopt;
    }
    for (int64_t p : got) {
      if (used_[p] != -1) throw_state("PageAllocator handed out page " + std::to_string(p) + " that the pool already holds.");
      adopt_page(p);
      fresh.push_back(p);
    }
  }
  out.reserve(n);
  while (static_cast<int64_t>(out.size()) < n) {
    int64_t p = *partial_.begin();
    auto& st = stack_[p];
    while (!st.empty() && static_cast<int64_t>(out.size()) < n) {
      int64_t id = p * bpp_ + st.back();
      st.pop_back();
      allocated_[id] = 1;
      used_[p]++;
      out.push_back(id);
    }
    if (st.empty()) partial_.erase(partial_.begin());
  }
  free_held_.fetch_sub(n, std::memory_order_relaxed);
  num_allocated_.fetch_add(n, std::memory_order_relaxed);
  return out;
}

void BlockPool::free(const std::vector<int64_t>& ids) {
  if (ids.empty()) return;
  Lock lock(mu_);
  // Validate everything first so that a bad id leaves the pool as it was.
  size_t i = 0;
  std::string err;
  for (; i < ids.size(); ++i) {
    int64_t id = ids[i];
    if (id < 0 || id >= num_blocks_) {
      err = "free: block id " + std::to_string(id) + " out of range [0, " + std::to_string(num_blocks_) + ")";
      break;
    }
    if (allocated_[id] == 2) {
      err = "free: block id " + std::to_string(id) + " appears twice in one call";
      break;
    }
    if (allocated_[id] != 1) {
      err = "free: block id " + std::to_string(id) + " is not allocated (double free?)";
      break;
    }
    allocated_[id] = 2;
  }
  if (!err.empty()) {
    for (size_t j = 0; j < i; ++j) allocated_[ids[j]] = 1;
    throw_value(err + "; nothing was freed.");
  }
  std::vector<int64_t> empty;
  for (int64_t id : ids) {
    allocated_[id] = 0;
    int64_t p = id / bpp_;
    auto& st = stack_[p];
    if (st.empty()) partial_.insert(p);
    st.push_back(static_cast<int32_t>(id - p * bpp_));
    if (--used_[p] == 0) empty.push_back(p);
  }
  free_held_.fetch_add(static_cast<int64_t>(ids.size()), std::memory_order_relaxed);
  num_allocated_.fetch_sub(static_cast<int64_t>(ids.size()), std::memory_order_relaxed);
  if (empty.empty()) return;
  // Pages with no live block go back to the allocator, lowest first.
  std::sort(empty.begin(), empty.end());
  for (int64_t p : empty) {
    partial_.erase(p);
    free_held_.fetch_sub(valid_blocks(p), std::memory_order_relaxed);
    held_pages_.fetch_sub(1, std::memory_order_relaxed);
    used_[p] = -1;
    stack_[p].clear();
  }
  give_pages(empty);
}

int64_t BlockPool::available() const {
  int64_t held = free_held_.load(std::memory_order_relaxed);
  int64_t more = pa_->obtainable_pages() * bpp_;
  int64_t left = num_blocks_ - num_allocated_.load(std::memory_order_relaxed);
  return std::max<int64_t>(0, std::min(held + more, left));
}

bool BlockPool::is_allocated(int64_t id) const {
  if (id < 0 || id >= num_blocks_) {
    throw_value("block id " + std::to_string(id) + " out of range [0, " + std::to_string(num_blocks_) + ").");
  }
  return allocated_[id] != 0;
}

}  // namespace kvc
