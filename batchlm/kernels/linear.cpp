// batchlm::linear: y = x @ W^T for float32 or bfloat16, every output summed over k in ascending order in
// float32, the next block of W prefetched while the current one is multiplied.
//
// Contract (checked at the top of linear):
//   x        (T, K)            float32 or bfloat16, the dtype of packed (made contiguous here)
//   packed   pack_linear(W)    for W (N, K) in x's dtype:
//            float32  (G, K, 64)       group g holds output columns 64g .. 64g+63 (zero past N); row k of a
//                                      group is those columns' weights at k
//            bfloat16 (G, K2, 64, 2)   K2 = ceil(K / 2): row j of a group is those columns' weights at k = 2j
//                                      and 2j + 1 (zero past K), pairwise, as the bfloat16 dot product reads them
//   n        int               N, the output features: 64(G - 1) < N <= 64G
//   returns  (T, N)            x's dtype
// linear_bf16(x (T, K) float32, packed (G, K2, 64, 2) bfloat16, n) -> (T, N) float32: the bfloat16 form with
// x rounded to bfloat16 here (nearest even) and the sums returned in float32, unrounded: the fast tier for a
// GGUF file's BF16 weights in a float32 model (batchlm/model/quantized.py). Needs AVX-512 BF16 (refused
// without it).
// pack_linear(W (N, K)) -> packed, G = ceil(N / 64). linear_is_native(dtype) -> bool: whether this build
// has the vector code for that dtype (float32: AVX-512, or AVX2 with FMA; bfloat16: AVX-512 BF16). Without
// it float32 runs a scalar loop with the same sums (correct, slow) and bfloat16 is refused; callers use
// oneDNN instead. With AVX2 (16 vector registers of 8 lanes) a register block holds 16 of a group's 64
// columns, so a block walks the group four times, one 64-byte line of each 256-byte row per pass.
//
// Why a kernel: a decode step streams every weight from DRAM (the weights are many times a CPU's L3), and
// oneDNN's packed matmul does not overlap that streaming with the arithmetic (`batchlm-bench forward
// --linear onednn --profile` shows it). Each group is one sequential stream (256 bytes per k, or per pair
// of k in bfloat16), multiplied
// by one register block of rows after another; while they do, the next group is prefetched into L2 in order,
// one row every `parts` iterations across all the blocks (Prefetch), so the memory system stays one group
// ahead of the arithmetic and DRAM is kept busy for the whole group, not only during its first block.
//
// Exactness: whatever T is, and whichever register block, chunk, thread or column group computes a row,
//   float32:  out[t][n] = fma(x[t][K-1], W[n][K-1], ... fma(x[t][0], W[n][0], 0))
//   bfloat16: acc = 0; for j in 0 .. K2-1: acc = vdpbf16ps(acc, x pair j, W pair j) (k = 2j+1, then 2j, as
//             the instruction defines); out = acc rounded to bfloat16 once (nearest even); linear_bf16: out = acc
// So a row's bits do not depend on what else is in the call: batch-invariant bit for bit. (oneDNN's
// matmul does not promise this: its blocking can depend on the row count, so on some CPUs and shapes a
// row alone differs from the same row among others, in float32 and in bfloat16.)

#include <ATen/ATen.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "linear_blocks.h"

namespace {

#ifdef __AVX512BF16__
// bfloat16: x and w as pairs of bfloat16 in 32-bit words; x rows of K2 pairs, w one group (K2, 64 pairs). O
// bfloat16 rounds each sum once (linear); float32 stores it as it is (linear_bf16).
template <typename O, int R>
void block_bf16(const uint32_t* __restrict x, int64_t K2, const uint32_t* __restrict w, const Prefetch& prefetch,
                O* __restrict out, int64_t n, int64_t ncols) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  with_prefetch<uint32_t>(prefetch, K2, [&](auto hint) {
    for (int64_t j = 0; j < K2; ++j) {
      hint(j);
      const uint32_t* wj = w + j * kCols;
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wj), w1 = (__m512bh)_mm512_loadu_si512(wj + 16),
                     w2 = (__m512bh)_mm512_loadu_si512(wj + 32), w3 = (__m512bh)_mm512_loadu_si512(wj + 48);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * K2 + j]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
      }
    }
  });
  for (int r = 0; r < R; ++r) {
    if constexpr (std::is_same_v<O, float>) {
      store_cols(out + r * n, acc[r], ncols);
    } else {
      alignas(64) uint16_t tmp[kCols];
      for (int v = 0; v < 4; ++v)
        _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 16 * v), (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
      std::memcpy(out + r * n, tmp, ncols * sizeof(uint16_t));
    }
  }
}

template <typename O>
constexpr BlockFn<uint32_t, uint32_t, O> kBf16Blocks[kRows + 1] = {
    nullptr,          block_bf16<O, 1>, block_bf16<O, 2>, block_bf16<O, 3>,
    block_bf16<O, 4>, block_bf16<O, 5>, block_bf16<O, 6>};

// float32 rows (T, K) rounded to bfloat16 as pairs in 32-bit words, (T, ceil(K / 2)), a zero partner for an
// odd K's last k. The rounding is c10::BFloat16's (nearest even, NaN to 0x7fc0), 16 values a vector; here
// rather than through x.to(bfloat16), whose dispatch costs more than the rounding for a decode step's rows.
std::vector<uint32_t> round_bf16_rows(const float* x, int64_t T, int64_t K) {
  const int64_t K2 = (K + 1) / 2;
  std::vector<uint32_t> pairs(T * K2, 0);
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), nan = _mm512_set1_epi32(0x7fc0);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * K;
    uint16_t* o = reinterpret_cast<uint16_t*>(pairs.data() + t * K2);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 v = _mm512_loadu_ps(row + k);
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i bias = _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(bits, 16), one));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), _mm512_cvtepi32_epi16(r));
    }
    for (; k < K; ++k) o[k] = c10::BFloat16(row[k]).x;
  }
  return pairs;
}
#endif

bool linear_is_native(at::ScalarType dtype) {
#ifdef BATCHLM_F32_VECTOR
  if (dtype == at::kFloat) return true;
#endif
#ifdef __AVX512BF16__
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2, "x must be a (T, K) tensor");
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || bf16, "x must be float32 or bfloat16, got ", x_in.scalar_type());
  TORCH_CHECK(packed.scalar_type() == x_in.scalar_type() && packed.is_contiguous() &&
                  packed.dim() == (bf16 ? 4 : 3) && packed.size(2) == kCols && (!bf16 || packed.size(3) == 2),
              "packed must be pack_linear(W) of W in x's dtype: contiguous (G, K, 64) float32 or (G, K2, 64, 2) "
              "bfloat16");
  TORCH_CHECK(!bf16 || linear_is_native(at::kBFloat16), "this build has no bfloat16 linear (needs AVX-512 BF16)");
  const int64_t T = x_in.size(0), K = x_in.size(1), G = packed.size(0);
  const int64_t row = bf16 ? (K + 1) / 2 : K;
  TORCH_CHECK(packed.size(1) == row, "x has ", K, " features, the packed weight ", bf16 ? 2 * packed.size(1) : packed.size(1));
  TORCH_CHECK(n > (G - 1) * kCols && n <= G * kCols, "n = ", n, " does not fit ", G, " groups of 64");
  auto out = at::empty({T, n}, x_in.options());
  if (T == 0) return out;
  if (K == 0) return out.zero_();
  if (!bf16) {
    const at::Tensor x = x_in.contiguous();
    run(x.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(), T, row, G, n, kF32Blocks);
    return out;
  }
#ifdef __AVX512BF16__
  at::Tensor x = x_in.contiguous();
  if (K % 2 != 0) x = at::constant_pad_nd(x, {0, 1});  // a zero partner for the last k
  run(reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()),
      reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()), out.data_ptr<at::BFloat16>(), T, row, G,
      n, kBf16Blocks<at::BFloat16>);
#endif
  return out;
}

at::Tensor linear_bf16(const at::Tensor& x_in, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a (T, K) float32 tensor");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(2) == kCols && packed.size(3) == 2,
              "packed must be pack_linear(W) of a bfloat16 W: contiguous (G, K2, 64, 2) bfloat16");
  TORCH_CHECK(linear_is_native(at::kBFloat16), "this build has no bfloat16 dot product (needs AVX-512 BF16)");
  const int64_t T = x_in.size(0), K = x_in.size(1), G = packed.size(0);
  TORCH_CHECK(packed.size(1) == (K + 1) / 2, "x has ", K, " features, the packed weight ", 2 * packed.size(1));
  TORCH_CHECK(n > (G - 1) * kCols && n <= G * kCols, "n = ", n, " does not fit ", G, " groups of 64");
  auto out = at::empty({T, n}, x_in.options());
  if (T == 0) return out;
  if (K == 0) return out.zero_();
#ifdef __AVX512BF16__
  const at::Tensor x = x_in.contiguous();
  const std::vector<uint32_t> pairs = round_bf16_rows(x.data_ptr<float>(), T, K);
  run(pairs.data(), reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()), out.data_ptr<float>(), T,
      packed.size(1), G, n, kBf16Blocks<float>);
#endif
  return out;
}

at::Tensor pack_linear(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "w must be an (N, K) float32 or bfloat16 tensor");
  const int64_t N = w.size(0), K = w.size(1), G = (N + kCols - 1) / kCols;
  if (w.scalar_type() == at::kFloat) {
    auto padded = at::zeros({G * kCols, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
    return padded.view({G, kCols, K}).transpose(1, 2).contiguous();  // (G, K, 64)
  }
  const int64_t K2 = (K + 1) / 2;
  auto padded = at::zeros({G * kCols, 2 * K2}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({G, kCols, K2, 2}).permute({0, 2, 1, 3}).contiguous();  // (G, K2, 64, 2)
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchlm, m) {
  m.def("linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("pack_linear(Tensor w) -> Tensor");
  m.def("linear_is_native(ScalarType dtype) -> bool", &linear_is_native);  // no tensors: one kernel for all keys
}

TORCH_LIBRARY_IMPL(batchlm, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("pack_linear", &pack_linear);
}
