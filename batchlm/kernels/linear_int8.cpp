// batchlm::linear_q8: y = x @ W^T with W's GGUF blocks (Q4_0, Q4_1, Q8_0) multiplied in integers against x
// quantized to int8 per row and block of 32: the fast tier. Not exact: each row's activations are rounded
// to 8 bits; the result is still batch-invariant (each row is quantized and summed on its own, in an
// order fixed by the code).
//
// Contract (checked at the top of linear_q8):
//   x        (T, K)                     float32 (made contiguous here); K a multiple of 32
//   packed   pack_linear_q8(raw, qtype) uint8 (G, K / 32, tile_bytes(qtype)), raw as for pack_linear_q. Tile
//            (g, b) holds output columns 64g .. 64g+63 (zero past N) at k = 32b .. 32b+31, each column's
//            bytes four k at a time, so one 32-bit lane of a vector is one column:
//              Q4_0  d[64] float16 | q[4][64][4]: byte i of (j, c): low nibble k = 8j + i, high k = 8j + 4 + i
//              Q4_1  d[64] | m[64] float16 | q as Q4_0
//              Q8_0  d[64] | q[8][64][4] int8: byte i of (j, c) at k = 4j + i
//   qtype    2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)
//   n        int, N: 64(G - 1) < N <= 64G
//   returns  (T, N) float32
// embedding_q8(packed, qtype, ids (T,) int64) -> (T, K) float32: rows of W dequantized (embedding_q's values).
//
// Per row and block b of 32 values: a = max |x|, dx = a / 127, xq = nearbyint(x * (127 / a)) (0 when a is
// 0), s = sum of xq. Per output column c with scales d (and m) of block b, in integers, exactly:
//   Q8_0 i = sum q xq;  Q4_0 i = sum q xq - 8 s;  Q4_1 i = sum q xq
// then, b ascending from acc = 0: acc = fma(float(i), d * dx, acc), and for Q4_1 acc = fma(m, dx * s, acc).
// The vector code and the scalar code do these operations, so they give the same bits.
//
// Why: an int8 multiply-add does 32 products (AVX2 vpmaddubsw) or 64 (AVX-512 VNNI vpdpbusd) where a
// float32 FMA does 8 or 16, and the Q4 nibbles are used as they are, with no conversion to float per
// weight. This is how llama.cpp multiplies its quantized files on CPUs.

#include <torch/library.h>

#include <vector>

#include "gguf_tiles.h"

namespace {

// rows per register block: AVX2, 4 x (float + int sums) + weights of 16 registers; VNNI, see kQ8Blocks
constexpr int64_t kQ8Rows = 4;
constexpr int64_t kAheadTiles = 8;  // tiles prefetched ahead of the one read, as in linear_quant.cpp

int64_t k_groups(int64_t qtype) { return qtype == kQ8_0 ? kBlock / 4 : kBlock / 8; }  // 32-bit rows of a tile

// x's rows quantized block by block (the header's xq, dx and s), for all T rows.
struct QuantizedRows {
  std::vector<int8_t> q;   // (T, K)
  std::vector<uint8_t> biased;  // (T, K) xq + 128, for Q8_0 under VNNI; empty otherwise
  std::vector<float> dx;   // (T, NB)
  std::vector<int32_t> s;  // (T, NB)
};

// One block of 32 values of x -> its xq (and xq + 128 if `biased`), dx and s: the header's operations, with
// vectors where there are (the maximum is the same in any order, x * inv is one float multiply, and the
// conversions round to nearest even as nearbyint does in the default rounding mode), so the same values.
inline void quantize_block(const float* xb, int8_t* q, uint8_t* biased, float* dx, int32_t* s) {
#if defined(__AVX512F__)
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const __m512 inv = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
  const __m128i b0 = _mm512_cvtepi32_epi8(i0), b1 = _mm512_cvtepi32_epi8(i1);  // |xq| <= 127: no truncation
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), b0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), b1);
  if (biased != nullptr) {  // xq + 128 as a byte: xq with its top bit flipped
    const __m128i top = _mm_set1_epi8(static_cast<char>(0x80));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(biased), _mm_xor_si128(b0, top));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(biased + 16), _mm_xor_si128(b1, top));
  }
  *s = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], m = _mm256_setzero_ps();
  for (int v = 0; v < 4; ++v) {
    x[v] = _mm256_loadu_ps(xb + 8 * v);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[v]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float a = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  const __m256 inv = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
  __m256i i[4];
  for (int v = 0; v < 4; ++v) i[v] = _mm256_cvtps_epi32(_mm256_mul_ps(x[v], inv));
  // packs interleave the 128-bit lanes: 32-bit groups come out as 0 2 4 6 1 3 5 7; the permute puts them back
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i b = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
  if (biased != nullptr) {  // xq + 128 as a byte: xq with its top bit flipped
    const __m256i top = _mm256_set1_epi8(static_cast<char>(0x80));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(biased), _mm256_xor_si256(b, top));
  }
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  *s = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
#else
  float a = 0.0f;
  for (int64_t k = 0; k < kBlock; ++k) a = std::max(a, std::fabs(xb[k]));
  const float inv = a > 0.0f ? 127.0f / a : 0.0f;
  int32_t sum = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
    q[k] = static_cast<int8_t>(v);
    if (biased != nullptr) biased[k] = static_cast<uint8_t>(v + 128);
    sum += v;
  }
  *s = sum;
#endif
  *dx = a / 127.0f;
}

QuantizedRows quantize_rows(const float* x, int64_t T, int64_t K, bool biased) {
  const int64_t NB = K / kBlock;
  QuantizedRows r{std::vector<int8_t>(T * K), std::vector<uint8_t>(biased ? T * K : 0), std::vector<float>(T * NB),
                  std::vector<int32_t>(T * NB)};
  at::parallel_for(0, T * NB, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      quantize_block(x + i * kBlock, r.q.data() + i * kBlock, biased ? r.biased.data() + i * kBlock : nullptr,
                     &r.dx[i], &r.s[i]);
  });
  return r;
}

template <int64_t Q>
using Q8Fn = void (*)(const QuantizedRows&, int64_t, int64_t, const uint8_t*, const uint8_t*, float*, int64_t,
                      int64_t);

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BATCHLM_Q8_VNNI 1
#define BATCHLM_Q8_VECTOR 1
// One tile's integer sums for V vectors of 16 columns from c0 and rows 0 .. R - 1, with AVX-512 VNNI's
// vpdpbusd: 16 lanes, each adding 4 products of unsigned by signed bytes into int32, with no saturation, so
// the sums are the header's integers exactly. Q4: the nibbles are the unsigned bytes and x the signed ones.
// Q8_0 has signed bytes on both sides, so x comes biased to unsigned (xb = xq + 128, QuantizedRows::biased)
// and 128 times each column's weight sum (one more vpdpbusd per vector, shared by all rows) is taken off.
template <int64_t Q, int R, int V>
inline void tile_sums_vnni(const uint8_t* q, int64_t c0, const uint8_t* const* xb, __m512i (&sums)[R][V]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) sums[r][v] = _mm512_setzero_si512();
  const auto row4 = [](const uint8_t* p) {
    int32_t x4;
    std::memcpy(&x4, p, 4);
    return _mm512_set1_epi32(x4);
  };
  if constexpr (Q == kQ8_0) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i wsum[V];
    for (int v = 0; v < V; ++v) wsum[v] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int64_t j = 0; j < kBlock / 4; ++j) {
      __m512i w[V];
      for (int v = 0; v < V; ++v) {
        w[v] = _mm512_loadu_si512(q + (j * kCols + c0 + 16 * v) * 4);
        wsum[v] = _mm512_dpbusd_epi32(wsum[v], ones, w[v]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i x = row4(xb[r] + 4 * j);
        for (int v = 0; v < V; ++v) sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], x, w[v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) sums[r][v] = _mm512_sub_epi32(sums[r][v], _mm512_slli_epi32(wsum[v], 7));
  } else {
    const __m512i low = _mm512_set1_epi8(15);
#pragma GCC unroll 1
    for (int64_t j = 0; j < kBlock / 8; ++j) {
      __m512i lo[V], hi[V];
      for (int v = 0; v < V; ++v) {
        const __m512i w = _mm512_loadu_si512(q + (j * kCols + c0 + 16 * v) * 4);
        lo[v] = _mm512_and_si512(w, low);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i x0 = row4(xb[r] + 8 * j), x1 = row4(xb[r] + 8 * j + 4);
        for (int v = 0; v < V; ++v)
          sums[r][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[r][v], lo[v], x0), hi[v], x1);
      }
    }
  }
}

// Rows 0 .. R - 1 (the chunk's quantized rows from `row`) times one group of NB tiles, 16V columns a pass;
// the scaling is block_q8's (and the scalar code's), vector for vector.
template <int64_t Q, int R, int V>
void block_q8_vnni(const QuantizedRows& x, int64_t row, int64_t K, const uint8_t* group, const uint8_t* next,
                   float* out, int64_t n, int64_t ncols) {
  constexpr int64_t kPass = 16 * V;
  const int64_t NB = K / kBlock, tb = tile_bytes(Q), passes = (ncols + kPass - 1) / kPass;
  const uint8_t* rows = Q == kQ8_0 ? x.biased.data() : reinterpret_cast<const uint8_t*>(x.q.data());
  for (int64_t c0 = 0; c0 < ncols; c0 += kPass) {
    __m512 acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t b = 0; b < NB; ++b) {
      const uint8_t* tile = group + b * tb;
      if (c0 == 0)  // the first pass streams the group: ask for the tiles ahead of it (a hint)
        for (int64_t line = 0; line < tb; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tile) + kAheadTiles * tb + line, _MM_HINT_T0);
      prefetch_tile_part(next, b, tb, c0 / kPass, passes);
      const uint8_t* xb[R];
      for (int r = 0; r < R; ++r) xb[r] = rows + (row + r) * K + b * kBlock;
      __m512i sums[R][V];
      tile_sums_vnni<Q, R, V>(tile + scales_bytes(Q), c0, xb, sums);
      __m512 d[V], m[V];
      for (int v = 0; v < V; ++v) {
        d[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 2 * (c0 + 16 * v))));
        if constexpr (Q == kQ4_1)
          m[v] = _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 2 * (kCols + c0 + 16 * v))));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (row + r) * NB + b;
        const __m512 dx = _mm512_set1_ps(x.dx[i]);
        for (int v = 0; v < V; ++v) {
          __m512i s = sums[r][v];
          if constexpr (Q == kQ4_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * x.s[i]));
          acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d[v], dx), acc[r][v]);
          if constexpr (Q == kQ4_1)
            acc[r][v] = _mm512_fmadd_ps(m[v], _mm512_set1_ps(x.dx[i] * static_cast<float>(x.s[i])), acc[r][v]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V && c0 + 16 * v < ncols; ++v) {
        const int64_t left = std::min<int64_t>(16, ncols - c0 - 16 * v);
        _mm512_mask_storeu_ps(out + r * n + c0 + 16 * v, static_cast<__mmask16>((1u << left) - 1), acc[r][v]);
      }
  }
}

// 1 or 2 rows: 64 columns a pass (the group streams once); 3 or 4: 32, so their int and float sums fit 32 registers
template <int64_t Q>
constexpr Q8Fn<Q> kQ8Blocks[kQ8Rows + 1] = {nullptr, block_q8_vnni<Q, 1, 4>, block_q8_vnni<Q, 2, 4>,
                                            block_q8_vnni<Q, 3, 2>, block_q8_vnni<Q, 4, 2>};
#elif defined(__AVX2__)
// One tile's integer sums for 8 columns c0 .. c0 + 7 and rows 0 .. R - 1, with the AVX2 byte multiply-add:
// vpmaddubsw multiplies unsigned weight bytes by signed activation bytes and adds adjacent pairs to int16,
// which cannot overflow here (Q4: 8 products of at most 15 x 127 per lane; Q8_0: 2 of 128 x 127).
#define BATCHLM_Q8_VECTOR 1
template <int64_t Q, int R>
inline void tile_sums(const uint8_t* q, int64_t c0, const int8_t* const* xq, __m256i (&sums)[R]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Q == kQ8_0) {
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    // NOTE: the k loops stay rolled: unrolled, GCC 12 runs every multiply of the tile first and keeps their
    // products on the stack, at half the speed.
#pragma GCC unroll 1
    for (int64_t j = 0; j < kBlock / 4; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (j * kCols + c0) * 4));
      const __m256i aw = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes (-128 -> 128)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq[r] + 4 * j, 4);
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(x4), w);  // x with w's sign (0 where w is 0)
        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
      }
    }
  } else {
    const __m256i low = _mm256_set1_epi8(15);
    __m256i half[R];
    for (int r = 0; r < R; ++r) half[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int64_t j = 0; j < kBlock / 8; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (j * kCols + c0) * 4));
      const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x0, x1;
        std::memcpy(&x0, xq[r] + 8 * j, 4);
        std::memcpy(&x1, xq[r] + 8 * j + 4, 4);
        half[r] = _mm256_add_epi16(half[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1))));
      }
    }
    for (int r = 0; r < R; ++r) sums[r] = _mm256_madd_epi16(half[r], ones);
  }
}

// Rows 0 .. R - 1 (the chunk's quantized rows from `row`) times one group of NB tiles, 8 columns at a time.
// `next`: the group this thread will likely run next (nullptr: none), prefetched a share per pass.
template <int64_t Q, int R>
void block_q8(const QuantizedRows& x, int64_t row, int64_t K, const uint8_t* group, const uint8_t* next, float* out,
              int64_t n, int64_t ncols) {
  const int64_t NB = K / kBlock, tb = tile_bytes(Q), passes = (ncols + 7) / 8;
  for (int64_t c0 = 0; c0 < ncols; c0 += 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < NB; ++b) {
      const uint8_t* tile = group + b * tb;
      if (c0 == 0)  // the first pass streams the group: ask for the tiles ahead of it (a hint)
        for (int64_t line = 0; line < tb; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tile) + kAheadTiles * tb + line, _MM_HINT_T0);
      prefetch_tile_part(next, b, tb, c0 / 8, passes);
      const int8_t* xq[R];
      for (int r = 0; r < R; ++r) xq[r] = x.q.data() + (row + r) * K + b * kBlock;
      __m256i sums[R];
      tile_sums<Q, R>(tile + scales_bytes(Q), c0, xq, sums);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 2 * c0)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t i = (row + r) * NB + b;
        __m256i s = sums[r];
        if constexpr (Q == kQ4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * x.s[i]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x.dx[i])), acc[r]);
        if constexpr (Q == kQ4_1) {
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 2 * (kCols + c0))));
          acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.dx[i] * static_cast<float>(x.s[i])), acc[r]);
        }
      }
    }
    alignas(32) float tmp[8];
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(tmp, acc[r]);
      std::copy(tmp, tmp + std::min<int64_t>(8, ncols - c0), out + r * n + c0);
    }
  }
}

template <int64_t Q>
constexpr Q8Fn<Q> kQ8Blocks[kQ8Rows + 1] = {nullptr, block_q8<Q, 1>, block_q8<Q, 2>, block_q8<Q, 3>,
                                            block_q8<Q, 4>};
#endif

// The header's sums with scalar code: one row, one column (the same operations as block_q8).
template <int64_t Q>
float column_q8(const QuantizedRows& x, int64_t row, int64_t K, const uint8_t* group, int64_t c) {
  const int64_t NB = K / kBlock, tb = tile_bytes(Q);
  float acc = 0.0f;
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* tile = group + b * tb;
    const uint8_t* q = tile + scales_bytes(Q);
    const int8_t* xq = x.q.data() + row * K + b * kBlock;
    int32_t i = 0;
    for (int64_t j = 0; j < k_groups(Q); ++j)
      for (int64_t l = 0; l < 4; ++l) {
        const uint8_t byte = q[(j * kCols + c) * 4 + l];
        if constexpr (Q == kQ8_0) {
          i += static_cast<int8_t>(byte) * xq[4 * j + l];
        } else {
          i += (byte & 15) * xq[8 * j + l] + (byte >> 4) * xq[8 * j + 4 + l];
        }
      }
    const int64_t at = row * NB + b;
    if constexpr (Q == kQ4_0) i -= 8 * x.s[at];
    acc = std::fma(static_cast<float>(i), half_value<kF16>(tile + 2 * c) * x.dx[at], acc);
    if constexpr (Q == kQ4_1)
      acc = std::fma(half_value<kF16>(tile + 2 * (kCols + c)), x.dx[at] * static_cast<float>(x.s[at]), acc);
  }
  return acc;
}

template <int64_t Q>
void run_q8(const QuantizedRows& x, const uint8_t* w, float* out, int64_t T, int64_t K, int64_t G, int64_t n) {
  const int64_t group_bytes = K / kBlock * tile_bytes(Q);
  for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
    const int64_t rows = std::min(kChunk, T - t0);
    batchlm::for_each_item(G, [] { return 0; }, [&](int, int64_t g, int64_t next) {
      const uint8_t* group = w + g * group_bytes;
      const int64_t ncols = std::min(kCols, n - g * kCols);
#ifdef BATCHLM_Q8_VECTOR
      for (int64_t r = 0; r < rows; r += kQ8Rows) {
        const int R = static_cast<int>(std::min<int64_t>(kQ8Rows, rows - r));
        // the next group is asked for once, by the chunk's last block of rows
        const uint8_t* ahead = next >= 0 && r + kQ8Rows >= rows ? w + next * group_bytes : nullptr;
        kQ8Blocks<Q>[R](x, t0 + r, K, group, ahead, out + (t0 + r) * n + g * kCols, n, ncols);
      }
#else
      for (int64_t r = t0; r < t0 + rows; ++r)
        for (int64_t c = 0; c < ncols; ++c) out[r * n + g * kCols + c] = column_q8<Q>(x, r, K, group, c);
#endif
    });
  }
}

void check_q8_type(int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0,
              "qtype must be 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0) for int8 activations, got ", qtype);
}

at::Tensor linear_q8(const at::Tensor& x_in, const at::Tensor& packed, int64_t qtype, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a (T, K) float32 tensor");
  check_q8_type(qtype);
  const int64_t T = x_in.size(0), K = x_in.size(1), G = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == tile_bytes(qtype),
              "packed must be pack_linear_q8(raw, ", qtype, "): contiguous uint8 (G, K / 32, ", tile_bytes(qtype), ")");
  TORCH_CHECK(K % kBlock == 0 && packed.size(1) * kBlock == K, "x has ", K, " features, the packed weight ",
              packed.size(1) * kBlock);
  TORCH_CHECK(n > (G - 1) * kCols && n <= G * kCols, "n = ", n, " does not fit ", G, " groups of 64");
  auto out = at::empty({T, n}, x_in.options());
  if (T == 0) return out;
  if (K == 0) return out.zero_();
  const at::Tensor x = x_in.contiguous();
#ifdef BATCHLM_Q8_VNNI
  const bool biased = qtype == kQ8_0;
#else
  const bool biased = false;
#endif
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), T, K, biased);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (qtype) {
    case kQ4_0: run_q8<kQ4_0>(xq, w, o, T, K, G, n); break;
    case kQ4_1: run_q8<kQ4_1>(xq, w, o, T, K, G, n); break;
    default: run_q8<kQ8_0>(xq, w, o, T, K, G, n); break;
  }
  return out;
}

at::Tensor pack_linear_q8(const at::Tensor& raw_in, int64_t qtype) {
  check_q8_type(qtype);
  const int64_t bb = block_bytes(qtype), tb = tile_bytes(qtype), sb = scales_bytes(qtype);
  TORCH_CHECK(raw_in.dim() == 2 && raw_in.scalar_type() == at::kByte && raw_in.size(1) % bb == 0,
              "raw must be a (N, K / 32 * ", bb, ") uint8 tensor: the rows of GGUF blocks");
  const at::Tensor raw = raw_in.contiguous();
  const int64_t N = raw.size(0), NB = raw.size(1) / bb, G = (N + kCols - 1) / kCols, scales = scale_bytes(qtype);
  auto packed = at::zeros({G, NB, tb}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t row = 0; row < N; ++row) {
    const int64_t g = row / kCols, c = row % kCols;
    for (int64_t b = 0; b < NB; ++b) {
      const uint8_t* block = src + (row * NB + b) * bb;
      uint8_t* tile = dst + (g * NB + b) * tb;
      for (int64_t i = 0; i < scales; i += 2) std::memcpy(tile + i * kCols + 2 * c, block + i, 2);  // d, m
      const uint8_t* qs = block + scales;
      uint8_t* q = tile + sb;
      for (int64_t j = 0; j < k_groups(qtype); ++j)
        for (int64_t l = 0; l < 4; ++l) {
          if (qtype == kQ8_0) {
            q[(j * kCols + c) * 4 + l] = qs[4 * j + l];
            continue;
          }
          // the file's byte e holds value e (low nibble) and value e + 16 (high nibble)
          const auto nibble = [&](int64_t k) { return k < 16 ? qs[k] & 15 : qs[k - 16] >> 4; };
          q[(j * kCols + c) * 4 + l] = static_cast<uint8_t>(nibble(8 * j + l) | nibble(8 * j + 4 + l) << 4);
        }
    }
  }
  return packed;
}

// The rows `ids` of W from pack_linear_q8's tiles, dequantized as embedding_q does (the same values).
at::Tensor embedding_q8(const at::Tensor& packed, int64_t qtype, const at::Tensor& ids_in) {
  check_q8_type(qtype);
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, "ids must be a (T,) int64 tensor");
  const int64_t tb = tile_bytes(qtype), NB = packed.size(1), G = packed.size(0), K = NB * kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 && packed.size(2) == tb,
              "packed must be pack_linear_q8(raw, ", qtype, ")");
  const at::Tensor ids = ids_in.contiguous();
  auto out = at::empty({ids.size(0), K}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < ids.size(0); ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < G * kCols, "id ", id[t], " is outside the ", G * kCols, " packed rows");
    const int64_t g = id[t] / kCols, c = id[t] % kCols;
    for (int64_t b = 0; b < NB; ++b) {
      const uint8_t* tile = w + (g * NB + b) * tb;
      const uint8_t* q = tile + scales_bytes(qtype);
      const float d = half_value<kF16>(tile + 2 * c);
      const float m = qtype == kQ4_1 ? half_value<kF16>(tile + 2 * (kCols + c)) : 0.0f;
      float* row = o + t * K + b * kBlock;
      for (int64_t j = 0; j < k_groups(qtype); ++j)
        for (int64_t l = 0; l < 4; ++l) {
          const uint8_t byte = q[(j * kCols + c) * 4 + l];
          if (qtype == kQ8_0) {
            row[4 * j + l] = static_cast<float>(static_cast<int8_t>(byte)) * d;
          } else if (qtype == kQ4_1) {
            row[8 * j + l] = std::fma(d, static_cast<float>(byte & 15), m);  // d * q exact: one rounding
            row[8 * j + 4 + l] = std::fma(d, static_cast<float>(byte >> 4), m);
          } else {
            row[8 * j + l] = d * static_cast<float>((byte & 15) - 8);
            row[8 * j + 4 + l] = d * static_cast<float>((byte >> 4) - 8);
          }
        }
    }
  }
  return out;
}

bool linear_q8_is_native() {
#ifdef BATCHLM_Q8_VECTOR
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchlm, m) {
  m.def("linear_q8(Tensor x, Tensor packed, int qtype, int n) -> Tensor");
  m.def("pack_linear_q8(Tensor raw, int qtype) -> Tensor");
  m.def("embedding_q8(Tensor packed, int qtype, Tensor ids) -> Tensor");
  m.def("linear_q8_is_native() -> bool", &linear_q8_is_native);
}

TORCH_LIBRARY_IMPL(batchlm, CPU, m) {
  m.impl("linear_q8", &linear_q8);
  m.impl("pack_linear_q8", &pack_linear_q8);
  m.impl("embedding_q8", &embedding_q8);
}
