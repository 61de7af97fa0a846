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
  bucket_head_.assign(bpp_ + 1, -1);
  next_.assign(pool_pages_, -1);
  prev_.assign(pool_pages_, -1);
  bucket_of_.assign(pool_pages_, 0);
  bits_.assign(static_cast<size_t>(bpp_ / 64 + 1), 0);
  summary_.assign(bits_.size() / 64 + 1, 0);
}

inline void BlockPool::set_bucket_bit(int64_t c, bool on) {
  size_t w = static_cast<size_t>(c) >> 6;
  uint64_t bit = uint64_t{1} << (c & 63), was = bits_[w];
  bits_[w] = on ? was | bit : was & ~bit;
  if (!was != !bits_[w]) summary_[w >> 6] ^= uint64_t{1} << (w & 63);  // the word became (non-)empty
}

inline void BlockPool::list_page(int64_t page) {
  int64_t c = static_cast<int64_t>(stack_[page].size());
  if (c == 0 || used_[page] < 0) return;
  int64_t head = bucket_head_[c];
  next_[page] = head;
  prev_[page] = -1;
  if (head >= 0) {
    prev_[head] = page;
  } else {
    set_bucket_bit(c, true);
  }
  bucket_head_[c] = page;
  bucket_of_[page] = c;
}

inline void BlockPool::unlist_page(int64_t page) {
  int64_t c = bucket_of_[page];
  if (c == 0) return;
  int64_t n = next_[page], p = prev_[page];
  if (p >= 0) {
    next_[p] = n;
  } else {
    bucket_head_[c] = n;
  }
  if (n >= 0) prev_[n] = p;
  if (bucket_head_[c] < 0) set_bucket_bit(c, false);
  bucket_of_[page] = 0;
}

int64_t BlockPool::bucket_at_least(int64_t c) const {
  if (c > bpp_) return -1;
  size_t w = static_cast<size_t>(c) >> 6;
  uint64_t b = bits_[w] & (~uint64_t{0} << (c & 63));
  if (b) return static_cast<int64_t>((w << 6) + __builtin_ctzll(b));
  size_t next = w + 1;  // the first non-empty word after w, through the summary
  if (next >= bits_.size()) return -1;
  size_t s = next >> 6;
  uint64_t sb = summary_[s] & (~uint64_t{0} << (next & 63));
  while (!sb) {
    if (++s >= summary_.size()) return -1;
    sb = summary_[s];
  }
  size_t word = (s << 6) + __builtin_ctzll(sb);
  return static_cast<int64_t>((word << 6) + __builtin_ctzll(bits_[word]));
}

int64_t BlockPool::largest_bucket() const {
  for (size_t s = summary_.size(); s-- > 0;) {
    if (summary_[s]) {
      size_t word = (s << 6) + 63 - __builtin_clzll(summary_[s]);
      return static_cast<int64_t>((word << 6) + 63 - __builtin_clzll(bits_[word]));
    }
  }
  return -1;
}

int64_t BlockPool::valid_blocks(int64_t page) const { return std::min(bpp_, num_blocks_ - page * bpp_); }

void BlockPool::adopt_page(int64_t page) {
  int64_t v = valid_blocks(page);
  auto& st = stack_[page];
  st.resize(v);
  for (int64_t i = 0; i < v; ++i) st[i] = static_cast<int32_t>(v - 1 - i);  // pop gives the lowest block
  used_[page] = 0;
  list_page(page);
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
        unlist_page(p);
        free_held_.fetch_sub(valid_blocks(p));
        held_pages_.fetch_sub(1);
        used_[p] = -1;
        stack_[p].clear();
      }
      give_pages(back);
      return std::nullopt;
    }
    // highest first: a bucket lists its latest page first, so fresh pages are used lowest first
    std::sort(got.begin(), got.end());
    for (auto it = got.rbegin(); it != got.rend(); ++it) {
      int64_t p = *it;
      if (used_[p] != -1) throw_state("PageAllocator handed out page " + std::to_string(p) + " that the pool already holds.");
      adopt_page(p);
      fresh.push_back(p);
    }
  }
  out.reserve(n);
  // Best fit: the page with the fewest free blocks that still holds the rest of the request, else
  // the page with the most (the largest bite, then again). A request's blocks then share few pages,
  // and small holes fill with small requests, so fewer pages stay held by a few blocks.
  while (static_cast<int64_t>(out.size()) < n) {
    int64_t rest = n - static_cast<int64_t>(out.size());
    int64_t c = bucket_at_least(rest);
    if (c < 0) c = largest_bucket();
    int64_t p = bucket_head_[c];
    auto& st = stack_[p];
    while (!st.empty() && static_cast<int64_t>(out.size()) < n) {
      int64_t id = p * bpp_ + st.back();
      st.pop_back();
      allocated_[id] = kAllocated;
      used_[p]++;
      out.push_back(id);
    }
    relist_page(p);
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
  stack_[p].push_back(static_cast<int32_t>(id - p * bpp_));
  relist_page(p);
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
    unlist_page(p);
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
