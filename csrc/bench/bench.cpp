// Per-call latency of the raw backend calls, timed in C++ (no Python overhead).
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "backend.h"

namespace kvc {

std::map<std::string, std::vector<double>> bench_driver_calls(Backend& b, int64_t num_pages, size_t page_bytes) {
  if (num_pages <= 0) throw_value("num_pages must be positive, got " + std::to_string(num_pages) + ".");
  b.check_aligned("page_bytes", page_bytes);
  // n * page_bytes must not wrap: the maps below would then land outside the reservation.
  if (static_cast<size_t>(num_pages) > (size_t{1} << 48) / page_bytes) {
    throw_value("num_pages * page_bytes must be at most 2^48 B, got " + std::to_string(num_pages) + " x " +
                std::to_string(page_bytes) + " B; lower num_pages.");
  }
  using clk = std::chrono::steady_clock;
  auto us = [](clk::time_point a, clk::time_point z) { return std::chrono::duration<double, std::micro>(z - a).count(); };
  std::map<std::string, std::vector<double>> out;
  size_t n = static_cast<size_t>(num_pages);
  size_t total = n * page_bytes;
  for (int i = 0; i < 8; ++i) {
    auto t0 = clk::now();
    uintptr_t va = b.reserve(total);
    auto t1 = clk::now();
    b.free_va(va, total);
    auto t2 = clk::now();
    out["reserve"].push_back(us(t0, t1));
    out["free_va"].push_back(us(t1, t2));
  }
  uintptr_t va = b.reserve(total);
  std::vector<Handle> hs;
  try {
    for (size_t i = 0; i < n; ++i) {
      auto t0 = clk::now();
      hs.push_back(b.create(page_bytes));
      out["create"].push_back(us(t0, clk::now()));
    }
    for (size_t i = 0; i < n; ++i) {
      auto t0 = clk::now();
      b.map(va + i * page_bytes, page_bytes, hs[i], 0);
      out["map"].push_back(us(t0, clk::now()));
    }
    // Batched calls first, on fresh mappings: setting access again on a mapping that
    // already has it is ~100x cheaper and would flatter the batch.
    auto t0 = clk::now();
    b.set_access(va, total);
    out["set_access_all_pages_once"].push_back(us(t0, clk::now()));
    t0 = clk::now();
    b.unmap_units(va, total, page_bytes);
    out["unmap_all_pages_once"].push_back(us(t0, clk::now()));
    for (size_t i = 0; i < n; ++i) b.map(va + i * page_bytes, page_bytes, hs[i], 0);
    for (size_t i = 0; i < n; ++i) {
      auto t1 = clk::now();
      b.set_access(va + i * page_bytes, page_bytes);
      out["set_access"].push_back(us(t1, clk::now()));
    }
    for (size_t i = 0; i < n; ++i) {
      auto t1 = clk::now();
      b.unmap(va + i * page_bytes, page_bytes);
      out["unmap"].push_back(us(t1, clk::now()));
    }
    for (size_t i = 0; i < n; ++i) {
      auto t1 = clk::now();
      b.release(hs[i]);
      out["release"].push_back(us(t1, clk::now()));
    }
    hs.clear();
  } catch (...) {
    for (Handle h : hs) b.release(h);
    b.free_va(va, total);
    throw;
  }
  b.free_va(va, total);
  return out;
}

}  // namespace kvc
