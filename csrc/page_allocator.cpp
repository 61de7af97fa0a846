#include "page_allocator.h"

#include <algorithm>
#include <chrono>

namespace kvc {
namespace {

std::mutex g_live_mu;
std::set<PageAllocator*> g_live;  // for stopping prealloc threads at interpreter exit

}  // namespace

void stop_all_prealloc_threads() noexcept {
  std::lock_guard<std::mutex> lk(g_live_mu);
  for (auto* pa : g_live) {
    pa->stop_thread();
    // No thread may call the driver while the process tears it down; from here on every
    // release happens inline, in the call that frees the memory.
    pa->backend()->stop_releaser();
  }
}

PageAllocator::PageAllocator(std::shared_ptr<Backend> backend, std::vector<std::shared_ptr<VirtualTensor>> tensors,
                             std::vector<RegionSpec> regions, int64_t num_pages, int64_t min_reserved,
                             int64_t max_reserved, bool prealloc, int64_t max_run_pages)
    : backend_(std::move(backend)),
      tensors_(std::move(tensors)),
      regions_(std::move(regions)),
      num_pages_(num_pages),
      min_reserved_(min_reserved),
      max_reserved_(max_reserved),
      limit_(num_pages) {
  if (!backend_) throw_value("PageAllocator needs a Backend, got None.");
  if (num_pages <= 0) throw_value("num_pages must be positive, got " + std::to_string(num_pages) + ".");
  if (min_reserved < 0 || max_reserved < 0 || min_reserved > max_reserved) {
    throw_value("need 0 <= min_reserved <= max_reserved, got min_reserved=" + std::to_string(min_reserved) +
                ", max_reserved=" + std::to_string(max_reserved) + ".");
  }
  if (max_run_pages < 0) {
    throw_value("max_run_pages must be >= 0 (0: default), got " + std::to_string(max_run_pages) + ".");
  }
  if (tensors_.empty()) throw_value("PageAllocator needs at least one VirtualTensor.");
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!tensors_[i]) throw_value("tensors[" + std::to_string(i) + "] is None.");
    if (tensors_[i]->backend() != backend_) {
      throw_value("tensors[" + std::to_string(i) + "] belongs to another Backend; create every VirtualTensor "
                  "with the allocator's backend.");
    }
  }
  if (regions_.empty()) throw_value("PageAllocator needs at least one region (tensor, base, size).");
  std::vector<std::vector<std::pair<size_t, size_t>>> spans(tensors_.size());
  for (size_t i = 0; i < regions_.size(); ++i) {
    const RegionSpec& r = regions_[i];
    std::string name = "region " + std::to_string(i) + " (tensor=" + std::to_string(r.tensor) +
                       ", base=" + std::to_string(r.base) + ", size=" + std::to_string(r.size) + ")";
    if (r.tensor < 0 || r.tensor >= static_cast<int64_t>(tensors_.size())) {
      throw_value(name + ": tensor index out of range [0, " + std::to_string(tensors_.size()) + ").");
    }
    const VirtualTensor& t = *tensors_[r.tensor];
    if (r.size == 0 || r.size % t.unit() || r.base % t.unit()) {
      throw_value(name + ": base and size must be multiples of the tensor's unit (" + std::to_string(t.unit()) +
                  " B) and size positive.");
    }
    // Divide instead of multiplying: base + num_pages * size can wrap around 2^64.
    if (r.base > t.size() || static_cast<size_t>(num_pages) > (t.size() - r.base) / r.size) {
      throw_value(name + ": " + std::to_string(num_pages) + " pages of " + std::to_string(r.size) +
                  " B from byte " + std::to_string(r.base) + " reach past the tensor's " +
                  std::to_string(t.size()) + " B; lower num_pages or make the tensor larger.");
    }
    size_t end = r.base + static_cast<size_t>(num_pages) * r.size;
    spans[r.tensor].emplace_back(r.base, end);
    slice_off_.push_back(page_bytes_);
    page_bytes_ += r.size;
  }
  for (size_t t = 0; t < spans.size(); ++t) {
    auto& s = spans[t];
    std::sort(s.begin(), s.end());
    for (size_t i = 1; i < s.size(); ++i) {
      if (s[i].first < s[i - 1].second) {
        throw_value("regions overlap in tensor " + std::to_string(t) + " (bytes " + std::to_string(s[i].first) +
                    ".." + std::to_string(s[i - 1].second) + "); each byte may belong to one region only.");
      }
    }
  }
  one_handle_ = backend_->map_offset_ok();
  if (max_run_pages == 0) max_run_pages = static_cast<int64_t>(std::max<size_t>(1, kDefaultRunBytes / page_bytes_));
  max_run_pages_ = std::min(max_run_pages, num_pages);
  state_.assign(num_pages, kFree);
  handles_.resize(num_pages);
  run_of_.assign(num_pages, -1);
  run_len_.assign(num_pages, 0);
  run_live_.assign(num_pages, 0);
  for (int64_t p = 0; p < num_pages; ++p) free_.insert(free_.end(), p);
  refresh_mem_info();
  {
    std::lock_guard<std::mutex> lk(g_live_mu);
    g_live.insert(this);
  }
  if (prealloc) thread_ = std::thread([this] { thread_main(); });
}

PageAllocator::~PageAllocator() {
  {
    std::lock_guard<std::mutex> lk(g_live_mu);
    g_live.erase(this);
  }
  try {
    close();
  } catch (const std::exception& e) {
    log_warning(std::string("PageAllocator teardown: ") + e.what());
  }
}

void PageAllocator::check_open() const {
  if (closed_.load()) throw_state("this PageAllocator is closed; create a new one.");
}

void PageAllocator::refresh_mem_info() noexcept { rel_report_->refresh(*backend_); }

// Memory whose release is pending counts as held, as the driver (and every other process)
// sees it: between a shrink and its background release (a few hundred microseconds) this
// reports up to the shrunk pages less than what alloc_pages could map (create_draining
// would flush them), never more than there is. The releaser reads the free memory again
// once they are released.
int64_t PageAllocator::obtainable_pages() const {
  int64_t in_use = num_in_use(), res = num_reserved();
  int64_t n = std::min(limit_pages(), num_pages_) - in_use;
  n = std::min(n, res + static_cast<int64_t>(rel_report_->free_bytes() / page_bytes_));
  return std::max<int64_t>(n, 0);
}

bool PageAllocator::is_in_use(int64_t p) {
  if (p < 0 || p >= num_pages_) throw_value("page " + std::to_string(p) + " out of range [0, " + std::to_string(num_pages_) + ").");
  std::lock_guard<std::mutex> lk(mu_);
  return state_[p] == kInUse;
}

void PageAllocator::publish_locked() {
  const int64_t in_use = in_use_locked();
  if (lazy_ms_.load(std::memory_order_relaxed) > 0 && in_use != in_use_.load(std::memory_order_relaxed)) {
    while (!peaks_.empty() && peaks_.back().second <= in_use) peaks_.pop_back();
    peaks_.emplace_back(std::chrono::steady_clock::now(), in_use);
  }
  in_use_.store(in_use, std::memory_order_relaxed);
  if (in_use > peak_in_use_.load(std::memory_order_relaxed)) peak_in_use_.store(in_use, std::memory_order_relaxed);
  reserved_n_.store(static_cast<int64_t>(reserved_.size()), std::memory_order_relaxed);
}

void PageAllocator::set_lazy_reserve_ms(int64_t ms) {
  if (ms < 0) throw_value("set_lazy_reserve_ms(ms) needs ms >= 0 (0: off), got " + std::to_string(ms) + ".");
  std::lock_guard<std::mutex> lk(mu_);
  lazy_ms_.store(ms, std::memory_order_relaxed);
  peaks_.clear();
  if (ms > 0) peaks_.emplace_back(std::chrono::steady_clock::now(), in_use_.load(std::memory_order_relaxed));
  if (thread_.joinable()) cv_.notify_one();
}

int64_t PageAllocator::window_peak_locked(int64_t in_use) {
  const int64_t ms = lazy_ms_.load(std::memory_order_relaxed);
  if (ms <= 0) return in_use;
  const auto oldest = std::chrono::steady_clock::now() - std::chrono::milliseconds(ms);
  // An entry stands for its count from its time until the next entry's: drop one only when the
  // next one is also older than the window (the count then fell inside it), never the last.
  while (peaks_.size() > 1 && peaks_[1].first <= oldest) peaks_.pop_front();
  return peaks_.empty() ? in_use : std::max(in_use, peaks_.front().second);
}

// None after trim or while the device is nearly full: a page mapped ahead of need must not keep memory
// from a request that another engine has waiting. Else max_reserved, and with the lazy reserve (its
// thread running) what the pages in use reached within the window.
int64_t PageAllocator::reserve_bound_locked(int64_t in_use) {
  if (trimmed_ || device_tight()) return 0;
  if (lazy_ms_.load(std::memory_order_relaxed) <= 0 || !thread_.joinable()) return max_reserved_;
  return max_reserved_ + window_peak_locked(in_use) - in_use;
}

void PageAllocator::reset_peak() {
  std::lock_guard<std::mutex> lk(mu_);
  peak_in_use_.store(in_use_.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

std::map<std::string, std::pair<double, int64_t>> PageAllocator::phase_times() {
  std::lock_guard<std::mutex> lk(mu_);
  auto out = phases_;
  // The releases done after the shrinks returned: by the backend's thread, or by a call
  // that flushed (trim, close, a create that ran out of memory).
  const ReleaseReport& r = *rel_report_;
  if (int64_t n = r.background_calls.load()) out["release.background"] = {r.background_ns.load() / 1e3, n};
  if (int64_t n = r.flushed_calls.load()) out["release.flushed"] = {r.flushed_ns.load() / 1e3, n};
  return out;
}

void PageAllocator::reset_phase_times() {
  std::lock_guard<std::mutex> lk(mu_);
  phases_.clear();
  ReleaseReport& r = *rel_report_;
  r.background_ns = r.background_calls = r.flushed_ns = r.flushed_calls = 0;
}

std::vector<int64_t> PageAllocator::alloc_pages(int64_t n) {
  if (n < 0) throw_value("alloc_pages(n) needs n >= 0, got " + std::to_string(n) + ".");
  std::unique_lock<std::mutex> lk(mu_);
  check_open();
  std::vector<int64_t> out;
  if (n == 0) return out;
  // The prealloc thread is mapping pages for the reserve: wait for them rather than map others inline.
  mapped_cv_.wait(lk, [&] { return mapping_n_ == 0 || static_cast<int64_t>(reserved_.size()) >= n; });
  check_open();
  int64_t in_use = in_use_locked();
  int64_t limit = limit_.load();
  // Compare n with what is left, never in_use + n: n may be near INT64_MAX. The limit may
  // exceed num_pages, so the pages themselves bound it too (else the loop below runs off free_).
  int64_t left = std::max<int64_t>(0, std::min(limit, num_pages_) - in_use);
  if (n > left) {
    throw Error(ErrKind::OutOfMemory, "alloc_pages(" + std::to_string(n) + "): only " + std::to_string(left) +
                                          " pages can be handed out (" + std::to_string(in_use) +
                                          " in use, the limit is " + std::to_string(limit) + ", " +
                                          std::to_string(num_pages_) +
                                          " pages in all); free pages or raise the limit (set_limit_pages / kvctl "
                                          "limit).");
  }
  int64_t from_res = std::min<int64_t>(n, static_cast<int64_t>(reserved_.size()));
  const int64_t need = n - from_res;
  // lazy reserve: an inline map also maps the reserve's shortfall in the same run (the driver charges
  // per run and region, not per page), so the next steps find pages mapped
  int64_t extra = 0;
  if (need > 0 && thread_.joinable() && lazy_ms_.load(std::memory_order_relaxed) > 0) {
    const int64_t res_after = static_cast<int64_t>(reserved_.size()) - from_res;
    extra = std::min({std::min(max_reserved_, reserve_bound_locked(in_use + n)) - res_after, left - n - res_after,
                      static_cast<int64_t>(free_.size()) - need});
    extra = std::max<int64_t>(extra, 0);
  }
  std::vector<int64_t> fresh;
  for (auto it = free_.begin(); static_cast<int64_t>(fresh.size()) < need + extra; ++it) fresh.push_back(*it);
  try {
    map_locked(fresh);  // throws with nothing changed
  } catch (const Error& e) {
    if (extra == 0 || e.kind != ErrKind::OutOfMemory) throw;
    fresh.resize(need);  // no memory for the reserve: map what was asked for alone
    extra = 0;
    map_locked(fresh);
  }
  for (int64_t i = 0; i < need + extra; ++i) {
    const int64_t p = fresh[i];
    free_.erase(p);
    if (i < need) {
      set_state_locked(p, kInUse);
      out.push_back(p);
    } else {
      set_state_locked(p, kReserved);
      reserved_.insert(p);
    }
  }
  take_reserved_locked(from_res, out);
  publish_locked();
  if (!fresh.empty()) refresh_mem_info();
  std::sort(out.begin(), out.end());
  if (thread_.joinable() && static_cast<int64_t>(reserved_.size()) < min_reserved_) cv_.notify_one();
  return out;
}

void PageAllocator::map_pages(const std::vector<int64_t>& ids) {
  std::unique_lock<std::mutex> lk(mu_);
  check_open();
  mapped_cv_.wait(lk, [&] { return mapping_n_ == 0; });  // no page of `ids` is half mapped by the thread
  check_open();
  std::set<int64_t> seen;
  std::vector<int64_t> fresh;
  for (int64_t p : ids) {
    if (p < 0 || p >= num_pages_) {
      throw_value("map_pages: page " + std::to_string(p) + " out of range [0, " + std::to_string(num_pages_) +
                  "); nothing was mapped.");
    }
    if (state_[p] == kInUse) {
      throw_value("map_pages: page " + std::to_string(p) + " is already in use (unmap or free it first); nothing "
                  "was mapped.");
    }
    if (!seen.insert(p).second) {
      throw_value("map_pages: page " + std::to_string(p) + " appears twice in one call; nothing was mapped.");
    }
    if (state_[p] == kFree) fresh.push_back(p);
  }
  if (ids.empty()) return;
  int64_t in_use = in_use_locked();
  int64_t n = static_cast<int64_t>(ids.size()), limit = limit_.load();
  if (n > limit - in_use) {
    throw Error(ErrKind::OutOfMemory, "map_pages(" + std::to_string(n) + " pages): " + std::to_string(in_use) +
                                          " pages in use and the limit is " + std::to_string(limit) + " (of " +
                                          std::to_string(num_pages_) +
                                          "); unmap pages or raise the limit (set_limit_pages / kvctl limit).");
  }
  std::sort(fresh.begin(), fresh.end());
  map_locked(fresh);  // throws with nothing changed
  for (int64_t p : ids) {
    if (state_[p] == kFree) {
      free_.erase(p);
    } else {
      reserved_.erase(p);
    }
    set_state_locked(p, kInUse);
  }
  trimmed_ = false;
  publish_locked();
  if (!fresh.empty()) refresh_mem_info();
  // Fresh pages beside a reserve: pages in use plus reserved may now pass the limit (or the
  // reserve bound), which free_pages and the thread keep; give back what no page in use pins.
  int64_t keep = std::min(reserve_bound_locked(in_use + n), limit - (in_use + n));
  if (static_cast<int64_t>(reserved_.size()) > keep) {
    if (thread_.joinable()) {
      cv_.notify_one();
    } else {
      shrink_reserved_locked(keep);
    }
  } else if (thread_.joinable() && static_cast<int64_t>(reserved_.size()) < min_reserved_) {
    cv_.notify_one();
  }
}

// Moves the n lowest reserved (mapped, unused) pages to in use; the caller holds mu_.
void PageAllocator::take_reserved_locked(int64_t n, std::vector<int64_t>& out) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t p = *reserved_.begin();
    reserved_.erase(reserved_.begin());
    set_state_locked(p, kInUse);
    out.push_back(p);
  }
  trimmed_ = false;
}

bool PageAllocator::try_take_reserved(int64_t n, std::vector<int64_t>& out) {
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (n <= 0 || !lk.owns_lock() || closed_.load() || static_cast<int64_t>(reserved_.size()) < n) return false;
  int64_t in_use = in_use_locked();
  if (n > limit_.load() - in_use) return false;
  take_reserved_locked(n, out);
  publish_locked();
  if (thread_.joinable() && static_cast<int64_t>(reserved_.size()) < min_reserved_) cv_.notify_one();
  return true;
}

bool PageAllocator::try_return(const std::vector<int64_t>& ids) {
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock() || closed_.load()) return false;
  const int64_t in_use_after = in_use_locked() - static_cast<int64_t>(ids.size());
  if (static_cast<int64_t>(reserved_.size() + ids.size()) > reserve_bound_locked(in_use_after)) return false;
  if (num_pages_ - static_cast<int64_t>(free_.size()) > limit_.load()) return false;  // over a lowered limit
  for (int64_t p : ids) {
    if (p < 0 || p >= num_pages_ || state_[p] != kInUse) return false;  // let free_pages explain
  }
  for (int64_t p : ids) {
    set_state_locked(p, kReserved);
    reserved_.insert(p);
  }
  publish_locked();
  return true;
}

void PageAllocator::free_pages(const std::vector<int64_t>& ids) {
  std::unique_lock<std::mutex> lk(mu_);
  check_open();
  std::set<int64_t> seen;
  for (int64_t p : ids) {
    if (p < 0 || p >= num_pages_) {
      throw_value("free_pages: page " + std::to_string(p) + " out of range [0, " + std::to_string(num_pages_) +
                  "); nothing was freed.");
    }
    if (state_[p] != kInUse) {
      throw_value("free_pages: page " + std::to_string(p) + " is not in use (double free?); nothing was freed.");
    }
    if (!seen.insert(p).second) {
      throw_value("free_pages: page " + std::to_string(p) + " appears twice in one call; nothing was freed.");
    }
  }
  for (int64_t p : ids) {
    set_state_locked(p, kReserved);
    reserved_.insert(p);
  }
  publish_locked();
  int64_t in_use = in_use_locked();
  int64_t keep = std::min(reserve_bound_locked(in_use), limit_.load() - in_use);
  if (static_cast<int64_t>(reserved_.size()) > keep) {
    if (thread_.joinable()) {
      cv_.notify_one();  // the thread unmaps the excess; free stays cheap
    } else {
      shrink_reserved_locked(keep);
    }
  }
}

void PageAllocator::shrink_reserved_locked(int64_t keep) {
  keep = std::max<int64_t>(keep, 0);
  int64_t excess = static_cast<int64_t>(reserved_.size()) - keep;
  if (excess <= 0) return;
  // Only runs with no page in use can go, whole, highest first so the low ones stay mapped.
  std::vector<int64_t> drop;
  for (auto it = reserved_.rbegin(); it != reserved_.rend() && excess > 0;) {
    int64_t first = run_of_[*it];
    if (run_live_[first] == 0) {
      drop.push_back(first);
      excess -= run_len_[first];
    }
    it = std::make_reverse_iterator(reserved_.lower_bound(first));  // past the rest of this run
  }
  if (drop.empty()) return;
  const int64_t split = drop.back();  // the lowest: it may take the reserve below `keep`
  std::sort(drop.begin(), drop.end());
  bool deferred;
  try {
    deferred = unmap_runs_locked(drop);
  } catch (...) {
    publish_locked();
    refresh_mem_info();
    throw;
  }
  bool remapped = false;
  if (excess < 0) {
    // The last run went below `keep`: map its low pages again as a shorter run, so the
    // reserve holds what it would hold page by page. Best effort: without memory the
    // reserve is just smaller (the prealloc thread tries again).
    std::vector<int64_t> again;
    for (int64_t p = split; p < split - excess; ++p) again.push_back(p);
    try {
      map_locked(again);
      for (int64_t p : again) {
        free_.erase(p);
        set_state_locked(p, kReserved);
        reserved_.insert(p);
      }
      remapped = true;
    } catch (const Error&) {
    }
  }
  publish_locked();
  // Deferred: the memory is still held now; the releaser reads the figure after releasing it.
  if (!deferred || remapped) refresh_mem_info();
}

void PageAllocator::trim() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    check_open();
    mapped_cv_.wait(lk, [&] { return mapping_n_ == 0; });  // pages the thread is mapping go too
    check_open();
    trimmed_ = true;
    shrink_reserved_locked(0);
  }
  // trim's promise is memory back now (kvctl trim, a user making room for another process),
  // so it does not return while the releases it (or an earlier free) queued are pending.
  // Outside mu_: other calls need not wait for the driver.
  backend_->flush_releases();
  refresh_mem_info();
}

bool PageAllocator::set_limit_pages(int64_t n) {
  if (n < 0) throw_value("set_limit_pages(n) needs n >= 0, got " + std::to_string(n) + ".");
  std::unique_lock<std::mutex> lk(mu_);
  check_open();
  limit_.store(n);
  int64_t in_use = in_use_locked();
  shrink_reserved_locked(n - in_use);
  if (thread_.joinable()) cv_.notify_one();
  return in_use <= n;
}

void PageAllocator::thread_main() {
  std::unique_lock<std::mutex> lk(mu_);
  bool failed = false;  // after a failure, wait for a change before trying again
  while (!stop_) {
    int64_t in_use = in_use_locked();
    int64_t res = static_cast<int64_t>(reserved_.size());
    int64_t limit = limit_.load();
    try {
      const bool lazy = lazy_ms_.load(std::memory_order_relaxed) > 0;
      int64_t keep = std::min(reserve_bound_locked(in_use), limit - in_use);
      if (res > keep) {
        shrink_reserved_locked(keep);
      } else if (!trimmed_ && !failed && res < min_reserved_) {
        // lazy: refill to the upper bound in one run (one set of driver calls per region), not page by page;
        // never into the device's last max_reserved + 1 pages, which would make it tight and the next
        // pass unmap them again
        int64_t target = lazy ? max_reserved_ : min_reserved_;
        const int64_t room = static_cast<int64_t>(rel_report_->free_bytes() / page_bytes_) - (max_reserved_ + 1);
        int64_t want = std::min({target - res, limit - in_use - res, static_cast<int64_t>(free_.size()), room});
        if (want > 0) {
          // Mapped outside mu_ (the driver takes ~100 us per run and region, so up to ~10 ms for a
          // per-layer page group of 64 regions): meanwhile a step takes reserved pages and returns freed
          // ones through the fast paths, and an allocation that needs more waits for these.
          std::vector<int64_t> fresh(free_.begin(), std::next(free_.begin(), want));
          for (int64_t p : fresh) {
            free_.erase(p);
            state_[p] = kMapping;
          }
          mapping_n_ = want;
          lk.unlock();
          Phases ph;
          std::vector<std::vector<Handle>> hs;
          std::exception_ptr err;
          try {
            hs = map_driver(fresh, ph);
          } catch (...) {
            err = std::current_exception();
          }
          lk.lock();
          for (const auto& [k, v] : ph) add_phase(k.c_str(), v.first, v.second);
          mapping_n_ = 0;
          for (int64_t p : fresh) state_[p] = kFree;
          if (err) {
            free_.insert(fresh.begin(), fresh.end());
            mapped_cv_.notify_all();
            std::rethrow_exception(err);
          }
          install_runs_locked(fresh, std::move(hs));
          for (int64_t p : fresh) {
            set_state_locked(p, kReserved);
            reserved_.insert(p);
          }
          publish_locked();
          mapped_cv_.notify_all();
          refresh_mem_info();
          continue;  // at once: a limit, trim or demand may have come while mu_ was free
        }
      }
    } catch (const std::exception& e) {
      failed = true;
      log_warning(std::string("prealloc thread: ") + e.what());
    }
    refresh_mem_info();
    if (cv_.wait_for(lk, std::chrono::milliseconds(250)) == std::cv_status::no_timeout) failed = false;
  }
}

void PageAllocator::stop_thread() noexcept {
  std::lock_guard<std::mutex> tl(thread_mu_);
  stop_thread_locked();
}

void PageAllocator::stop_thread_locked() noexcept {
  std::thread t;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    t = std::move(thread_);  // under mu_: the paths that test thread_.joinable() hold mu_ too
  }
  cv_.notify_all();
  if (!t.joinable()) return;
  if (t.get_id() == std::this_thread::get_id()) {
    t.detach();  // called from the thread itself: it leaves its loop on return
  } else {
    t.join();
  }
}

bool PageAllocator::start_thread() {
  std::lock_guard<std::mutex> tl(thread_mu_);
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_.load()) return false;
  if (thread_.joinable()) return true;
  stop_ = false;
  thread_ = std::thread([this] { thread_main(); });  // it waits on mu_ until this call returns
  return true;
}

bool PageAllocator::thread_running() {
  std::lock_guard<std::mutex> lk(mu_);
  return thread_.joinable();
}

void PageAllocator::close() {
  std::lock_guard<std::mutex> tl(thread_mu_);  // held throughout: no start_thread between stop and closed_
  stop_thread_locked();
  std::unique_lock<std::mutex> lk(mu_);
  if (closed_.exchange(true)) return;
  std::vector<int64_t> firsts;
  for (int64_t p = 0; p < num_pages_; ++p) {
    if (run_len_[p] > 0) firsts.push_back(p);
  }
  try {
    unmap_runs_locked(firsts);
  } catch (const std::exception& e) {
    log_warning(std::string("close: ") + e.what());
  }
  for (int64_t p = 0; p < num_pages_; ++p) {
    state_[p] = kFree;
    free_.insert(p);
  }
  reserved_.clear();
  publish_locked();
  lk.unlock();
  // Closed means released: the caller may drop the backend or hand the memory to
  // another process next, and nothing of this allocator may outlive it in the queue.
  backend_->flush_releases();
}

}  // namespace kvc
