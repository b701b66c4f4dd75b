// The GEMM driver: cache blocking, output tiles shared among threads, partial panels, and the
// choice of microkernel (see gemm.h for the property every path keeps).
#include "engine/cpu/gemm.h"

#include <omp.h>
#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "engine/cpu/gemm_kernels.h"

namespace dgserve::cpu {
namespace {

using gemm_internal::Bf16KernelSet;
using gemm_internal::KernelSet;
using gemm_internal::Tile;
using gemm_internal::TileBf16;

// Block sizes. None of them changes a result (THE PROPERTY); they only place work in caches:
// a k block of one two-panel B strip (kKc × 32 bf16 = 16 KB) and a tile's A block (kMc × kKc
// floats = 32 KB) stay in L1/L2 while the row groups stream past the strip.
constexpr int kKc = 256;  // k per block
constexpr int kMc = 32;   // rows per output tile
constexpr int kNc = 256;  // columns per output tile (a multiple of 2 panels)

// The widened path (a bf16 B and at least kWideMinRows rows, or a row-major B and more rows than
// one microkernel call takes): per k block, a tile
// widens its B block (kKcWide × up to kNcWide columns) once into float32 panels, which every row
// group of the tile (up to kMcWide rows) then reads with the float32 microkernel: the widening
// is paid once per tile instead of once per row group.
constexpr int kKcWide = 256;
constexpr int kNcWide = 256;
constexpr int kMcWide = 256;
// Below this many rows a packed bf16 B is cheaper widened in registers (B is read by few row
// groups, and a B block read from memory and packed before any arithmetic would leave the FMA
// units idle). A row-major B (k stride n) is read far better from a packed copy as soon as two
// row groups read it: soft-embedding tile, 2816 columns, k 512, measured on Zen 5, 2 threads,
// AVX-512: 16 rows 118 -> 248 GFLOP/s, 32 rows 182 -> 311; AVX2: 8 rows 56 -> 119, 32 rows 124 ->
// 181; with one row group it stays in registers (AVX-512, 8 rows: 346 in registers, 174 packed).
constexpr int kWideMinRows = 64;

bool UseWidePath(const GemmArgs& g, const KernelSet& ks) {
  if (g.b.k_stride != kGemmPanel) return g.m > ks.max_rows;
  return g.b.type == GemmB::Type::kBf16 && g.m >= kWideMinRows;
}
constexpr int kAPad = 16;

bool CpuHas(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kPortable: return true;
    case GemmIsa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case GemmIsa::kAvx512: return __builtin_cpu_supports("avx512f");
    case GemmIsa::kAvx512Bf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512bf16");
  }
  return false;
}

GemmIsa BestIsa() {
  if (CpuHas(GemmIsa::kAvx512Bf16)) return GemmIsa::kAvx512Bf16;
  if (CpuHas(GemmIsa::kAvx512)) return GemmIsa::kAvx512;
  if (CpuHas(GemmIsa::kAvx2)) return GemmIsa::kAvx2;
  return GemmIsa::kPortable;
}

std::atomic<GemmIsa>& Active() {
  static std::atomic<GemmIsa> isa{BestIsa()};
  return isa;
}

KernelSet Kernels(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kAvx512Bf16:
    case GemmIsa::kAvx512: return gemm_internal::Avx512Kernels();
    case GemmIsa::kAvx2: return gemm_internal::Avx2Kernels();
    case GemmIsa::kPortable: break;
  }
  return gemm_internal::PortableKernels();
}

size_t ElementSize(const GemmB& b) { return b.type == GemmB::Type::kBf16 ? 2 : 4; }

// Address of B element (kk, j) for j a multiple of 16.
const void* BAt(const GemmB& b, int64_t kk, int64_t j) {
  const int64_t e = (j / kGemmPanel) * b.panel_stride + kk * b.k_stride;
  return static_cast<const char*>(b.data) + e * int64_t(ElementSize(b));
}

// Per-thread buffers for a partial last panel: its B strip padded to 16 columns, and C rows.
struct Scratch {
  std::vector<float> b;     // [kKc][16] floats (or half of it as bf16)
  std::vector<float> c;     // [max_rows][16]
  std::vector<float> wide;  // the widened path's B block: [groups][kc][16 · panels per group]
  std::vector<float> a;     // the widened path's A block: [rows][kc + kAPad]
};

// The first 64-byte aligned float of v after growing it to hold n floats from there: panels read
// from it with full-width loads then never straddle a cache line.
float* Aligned64(std::vector<float>& v, size_t n) {
  if (v.size() < n + 16) v.resize(n + 16);
  const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - p % 64) % 64) / sizeof(float);
}

// Kept across calls (the engine calls the GEMM from long-lived OpenMP threads).
Scratch& ThreadScratch() {
  static thread_local Scratch s;
  return s;
}

// Columns [j, j + cols) with cols < 16 (the partial last panel) for rows [m0, m1), k block k0.
void PartialPanel(const GemmArgs& g, const KernelSet& ks, int m0, int m1, int j, int cols, int k0,
                  int kc, bool load_c, Scratch& s) {
  const bool bf16 = g.b.type == GemmB::Type::kBf16;
  s.b.assign(size_t(kc) * kGemmPanel, 0.0f);
  const char* src = static_cast<const char*>(BAt(g.b, k0, j));
  const size_t es = ElementSize(g.b);
  char* dst = reinterpret_cast<char*>(s.b.data());
  for (int kk = 0; kk < kc; ++kk) {
    std::memcpy(dst + size_t(kk) * kGemmPanel * es, src + size_t(kk) * g.b.k_stride * es,
                size_t(cols) * es);
  }
  s.c.assign(size_t(ks.max_rows) * kGemmPanel, 0.0f);
  for (int i = m0; i < m1; i += ks.max_rows) {
    const int rows = std::min(ks.max_rows, m1 - i);
    if (load_c) {
      for (int r = 0; r < rows; ++r) {
        std::memcpy(&s.c[size_t(r) * kGemmPanel], g.c + (i + r) * g.ldc + j, sizeof(float) * cols);
      }
    }
    Tile t;
    t.kc = kc;
    t.a = g.a + i * g.lda + k0;
    t.lda = g.lda;
    t.b0 = s.b.data();
    t.b_kstride = kGemmPanel;
    t.c = s.c.data();
    t.ldc = kGemmPanel;
    t.load_c = load_c;
    ks.run(rows, 1, bf16, t);
    for (int r = 0; r < rows; ++r) {
      std::memcpy(g.c + (i + r) * g.ldc + j, &s.c[size_t(r) * kGemmPanel], sizeof(float) * cols);
    }
  }
}

// One output tile: rows [m0, m1), columns [n0, n1), all of k.
void RunTile(const GemmArgs& g, const KernelSet& ks, int m0, int m1, int n0, int n1, Scratch& s) {
  const bool bf16 = g.b.type == GemmB::Type::kBf16;
  for (int k0 = 0; k0 < g.k; k0 += kKc) {
    const int kc = std::min(kKc, g.k - k0);
    const bool load_c = g.accumulate || k0 > 0;  // later k blocks continue the chains
    for (int j = n0; j < n1;) {
      const int full = (n1 - j) / kGemmPanel;
      if (full == 0) {
        PartialPanel(g, ks, m0, m1, j, n1 - j, k0, kc, load_c, s);
        break;
      }
      const int panels = std::min(ks.max_panels, full);
      Tile t;
      t.kc = kc;
      t.lda = g.lda;
      t.b0 = BAt(g.b, k0, j);
      t.b1 = panels > 1 ? BAt(g.b, k0, j + kGemmPanel) : nullptr;
      t.b_kstride = g.b.k_stride;
      t.ldc = g.ldc;
      t.load_c = load_c;
      for (int i = m0; i < m1; i += ks.max_rows) {
        t.a = g.a + i * g.lda + k0;
        t.c = g.c + i * g.ldc + j;
        ks.run(std::min(ks.max_rows, m1 - i), panels, bf16, t);
      }
      j += panels * kGemmPanel;
    }
  }
}

// One output tile on the widened path: rows [m0, m1), columns [n0, n1), all of k. Per k block the
// full panels of B are copied as float32 (bf16 widened exactly) into groups of ks.max_panels
// panels, each group [kc][16 · panels] with its panels side by side, and every row group runs
// the float32 microkernel on them: the same chains as reading B directly.
void RunTileWide(const GemmArgs& g, const KernelSet& ks, int m0, int m1, int n0, int n1,
                 Scratch& s) {
  const bool bf16 = g.b.type == GemmB::Type::kBf16;
  const int full = (n1 - n0) / kGemmPanel, tail = (n1 - n0) % kGemmPanel;
  const int group_width = ks.max_panels * kGemmPanel;
  const int groups = (full + ks.max_panels - 1) / ks.max_panels;
  const int row_groups = (m1 - m0 + ks.max_rows - 1) / ks.max_rows;
  float* const wide = Aligned64(s.wide, size_t(kKcWide) * full * kGemmPanel);
  const int64_t lda = kKcWide + kAPad;
  float* const a_block = Aligned64(s.a, size_t(m1 - m0) * lda);
  for (int k0 = 0; k0 < g.k; k0 += kKcWide) {
    const int kc = std::min(kKcWide, g.k - k0);
    const bool load_c = g.accumulate || k0 > 0;  // later k blocks continue the chains
    for (int i = m0; i < m1; ++i) {
      std::memcpy(a_block + size_t(i - m0) * lda, g.a + i * g.lda + k0, sizeof(float) * kc);
    }
    for (int grp = 0; grp < groups; ++grp) {
      const int panels = std::min(ks.max_panels, full - grp * ks.max_panels);
      const int j = n0 + grp * group_width;
      float* block = wide + size_t(grp) * kc * group_width;
      for (int p = 0; p < panels; ++p) {
        ks.pack(kc, BAt(g.b, k0, j + p * kGemmPanel), g.b.k_stride, bf16, block + p * kGemmPanel,
                panels * kGemmPanel);
      }
      Tile t;
      t.kc = kc;
      t.lda = lda;
      t.b0 = block;
      t.b1 = panels > 1 ? block + kGemmPanel : nullptr;
      t.b_kstride = panels * kGemmPanel;
      t.ldc = g.ldc;
      t.load_c = load_c;
      for (int ig = 0; ig < row_groups; ++ig) {
        const int i = m0 + ig * ks.max_rows;
        t.a = a_block + (i - m0) * lda;
        t.c = g.c + i * g.ldc + j;
        ks.run(std::min(ks.max_rows, m1 - i), panels, /*bf16=*/false, t);
      }
    }
    if (tail > 0) PartialPanel(g, ks, m0, m1, n0 + full * kGemmPanel, tail, k0, kc, load_c, s);
  }
}

// MXCSR's FTZ (bit 15) and DAZ (bit 6) bits set on this thread while alive (when `on`): the
// bf16-input mode's emulation on the AVX2 and AVX-512F kernels (gemm.h). Restored on exit.
class FtzDazScope {
 public:
  explicit FtzDazScope(bool on) : on_(on) {
    if (!on_) return;
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);
  }
  ~FtzDazScope() {
    if (on_) _mm_setcsr(saved_);
  }
  FtzDazScope(const FtzDazScope&) = delete;
  FtzDazScope& operator=(const FtzDazScope&) = delete;

 private:
  bool on_;
  unsigned saved_ = 0;
};

// Cuts an m×n output into tiles of at most kMcWide rows (a multiple of `max_rows`) by column
// groups of `max_panels` panels (about kNcWide columns per tile; more column tiles while there are
// fewer than 8 tiles per thread), and calls tile(row0, row1, col0, col1) for each, row-tile major
// (consecutive tiles share their A rows in cache), over `threads` threads. Tiles only split the
// work: every output element is computed whole by one tile.
template <typename Tile>
void ForEachWideTile(int m, int n, int max_rows, int max_panels, int threads, const Tile& tile) {
  const int row_tiles = (m + kMcWide - 1) / kMcWide;
  const int mc = ((m + row_tiles - 1) / row_tiles + max_rows - 1) / max_rows * max_rows;
  const int unit = max_panels * kGemmPanel, groups = (n + unit - 1) / unit;
  const int per_tile = kNcWide / unit;
  int col_tiles = (groups + per_tile - 1) / per_tile;
  if (threads > 1 && row_tiles * col_tiles < 8 * threads) {
    while ((row_tiles * col_tiles) % threads != 0 && col_tiles < groups) ++col_tiles;
  }
  const int tiles = row_tiles * col_tiles;
  auto run = [&](int t) {
    const int ti = t / col_tiles, tj = t % col_tiles;
    const int g0 = int(int64_t(groups) * tj / col_tiles);
    const int g1 = int(int64_t(groups) * (tj + 1) / col_tiles);
    tile(ti * mc, std::min(m, (ti + 1) * mc), g0 * unit, std::min(n, g1 * unit));
  };
  if (threads > 1 && tiles > 1) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int t = 0; t < tiles; ++t) run(t);
    return;
  }
  for (int t = 0; t < tiles; ++t) run(t);
}

void GemmWide(const GemmArgs& g, const KernelSet& ks, int threads, bool ftz) {
  ForEachWideTile(g.m, g.n, ks.max_rows, ks.max_panels, threads,
                  [&](int r0, int r1, int c0, int c1) {
                    const FtzDazScope scope(ftz);
                    RunTileWide(g, ks, r0, r1, c0, c1, ThreadScratch());
                  });
}

// The float32 machinery on g (A float32; in the bf16 mode's emulation A holds bf16(A) and `ftz`
// asks for MXCSR's FTZ and DAZ around the kernels).
void GemmF32(const GemmArgs& g, const KernelSet& ks, bool parallel, bool ftz) {
  if (UseWidePath(g, ks)) {
    GemmWide(g, ks, parallel ? omp_get_max_threads() : 1, ftz);
    return;
  }
  const int mc = kMc;
  const int row_tiles = (g.m + mc - 1) / mc, col_tiles = (g.n + kNc - 1) / kNc;
  const int tiles = row_tiles * col_tiles;
  auto run = [&](int t, Scratch& s) {
    // Column-tile major: consecutive tiles share their B block (kNc columns × k) in cache.
    const int tj = t / row_tiles, ti = t % row_tiles;
    const FtzDazScope scope(ftz);
    RunTile(g, ks, ti * mc, std::min(g.m, (ti + 1) * mc), tj * kNc, std::min(g.n, (tj + 1) * kNc),
            s);
  };
  if (parallel && tiles > 1) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int t = 0; t < tiles; ++t) run(t, ThreadScratch());
    return;
  }
  for (int t = 0; t < tiles; ++t) run(t, ThreadScratch());
}

// ---- The bf16-input mode's native path (VDPBF16PS). ----

// Tiles of at most this many rows read B's panels directly (pairs formed in registers); taller
// tiles pack each B block into pairs once for all their row groups.
constexpr int kNativeDirectMaxRows = 32;

// Per-thread buffers of the native path.
struct NativeScratch {
  std::vector<uint16_t> b;      // one group's B block in pair layout [pairs][16 · panels · 2]
  std::vector<uint16_t> strip;  // a partial panel's B strip padded to 16 columns [kc][16]
  std::vector<float> c;         // C rows of a group with a partial panel [max_rows][32]
};

NativeScratch& ThreadNativeScratch() {
  static thread_local NativeScratch s;
  return s;
}

// One output tile of the native path: rows [m0, m1), columns [n0, n1), all of k. Per k block
// (kKcWide, even, so blocks start on pair boundaries) and per group of up to max_panels panels,
// B is packed into pairs once and read by every row group of the tile.
void RunTileNative(const GemmArgs& g, const GemmABf16& a, const Bf16KernelSet& ks, int m0, int m1,
                   int n0, int n1, NativeScratch& s) {
  const int group_cols = ks.max_panels * kGemmPanel;
  // One row group reads each B block once: the kernel then forms the pairs in registers.
  const bool direct = m1 - m0 <= kNativeDirectMaxRows;
  for (int k0 = 0; k0 < g.k; k0 += kKcWide) {
    const int kc = std::min(kKcWide, g.k - k0), pairs = (kc + 1) / 2;
    const bool load_c = g.accumulate || k0 > 0;
    for (int j = n0; j < n1; j += group_cols) {
      const int cols = std::min(group_cols, n1 - j);
      const int panels = (cols + kGemmPanel - 1) / kGemmPanel;
      const bool partial = cols % kGemmPanel != 0;
      const int64_t ps = int64_t(panels) * 2 * kGemmPanel;
      if (s.b.size() < size_t(pairs) * ps) s.b.resize(size_t(pairs) * ps);
      TileBf16 t;
      t.pairs = pairs;
      t.lda = a.ld_pairs;
      t.load_c = load_c;
      if (direct && !partial) {
        t.direct = true;
        t.kc = kc;
        t.b_kstride = g.b.k_stride;
        t.b0 = static_cast<const uint16_t*>(BAt(g.b, k0, j));
        t.b1 = panels > 1 ? static_cast<const uint16_t*>(BAt(g.b, k0, j + kGemmPanel)) : nullptr;
      } else {
        t.b0 = s.b.data();
        t.b1 = panels > 1 ? s.b.data() + 2 * kGemmPanel : nullptr;
        t.b_pstride = ps;
      }
      for (int p = 0; p < panels && !t.direct; ++p) {
        const int pc = std::min(kGemmPanel, cols - p * kGemmPanel);
        const uint16_t* src = static_cast<const uint16_t*>(BAt(g.b, k0, j + p * kGemmPanel));
        int64_t kstride = g.b.k_stride;
        if (pc < kGemmPanel) {
          s.strip.assign(size_t(kc) * kGemmPanel, 0);
          for (int kk = 0; kk < kc; ++kk) {
            std::memcpy(&s.strip[size_t(kk) * kGemmPanel], src + kk * g.b.k_stride,
                        sizeof(uint16_t) * pc);
          }
          src = s.strip.data();
          kstride = kGemmPanel;
        }
        ks.pack_pairs(kc, src, kstride, s.b.data() + p * 2 * kGemmPanel, ps);
      }
      for (int i = m0; i < m1; i += ks.max_rows) {
        const int rows = std::min(ks.max_rows, m1 - i);
        t.a = a.pairs + i * a.ld_pairs + k0;
        if (!partial) {
          t.c = g.c + i * g.ldc + j;
          t.ldc = g.ldc;
          ks.run(rows, panels, t);
          continue;
        }
        s.c.assign(size_t(ks.max_rows) * group_cols, 0.0f);
        if (load_c) {
          for (int r = 0; r < rows; ++r) {
            std::memcpy(&s.c[size_t(r) * group_cols], g.c + (i + r) * g.ldc + j,
                        sizeof(float) * cols);
          }
        }
        t.c = s.c.data();
        t.ldc = group_cols;
        ks.run(rows, panels, t);
        for (int r = 0; r < rows; ++r) {
          std::memcpy(g.c + (i + r) * g.ldc + j, &s.c[size_t(r) * group_cols],
                      sizeof(float) * cols);
        }
      }
    }
  }
}

// The native path, on the widened path's tiles (ForEachWideTile).
void GemmNative(const GemmArgs& g, const GemmABf16& a, int threads) {
  const Bf16KernelSet ks = gemm_internal::Avx512Bf16Kernels();
  ForEachWideTile(g.m, g.n, ks.max_rows, ks.max_panels, threads,
                  [&](int r0, int r1, int c0, int c1) {
                    RunTileNative(g, a, ks, r0, r1, c0, c1, ThreadNativeScratch());
                  });
}

// RoundActivationToBf16 without branches, as float32 bits (bf16 in the high half): vectorizes.
inline uint32_t RoundBits(uint32_t b) {
  const uint32_t daz = (b & 0x7F800000u) == 0 ? b & 0x80000000u : b;
  const uint32_t rne = (daz + 0x7FFFu + ((daz >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t nan = (daz | 0x00400000u) & 0xFFFF0000u;
  return (daz & 0x7FFFFFFFu) > 0x7F800000u ? nan : rne;
}

// n values of one row rounded (RoundBits). Cloned for AVX-512F, AVX2 and the baseline (an ifunc
// picks one at load): the loop vectorizes to the widest the CPU has; every clone computes the
// same integer function.
#if defined(__clang__)
#define DGSERVE_ROUND_CLONES
#else
#define DGSERVE_ROUND_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
DGSERVE_ROUND_CLONES
void RoundValuesRow(const uint32_t* src, int n, uint32_t* dst) {
  for (int i = 0; i < n; ++i) dst[i] = RoundBits(src[i]);
}

// Rows of A rounded for the bf16-input mode: float32 values (ld = k) and/or pairs (ld = k
// rounded up to even; pair p = bf16(A[2p+1]) low, bf16(A[2p]) high, an odd k's pad −0). Pairs
// are rounded by the native kernels' VCVTNE2PS2BF16 (the same function) 32 at a time where the
// CPU has it.
// `parallel`: shared among the threads of a new OpenMP region (large A only).
void RoundRows(const float* a, int m, int k, int64_t lda, float* values, uint16_t* pairs,
               bool parallel) {
  const int64_t ldp = k + (k & 1);
  const auto round_pairs = pairs != nullptr && CpuHas(GemmIsa::kAvx512Bf16)
                               ? gemm_internal::Avx512Bf16Kernels().round_pairs
                               : nullptr;
#pragma omp parallel for schedule(static) if (parallel && int64_t(m) * k >= (1 << 16))
  for (int i = 0; i < m; ++i) {
    const float* row = a + i * lda;
    if (values != nullptr) {
      RoundValuesRow(reinterpret_cast<const uint32_t*>(row), k,
                     reinterpret_cast<uint32_t*>(values + int64_t(i) * k));
    }
    if (pairs != nullptr) {
      uint16_t* p = pairs + i * ldp;
      const int vec = round_pairs != nullptr ? k / 32 * 32 : 0;
      if (vec > 0) round_pairs(row, vec, p);
      for (int kk = vec; kk + 1 < k; kk += 2) {
        p[kk] = RoundActivationToBf16(row[kk + 1]);
        p[kk + 1] = RoundActivationToBf16(row[kk]);
      }
      if (k & 1) {
        p[k - 1] = 0x8000;  // −0: with the +0 of B's pad, a product that changes nothing
        p[k] = RoundActivationToBf16(row[k - 1]);
      }
    }
  }
}

// Per-thread buffers for A rounded inside one Gemm call (bf16 mode, when the caller passed no
// a_bf16). Kept per thread rather than owned by a backend: at most 6 bytes per element of the
// largest A rounded on that thread (values and pairs; 4.3 MB for 256 rows of the real width,
// 2816), the size of an activation, where the vocabulary step's [rows, V] buffer is the
// backend's (VocabScratch, cpu_vocab.h).
struct RoundScratch {
  std::vector<float> values;
  std::vector<uint16_t> pairs;
};

RoundScratch& ThreadRoundScratch() {
  static thread_local RoundScratch s;
  return s;
}

}  // namespace

uint16_t RoundActivationToBf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return uint16_t(RoundBits(b) >> 16);
}

const char* GemmInputName(GemmInput input) {
  return input == GemmInput::kBf16 ? "bf16" : "float32";
}

absl::StatusOr<GemmInput> ParseGemmInput(absl::string_view name) {
  if (name == "float32") return GemmInput::kFloat32;
  if (name == "bf16") return GemmInput::kBf16;
  return absl::InvalidArgumentError(
      absl::StrCat("GEMM input '", name, "': must be 'float32' or 'bf16'"));
}

Bf16Activations Bf16Activations::Round(const float* a, int m, int k, int64_t lda) {
  Bf16Activations r;
  r.m_ = m;
  r.k_ = k;
  r.ld_pairs_ = k + (k & 1);
  r.values_.resize(size_t(m) * k);
  r.pairs_.resize(size_t(m) * r.ld_pairs_);
  RoundRows(a, m, k, lda, r.values_.data(), r.pairs_.data(), !omp_in_parallel());
  return r;
}

GemmABf16 Bf16Activations::View(int row0) const {
  GemmABf16 v;
  v.values = values_.data() + size_t(row0) * k_;
  v.ld = k_;
  v.pairs = pairs_.data() + size_t(row0) * ld_pairs_;
  v.ld_pairs = ld_pairs_;
  return v;
}

const char* GemmIsaName(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kAvx512Bf16: return "avx512bf16";
    case GemmIsa::kAvx512: return "avx512";
    case GemmIsa::kAvx2: return "avx2";
    case GemmIsa::kPortable: break;
  }
  return "portable";
}

bool GemmIsaSupported(GemmIsa isa) { return CpuHas(isa); }

GemmIsa ActiveGemmIsa() { return Active().load(std::memory_order_relaxed); }

absl::Status SetGemmIsa(GemmIsa isa) {
  if (!CpuHas(isa)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMM path ", GemmIsaName(isa), " is not supported by this CPU"));
  }
  Active().store(isa, std::memory_order_relaxed);
  return absl::OkStatus();
}

void Gemm(const GemmArgs& args, GemmThreads threads) { Gemm(args, ActiveGemmIsa(), threads); }

void Gemm(const GemmArgs& g, GemmIsa isa, GemmThreads threads) {
  if (g.m <= 0 || g.n <= 0) return;
  if (g.k <= 0) {
    if (!g.accumulate) {
      for (int i = 0; i < g.m; ++i) std::fill(g.c + i * g.ldc, g.c + i * g.ldc + g.n, 0.0f);
    }
    return;
  }
  const bool parallel =
      threads == GemmThreads::kOpenMp && !omp_in_parallel() && omp_get_max_threads() > 1;
  if (g.input != GemmInput::kBf16 || g.b.type != GemmB::Type::kBf16) {
    GemmF32(g, Kernels(isa), parallel, /*ftz=*/false);
    return;
  }
  // The bf16-input mode: A rounded once (unless the caller did), then the native path or the
  // emulation (gemm.h).
  const bool native = isa == GemmIsa::kAvx512Bf16;
  GemmABf16 a = g.a_bf16;
  if (a.empty() || (native && a.pairs == nullptr)) {
    RoundScratch& rs = ThreadRoundScratch();
    a = {};
    if (native) {
      a.ld_pairs = g.k + (g.k & 1);
      rs.pairs.resize(size_t(g.m) * a.ld_pairs);
      RoundRows(g.a, g.m, g.k, g.lda, nullptr, rs.pairs.data(), parallel);
      a.pairs = rs.pairs.data();
    } else {
      a.ld = g.k;
      rs.values.resize(size_t(g.m) * g.k);
      RoundRows(g.a, g.m, g.k, g.lda, rs.values.data(), nullptr, parallel);
      a.values = rs.values.data();
    }
  }
  if (native) {
    GemmNative(g, a, parallel ? omp_get_max_threads() : 1);
    return;
  }
  GemmArgs e = g;
  e.a = a.values;
  e.lda = a.ld;
  if (isa == GemmIsa::kPortable) {
    GemmF32(e, gemm_internal::PortableFtzKernels(), parallel, /*ftz=*/false);
  } else {
    GemmF32(e, Kernels(isa), parallel, /*ftz=*/true);
  }
}

}  // namespace dgserve::cpu
