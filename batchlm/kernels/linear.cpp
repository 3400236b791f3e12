// batchlm::linear: y = x @ W^T in float32, every output summed over k in ascending order with fma, the
// next block of W prefetched while the current one is multiplied.
//
// Contract (checked at the top of linear):
//   x        (T, K)       float32 (made contiguous here)
//   packed   (G, K, 64)   float32, contiguous: pack_linear(W) for W (N, K); group g holds output columns
//                         64g .. 64g+63 (zero past N), row k of a group is those columns' weights at k
//   n        int          N, the output features: 64(G - 1) < N <= 64G
//   returns  (T, N)       float32
//
// pack_linear(W (N, K) float32) -> (G, K, 64): the layout above, G = ceil(N / 64).
//
// Why a kernel: a decode step streams every weight from DRAM (the model is ~4x this CPU's L3), and with
// oneDNN's packed matmul that streaming and the arithmetic did not overlap: a batch-8 step cost ~1.3x
// and a batch-40 step ~1.1x what it costs here (docs/architecture.md item 18). Each group is one
// sequential 256-byte-per-k stream, and the first register block of rows prefetches the next group's
// row k into L2 as it reads its own, so the memory system is one group ahead of the FMAs.
//
// Exactness: output (t, n) is fma(x[t][K-1], W[n][K-1], ... fma(x[t][0], W[n][0], 0)), in that order,
// whatever T is, whichever register block or thread computes the row, and whichever column group. So a
// row's result does not depend on what else is in the call: batch-invariant bit for bit (oneDNN's
// float32 kernel changes its summation between 1 and 2 rows for K = 1408 on the AMD EPYC of session 15).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kCols = 64;    // output columns per group: four 16-lane vectors
constexpr int kVecs = 4;
constexpr int kRows = 6;         // rows per register block: 6 x 4 accumulators + 4 weight vectors
constexpr int64_t kChunk = 96;   // rows per pass over W: a chunk of x stays in L2 while W streams by

// Rows r .. r + R of x times one group `w` (K, 64); writes `ncols` (<= 64) columns of out (row stride n).
// `next`, when not null, is the following group: its row k is prefetched as this group's row k is read.
template <int R>
void block(const float* __restrict x, int64_t K, const float* __restrict w, const float* next,
           float* __restrict out, int64_t n, int64_t ncols) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kCols;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32),
                 w3 = _mm512_loadu_ps(wk + 48);
    if (next != nullptr) {
      const char* line = reinterpret_cast<const char*>(next + k * kCols);
      _mm_prefetch(line, _MM_HINT_T1);
      _mm_prefetch(line + 64, _MM_HINT_T1);
      _mm_prefetch(line + 128, _MM_HINT_T1);
      _mm_prefetch(line + 192, _MM_HINT_T1);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + r * n;
    if (ncols == kCols) {
      for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(o + 16 * v, acc[r][v]);
    } else {  // the last group of an N that is not a multiple of 64
      alignas(64) float tmp[kCols];
      for (int v = 0; v < kVecs; ++v) _mm512_store_ps(tmp + 16 * v, acc[r][v]);
      std::copy(tmp, tmp + ncols, o);
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t);
constexpr BlockFn kBlocks[kRows + 1] = {nullptr, block<1>, block<2>, block<3>, block<4>, block<5>, block<6>};

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a (T, K) float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == kCols,
              "packed must be a contiguous (G, K, 64) float32 tensor (pack_linear)");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), G = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features, the packed weight ", packed.size(1));
  TORCH_CHECK(n > (G - 1) * kCols && n <= G * kCols, "n = ", n, " does not fit ", G, " groups of 64");
  auto out = at::empty({T, n}, x.options());
  if (T == 0 || K == 0) return out.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
    const int64_t rows = std::min(kChunk, T - t0);
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const float* w = wp + g * K * kCols;
        const float* next = g + 1 < g1 ? w + K * kCols : nullptr;  // this thread's next group
        const int64_t ncols = std::min(kCols, n - g * kCols);
        for (int64_t r = 0; r < rows; r += kRows) {
          const int R = static_cast<int>(std::min<int64_t>(kRows, rows - r));
          kBlocks[R](xp + (t0 + r) * K, K, w, r == 0 ? next : nullptr, op + (t0 + r) * n + g * kCols, n, ncols);
        }
      }
    });
  }
  return out;
}

at::Tensor pack_linear(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w must be an (N, K) float32 tensor");
  const int64_t N = w.size(0), K = w.size(1), G = (N + kCols - 1) / kCols;
  auto padded = at::zeros({G * kCols, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({G, kCols, K}).transpose(1, 2).contiguous();  // (G, K, 64)
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchlm, m) {
  m.def("linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("pack_linear(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchlm, CPU, m) {
  m.impl("linear", &linear);
  m.impl("pack_linear", &pack_linear);
}
