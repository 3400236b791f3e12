// The float32 register blocks of batchlm::linear and the loop that runs them over rows and column groups,
// shared by linear.cpp (float32 and bfloat16 weights) and linear_quant.cpp (GGUF blocks, dequantized into
// a float32 group first). The layout and the exactness contract are linear.cpp's.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "work_split.h"

namespace {

constexpr int64_t kCols = 64;   // output columns per group: four 16-lane vectors
constexpr int kRows = 6;        // rows per register block: 6 x 4 accumulators + 4 weight vectors
constexpr int64_t kChunk = 96;  // rows per pass over W: a chunk of x stays in L2 while W streams by

// Which rows of the next group one register block prefetches. The `parts` sharing blocks of a group (its
// full blocks, or its first block alone if none is full; see run) run parts * K iterations (K rows each);
// iteration i = part * K + k prefetches row i / parts when parts divides i, so the rows go out in order,
// evenly over those blocks, each row once. No `next`: nothing to prefetch (the thread's last group, or a
// block that does not share).
struct Prefetch {
  const void* next;  // the next group, or null
  int64_t part;      // this block's index among the group's blocks
  int64_t parts;     // the group's blocks
};

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define BATCHLM_F32_VECTOR 1
#endif

#ifdef BATCHLM_F32_VECTOR
inline void prefetch_row(const void* p) {  // one group row: 256 bytes, four lines (a hint, no effect on results)
  const char* line = static_cast<const char*>(p);
  _mm_prefetch(line, _MM_HINT_T1);
  _mm_prefetch(line + 64, _MM_HINT_T1);
  _mm_prefetch(line + 128, _MM_HINT_T1);
  _mm_prefetch(line + 192, _MM_HINT_T1);
}

class PrefetchCursor {  // walks one block's share of Prefetch, iteration by iteration
 public:
  PrefetchCursor(const Prefetch& p, int64_t K) : next_(p.next), every_(p.parts) {
    const int64_t start = p.part * K;
    due_ = next_ != nullptr ? (p.parts - start % p.parts) % p.parts : K;
    row_ = (start + due_) / p.parts;
  }
  // Call once per iteration k, in order; issues a row's prefetch on the iterations that own one.
  template <typename W>
  void at(int64_t k) {
    if (k != due_) return;
    prefetch_row(static_cast<const W*>(next_) + row_ * kCols);
    ++row_;
    due_ += every_;
  }

 private:
  const void* next_;
  int64_t every_, due_, row_;
};

#ifdef __AVX512F__
// V vectors of sums: 16V columns to o, or the first ncols of them where fewer are left
template <int V>
inline void store_cols(float* o, const __m512 (&acc)[V], int64_t ncols) {
  if (ncols >= 16 * V) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + 16 * v, acc[v]);
    return;
  }
  alignas(64) float tmp[16 * V];  // the last group of an N that is not a multiple of 64
  for (int v = 0; v < V; ++v) _mm512_store_ps(tmp + 16 * v, acc[v]);
  std::copy(tmp, tmp + ncols, o);
}
#else
inline void store_quarter(float* o, __m256 lo, __m256 hi, int64_t ncols) {  // 16 columns, or the first ncols
  if (ncols >= 16) {
    _mm256_storeu_ps(o, lo);
    _mm256_storeu_ps(o + 8, hi);
    return;
  }
  alignas(32) float tmp[16];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  std::copy(tmp, tmp + ncols, o);
}
#endif

// Calls body(hint) with the per-iteration prefetch `hint(k)` this block owes: none, every row of the next
// group (the block is the group's only part), or its share (PrefetchCursor). Three loops, each compiled
// with its own hint, so a block with nothing or everything to prefetch runs a loop without the cursor.
template <typename W, typename Body>
inline void with_prefetch(const Prefetch& prefetch, int64_t K, Body body) {
  if (prefetch.next == nullptr) {
    body([](int64_t) {});
  } else if (prefetch.parts == 1) {
    const W* next = static_cast<const W*>(prefetch.next);
    body([next](int64_t k) { prefetch_row(next + k * kCols); });
  } else {
    PrefetchCursor cursor(prefetch, K);
    body([&cursor](int64_t k) { cursor.at<W>(k); });
  }
}
#endif

// float32: rows r .. r + R of x (row stride K) times one group `w` (K, 64); writes `ncols` (<= 64) columns
// of out (row stride n). `prefetch` names this block's share of the following group (Prefetch).
template <int R>
void block_f32(const float* __restrict x, int64_t K, const float* __restrict w, const Prefetch& prefetch,
               float* __restrict out, int64_t n, int64_t ncols) {
#if !defined(__AVX512F__) && defined(BATCHLM_F32_VECTOR)
  // AVX2: R x 2 accumulators + 2 weight vectors + 1 broadcast of 16 registers; one pass per 16 columns. Each
  // pass is a part of its own in the prefetch's split (part * 4 + q of parts * 4), so the block's share of the
  // next group goes out evenly over all four passes, in row order, as one pass would send it.
  constexpr int kPasses = kCols / 16;
  for (int q = 0; q < kPasses && 16 * q < ncols; ++q) {
    const float* wq = w + 16 * q;
    const Prefetch pass{prefetch.next, prefetch.part * kPasses + q, prefetch.parts * kPasses};
    with_prefetch<float>(pass, K, [&](auto hint) {
      // NOTE: every loop over r unrolled: if one is left rolled (GCC 12 leaves the set-up and the stores),
      // the accumulators stay in memory and are stored on every iteration, at a third of the FMA rate.
      __m256 acc[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        hint(k);
        const __m256 w0 = _mm256_loadu_ps(wq + k * kCols), w1 = _mm256_loadu_ps(wq + k * kCols + 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
          acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) store_quarter(out + r * n + 16 * q, acc[r][0], acc[r][1], ncols - 16 * q);
    });
  }
#elif defined(__AVX512F__)
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  with_prefetch<float>(prefetch, K, [&](auto hint) {
    for (int64_t k = 0; k < K; ++k) {
      hint(k);
      const float* wk = w + k * kCols;
      const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32),
                   w3 = _mm512_loadu_ps(wk + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * K + k]);
        acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
      }
    }
  });
  for (int r = 0; r < R; ++r) store_cols(out + r * n, acc[r], ncols);
#else
  (void)prefetch;
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < ncols; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * K + k], w[k * kCols + c], acc);
      out[r * n + c] = acc;
    }
#endif
}

template <typename X, typename W, typename O>
using BlockFn = void (*)(const X*, int64_t, const W*, const Prefetch&, O*, int64_t, int64_t);

// Rows in chunks of kChunk; in each chunk the threads share out the groups (for_each_item: each its own run
// of groups, then what is left of the others'), and each group is multiplied by the chunk's rows kRows at a
// time. `row` is the length of one x row and one group row (in elements of X and W: k for float32, pairs of
// k for bfloat16).
template <typename X, typename W, typename O>
void run(const X* x, const W* w, O* out, int64_t T, int64_t row, int64_t G, int64_t n,
         const BlockFn<X, W, O> (&blocks)[kRows + 1]) {
  for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
    const int64_t rows = std::min(kChunk, T - t0);
    batchlm::for_each_item(G, [] { return 0; }, [&](int, int64_t g, int64_t next_g) {
      const W* group = w + g * row * kCols;
      const W* next = next_g >= 0 ? w + next_g * row * kCols : nullptr;  // this thread's likely next group
      const int64_t ncols = std::min(kCols, n - g * kCols);
      // NOTE: the prefetch is shared by the full blocks only (or left to the first block if none is full):
      // a short last block runs its iterations a few times faster, and its share would go out in a burst.
      const int64_t parts = std::max<int64_t>(1, rows / kRows);
      for (int64_t r = 0, part = 0; r < rows; r += kRows, ++part) {
        const int R = static_cast<int>(std::min<int64_t>(kRows, rows - r));
        blocks[R](x + (t0 + r) * row, row, group, Prefetch{part < parts ? next : nullptr, part, parts},
                  out + (t0 + r) * n + g * kCols, n, ncols);
      }
    });
  }
}

constexpr BlockFn<float, float, float> kF32Blocks[kRows + 1] = {
    nullptr, block_f32<1>, block_f32<2>, block_f32<3>, block_f32<4>, block_f32<5>, block_f32<6>};

}  // namespace
