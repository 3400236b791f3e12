// batchlm::paged_attention: every query token attends to its own sequence's keys, read in place from
// the paged KV cache, with a reduction order fixed by the code alone.
//
// Contract (checked at the top of paged_attention):
//   q            (T, H, hd)             float32 or bfloat16, contiguous
//   k_cache      (num_blocks, KVH, hd, bs)  the dtype of q, contiguous: keys TRANSPOSED within a block, so
//                                       the scores of a block's bs keys are bs-wide vector FMAs, no sums across lanes
//   v_cache      (num_blocks * bs, KVH, hd) the dtype of q, contiguous, slot-major (slot = block * bs + offset)
//   block_tables (S, max_blocks)        int64; key j of sequence s is in block table[s][j / bs], offset j % bs
//   seq_ids      (T,)                   int64: the block-table row of each token
//   key_lens     (T,)                   int64: the keys token t sees, positions 0 .. key_lens[t] - 1
//   returns      (T, H, hd)             the dtype of q
//
// Why a kernel: the result for one query depends only on that query, its sequence's keys and values,
// and its key count. No padding, no grouping with other sequences, no dependence on how many tokens
// share the call or on the thread that computes it: every sum runs in one fixed order (a score sums its
// hd products in order; softmax sums and maxima use 16 partial sums combined in a fixed tree; values are
// accumulated over keys in ascending position), with explicit fma so that vector and scalar code agree. A token's output is therefore
// bit-identical whether its sequence runs alone, in a batch of 64 or as part of a prefill chunk, which
// keeps greedy decoding batch-invariant even in bfloat16, where one last-bit difference is 0.4%.
// Math is float32 throughout; bfloat16 inputs are widened on load and the output is rounded once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "scalar_math.h"
#include "work_split.h"

namespace {

using batchlm::combine;
using batchlm::exp_nonpositive;
using batchlm::kLanes;
using batchlm::narrow;
using batchlm::widen;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n);

template <>
inline void load_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void load_row<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = widen(src[d]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n);

template <>
inline void store_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void store_row<at::BFloat16>(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = narrow<at::BFloat16>(src[d]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[d + l] * b[d + l];
  for (int l = 0; d < n; ++d, ++l) acc[l] += a[d] * b[d];
  return combine(acc);
}

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4
#endif
constexpr int64_t kPrefetchBlocks = PREFETCH_BLOCKS;

// Ask for the cache lines of n elements from p on, into L2 (a hint: no effect on results). Into L2 rather than
// L1: a sequence's values are asked for during its score pass and read after it, 48 KB at a 190-token
// context, more than L1 holds, so lines prefetched into L1 are evicted before they are read
// (`batchlm-bench attention` times a decode step's attention).
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 1);
}

template <typename T>
inline const float* widen(const T* src, float* scratch, int64_t n) {
  load_row(src, scratch, n);
  return scratch;
}

template <>
inline const float* widen<float>(const float* src, float*, int64_t) {
  return src;
}

// Scores of one block: s[h * stride + l] = q_h . key l, for the G heads and BS keys of a (hd, BS) transposed
// block. Each key row is loaded once for all G heads; every score still sums its hd products in order d = 0..
// BS > 0 and GG > 0 are the block size and heads per KV head known at compile time (accumulators in
// registers); 0 reads them from bs and G.
template <int BS, int GG>
inline void block_scores(const float* qf, const float* kt, float* s, int64_t G_, int64_t hd, int64_t bs,
                         int64_t stride) {
  const int64_t n = BS > 0 ? BS : bs;
  const int64_t G = GG > 0 ? GG : G_;
#ifdef __AVX512F__
  if constexpr (BS == kLanes && GG > 0) {
    __m512 acc[GG];
    for (int h = 0; h < GG; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; ++d) {
      const __m512 row = _mm512_loadu_ps(kt + d * BS);
      for (int h = 0; h < GG; ++h) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(qf[h * hd + d]), row, acc[h]);
    }
    for (int h = 0; h < GG; ++h) _mm512_storeu_ps(s + h * stride, acc[h]);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (BS == 16 && GG > 0 && GG <= 6) {  // AVX2: a block's 16 keys are two vectors of 8
    // NOTE: every loop over h unrolled: one left rolled keeps the accumulators in memory (GCC 12).
    __m256 acc[GG][2];
#pragma GCC unroll 8
    for (int h = 0; h < GG; ++h) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; ++d) {
      const __m256 lo = _mm256_loadu_ps(kt + d * BS), hi = _mm256_loadu_ps(kt + d * BS + 8);
#pragma GCC unroll 8
      for (int h = 0; h < GG; ++h) {
        const __m256 qd = _mm256_broadcast_ss(qf + h * hd + d);
        acc[h][0] = _mm256_fmadd_ps(qd, lo, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(qd, hi, acc[h][1]);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < GG; ++h) {
      _mm256_storeu_ps(s + h * stride, acc[h][0]);
      _mm256_storeu_ps(s + h * stride + 8, acc[h][1]);
    }
    return;
  }
#endif
  {
    for (int64_t h = 0; h < G; ++h) {
      float* out = s + h * stride;
      for (int64_t l = 0; l < n; ++l) out[l] = 0.0f;
      const float* qh = qf + h * hd;
      for (int64_t d = 0; d < hd; ++d) {
        const float qd = qh[d];
        const float* row = kt + d * n;
        for (int64_t l = 0; l < n; ++l) out[l] = std::fma(qd, row[l], out[l]);
      }
    }
  }
}

// acc[h] = sum over keys j < L, in ascending order, of p_h[j] * v_j, for the G query heads of KV head g
// (p_h = p + h * stride). Each value row is loaded (and widened) once for all G heads.
// HD > 0 and GG > 0 are the head size and heads per KV head known at compile time: the accumulators then
// live in registers.
template <int HD, int GG, typename T>
inline void weighted_values(const T* v_cache, const int64_t* table, const float* p, float* acc, float* scratch,
                            int64_t L, int64_t KVH, int64_t g, int64_t G_, int64_t hd_, int64_t bs, int64_t stride) {
  const int64_t hd = HD > 0 ? HD : hd_;
  const int64_t G = GG > 0 ? GG : G_;
#ifdef __AVX512F__
  if constexpr (HD > 0 && HD % kLanes == 0 && GG > 0) {
    constexpr int C = HD / kLanes;  // vectors per head
    __m512 a[GG][C];
    for (int h = 0; h < GG; ++h)
      for (int c = 0; c < C; ++c) a[h][c] = _mm512_setzero_ps();
    for (int64_t j0 = 0, b = 0; j0 < L; j0 += bs, ++b) {
      const T* block = v_cache + (table[b] * bs * KVH + g) * HD;
      const int64_t n = std::min(bs, L - j0);
      for (int64_t l = 0; l < n; ++l) {
        const float* v = widen(block + l * KVH * HD, scratch, HD);
        __m512 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + c * kLanes);
        for (int h = 0; h < GG; ++h) {
          const __m512 pj = _mm512_set1_ps(p[h * stride + j0 + l]);
          for (int c = 0; c < C; ++c) a[h][c] = _mm512_fmadd_ps(pj, vv[c], a[h][c]);
        }
      }
    }
    for (int h = 0; h < GG; ++h)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + h * HD + c * kLanes, a[h][c]);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (HD > 0 && HD % 16 == 0 && GG > 0 && GG <= 6) {
    // AVX2: G x HD accumulators do not fit 16 registers, so one pass over the keys per 16 dimensions (G x 2
    // accumulators), each reading one 64-byte line of every value row; a sum still runs over the keys in order.
    for (int64_t c0 = 0; c0 < HD; c0 += 16) {
      __m256 a[GG][2];
#pragma GCC unroll 8
      for (int h = 0; h < GG; ++h) a[h][0] = a[h][1] = _mm256_setzero_ps();
      for (int64_t j0 = 0, b = 0; j0 < L; j0 += bs, ++b) {
        const T* block = v_cache + (table[b] * bs * KVH + g) * HD;
        const int64_t n = std::min(bs, L - j0);
        for (int64_t l = 0; l < n; ++l) {
          const float* v = widen(block + l * KVH * HD + c0, scratch, 16);
          const __m256 lo = _mm256_loadu_ps(v), hi = _mm256_loadu_ps(v + 8);
#pragma GCC unroll 8
          for (int h = 0; h < GG; ++h) {
            const __m256 pj = _mm256_broadcast_ss(p + h * stride + j0 + l);
            a[h][0] = _mm256_fmadd_ps(pj, lo, a[h][0]);
            a[h][1] = _mm256_fmadd_ps(pj, hi, a[h][1]);
          }
        }
      }
#pragma GCC unroll 8
      for (int h = 0; h < GG; ++h) {
        _mm256_storeu_ps(acc + h * HD + c0, a[h][0]);
        _mm256_storeu_ps(acc + h * HD + c0 + 8, a[h][1]);
      }
    }
    return;
  }
#endif
  {
    for (int64_t i = 0; i < G * hd; ++i) acc[i] = 0.0f;
    for (int64_t j0 = 0, b = 0; j0 < L; j0 += bs, ++b) {
      const T* block = v_cache + (table[b] * bs * KVH + g) * hd;
      const int64_t n = std::min(bs, L - j0);
      for (int64_t l = 0; l < n; ++l) {
        const float* v = widen(block + l * KVH * hd, scratch, hd);
        for (int64_t h = 0; h < G; ++h) {
          const float pj = p[h * stride + j0 + l];
          float* a = acc + h * hd;
          for (int64_t d = 0; d < hd; ++d) a[d] = std::fma(pj, v[d], a[d]);
        }
      }
    }
  }
}

template <typename T, int BS, int HD, int GG>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* seq_ids,
            const int64_t* key_lens, T* out, int64_t T_, int64_t H, int64_t KVH, int64_t hd, int64_t max_blocks,
            int64_t bs, float scale, int64_t max_len) {
  const int64_t G = H / KVH;
  const int64_t stride = (max_len + bs - 1) / bs * bs;  // scores per head, whole blocks
  struct Scratch {  // one per thread; `expected` is the item whose first keys the thread prefetched last
    std::vector<float> qf, kscratch, vrow, acc, scores, inv_sum;
    int64_t expected = -1;
  };
  const auto first_keys = [&](int64_t item) {
    const int64_t* table = tables + seq_ids[item / KVH] * max_blocks;
    const int64_t nb = std::min<int64_t>(kPrefetchBlocks, (key_lens[item / KVH] + bs - 1) / bs);
    for (int64_t b = 0; b < nb; ++b) prefetch(k_cache + (table[b] * KVH + item % KVH) * hd * bs, hd * bs);
  };
  batchlm::for_each_item(
      T_ * KVH,
      [&] { return Scratch{std::vector<float>(G * hd), std::vector<float>(hd * bs), std::vector<float>(hd),
                           std::vector<float>(G * hd), std::vector<float>(G * stride), std::vector<float>(G)}; },
      [&](Scratch& sc, int64_t item, int64_t next) {
      std::vector<float>&qf = sc.qf, &kscratch = sc.kscratch, &vrow = sc.vrow, &acc = sc.acc, &scores = sc.scores,
                        &inv_sum = sc.inv_sum;
      const int64_t t = item / KVH, g = item % KVH;
      const int64_t* table = tables + seq_ids[t] * max_blocks;
      const int64_t L = key_lens[t];
      for (int64_t h = 0; h < G; ++h) {
        load_row(q + (t * H + g * G + h) * hd, qf.data() + h * hd, hd);
        for (int64_t d = 0; d < hd; ++d) qf[h * hd + d] *= scale;
      }
      const int64_t nblk = (L + bs - 1) / bs;
      // the first keys of the item this thread will likely run next (and of this one, if it was not that)
      if (item != sc.expected) first_keys(item);
      if (next >= 0) first_keys(next);
      sc.expected = next;
      for (int64_t b = 0; b < nblk; ++b) {  // NOTE: lanes past L in the last block are computed, never read
        // The blocks sit anywhere in a cache far larger than the CPU's caches, and a model step streams all
        // weights between two calls: ask for the keys PREFETCH_BLOCKS blocks ahead and this block's values
        // (read after the softmax) now, so that the loads below and in weighted_values find them cached.
        if (b + kPrefetchBlocks < nblk)
          prefetch(k_cache + (table[b + kPrefetchBlocks] * KVH + g) * hd * bs, hd * bs);
        for (int64_t l = 0, n = std::min(bs, L - b * bs); l < n; ++l)
          prefetch(v_cache + ((table[b] * bs + l) * KVH + g) * hd, hd);
        const float* kt = widen(k_cache + (table[b] * KVH + g) * hd * bs, kscratch.data(), hd * bs);
        block_scores<BS, GG>(qf.data(), kt, scores.data() + b * bs, G, hd, bs, stride);
      }
      for (int64_t h = 0; h < G; ++h) {
        float* s = scores.data() + h * stride;
        float top[kLanes];
        std::fill(top, top + kLanes, -INFINITY);
        int64_t j = 0;
        for (; j + kLanes <= L; j += kLanes)
          for (int l = 0; l < kLanes; ++l) top[l] = std::max(top[l], s[j + l]);
        for (int l = 0; j < L; ++j, ++l) top[l] = std::max(top[l], s[j]);
        float m = top[0];
        for (int l = 1; l < kLanes; ++l) m = std::max(m, top[l]);
        for (j = 0; j < L; ++j) s[j] = exp_nonpositive(s[j] - m);
        float sums[kLanes] = {0};
        for (j = 0; j + kLanes <= L; j += kLanes)
          for (int l = 0; l < kLanes; ++l) sums[l] += s[j + l];
        for (int l = 0; j < L; ++j, ++l) sums[l] += s[j];
        inv_sum[h] = 1.0f / combine(sums);
      }
      weighted_values<HD, GG>(v_cache, table, scores.data(), acc.data(), vrow.data(), L, KVH, g, G, hd, bs, stride);
      for (int64_t h = 0; h < G; ++h) {
        float* a = acc.data() + h * hd;
        for (int64_t d = 0; d < hd; ++d) a[d] *= inv_sum[h];
        store_row(a, out + (t * H + g * G + h) * hd, hd);
      }
      });
}

template <typename T>
void dispatch(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* seqs, const int64_t* lens,
              T* out, int64_t T_, int64_t H, int64_t KVH, int64_t hd, int64_t max_blocks, int64_t bs, float scale,
              int64_t max_len) {
  // NOTE: the specializations compute exactly what the generic code does (same operations, same order);
  // they only let the compiler keep the scores and value accumulators of a KV head's G query heads in
  // registers (G = 3: SmolLM2-135M's 9 query heads over 3 KV heads; G = 4: the tiny test model's 8 over 2).
  if (bs == 16 && hd == 64 && H == 3 * KVH)
    attend<T, 16, 64, 3>(q, k, v, tables, seqs, lens, out, T_, H, KVH, hd, max_blocks, bs, scale, max_len);
  else if (bs == 16 && hd == 64 && H == 4 * KVH)
    attend<T, 16, 64, 4>(q, k, v, tables, seqs, lens, out, T_, H, KVH, hd, max_blocks, bs, scale, max_len);
  else if (bs == 16)
    attend<T, 16, 0, 0>(q, k, v, tables, seqs, lens, out, T_, H, KVH, hd, max_blocks, bs, scale, max_len);
  else
    attend<T, 0, 0, 0>(q, k, v, tables, seqs, lens, out, T_, H, KVH, hd, max_blocks, bs, scale, max_len);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_ids, const at::Tensor& key_lens,
                           int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 3,
              "q (T, H, hd), k_cache (num_blocks, KVH, hd, bs) and v_cache (num_slots, KVH, hd) expected");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, k_cache, v_cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q, k_cache, v_cache must share a dtype");
  const int64_t T_ = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == hd && k_cache.size(3) == block_size && v_cache.size(1) == KVH &&
                  v_cache.size(2) == hd && v_cache.size(0) == k_cache.size(0) * block_size && H % KVH == 0,
              "q, k_cache and v_cache shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be a contiguous (S, max_blocks) int64 tensor");
  TORCH_CHECK(seq_ids.scalar_type() == at::kLong && key_lens.scalar_type() == at::kLong &&
                  seq_ids.numel() == T_ && key_lens.numel() == T_ && seq_ids.is_contiguous() &&
                  key_lens.is_contiguous(),
              "seq_ids and key_lens must be contiguous int64 tensors of T elements");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  auto out = at::empty_like(q);
  if (T_ == 0) return out;
  const int64_t* lens = key_lens.data_ptr<int64_t>();
  const int64_t* seqs = seq_ids.data_ptr<int64_t>();
  const int64_t S = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(0);
  int64_t max_len = 1;
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(lens[t] >= 1 && lens[t] <= max_blocks * block_size, "key_lens[", t, "] out of range");
    TORCH_CHECK(seqs[t] >= 0 && seqs[t] < S, "seq_ids[", t, "] out of range");
    const int64_t* table = block_tables.data_ptr<int64_t>() + seqs[t] * max_blocks;
    for (int64_t b = 0; b * block_size < lens[t]; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block_tables entry out of range");
    max_len = std::max(max_len, lens[t]);
  }
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    dispatch<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  block_tables.data_ptr<int64_t>(), seqs, lens, out.data_ptr<float>(), T_, H, KVH, hd,
                  max_blocks, block_size, s, max_len);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                         v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int64_t>(), seqs, lens,
                         out.data_ptr<at::BFloat16>(), T_, H, KVH, hd, max_blocks, block_size, s, max_len);
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(batchlm, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_ids, "
        "Tensor key_lens, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchlm, CPU, m) { m.impl("paged_attention", &paged_attention); }
