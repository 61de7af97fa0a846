// PageAllocator's runs: mapping pages as runs (one physical allocation per region, or
// one sliced by region where the backend maps at offsets) and unmapping whole runs.
#include <algorithm>
#include <chrono>
#include <limits>

#include "page_allocator.h"

namespace kvc {
namespace {

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

using Runs = std::vector<std::pair<int64_t, int64_t>>;  // [first, last] of consecutive page indices

// Consecutive ids, cut every `cap` pages.
Runs runs_of(const std::vector<int64_t>& sorted, int64_t cap) {
  Runs runs;
  for (int64_t p : sorted) {
    if (!runs.empty() && runs.back().second + 1 == p && p - runs.back().first < cap) {
      runs.back().second = p;
    } else {
      runs.emplace_back(p, p);
    }
  }
  return runs;
}

}  // namespace

void PageAllocator::map_locked(const std::vector<int64_t>& pages) {
  if (pages.empty()) return;
  install_runs_locked(pages, map_driver(pages, phases_));
}

std::vector<std::vector<Handle>> PageAllocator::map_driver(const std::vector<int64_t>& pages, Phases& ph) {
  std::lock_guard<std::mutex> dl(map_mu_);
  Runs runs = runs_of(pages, max_run_pages_);
  // 1. physical memory: one allocation per run (sliced by region) or per run and region
  std::vector<std::vector<Handle>> hs(runs.size());
  auto release_all = [&] {
    for (auto& v : hs) {
      for (Handle h : v) backend_->release(h);
      v.clear();
    }
  };
  auto t_create = Clock::now();
  int64_t created = 0;
  double drain_us = 0;  // out of memory with releases pending: time spent flushing them
  try {
    for (size_t ui = 0; ui < runs.size(); ++ui) {
      size_t len = static_cast<size_t>(runs[ui].second - runs[ui].first + 1);
      if (one_handle_) {
        hs[ui].push_back(backend_->create_draining(len * page_bytes_, &drain_us));
        ++created;
      } else {
        for (const auto& r : regions_) {
          hs[ui].push_back(backend_->create_draining(len * r.size, &drain_us));
          ++created;
        }
      }
    }
  } catch (...) {
    release_all();
    throw;
  }
  if (drain_us > 0) add_phase(ph, "map.drain", drain_us);
  add_phase(ph, "map.create", us_since(t_create) - drain_us, created);
  // 2. per region and stretch of consecutive pages (runs cut by the cap lie side by side):
  // drop the zero page once, one mapping per run, one access call
  Runs stretches = runs_of(pages, std::numeric_limits<int64_t>::max());
  struct Done {
    size_t region;
    size_t stretch;
    size_t run0, mapped;  // the stretch's first run, runs mapped so far
    size_t lo, hi;        // the range take_zero touched (leftover zero pieces included)
  };
  std::vector<Done> done;
  try {
    for (size_t ri = 0; ri < regions_.size(); ++ri) {
      const RegionSpec& r = regions_[ri];
      VirtualTensor& t = *tensors_[r.tensor];
      size_t ui = 0;
      for (size_t si = 0; si < stretches.size(); ++si) {
        auto [a, b] = stretches[si];
        size_t off = r.base + static_cast<size_t>(a) * r.size;
        size_t len = static_cast<size_t>(b - a + 1) * r.size;
        auto t0 = Clock::now();
        auto span = t.take_zero(off, len);  // restores the zero backing itself if it fails
        add_phase(ph, "map.take_zero", us_since(t0));
        done.push_back({ri, si, ui, 0, span.first, span.second});
        for (; ui < runs.size() && runs[ui].second <= b; ++ui) {
          int64_t n = runs[ui].second - runs[ui].first + 1;
          size_t at = r.base + static_cast<size_t>(runs[ui].first) * r.size;
          size_t bytes = static_cast<size_t>(n) * r.size;
          t0 = Clock::now();
          if (one_handle_) {
            backend_->map(t.ptr() + at, bytes, hs[ui][0], static_cast<size_t>(n) * slice_off_[ri]);
          } else {
            backend_->map(t.ptr() + at, bytes, hs[ui][ri], 0);
          }
          add_phase(ph, "map.map", us_since(t0));
          done.back().mapped++;
        }
        t0 = Clock::now();
        backend_->set_access(t.ptr() + span.first, span.second - span.first);
        add_phase(ph, "map.set_access", us_since(t0));
      }
    }
  } catch (...) {
    // Roll back: every touched range goes back to the zero page, then the memory is released.
    for (const Done& d : done) {
      const RegionSpec& r = regions_[d.region];
      VirtualTensor& t = *tensors_[r.tensor];
      auto [a, b] = stretches[d.stretch];
      size_t off = r.base + static_cast<size_t>(a) * r.size;
      size_t len = static_cast<size_t>(b - a + 1) * r.size;
      try {
        for (size_t k = d.run0; k < d.run0 + d.mapped; ++k) {
          size_t at = r.base + static_cast<size_t>(runs[k].first) * r.size;
          backend_->unmap(t.ptr() + at, static_cast<size_t>(runs[k].second - runs[k].first + 1) * r.size);
        }
        t.give_zero(off, len);
        backend_->set_access(t.ptr() + d.lo, d.hi - d.lo);
      } catch (const std::exception& e) {
        log_warning(std::string("rollback of a failed map left pages unmapped: ") + e.what());
      }
    }
    release_all();
    throw;
  }
  return hs;
}

void PageAllocator::install_runs_locked(const std::vector<int64_t>& pages, std::vector<std::vector<Handle>> hs) {
  Runs runs = runs_of(pages, max_run_pages_);
  for (size_t ui = 0; ui < runs.size(); ++ui) {
    auto [a, b] = runs[ui];
    handles_[a] = std::move(hs[ui]);
    run_len_[a] = b - a + 1;
    run_live_[a] = 0;
    for (int64_t p = a; p <= b; ++p) run_of_[p] = a;
  }
  pages_mapped_.fetch_add(static_cast<int64_t>(pages.size()), std::memory_order_relaxed);
}

bool PageAllocator::unmap_runs_locked(const std::vector<int64_t>& firsts) {
  std::lock_guard<std::mutex> dl(map_mu_);
  bool deferred = true;
  for (size_t i = 0; i < firsts.size();) {
    // A stretch of runs side by side: one unmap call, zero backing and access call per
    // region, so the zero page comes back in pieces as large as the stretch allows.
    size_t j = i + 1;
    while (j < firsts.size() && firsts[j - 1] + run_len_[firsts[j - 1]] == firsts[j]) ++j;
    const int64_t a = firsts[i], n = firsts[j - 1] + run_len_[firsts[j - 1]] - a;
    for (const auto& r : regions_) {
      VirtualTensor& t = *tensors_[r.tensor];
      size_t off = r.base + static_cast<size_t>(a) * r.size;
      size_t len = static_cast<size_t>(n) * r.size;
      std::vector<size_t> sizes;
      for (size_t k = i; k < j; ++k) sizes.push_back(static_cast<size_t>(run_len_[firsts[k]]) * r.size);
      auto t0 = Clock::now();
      backend_->unmap_mappings(t.ptr() + off, sizes);
      add_phase("unmap.unmap", us_since(t0));
      t0 = Clock::now();
      t.give_zero(off, len);
      add_phase("unmap.give_zero", us_since(t0));
      t0 = Clock::now();
      backend_->set_access(t.ptr() + off, len);
      add_phase("unmap.set_access", us_since(t0));
    }
    // Nothing maps these handles any more: their release (the costliest step) is queued
    // for the backend's thread, so the call returns now; see deferred_release.cpp.
    auto t0 = Clock::now();
    std::vector<Handle> hs;
    for (size_t k = i; k < j; ++k) hs.insert(hs.end(), handles_[firsts[k]].begin(), handles_[firsts[k]].end());
    for (size_t k = i; k < j; ++k) {
      handles_[firsts[k]].clear();
      run_len_[firsts[k]] = 0;
      run_live_[firsts[k]] = 0;
    }
    const auto released = static_cast<int64_t>(hs.size());
    if (backend_->release_later(hs, static_cast<size_t>(n) * page_bytes_, rel_report_)) {
      add_phase("unmap.release_deferred", us_since(t0), released);
    } else {
      for (Handle h : hs) backend_->release(h);
      add_phase("unmap.release", us_since(t0), released);
      deferred = false;
    }
    for (int64_t p = a; p < a + n; ++p) {
      run_of_[p] = -1;
      if (state_[p] == kReserved) reserved_.erase(p);
      state_[p] = kFree;
      free_.insert(p);
    }
    pages_unmapped_.fetch_add(n, std::memory_order_relaxed);
    i = j;
  }
  return deferred;
}

std::vector<std::tuple<int64_t, int64_t, int64_t>> PageAllocator::runs() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
  for (int64_t p = 0; p < num_pages_; p += std::max<int64_t>(run_len_[p], 1)) {
    if (run_len_[p] > 0) out.emplace_back(p, run_len_[p], run_live_[p]);
  }
  return out;
}

}  // namespace kvc
