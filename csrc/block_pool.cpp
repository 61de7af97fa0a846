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

// allocated_ states. A pending block was freed by free_keeping_pages but may still be read by
// device work: it stays allocated, its page stays held, until free() gives it back.
constexpr uint8_t kFree = 0, kAllocated = 1, kPending = 2;
constexpr uint8_t kInCall = 0x80;  // set on the ids of the call under validation

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
  pending_.assign(pool_pages_, 0);
  call_count_.assign(pool_pages_, 0);
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

// The lowest partly used page that holds all `rest` blocks, else the lowest partly used page.
// Lowest first packs live blocks into few pages (measured against best fit, which held more
// pages: benchmarks/results/page_choice_host.md); taking the whole rest from one page keeps a
// request's blocks together instead of spreading them over small holes, where a few cached
// blocks would later hold many pages. One block (decode) takes the lowest page at once.
// `most` bounds every partly used page's free blocks: a scan that finds none big enough lowers it,
// so one alloc call scans the pages at most once per size it still lacks (pages only lose blocks).
int64_t BlockPool::first_fit(int64_t rest, int64_t& most) const {
  int64_t lowest = *partial_.begin();
  if (rest <= static_cast<int64_t>(stack_[lowest].size()) || rest > most) return lowest;
  int64_t seen = 0;
  for (int64_t p : partial_) {
    int64_t f = static_cast<int64_t>(stack_[p].size());
    if (f >= rest) return p;
    seen = std::max(seen, f);
  }
  most = seen;
  return lowest;
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
  int64_t most = bpp_;
  while (static_cast<int64_t>(out.size()) < n) {
    int64_t p = first_fit(n - static_cast<int64_t>(out.size()), most);
    auto& st = stack_[p];
    while (!st.empty() && static_cast<int64_t>(out.size()) < n) {
      int64_t id = p * bpp_ + st.back();
      st.pop_back();
      allocated_[id] = kAllocated;
      used_[p]++;
      out.push_back(id);
    }
    if (st.empty()) partial_.erase(p);
  }
  free_held_.fetch_sub(n, std::memory_order_relaxed);
  num_allocated_.fetch_add(n, std::memory_order_relaxed);
  return out;
}

// Validates every id before anything changes, so that a bad id leaves the pool as it was;
// the ids of the call keep kInCall until the caller has applied them.
void BlockPool::mark_call(const std::vector<int64_t>& ids, Accept accept, const char* what) {
  size_t i = 0;
  const char* why = nullptr;
  for (; i < ids.size(); ++i) {
    int64_t id = ids[i];
    if (id < 0 || id >= num_blocks_) {
      why = "out of range";
      break;
    }
    uint8_t s = allocated_[id];
    if (s & kInCall) {
      why = "appears twice in one call";
    } else if (accept == Accept::Pending && s != kPending) {
      why = "is not pending";
    } else if (s == kFree) {
      why = "is not allocated (double free?)";
    } else if (s == kPending && accept == Accept::Allocated) {
      why = "was freed already and waits for the device (double free?)";
    }
    if (why) break;
    allocated_[id] = s | kInCall;
  }
  if (!why) return;
  for (size_t j = 0; j < i; ++j) allocated_[ids[j]] &= static_cast<uint8_t>(~kInCall);
  std::string err = std::string(what) + ": block id " + std::to_string(ids[i]) + " " + why;
  if (ids[i] < 0 || ids[i] >= num_blocks_) err += " [0, " + std::to_string(num_blocks_) + ")";
  throw_value(err + (accept == Accept::Pending ? "; nothing was changed." : "; nothing was freed."));
}

// Puts one marked block back on its page's free stack; true if that left the page empty.
bool BlockPool::push_free(int64_t id) {
  int64_t p = id / bpp_;
  if (allocated_[id] == (kPending | kInCall)) pending_[p]--;
  allocated_[id] = kFree;
  auto& st = stack_[p];
  if (st.empty()) partial_.insert(p);
  st.push_back(static_cast<int32_t>(id - p * bpp_));
  return --used_[p] == 0;
}

void BlockPool::free(const std::vector<int64_t>& ids) {
  if (ids.empty()) return;
  Lock lock(mu_);
  mark_call(ids, Accept::AllocatedOrPending, "free");
  std::vector<int64_t> empty;
  for (int64_t id : ids) {
    if (push_free(id)) empty.push_back(id / bpp_);
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

std::vector<int64_t> BlockPool::free_keeping_pages(const std::vector<int64_t>& ids) {
  std::vector<int64_t> later;
  if (ids.empty()) return later;
  Lock lock(mu_);
  mark_call(ids, Accept::Allocated, "free_keeping_pages");
  for (int64_t id : ids) call_count_[id / bpp_]++;
  // Decided per page for the whole call before anything changes. Pending blocks do not keep a
  // page here: their release may unmap it as soon as their own (earlier) device work is done,
  // which says nothing of the work launched since on a block freed now.
  std::vector<uint8_t> now(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    int64_t p = ids[i] / bpp_;
    now[i] = used_[p] - pending_[p] - call_count_[p] > 0;
  }
  int64_t freed = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    int64_t id = ids[i], p = id / bpp_;
    call_count_[p] = 0;
    if (now[i]) {
      push_free(id);  // never empties the page: a live block stays
      ++freed;
    } else {
      allocated_[id] = kPending;
      pending_[p]++;
      later.push_back(id);
    }
  }
  free_held_.fetch_add(freed, std::memory_order_relaxed);
  num_allocated_.fetch_sub(freed, std::memory_order_relaxed);
  return later;
}

void BlockPool::cancel_pending(const std::vector<int64_t>& ids) {
  if (ids.empty()) return;
  Lock lock(mu_);
  mark_call(ids, Accept::Pending, "cancel_pending");
  for (int64_t id : ids) {
    allocated_[id] = kAllocated;
    pending_[id / bpp_]--;
  }
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
  return allocated_[id] != kFree;
}

}  // namespace kvc
