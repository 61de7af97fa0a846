// Where the time of zero-page mapping goes: the same handle mapped at many places vs
// distinct handles, one access/unmap call over many mappings, allocation sizes, zero
// chunks of several sizes, partial mappings, and the per-region steps of grow/shrink.
// Every entry is microseconds (per call, or one total where the key says so).
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"

namespace kvc {
namespace {

using clk = std::chrono::steady_clock;
using Results = std::map<std::string, std::vector<double>>;

double us_since(clk::time_point t0) { return std::chrono::duration<double, std::micro>(clk::now() - t0).count(); }

template <class F>
double timed(F&& f) {
  auto t0 = clk::now();
  f();
  return us_since(t0);
}

// Runs one experiment; a failure is recorded as "<name>.failed" and printed, the rest go on.
void guarded(Results& out, const std::string& name, const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    out[name + ".failed"].push_back(1);
    std::fprintf(stderr, "[bench_breakdown] %s failed: %s\n", name.c_str(), e.what());
  }
}

// A reservation released on scope exit (mappings must be gone by then).
struct Va {
  Backend& b;
  uintptr_t p;
  size_t n;
  Va(Backend& be, size_t size) : b(be), p(be.reserve(size)), n(size) {}
  ~Va() { b.free_va(p, n); }
};

struct Hd {
  Backend& b;
  Handle h;
  Hd(Backend& be, size_t size) : b(be), h(be.create(size)) {}
  ~Hd() { b.release(h); }
};

}  // namespace

Results bench_breakdown(Backend& b, int64_t num_units, size_t unit) {
  if (num_units < 16) throw_value("num_units must be >= 16, got " + std::to_string(num_units) + ".");
  b.check_aligned("unit", unit);
  // n * unit must not wrap: the maps below would then land outside the reservation.
  if (static_cast<size_t>(num_units) > (size_t{1} << 48) / unit) {
    throw_value("num_units * unit must be at most 2^48 B, got " + std::to_string(num_units) + " x " +
                std::to_string(unit) + " B; lower num_units.");
  }
  Results out;
  const size_t n = static_cast<size_t>(num_units);
  const size_t total = n * unit;

  // A. one handle mapped at n places (the zero page of a per-layer tensor)
  guarded(out, "same", [&] {
    Hd z(b, unit);
    Va va(b, total);
    for (size_t i = 0; i < n; ++i) out["same.map"].push_back(timed([&] { b.map(va.p + i * unit, unit, z.h, 0); }));
    out["same.set_access_all"].push_back(timed([&] { b.set_access(va.p, total); }));
    out["same.set_access_all_again"].push_back(timed([&] { b.set_access(va.p, total); }));
    for (size_t k = 0; k < 16; ++k) {
      size_t at = (k * ((n - 8) / 16)) * unit;
      out["same.set_access_8"].push_back(timed([&] { b.set_access(va.p + at, 8 * unit); }));
    }
    for (size_t k = 0; k < 16; ++k) {  // what unmap_zero of one 8-page run costs, then put them back
      size_t at = (k * ((n - 8) / 16)) * unit;
      out["same.unmap_8_one_call"].push_back(timed([&] { b.unmap(va.p + at, 8 * unit); }));
      out["same.map_8_total"].push_back(timed([&] {
        for (size_t i = 0; i < 8; ++i) b.map(va.p + at + i * unit, unit, z.h, 0);
      }));
      out["same.set_access_8_after_remap"].push_back(timed([&] { b.set_access(va.p + at, 8 * unit); }));
    }
    out["same.unmap_all_one_call"].push_back(timed([&] { b.unmap(va.p, total); }));
    // the same without ever setting access: is the cost in the access or in the mapping?
    for (size_t i = 0; i < n; ++i) b.map(va.p + i * unit, unit, z.h, 0);
    out["same.unmap_all_no_access"].push_back(timed([&] { b.unmap(va.p, total); }));
    for (size_t i = 0; i < n; ++i) b.map(va.p + i * unit, unit, z.h, 0);
    b.set_access(va.p, total);
    const size_t each = n / 2;
    for (size_t i = 0; i < each; ++i) out["same.unmap_each"].push_back(timed([&] { b.unmap(va.p + i * unit, unit); }));
    b.unmap(va.p + each * unit, total - each * unit);
  });

  // B. n distinct handles (n * unit of physical memory)
  guarded(out, "dist", [&] {
    Va va(b, total);
    std::vector<Handle> hs;
    bool mapped = false;
    try {
      for (size_t i = 0; i < n; ++i) {
        auto t0 = clk::now();
        hs.push_back(b.create(unit));
        out["dist.create"].push_back(us_since(t0));
      }
      for (size_t i = 0; i < n; ++i) out["dist.map"].push_back(timed([&] { b.map(va.p + i * unit, unit, hs[i], 0); }));
      mapped = true;
      out["dist.set_access_all"].push_back(timed([&] { b.set_access(va.p, total); }));
      out["dist.set_access_all_again"].push_back(timed([&] { b.set_access(va.p, total); }));
      for (size_t k = 0; k < 16; ++k) {
        size_t at = (k * ((n - 8) / 16)) * unit;
        out["dist.set_access_8"].push_back(timed([&] { b.set_access(va.p + at, 8 * unit); }));
      }
      out["dist.unmap_all_one_call"].push_back(timed([&] { b.unmap(va.p, total); }));
      mapped = false;
      for (Handle h : hs) out["dist.release"].push_back(timed([&] { b.release(h); }));
      hs.clear();
    } catch (...) {
      if (mapped) b.unmap_units(va.p, total, unit);
      for (Handle h : hs) b.release(h);
      throw;
    }
  });

  // C. does a mapping get dearer as its handle has more mappings? (4n mappings)
  guarded(out, "scale", [&] {
    size_t m = 4 * n;
    Hd z(b, unit);
    Va va(b, m * unit);
    std::vector<double> t(m);
    for (size_t i = 0; i < m; ++i) t[i] = timed([&] { b.map(va.p + i * unit, unit, z.h, 0); });
    out["scale.map_first_256"].assign(t.begin(), t.begin() + 256);
    out["scale.map_last_256"].assign(t.end() - 256, t.end());
    out["scale.set_access_all_total"].push_back(timed([&] { b.set_access(va.p, m * unit); }));
    out["scale.unmap_all_total"].push_back(timed([&] { b.unmap(va.p, m * unit); }));
  });

  // D. allocation size
  for (size_t mib : {2, 32, 128, 512}) {
    size_t sz = mib << 20;
    if (sz % b.granularity) continue;
    std::string key = "create_" + std::to_string(mib) + "MiB";
    guarded(out, key, [&] {
      for (int i = 0; i < 4; ++i) {
        Handle h = 0;
        out[key].push_back(timed([&] { h = b.create(sz); }));
        out["release_" + std::to_string(mib) + "MiB"].push_back(timed([&] { b.release(h); }));
      }
    });
  }

  // E. a mapping shorter than its allocation (from offset 0)
  guarded(out, "partial", [&] {
    Hd h(b, 32 * unit);
    Va va(b, 32 * unit);
    double ok = 1;
    try {
      b.map(va.p, unit, h.h, 0);
      b.map(va.p + unit, 15 * unit, h.h, 0);
      b.set_access(va.p, 16 * unit);
      b.unmap(va.p, 16 * unit);
    } catch (const std::exception& e) {
      ok = 0;
      std::fprintf(stderr, "[bench_breakdown] partial mapping refused: %s\n", e.what());
      try {
        b.unmap_units(va.p, unit, unit);
      } catch (...) {
      }
    }
    out["partial_map_ok"].push_back(ok);
  });

  // F. zero chunks: the same handle of `chunk` bytes over the n-unit range
  for (size_t cu : {1, 4, 16, 64}) {
    if (cu > n || n % cu) continue;
    std::string key = "chunk_" + std::to_string(cu * unit >> 20) + "MiB";
    guarded(out, key, [&] {
      size_t cs = cu * unit, k = n / cu;
      Hd z(b, cs);
      Va va(b, total);
      out[key + ".map_total"].push_back(timed([&] {
        for (size_t i = 0; i < k; ++i) b.map(va.p + i * cs, cs, z.h, 0);
      }));
      out[key + ".set_access_total"].push_back(timed([&] { b.set_access(va.p, total); }));
      out[key + ".unmap_total"].push_back(timed([&] { b.unmap(va.p, total); }));
    });
  }

  // G. four threads creating 2 MiB handles at once (does the driver serialize?)
  guarded(out, "threads", [&] {
    const size_t per = 128;
    for (int nt : {1, 4}) {
      std::vector<std::vector<Handle>> hs(nt);
      double wall = timed([&] {
        std::vector<std::thread> th;
        for (int t = 0; t < nt; ++t) {
          th.emplace_back([&, t] {
            try {
              for (size_t i = 0; i < per; ++i) hs[t].push_back(b.create(unit));
            } catch (...) {
            }
          });
        }
        for (auto& x : th) x.join();
      });
      size_t made = 0;
      for (auto& v : hs) made += v.size();
      out["threads" + std::to_string(nt) + ".create_us_per_handle"].push_back(wall / static_cast<double>(made));
      double rel = timed([&] {
        std::vector<std::thread> th;
        for (int t = 0; t < nt; ++t) {
          th.emplace_back([&, t] {
            for (Handle h : hs[t]) b.release(h);
          });
        }
        for (auto& x : th) x.join();
      });
      out["threads" + std::to_string(nt) + ".release_us_per_handle"].push_back(rel / static_cast<double>(made));
    }
  });

  // H. one handle mapped at two places: which of the two mappings is dear?
  guarded(out, "two", [&] {
    for (int i = 0; i < 16; ++i) {
      Hd h(b, unit);
      Va v1(b, unit), v2(b, unit);
      out["two.map1"].push_back(timed([&] { b.map(v1.p, unit, h.h, 0); }));
      out["two.access1"].push_back(timed([&] { b.set_access(v1.p, unit); }));
      out["two.map2"].push_back(timed([&] { b.map(v2.p, unit, h.h, 0); }));
      out["two.access2"].push_back(timed([&] { b.set_access(v2.p, unit); }));
      out["two.unmap2"].push_back(timed([&] { b.unmap(v2.p, unit); }));
      out["two.unmap1"].push_back(timed([&] { b.unmap(v1.p, unit); }));
    }
  });
  // I. a grow and shrink of 8 pages inside a 64 MiB zero chunk; remainders from zero allocations of their size
  guarded(out, "split", [&] {
    const size_t cu = 32, cs = cu * unit, chunks = n / cu;
    if (chunks < 32) throw_value("needs num_units >= 1024");
    Hd z(b, cs), z8(b, 8 * unit), z16(b, 16 * unit);
    Va va(b, total);
    std::vector<Handle> hs;
    size_t mapped_chunks = 0;
    try {
      for (; mapped_chunks < chunks; ++mapped_chunks) b.map(va.p + mapped_chunks * cs, cs, z.h, 0);
      b.set_access(va.p, total);
      for (int i = 0; i < 8; ++i) hs.push_back(b.create(unit));
      for (size_t k = 0; k < 16; ++k) {
        uintptr_t c = va.p + 2 * k * cs;
        out["split.grow.unmap_chunk"].push_back(timed([&] { b.unmap(c, cs); }));
        out["split.grow.map_left_8"].push_back(timed([&] { b.map(c, 8 * unit, z8.h, 0); }));
        out["split.grow.map_real_8"].push_back(timed([&] {
          for (size_t i = 0; i < 8; ++i) b.map(c + (8 + i) * unit, unit, hs[i], 0);
        }));
        out["split.grow.map_right_16"].push_back(timed([&] { b.map(c + 16 * unit, 16 * unit, z16.h, 0); }));
        out["split.grow.set_access_chunk"].push_back(timed([&] { b.set_access(c, cs); }));
        out["split.shrink.unmap_real_8"].push_back(timed([&] { b.unmap(c + 8 * unit, 8 * unit); }));
        out["split.shrink.map_zero_8"].push_back(timed([&] { b.map(c + 8 * unit, 8 * unit, z8.h, 0); }));
        out["split.shrink.set_access_8"].push_back(timed([&] { b.set_access(c + 8 * unit, 8 * unit); }));
        b.unmap(c, cs);  // three zero mappings -> one again
        b.map(c, cs, z.h, 0);
        b.set_access(c, cs);
      }
    } catch (...) {
      for (Handle h : hs) b.release(h);
      throw;
    }
    b.unmap(va.p, total);
    for (Handle h : hs) b.release(h);
  });
  return out;
}

}  // namespace kvc
