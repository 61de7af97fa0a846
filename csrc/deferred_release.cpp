// Releasing physical handles off the caller's path. Shrinking KV memory is unmap, zero page
// back, set access, release; on an H200 the release is the largest part (8 x 128 MiB:
// 0.42 of 0.78 ms) and nothing the caller does next depends on it: the addresses are
// back on the zero page before the call returns, and the handles are no longer mapped
// anywhere. So PageAllocator queues them here and one thread per backend releases them.
//
// What may observe the gap, and why each is safe:
//  - This process running out of memory: create_draining flushes and retries, so a grow
//    right after a shrink never fails for memory that is only waiting to be released. It
//    flushes every backend of the process, not only its own: two Backend objects on one
//    device (or one host budget) draw on the same memory.
//  - Accounting: until really released a handle counts as held everywhere (physical_bytes,
//    the host budget, the driver's free memory, the allocators' cached figure), so
//    nothing reports memory as free before it is.
//  - Another process (another engine on the GPU, or on the host budget) sees the memory
//    as used for that gap, a few hundred microseconds after the shrink returned, as if
//    the shrink had taken that much longer; it cannot drain our queue. Callers that
//    promise memory back (trim, close) flush before returning.
//
// Locks: mu_ here is a leaf. It is held only to move batches and counters, never across
// a driver call, and the thread takes no other lock than the backend's own inside
// release(). So a caller may flush while holding its allocator's lock (the out-of-memory
// retry does): the thread never waits for that lock. g_releasers_mu (the registry of releasers)
// is taken before mu_, and only by callers, never by the threads.
//
// fork(): the child gets only the forking thread. Were a releaser thread inside release()
// at that moment, the child would find the backend's and the host budget's locks held
// forever; so before a fork every releaser is flushed and its lock held until the copy is
// made. The child forgets the thread and the queue (the parent releases those handles).
#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <set>
#include <thread>

#include "backend.h"

namespace kvc {

namespace {

using Clock = std::chrono::steady_clock;

// Every releaser of the process, for the out-of-memory flush; with their totals, so a
// failed create can tell cheaply whether anything was pending or got released meanwhile.
std::mutex g_releasers_mu;
std::set<DeferredRelease*> g_releasers;
std::atomic<size_t> g_pending{0};     // bytes queued or being released, all backends
std::atomic<uint64_t> g_released{0};  // handles released so far, all backends

}  // namespace

class DeferredRelease {
 public:
  explicit DeferredRelease(Backend& b) : b_(b) {
    static const int atfork = pthread_atfork(before_fork, after_fork_parent, after_fork_child);
    (void)atfork;
    std::lock_guard<std::mutex> lk(g_releasers_mu);
    g_releasers.insert(this);
  }
  ~DeferredRelease() { stop(); }

  // Flushes every releaser of the process.
  static void flush_all() noexcept {
    std::lock_guard<std::mutex> lk(g_releasers_mu);  // held throughout: none leaves (stop) meanwhile
    for (DeferredRelease* r : g_releasers) r->flush();
  }

  // Queues the handles, or returns false with `hs` untouched (stopped, or no thread or
  // memory to be had: the caller releases them inline).
  bool push(std::vector<Handle>& hs, size_t bytes, const std::shared_ptr<ReleaseReport>& report) noexcept {
    try {
      std::unique_lock<std::mutex> lk(mu_);
      if (stopped_) return false;
      if (!thread_) thread_ = new std::thread([this] { run(); });
      queue_.emplace_back();  // may throw: nothing moved yet
      Batch& b = queue_.back();
      b.handles.swap(hs);
      b.bytes = bytes;
      b.report = report;
      pending_.fetch_add(bytes);
      g_pending.fetch_add(bytes);
      lk.unlock();
      work_cv_.notify_one();
      return true;
    } catch (const std::exception& e) {
      log_warning(std::string("deferred release: ") + e.what() + "; releasing inline");
      return false;
    }
  }

  void flush() noexcept {
    std::unique_lock<std::mutex> lk(mu_);
    std::vector<Batch> mine;
    mine.swap(queue_);
    const bool busy = busy_;
    const uint64_t round = rounds_;
    lk.unlock();
    release(mine, false);
    if (!busy) return;
    lk.lock();
    done_cv_.wait(lk, [&] { return rounds_ != round; });
  }

  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lk(g_releasers_mu);
      g_releasers.erase(this);
    }
    std::thread* t;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopped_ = true;
      t = thread_;
      thread_ = nullptr;
    }
    work_cv_.notify_all();
    if (t) {
      t->join();  // it empties the queue before it leaves
      delete t;
    }
    flush();  // what it could not take (none when it ran)
  }

  void pause(bool on) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      paused_ = on;
    }
    work_cv_.notify_all();
  }

  size_t pending_bytes() const { return pending_.load(); }

 private:
  struct Batch {
    std::vector<Handle> handles;
    size_t bytes;
    std::shared_ptr<ReleaseReport> report;
  };

  void run() noexcept {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stopped_ || (!paused_ && !queue_.empty()); });
      if (queue_.empty()) return;  // stopped, nothing left
      std::vector<Batch> mine;
      mine.swap(queue_);
      busy_ = true;
      lk.unlock();
      release(mine, true);
      lk.lock();
      busy_ = false;
      ++rounds_;
      done_cv_.notify_all();
    }
  }

  // Release is noexcept and only logs a failed driver call: a handle the driver refuses to
  // release is lost memory, never a reason to stop the process or this thread.
  void release(std::vector<Batch>& batches, bool background) noexcept {
    if (batches.empty()) return;
    for (Batch& b : batches) {
      auto t0 = Clock::now();
      for (Handle h : b.handles) b_.release(h);
      int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
      int64_t n = static_cast<int64_t>(b.handles.size());
      (background ? b.report->background_ns : b.report->flushed_ns).fetch_add(ns);
      (background ? b.report->background_calls : b.report->flushed_calls).fetch_add(n);
      g_released.fetch_add(static_cast<uint64_t>(n));
      pending_.fetch_sub(b.bytes);  // after the release: pending memory is never counted free
      g_pending.fetch_sub(b.bytes);
    }
    // One reading per allocator after its memory is back (its cached figure was read before).
    for (size_t i = 0; i < batches.size(); ++i) {
      bool seen = false;
      for (size_t j = 0; j < i && !seen; ++j) seen = batches[j].report == batches[i].report;
      if (!seen) batches[i].report->refresh(b_);
    }
  }

  static void before_fork() {
    g_releasers_mu.lock();
    for (DeferredRelease* r : g_releasers) {
      for (;;) {  // flushed and idle, under its lock: the thread cannot take a batch now
        r->flush();
        r->mu_.lock();
        if (!r->busy_) break;
        r->mu_.unlock();
      }
    }
  }
  static void after_fork_parent() {
    for (DeferredRelease* r : g_releasers) r->mu_.unlock();
    g_releasers_mu.unlock();
  }
  static void after_fork_child() {
    for (DeferredRelease* r : g_releasers) {
      // Leaked, not joined or deleted: the parent's thread object means nothing here. The
      // thread starts again on the next push.
      r->thread_ = nullptr;
      size_t bytes = 0;
      for (const Batch& b : r->queue_) bytes += b.bytes;
      r->queue_.clear();  // the parent's to release
      r->pending_.fetch_sub(bytes);
      g_pending.fetch_sub(bytes);
      r->mu_.unlock();
    }
    g_releasers_mu.unlock();
  }

  Backend& b_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<Batch> queue_;
  bool busy_ = false;     // the thread holds a batch it is releasing
  bool stopped_ = false;  // no more deferring; the thread leaves once the queue is empty
  bool paused_ = false;   // tests: the thread leaves the queue to flushes
  uint64_t rounds_ = 0;   // batches the thread finished: a flush waits for the one it saw held
  std::thread* thread_ = nullptr;
  std::atomic<size_t> pending_{0};  // queued or being released
};

void ReleaseReport::refresh(Backend& b) noexcept {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ticket = ++started_;
  }
  try {
    size_t free = b.mem_info().first;
    std::lock_guard<std::mutex> lk(mu_);
    if (ticket > kept_) {
      kept_ = ticket;
      free_.store(free, std::memory_order_relaxed);
    }
  } catch (const std::exception& e) {
    log_warning(std::string("mem_info: ") + e.what());
  }
}

DeferredRelease* Backend::releaser(bool make) {
  std::lock_guard<std::mutex> lk(rel_make_mu_);
  if (!rel_ && make) rel_ = std::make_shared<DeferredRelease>(*this);
  return rel_.get();
}

bool Backend::release_later(std::vector<Handle>& hs, size_t bytes, const std::shared_ptr<ReleaseReport>& report) {
  if (hs.empty()) return true;
  try {
    return releaser(true)->push(hs, bytes, report);
  } catch (const std::exception& e) {  // the releaser could not be made
    log_warning(std::string("deferred release: ") + e.what() + "; releasing inline");
    return false;
  }
}

void Backend::flush_releases() noexcept {
  try {
    if (DeferredRelease* r = releaser(false)) r->flush();
  } catch (const std::exception& e) {  // std::mutex::lock may throw in theory
    log_warning(std::string("flush_releases: ") + e.what());
  }
}

size_t Backend::pending_release_bytes() {
  DeferredRelease* r = releaser(false);
  return r ? r->pending_bytes() : 0;
}

Handle Backend::create_draining(size_t size, double* drain_us) {
  const uint64_t before = g_released.load();
  try {
    return create(size);
  } catch (const Error& e) {
    // Not only "pending now": a batch released between the failure and this check freed
    // memory the failed call could not see either.
    if (e.kind != ErrKind::OutOfMemory) throw;
    if (g_pending.load() == 0 && g_released.load() == before) throw;
  }
  auto t0 = Clock::now();
  DeferredRelease::flush_all();
  if (drain_us) *drain_us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  return create(size);
}

void Backend::pause_releases(bool on) { releaser(true)->pause(on); }

void Backend::stop_releaser() noexcept {
  std::shared_ptr<DeferredRelease> r;
  {
    std::lock_guard<std::mutex> lk(rel_make_mu_);
    r = rel_;
  }
  if (r) r->stop();
}

}  // namespace kvc
