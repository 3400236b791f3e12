// GGUF blocks in tiles of 64 columns x 32 k (linear_quant.cpp's layout; its header states the contract and
// the exactness of each type's dequantization): the types' sizes, and a tile or one of its columns
// dequantized to float32, with AVX-512 in registers or with scalar code, the same bits either way.
#pragma once

#include <c10/util/Half.h>

#include <type_traits>

#include "linear_blocks.h"

// NOTE: GCC 12 reports _mm512_cvtepi32_ps's own `_mm512_undefined_ps()` pass-through (an unused operand of
// the unmasked form) as maybe uninitialized once it is inlined into the Q8_0 loops.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {

constexpr int64_t kBlock = 32;  // weights per GGUF block along k

enum QType : int64_t { kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kBF16 = 30 };

int64_t scale_bytes(int64_t qtype) {  // the float16 scales that open one block of 32 in the file: d (and m)
  switch (qtype) {
    case kQ4_0: case kQ8_0: return 2;
    case kQ4_1: return 4;
    case kF16: case kBF16: return 0;
    default: TORCH_CHECK(false, "qtype must be 1 (F16), 2 (Q4_0), 3 (Q4_1), 8 (Q8_0) or 30 (BF16), got ", qtype);
  }
}

// One payload row of a tile holds one element per column: a byte of two nibbles (Q4: k = j and j + 16), a
// signed byte (Q8_0) or a 16-bit float (F16, BF16), at k = j.
int64_t element_bytes(int64_t qtype) { return qtype == kF16 || qtype == kBF16 ? 2 : 1; }
int64_t payload_rows(int64_t qtype) { return qtype == kQ4_0 || qtype == kQ4_1 ? kBlock / 2 : kBlock; }
int64_t block_bytes(int64_t qtype) { return scale_bytes(qtype) + payload_rows(qtype) * element_bytes(qtype); }
int64_t scales_bytes(int64_t qtype) { return scale_bytes(qtype) * kCols; }  // a tile's d[64] (and m[64])
int64_t tile_bytes(int64_t qtype) { return block_bytes(qtype) * kCols; }

#if defined(__AVX2__) || defined(__AVX512F__)
// Share `part` of `parts` of the lines of tile b of `group` (nullptr: nothing), asked into L2. The AVX2
// forms pass over a group several times, a few columns at a time: only the first pass reads memory, and the
// others compute from cache while no load is outstanding. Asking for the next group's lines, a share per
// tile visited, keeps memory streaming through them: without it, a decode step's linears drew well below
// the bandwidth the CPU gives two threads.
inline void prefetch_tile_part(const uint8_t* group, int64_t b, int64_t tb, int64_t part, int64_t parts) {
  if (group == nullptr) return;
  const char* tile = reinterpret_cast<const char*>(group) + b * tb;
  const int64_t lines = (tb + 63) / 64;
  for (int64_t l = lines * part / parts; l < lines * (part + 1) / parts; ++l) _mm_prefetch(tile + 64 * l, _MM_HINT_T1);
}
#endif

inline void halves_to_floats(const uint8_t* h, float* f) {  // 64 float16 -> float32 (exact)
#ifdef __F16C__
  for (int i = 0; i < kCols; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * i))));
#else
  for (int i = 0; i < kCols; ++i) {
    uint16_t v;
    std::memcpy(&v, h + 2 * i, 2);
    f[i] = c10::detail::fp16_ieee_to_fp32_value(v);
  }
#endif
}

// A 16-bit float of the file as float32 (exact): IEEE half (F16) or bfloat16 (BF16).
template <int64_t Q>
inline float half_value(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  if constexpr (Q == kF16) return c10::detail::fp16_ieee_to_fp32_value(h);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One tile -> s (32, 64) float32, row k = the 64 columns' weights at k.
template <int64_t Q>
inline void dequantize_tile_scalar(const uint8_t* __restrict tile, float* __restrict s) {
  if constexpr (Q == kF16 || Q == kBF16) {
    for (int64_t k = 0; k < kBlock; ++k)
      for (int64_t c = 0; c < kCols; ++c) s[k * kCols + c] = half_value<Q>(tile + 2 * (k * kCols + c));
    return;
  }
  alignas(64) float d[kCols], m[kCols];
  halves_to_floats(tile, d);
  if constexpr (Q == kQ4_1) halves_to_floats(tile + 2 * kCols, m);
  const uint8_t* q = tile + scales_bytes(Q);
  if constexpr (Q == kQ8_0) {
    for (int64_t k = 0; k < kBlock; ++k)
      for (int64_t c = 0; c < kCols; ++c)
        s[k * kCols + c] = static_cast<float>(static_cast<int8_t>(q[k * kCols + c])) * d[c];
    return;
  }
  for (int64_t j = 0; j < kBlock / 2; ++j) {
    float* lo = s + j * kCols;
    float* hi = s + (j + kBlock / 2) * kCols;
    for (int64_t c = 0; c < kCols; ++c) {
      const int32_t byte = q[j * kCols + c];
      if constexpr (Q == kQ4_1) {
        lo[c] = d[c] * static_cast<float>(byte & 15) + m[c];
        hi[c] = d[c] * static_cast<float>(byte >> 4) + m[c];
      } else {
        lo[c] = d[c] * static_cast<float>((byte & 15) - 8);
        hi[c] = d[c] * static_cast<float>((byte >> 4) - 8);
      }
    }
  }
}

// Column c of one tile -> its 32 weights, with dequantize_tile's operations (so the same bits).
template <int64_t Q>
inline void dequantize_column(const uint8_t* tile, int64_t c, float* out) {
  if constexpr (Q == kF16 || Q == kBF16) {
    for (int64_t k = 0; k < kBlock; ++k) out[k] = half_value<Q>(tile + 2 * (k * kCols + c));
    return;
  }
  uint16_t h[2];
  std::memcpy(&h[0], tile + 2 * c, 2);
  const float d = c10::detail::fp16_ieee_to_fp32_value(h[0]);
  const uint8_t* q = tile + scales_bytes(Q);
  if constexpr (Q == kQ8_0) {
    for (int64_t k = 0; k < kBlock; ++k) out[k] = static_cast<float>(static_cast<int8_t>(q[k * kCols + c])) * d;
    return;
  }
  float m = 0.0f;
  if constexpr (Q == kQ4_1) {
    std::memcpy(&h[1], tile + 2 * kCols + 2 * c, 2);
    m = c10::detail::fp16_ieee_to_fp32_value(h[1]);
  }
  for (int64_t j = 0; j < kBlock / 2; ++j) {
    const int32_t byte = q[j * kCols + c];
    if constexpr (Q == kQ4_1) {
      out[j] = d * static_cast<float>(byte & 15) + m;
      out[j + kBlock / 2] = d * static_cast<float>(byte >> 4) + m;
    } else {
      out[j] = d * static_cast<float>((byte & 15) - 8);
      out[j + kBlock / 2] = d * static_cast<float>((byte >> 4) - 8);
    }
  }
}

// body(hi, k) for k = 0 .. 31 in order, hi (a std::bool_constant) telling the Q4 types' high nibbles
// (k >= 16) at compile time, so no iteration picks between the two.
template <int64_t Q, typename Body>
inline void for_each_k(Body body) {
  constexpr bool kNibbles = Q == kQ4_0 || Q == kQ4_1;
  for (int64_t k = 0; k < (kNibbles ? kBlock / 2 : kBlock); ++k) body(std::false_type{}, k);
  if constexpr (kNibbles)
    for (int64_t k = kBlock / 2; k < kBlock; ++k) body(std::true_type{}, k);
}

#ifdef __AVX512F__
// A tile's d (and m) as float32 vectors of 16 columns each (exact conversions).
struct TileScales {
  __m512 d[4], m[4];
};

template <int64_t Q>
inline TileScales tile_scales(const uint8_t* tile) {
  TileScales s;
  if constexpr (Q == kF16 || Q == kBF16) return s;  // no scales
  for (int v = 0; v < 4; ++v) {
    s.d[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * v)));
    if constexpr (Q == kQ4_1)
      s.m[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 2 * kCols + 32 * v)));
  }
  return s;
}

// Columns 16v .. 16v+15 of a tile's q at k (< 32), dequantized. d * q is exact in float32 (an 11-bit
// significand times one of at most 8 bits), so Q4_1's fma(d, q, m) rounds once, as d * q + m does.
template <int64_t Q, bool Hi>
inline __m512 tile_weights(const uint8_t* q, int64_t k, int v, const TileScales& s) {
  if constexpr (Q == kF16 || Q == kBF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * (k * kCols + 16 * v)));
    if constexpr (Q == kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (Q == kQ8_0) {
    const __m512i i = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * kCols + 16 * v)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(i), s.d[v]);
  } else {
    __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (k & 15) * kCols + 16 * v)));
    i = Hi ? _mm512_srli_epi32(i, 4) : _mm512_and_si512(i, _mm512_set1_epi32(15));
    if constexpr (Q == kQ4_1) return _mm512_fmadd_ps(s.d[v], _mm512_cvtepi32_ps(i), s.m[v]);
    return _mm512_mul_ps(s.d[v], _mm512_cvtepi32_ps(_mm512_sub_epi32(i, _mm512_set1_epi32(8))));
  }
}

#elif defined(BATCHLM_F32_VECTOR) && defined(__F16C__)
#define BATCHLM_Q_AVX2 1
// AVX2: 8 columns a vector, a tile read a quarter (16 columns, two vectors) at a time. The operations and
// so the bits are the AVX-512 path's.
// The scales d (and m) of columns c0 .. c0 + 8V - 1 of a tile, V vectors of 8.
template <int V>
struct PassScales {
  __m256 d[V], m[V];
};

template <int64_t Q, int V = 2>
inline PassScales<V> pass_scales(const uint8_t* tile, int64_t c0) {
  PassScales<V> s;
  if constexpr (Q == kF16 || Q == kBF16) return s;  // no scales
  for (int v = 0; v < V; ++v) {
    s.d[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 2 * (c0 + 8 * v))));
    if constexpr (Q == kQ4_1)
      s.m[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 2 * (kCols + c0 + 8 * v))));
  }
  return s;
}

// Columns c .. c + 7 of a tile's q at k (< 32), dequantized with scales d (and m) of those columns.
template <int64_t Q, bool Hi>
inline __m256 tile_weights8(const uint8_t* q, int64_t k, int64_t c, __m256 d, __m256 m) {
  if constexpr (Q == kF16 || Q == kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * (k * kCols + c)));
    if constexpr (Q == kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (Q == kQ8_0) {
    const __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * kCols + c)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(i), d);
  } else {
    __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (k & 15) * kCols + c)));
    i = Hi ? _mm256_srli_epi32(i, 4) : _mm256_and_si256(i, _mm256_set1_epi32(15));
    if constexpr (Q == kQ4_1) return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(i), m);
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(i, _mm256_set1_epi32(8))));
  }
}
#endif

template <int64_t Q>
inline void dequantize_tile(const uint8_t* __restrict tile, float* __restrict s) {
#ifdef __AVX512F__
  const TileScales sc = tile_scales<Q>(tile);
  const uint8_t* q = tile + scales_bytes(Q);
  for_each_k<Q>([&](auto hi, int64_t k) {
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(s + k * kCols + 16 * v, tile_weights<Q, hi>(q, k, v, sc));
  });
#elif defined(BATCHLM_Q_AVX2)
  const uint8_t* q = tile + scales_bytes(Q);
  for (int64_t c0 = 0; c0 < kCols; c0 += 16) {
    const PassScales<2> sc = pass_scales<Q>(tile, c0);
    for_each_k<Q>([&](auto hi, int64_t k) {
      for (int v = 0; v < 2; ++v)
        _mm256_storeu_ps(s + k * kCols + c0 + 8 * v, tile_weights8<Q, hi>(q, k, c0 + 8 * v, sc.d[v], sc.m[v]));
    });
  }
#else
  dequantize_tile_scalar<Q>(tile, s);
#endif
}

template <int64_t Q>
void dequantize_group(const uint8_t* group, int64_t NB, float* s) {
  const int64_t tile = tile_bytes(Q);
  for (int64_t b = 0; b < NB; ++b) dequantize_tile<Q>(group + b * tile, s + b * kBlock * kCols);
}

}  // namespace
