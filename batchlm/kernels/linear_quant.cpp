// batchlm::linear_q: y = x @ W^T with W held in memory as the GGUF file stores it (Q4_0, Q4_1, Q8_0, F16
// or BF16), float32 x and y.
//
// Contract (checked at the top of linear_q):
//   x        (T, K)                    float32 (made contiguous here); K a multiple of 32
//   packed   pack_linear_q(raw, qtype) uint8 (G, K / 32, tile_bytes(qtype)): for W (N, K) stored as `raw`,
//            the file's bytes (N, K / 32 blocks of block_bytes(qtype); F16 and BF16 rows taken 32 values
//            at a time). Tile (g, b) holds output columns 64g .. 64g+63 (zero past N) at k = 32b .. 32b+31:
//              Q4_0  d[64] float16 | q[16][64]: byte j of column c, low nibble k = j, high nibble k = j + 16
//              Q4_1  d[64] | m[64] float16 | q[16][64] as Q4_0
//              Q8_0  d[64] | q[32][64] int8
//              F16, BF16  w[32][64] 16-bit floats
//   qtype    ggml's type number: 1 (F16), 2 (Q4_0), 3 (Q4_1), 8 (Q8_0), 30 (BF16)
//   n        int, N: 64(G - 1) < N <= 64G
//   returns  (T, N) float32
// embedding_q(packed, qtype, ids (T,) int64) -> (T, K) float32: the rows `ids` of W, dequantized.
//
// Exactness: a weight is dequantized as the gguf package (and so transformers) reads the file, in float32
// with one rounding per operation: Q4_0 d * (q - 8), Q4_1 d * q + m (the product rounded, then the sum),
// Q8_0 q * d; F16 and BF16 widen exactly. Up to kFusedMaxRows rows, a group's weights are dequantized in
// registers as they are multiplied; beyond, each group of 64 columns is dequantized into a float32 (K, 64)
// group in a per-thread scratch and multiplied by linear.cpp's float32 register blocks. Either way every
// output is the same fma chain over k as batchlm::linear over the dequantized W: bit-identical to it, and
// batch-invariant as it is.
//
// Why: a decode step streams every weight. Q4_1 is 5 bits a weight (Q4_0 4.5, Q8_0 8.5, F16/BF16 16)
// against float32's 32, so at small batches, where the step waits on memory, it reads a sixth of the
// bytes. A group is dequantized once per chunk of rows (kChunk), so at large batches the dequantization
// is spread over many rows of multiply-adds.

#include <c10/util/Half.h>
#include <torch/library.h>

#include <vector>

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
template <int64_t Q>
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
    i = k < kBlock / 2 ? _mm512_and_si512(i, _mm512_set1_epi32(15)) : _mm512_srli_epi32(i, 4);
    if constexpr (Q == kQ4_1) return _mm512_fmadd_ps(s.d[v], _mm512_cvtepi32_ps(i), s.m[v]);
    return _mm512_mul_ps(s.d[v], _mm512_cvtepi32_ps(_mm512_sub_epi32(i, _mm512_set1_epi32(8))));
  }
}

// Rows r .. r + R of x (row stride K) times one group of NB tiles, dequantized in registers as they are
// read: for a few rows this skips the scratch group's store and reload. The sums are block_f32's: acc =
// fma(x[k], w[k], acc) for k ascending.
template <int64_t Q, int R>
void block_q(const float* __restrict x, int64_t K, const uint8_t* __restrict group, float* __restrict out, int64_t n,
             int64_t ncols) {
  const int64_t NB = K / kBlock, tb = tile_bytes(Q);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* tile = group + b * tb;
    const TileScales s = tile_scales<Q>(tile);
    const uint8_t* q = tile + scales_bytes(Q);
    const float* xb = x + b * kBlock;
    for (int64_t k = 0; k < kBlock; ++k) {
      __m512 w[4];
      for (int v = 0; v < 4; ++v) w[v] = tile_weights<Q>(q, k, v, s);
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(xb[r * K + k]);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(xr, w[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_cols(out + r * n, acc[r], ncols);
}

constexpr int kFusedRows = 4;  // 16 accumulators + 8 scales + 4 weights + a broadcast: 29 of 32 registers
constexpr int64_t kFusedMaxRows = 8;  // a chunk of up to this many rows skips the scratch group

template <int64_t Q>
using FusedFn = void (*)(const float*, int64_t, const uint8_t*, float*, int64_t, int64_t);

template <int64_t Q>
constexpr FusedFn<Q> kFused[kFusedRows + 1] = {nullptr, block_q<Q, 1>, block_q<Q, 2>, block_q<Q, 3>,
                                                block_q<Q, 4>};
#endif

template <int64_t Q>
inline void dequantize_tile(const uint8_t* __restrict tile, float* __restrict s) {
#ifdef __AVX512F__
  const TileScales sc = tile_scales<Q>(tile);
  const uint8_t* q = tile + scales_bytes(Q);
  for (int64_t k = 0; k < kBlock; ++k)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(s + k * kCols + 16 * v, tile_weights<Q>(q, k, v, sc));
#else
  dequantize_tile_scalar<Q>(tile, s);
#endif
}

template <int64_t Q>
void dequantize_group(const uint8_t* group, int64_t NB, float* s) {
  const int64_t tile = tile_bytes(Q);
  for (int64_t b = 0; b < NB; ++b) dequantize_tile<Q>(group + b * tile, s + b * kBlock * kCols);
}

// Rows in chunks of kChunk; in each chunk the threads share out the groups, and each group is dequantized
// into the thread's scratch and multiplied by the chunk's rows kRows at a time (linear.cpp's `run`).
template <int64_t Q>
void run_q(const float* x, const uint8_t* w, float* out, int64_t T, int64_t K, int64_t G, int64_t n) {
  const int64_t NB = K / kBlock, group_bytes = NB * tile_bytes(Q);
  for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
    const int64_t rows = std::min(kChunk, T - t0);
    batchlm::for_each_item(G, [] { return 0; }, [&](int, int64_t g, int64_t) {
      // NOTE: kept by the thread across calls: a fresh buffer per call would be mapped and faulted in anew.
      const uint8_t* group = w + g * group_bytes;
      const int64_t ncols = std::min(kCols, n - g * kCols);
#ifdef __AVX512F__
      if (rows <= kFusedMaxRows) {
        for (int64_t r = 0; r < rows; r += kFusedRows) {
          const int R = static_cast<int>(std::min<int64_t>(kFusedRows, rows - r));
          kFused<Q>[R](x + (t0 + r) * K, K, group, out + (t0 + r) * n + g * kCols, n, ncols);
        }
        return;
      }
#endif
      thread_local std::vector<float> scratch;
      if (static_cast<int64_t>(scratch.size()) < K * kCols) scratch.resize(K * kCols);
      dequantize_group<Q>(group, NB, scratch.data());
      for (int64_t r = 0; r < rows; r += kRows) {
        const int R = static_cast<int>(std::min<int64_t>(kRows, rows - r));
        kF32Blocks[R](x + (t0 + r) * K, K, scratch.data(), Prefetch{nullptr, 0, 1}, out + (t0 + r) * n + g * kCols,
                      n, ncols);
      }
    });
  }
}

void check_packed(const at::Tensor& packed, int64_t qtype, int64_t K) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == tile_bytes(qtype),
              "packed must be pack_linear_q(raw, ", qtype, "): contiguous uint8 (G, K / 32, ", tile_bytes(qtype), ")");
  TORCH_CHECK(K % kBlock == 0 && packed.size(1) * kBlock == K, "x has ", K, " features, the packed weight ",
              packed.size(1) * kBlock);
}

at::Tensor linear_q(const at::Tensor& x_in, const at::Tensor& packed, int64_t qtype, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be a (T, K) float32 tensor");
  const int64_t T = x_in.size(0), K = x_in.size(1), G = packed.size(0);
  check_packed(packed, qtype, K);
  TORCH_CHECK(n > (G - 1) * kCols && n <= G * kCols, "n = ", n, " does not fit ", G, " groups of 64");
  auto out = at::empty({T, n}, x_in.options());
  if (T == 0) return out;
  if (K == 0) return out.zero_();
  const at::Tensor x = x_in.contiguous();
  const float* xp = x.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (qtype) {
    case kF16: run_q<kF16>(xp, w, o, T, K, G, n); break;
    case kQ4_0: run_q<kQ4_0>(xp, w, o, T, K, G, n); break;
    case kQ4_1: run_q<kQ4_1>(xp, w, o, T, K, G, n); break;
    case kQ8_0: run_q<kQ8_0>(xp, w, o, T, K, G, n); break;
    default: run_q<kBF16>(xp, w, o, T, K, G, n); break;
  }
  return out;
}

at::Tensor pack_linear_q(const at::Tensor& raw_in, int64_t qtype) {
  const int64_t bb = block_bytes(qtype), tb = tile_bytes(qtype), sb = scales_bytes(qtype);
  TORCH_CHECK(raw_in.dim() == 2 && raw_in.scalar_type() == at::kByte && raw_in.size(1) % bb == 0,
              "raw must be a (N, K / 32 * ", bb, ") uint8 tensor: the rows of GGUF blocks");
  const at::Tensor raw = raw_in.contiguous();
  const int64_t N = raw.size(0), NB = raw.size(1) / bb, G = (N + kCols - 1) / kCols;
  auto packed = at::zeros({G, NB, tb}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t scales = scale_bytes(qtype), eb = element_bytes(qtype), rows = payload_rows(qtype);
  for (int64_t row = 0; row < N; ++row) {
    const int64_t g = row / kCols, c = row % kCols;
    for (int64_t b = 0; b < NB; ++b) {
      const uint8_t* block = src + (row * NB + b) * bb;
      uint8_t* tile = dst + (g * NB + b) * tb;
      for (int64_t i = 0; i < scales; i += 2) std::memcpy(tile + i * kCols + 2 * c, block + i, 2);  // d, m
      for (int64_t j = 0; j < rows; ++j) std::memcpy(tile + sb + (j * kCols + c) * eb, block + scales + j * eb, eb);
    }
  }
  return packed;
}

at::Tensor embedding_q(const at::Tensor& packed, int64_t qtype, const at::Tensor& ids_in) {
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, "ids must be a (T,) int64 tensor");
  const int64_t K = packed.size(1) * kBlock, NB = packed.size(1), G = packed.size(0), tb = tile_bytes(qtype);
  check_packed(packed, qtype, K);
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
      float* row = o + t * K + b * kBlock;
      switch (qtype) {
        case kF16: dequantize_column<kF16>(tile, c, row); break;
        case kQ4_0: dequantize_column<kQ4_0>(tile, c, row); break;
        case kQ4_1: dequantize_column<kQ4_1>(tile, c, row); break;
        case kQ8_0: dequantize_column<kQ8_0>(tile, c, row); break;
        default: dequantize_column<kBF16>(tile, c, row); break;
      }
    }
  }
  return out;
}

bool linear_q_is_native() {
#ifdef BATCHLM_F32_VECTOR
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchlm, m) {
  m.def("linear_q(Tensor x, Tensor packed, int qtype, int n) -> Tensor");
  m.def("pack_linear_q(Tensor raw, int qtype) -> Tensor");
  m.def("embedding_q(Tensor packed, int qtype, Tensor ids) -> Tensor");
  m.def("linear_q_is_native() -> bool", &linear_q_is_native);
}

TORCH_LIBRARY_IMPL(batchlm, CPU, m) {
  m.impl("linear_q", &linear_q);
  m.impl("pack_linear_q", &pack_linear_q);
  m.impl("embedding_q", &embedding_q);
}
