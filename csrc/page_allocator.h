// Page indices over one or more virtual tensors. Page p maps every region
// (tensor, base, size) at [base + p*size, +size) onto one physical page group.
//
// Physical memory comes in runs: the pages one call maps (consecutive ids, at most
// max_run_pages) share one allocation per region (or one in all where the backend maps
// at offsets), mapped once per region. GPU drivers charge per allocation and per
// mapping, not per byte, so a run of k pages costs about what one page used to. A run
// is mapped and unmapped as a whole: a freed page whose run still has a page in use
// stays mapped (reserved, handed out again first), and trim, the reserve bound and the
// limit unmap only runs with no page in use.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "vtensor.h"

namespace kvc {

struct RegionSpec {
  int64_t tensor;
  size_t base;
  size_t size;
};

class PageAllocator {
 public:
  // Default cap of one run: a page in use pins at most this much mapped memory beside
  // itself. Per run and region a grow and a shrink cost ~140 us of driver time on an
  // H200 (create, set-access and unmap are per call, not per byte), so 1 GiB runs of
  // 128 MiB page groups (32 layers) cut that 8x per page; doubling it saves under
  // 10 us per 2 MiB more while pinning twice as much.
  static constexpr size_t kDefaultRunBytes = size_t{1} << 30;

  PageAllocator(std::shared_ptr<Backend> backend, std::vector<std::shared_ptr<VirtualTensor>> tensors,
                std::vector<RegionSpec> regions, int64_t num_pages, int64_t min_reserved, int64_t max_reserved,
                bool prealloc, int64_t max_run_pages = 0);  // 0: kDefaultRunBytes worth of pages
  ~PageAllocator();

  // Blocking calls: the caller must not hold the GIL.
  std::vector<int64_t> alloc_pages(int64_t n);
  // Maps exactly these pages (free or reserved) and marks them in use; all-or-nothing.
  void map_pages(const std::vector<int64_t>& ids);
  void free_pages(const std::vector<int64_t>& ids);
  // Unmaps every reserved run with no page in use, then flushes the backend's pending
  // releases: on return the memory is back with the driver, not only queued.
  void trim();
  bool set_limit_pages(int64_t n);
  void close();
  void stop_thread() noexcept;
  // Start the prealloc thread again after stop_thread() (a no-op while it runs); false once closed.
  bool start_thread();
  bool thread_running();

  // Non-blocking fast paths for BlockPool (try_lock; false = take the slow path).
  bool try_take_reserved(int64_t n, std::vector<int64_t>& out);
  bool try_return(const std::vector<int64_t>& ids);

  int64_t num_pages() const { return num_pages_; }
  int64_t limit_pages() const { return limit_.load(std::memory_order_relaxed); }
  int64_t num_in_use() const { return in_use_.load(std::memory_order_relaxed); }
  int64_t num_reserved() const { return reserved_n_.load(std::memory_order_relaxed); }
  // Most pages in use at once since creation or the last reset_peak(): a burst shorter than any
  // observer's sampling period still shows.
  int64_t peak_in_use() const { return peak_in_use_.load(std::memory_order_relaxed); }
  // Pages mapped and unmapped since creation (monitoring: how much the pool churns).
  int64_t pages_mapped_total() const { return pages_mapped_.load(std::memory_order_relaxed); }
  int64_t pages_unmapped_total() const { return pages_unmapped_.load(std::memory_order_relaxed); }
  void reset_peak();
  // Lazy reserve (serving engines; 0, the default, turns it off): the prealloc thread refills the
  // reserve to max_reserved in one run once it falls below min_reserved, an allocation that must
  // map inline maps the reserve's shortfall in the same run, and pages freed past the reserve
  // bound stay mapped while the pages in use were that high within the last `ms` milliseconds.
  // A serving step then rarely waits on the driver, and a load that falls for longer than `ms`
  // still gives its memory back (the thread unmaps it within `ms` + 250 ms).
  void set_lazy_reserve_ms(int64_t ms);
  int64_t lazy_reserve_ms() const { return lazy_ms_.load(std::memory_order_relaxed); }
  int64_t min_reserved() const { return min_reserved_; }
  int64_t max_reserved() const { return max_reserved_; }
  size_t page_bytes() const { return page_bytes_; }
  int64_t max_run_pages() const { return max_run_pages_; }
  // Mapped runs as (first page, pages, pages in use), ascending.
  std::vector<std::tuple<int64_t, int64_t, int64_t>> runs();
  size_t mapped_bytes() const { return static_cast<size_t>(num_in_use() + num_reserved()) * page_bytes_; }
  bool closed() const { return closed_.load(); }
  bool is_in_use(int64_t p);
  // Pages that could be in use right now: limit, pages left, physical memory (cached).
  int64_t obtainable_pages() const;
  // The device is nearly full (its free memory, as last read, is under max_reserved + 1 pages): another
  // process sharing it may be waiting for memory, so no page stays mapped ahead of need (the reserve and
  // the lazy window give theirs back) and engines give their prefix caches back.
  bool device_tight() const {
    return rel_report_->free_bytes() < static_cast<size_t>(max_reserved_ + 1) * page_bytes_;
  }
  void refresh_mem_info() noexcept;
  const std::shared_ptr<Backend>& backend() const { return backend_; }
  const std::vector<std::shared_ptr<VirtualTensor>>& tensors() const { return tensors_; }
  // Time spent in each step of mapping and unmapping (µs, calls), for the benchmark.
  std::map<std::string, std::pair<double, int64_t>> phase_times();
  void reset_phase_times();

 private:
  // kMapping: taken from free_ by the prealloc thread, which maps it outside mu_ (in no set)
  enum : uint8_t { kFree = 0, kReserved = 1, kInUse = 2, kMapping = 3 };
  using Phases = std::map<std::string, std::pair<double, int64_t>>;
  void check_open() const;
  int64_t in_use_locked() const {
    return num_pages_ - static_cast<int64_t>(free_.size() + reserved_.size()) - mapping_n_;
  }
  // Maps sorted free pages as new runs (state unchanged: the caller sets it); all-or-nothing.
  void map_locked(const std::vector<int64_t>& pages);
  // The driver half of map_locked: physical memory, mappings and access for the pages' runs, under map_mu_
  // only (it reads nothing mu_ guards), timings into `ph`. Returns each run's handles; all-or-nothing.
  std::vector<std::vector<Handle>> map_driver(const std::vector<int64_t>& pages, Phases& ph);
  // The bookkeeping half: records the runs map_driver mapped (mu_ held).
  void install_runs_locked(const std::vector<int64_t>& pages, std::vector<std::vector<Handle>> hs);
  // Unmaps the runs starting at `firsts` (ascending): zero page back, pages free, the memory
  // queued for release (Backend::release_later; released here when nothing can be queued).
  // On a driver error the stretch at hand keeps its bookkeeping and the error is thrown.
  // True when every handle was queued (the releaser then refreshes the free-memory figure).
  bool unmap_runs_locked(const std::vector<int64_t>& firsts);
  // Every page state change of a mapped page goes through here: it keeps run_live_ right.
  void set_state_locked(int64_t p, uint8_t s) {
    int64_t r = run_of_[p];
    if (state_[p] == kInUse) --run_live_[r];
    if (s == kInUse) ++run_live_[r];
    state_[p] = s;
  }
  void shrink_reserved_locked(int64_t keep);
  void take_reserved_locked(int64_t n, std::vector<int64_t>& out);
  void publish_locked();
  // Pages in use at most within the lazy window (the current count if the window is off or empty).
  int64_t window_peak_locked(int64_t in_use);
  // Reserved pages that may stay mapped beside in_use pages in use (the limit aside). Every path that
  // returns, frees, maps or shrinks asks this, so none keeps what the thread would unmap, or the reverse.
  int64_t reserve_bound_locked(int64_t in_use);
  void thread_main();
  void stop_thread_locked() noexcept;  // thread_mu_ held
  static void add_phase(Phases& ph, const char* name, double us, int64_t calls = 1) {
    auto& e = ph[name];
    e.first += us;
    e.second += calls;
  }
  void add_phase(const char* name, double us, int64_t calls = 1) { add_phase(phases_, name, us, calls); }

  std::shared_ptr<Backend> backend_;
  std::vector<std::shared_ptr<VirtualTensor>> tensors_;
  std::vector<RegionSpec> regions_;
  int64_t num_pages_;
  int64_t min_reserved_, max_reserved_;
  size_t page_bytes_ = 0;
  int64_t max_run_pages_ = 1;
  bool one_handle_;  // one physical allocation per run, sliced by region; else one per region
  std::vector<size_t> slice_off_;  // region i's bytes per page before it in a one_handle_ page

  std::mutex thread_mu_;  // serializes start_thread/stop_thread; taken before mu_
  std::mutex mu_;
  // Serializes the driver's work on the tensors (mappings, zero backing, access): the prealloc thread maps
  // holding it without mu_, so a step's allocation or free need not wait for the driver. Taken alone or
  // after mu_, never before it.
  std::mutex map_mu_;
  std::condition_variable cv_;
  std::condition_variable mapped_cv_;  // the thread's unlocked mapping landed (mapping_n_ back to 0)
  int64_t mapping_n_ = 0;              // pages in kMapping (guarded by mu_)
  std::vector<uint8_t> state_;
  // Runs, indexed by their first page: handles, length, pages in use. run_of_[p] is the
  // first page of p's run, -1 while p is unmapped (kFree).
  std::vector<std::vector<Handle>> handles_;
  std::vector<int64_t> run_of_, run_len_, run_live_;
  std::set<int64_t> free_, reserved_;
  bool trimmed_ = false;  // after trim() the thread waits for demand before refilling
  bool stop_ = false;

  std::atomic<int64_t> limit_;
  std::atomic<int64_t> in_use_{0}, reserved_n_{0}, peak_in_use_{0};  // written under mu_
  std::atomic<int64_t> pages_mapped_{0}, pages_unmapped_{0};          // written under mu_
  std::atomic<int64_t> lazy_ms_{0};
  // (time, pages in use) with decreasing counts: the front is the window's peak (guarded by mu_)
  std::deque<std::pair<std::chrono::steady_clock::time_point, int64_t>> peaks_;
  // The backend's free memory, read after each map, shrink and background release.
  std::shared_ptr<ReleaseReport> rel_report_ = std::make_shared<ReleaseReport>();
  std::atomic<bool> closed_{false};
  std::thread thread_;  // assigned and moved out only under mu_: readers under mu_ see a settled value
  Phases phases_;  // guarded by mu_
};

}  // namespace kvc
