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
// Exactness: a weight is dequantized as the gguf package (and so transformers) reads the file, in float32 with one
// rounding per operation: Q4_0 d * (q - 8), Q4_1 d * q + m (the product rounded, then the sum), Q8_0 q * d; F16 and
// BF16 widen exactly. Up to kFusedMaxRows rows (8 with AVX-512, 4 with AVX2), a group's weights are dequantized in
// registers as they are multiplied (block_q); beyond, each tile is dequantized once into an L1 buffer and multiplied by
// every row of the chunk, 6 rows at a time, their sums carried from tile to tile (tile_block). Either way every output
// is the same fma chain over k as batchlm::linear over the dequantized W (acc = fma(x[k], w[k], acc) from zero, k
// ascending): bit-identical to it, and batch-invariant as it is. AVX2 (with FMA and F16C) runs both forms 16 columns at
// a time (block_q: 32 for a single row). Without vector code, a group is dequantized whole into a scratch and
// multiplied by linear.cpp's blocks (the same chain).
//
// Why: a decode step streams every weight. Q4_1 is 5 bits a weight (Q4_0 4.5, Q8_0 8.5, F16/BF16 16)
// against float32's 32, so at small batches, where the step waits on memory, it reads a sixth of the
// bytes. Dequantizing costs about as much as a row's multiply-adds, so past a few rows it is done once
// per tile and chunk (kChunk rows) and spread over all of them.

#include <torch/library.h>

#include <vector>

#include "gguf_tiles.h"

namespace {

// Tiles ahead of the one being read whose lines are prefetched: a thread's tiles are one sequential stream,
// which the hardware prefetcher alone follows at about half the bandwidth two threads can draw.
constexpr int64_t kPrefetchTiles = 8;

#ifdef __AVX512F__
// Rows r .. r + R of x (row stride K) times one group of NB tiles, dequantized in registers as they are
// read: for a few rows this skips the scratch group's store and reload. The sums are block_f32's: acc =
// fma(x[k], w[k], acc) for k ascending. Up to 4 rows, one pass over the group's 64 columns (4 x 4 sums and
// 8 scales in registers); 5 to 8 rows, two passes of 32 columns (8 x 2 sums), so that each weight is
// still dequantized once for all the rows, the second pass reading the group from cache. The first
// pass's own prefetch ahead keeps memory streaming, and `next` is not needed.
template <int64_t Q, int R, int V = (R <= 4 ? 4 : 2)>
void block_q(const float* __restrict x, int64_t K, const uint8_t* __restrict group, const uint8_t* /*next*/,
             float* __restrict out, int64_t n, int64_t ncols) {
  const int64_t NB = K / kBlock, tb = tile_bytes(Q);
  for (int h = 0; h < 4 / V && 16 * V * h < ncols; ++h) {
    __m512 acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < NB; ++b) {
      const uint8_t* tile = group + b * tb;
      const TileScales s = tile_scales<Q>(tile);
      const uint8_t* q = tile + scales_bytes(Q);
      const float* xb = x + b * kBlock;
      const char* ahead = reinterpret_cast<const char*>(tile) + kPrefetchTiles * tb;
      for_each_k<Q>([&](auto hi, int64_t k) {
        if (h == 0 && 64 * k < tb) _mm_prefetch(ahead + 64 * k, _MM_HINT_T0);
        __m512 w[V];
        for (int j = 0; j < V; ++j) w[j] = tile_weights<Q, hi>(q, k, V * h + j, s);
        for (int r = 0; r < R; ++r) {
          const __m512 xr = _mm512_set1_ps(xb[r * K + k]);
          for (int j = 0; j < V; ++j) acc[r][j] = _mm512_fmadd_ps(xr, w[j], acc[r][j]);
        }
      });
    }
    for (int r = 0; r < R; ++r) store_cols<V>(out + r * n + 16 * V * h, acc[r], ncols - 16 * V * h);
  }
}

// Rows r .. r + R of x (from k = 32b; row stride K) times one dequantized tile s (32, 64), carrying each
// row's 64 sums in `part` (R x 64: not read for the first tile, stored after each): the same fma chain
// over k as block_f32, a tile at a time, with the tile and the sums in L1.
template <int R>
void tile_block(const float* __restrict x, int64_t K, const float* __restrict s, float* __restrict part, bool first) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * kCols + 16 * v);
  for (int64_t k = 0; k < kBlock; ++k) {
    const float* wk = s + k * kCols;
    const __m512 w0 = _mm512_load_ps(wk), w1 = _mm512_load_ps(wk + 16), w2 = _mm512_load_ps(wk + 32),
                 w3 = _mm512_load_ps(wk + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(part + r * kCols + 16 * v, acc[r][v]);
}

#elif defined(BATCHLM_Q_AVX2)
// AVX2 forms of the two blocks above: the same chains, 8V columns at a time, so that R x V sums, their
// scales, the weight vectors and a broadcast fit 16 registers. One row takes 32 columns a pass (V = 4):
// each sum is one chain of FMAs over k, so with 16 columns only two chains are in flight and the step
// waits on the FMA latency; more rows give more chains with 16 columns (V = 2).
// `next`: the group this thread will likely run next (nullptr: none), prefetched a share per pass.
template <int64_t Q, int R, int V = (R == 1 ? 4 : 2)>
void block_q(const float* __restrict x, int64_t K, const uint8_t* __restrict group, const uint8_t* next,
             float* __restrict out, int64_t n, int64_t ncols) {
  constexpr int64_t kPassCols = 8 * V;
  const int64_t NB = K / kBlock, tb = tile_bytes(Q), passes = (ncols + kPassCols - 1) / kPassCols;
  for (int64_t c0 = 0; c0 < ncols; c0 += kPassCols) {
    __m256 acc[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t b = 0; b < NB; ++b) {
      const uint8_t* tile = group + b * tb;
      const PassScales<V> s = pass_scales<Q, V>(tile, c0);
      const uint8_t* q = tile + scales_bytes(Q);
      const float* xb = x + b * kBlock;
      const char* ahead = reinterpret_cast<const char*>(tile) + kPrefetchTiles * tb;
      prefetch_tile_part(next, b, tb, c0 / kPassCols, passes);
      for_each_k<Q>([&](auto hi, int64_t k) {
        if (c0 == 0 && 64 * k < tb) _mm_prefetch(ahead + 64 * k, _MM_HINT_T0);  // the first pass's
        __m256 w[V];
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) w[v] = tile_weights8<Q, hi>(q, k, c0 + 8 * v, s.d[v], s.m[v]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 xr = _mm256_broadcast_ss(xb + r * K + k);
#pragma GCC unroll 4
          for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xr, w[v], acc[r][v]);
        }
      });
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < V; v += 2)
        if (const int64_t left = ncols - c0 - 8 * v; left > 0)
          store_quarter(out + r * n + c0 + 8 * v, acc[r][v], acc[r][v + 1], left);
  }
}

template <int R>
void tile_block(const float* __restrict x, int64_t K, const float* __restrict s, float* __restrict part, bool first) {
  for (int64_t c0 = 0; c0 < kCols; c0 += 16) {
    __m256 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v)
        acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + r * kCols + c0 + 8 * v);
    for (int64_t k = 0; k < kBlock; ++k) {
      const __m256 w0 = _mm256_load_ps(s + k * kCols + c0), w1 = _mm256_load_ps(s + k * kCols + c0 + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v) _mm256_storeu_ps(part + r * kCols + c0 + 8 * v, acc[r][v]);
  }
}
#endif

#if defined(__AVX512F__) || defined(BATCHLM_Q_AVX2)
#define BATCHLM_Q_VECTOR 1
using TileBlockFn = void (*)(const float*, int64_t, const float*, float*, bool);
constexpr TileBlockFn kTileBlocks[kRows + 1] = {nullptr,       tile_block<1>, tile_block<2>, tile_block<3>,
                                                tile_block<4>, tile_block<5>, tile_block<6>};

// A chunk of up to kFusedMaxRows rows skips the scratch group, kFusedRows at a time. AVX-512: 4 rows x 4
// vectors of sums + 8 scales + 4 weights + a broadcast (29 of 32 registers), or 8 x 2 + 4 + 2 + 1 (23) in
// two passes; AVX2: 4 x 2 + 4 + 2 + 1 of 16, so past 4 rows a block would dequantize every weight again.
#ifdef __AVX512F__
constexpr int kFusedRows = 8;
#else
constexpr int kFusedRows = 4;
#endif
constexpr int64_t kFusedMaxRows = kFusedRows;

template <int64_t Q>
using FusedFn = void (*)(const float*, int64_t, const uint8_t*, const uint8_t*, float*, int64_t, int64_t);

#ifdef __AVX512F__
template <int64_t Q>
constexpr FusedFn<Q> kFused[kFusedRows + 1] = {nullptr,       block_q<Q, 1>, block_q<Q, 2>, block_q<Q, 3>,
                                                block_q<Q, 4>, block_q<Q, 5>, block_q<Q, 6>, block_q<Q, 7>,
                                                block_q<Q, 8>};
#else
template <int64_t Q>
constexpr FusedFn<Q> kFused[kFusedRows + 1] = {nullptr, block_q<Q, 1>, block_q<Q, 2>, block_q<Q, 3>,
                                                block_q<Q, 4>};
#endif
#endif

// Rows in chunks of kChunk; in each chunk the threads share out the groups, and each group is dequantized
// into the thread's scratch and multiplied by the chunk's rows kRows at a time (linear.cpp's `run`).
template <int64_t Q>
void run_q(const float* x, const uint8_t* w, float* out, int64_t T, int64_t K, int64_t G, int64_t n) {
  const int64_t NB = K / kBlock, group_bytes = NB * tile_bytes(Q);
  for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
    const int64_t rows = std::min(kChunk, T - t0);
    batchlm::for_each_item(G, [] { return 0; }, [&](int, int64_t g, int64_t next) {
      const uint8_t* group = w + g * group_bytes;
      const int64_t ncols = std::min(kCols, n - g * kCols);
#ifdef BATCHLM_Q_VECTOR
      if (rows <= kFusedMaxRows) {
        for (int64_t r = 0; r < rows; r += kFusedRows) {
          const int R = static_cast<int>(std::min<int64_t>(kFusedRows, rows - r));
          const uint8_t* ahead = next >= 0 && r + kFusedRows >= rows ? w + next * group_bytes : nullptr;
          kFused<Q>[R](x + (t0 + r) * K, K, group, ahead, out + (t0 + r) * n + g * kCols, n, ncols);
        }
        return;
      }
      // NOTE: kept by the thread across calls: a fresh buffer per call would be mapped and faulted in anew.
      thread_local std::vector<float> sums(kChunk * kCols);
      alignas(64) float tile[kBlock * kCols];
      for (int64_t b = 0; b < NB; ++b) {
        const char* ahead = reinterpret_cast<const char*>(group) + (b + kPrefetchTiles) * tile_bytes(Q);
        for (int64_t line = 0; line < tile_bytes(Q); line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        dequantize_tile<Q>(group + b * tile_bytes(Q), tile);
        for (int64_t r = 0; r < rows; r += kRows) {
          const int R = static_cast<int>(std::min<int64_t>(kRows, rows - r));
          kTileBlocks[R](x + (t0 + r) * K + b * kBlock, K, tile, sums.data() + r * kCols, b == 0);
        }
      }
      for (int64_t r = 0; r < rows; ++r) std::memcpy(out + (t0 + r) * n + g * kCols, sums.data() + r * kCols, ncols * 4);
#else
      thread_local std::vector<float> scratch;
      if (static_cast<int64_t>(scratch.size()) < K * kCols) scratch.resize(K * kCols);
      dequantize_group<Q>(group, NB, scratch.data());
      for (int64_t r = 0; r < rows; r += kRows) {
        const int R = static_cast<int>(std::min<int64_t>(kRows, rows - r));
        kF32Blocks[R](x + (t0 + r) * K, K, scratch.data(), Prefetch{nullptr, 0, 1}, out + (t0 + r) * n + g * kCols,
                      n, ncols);
      }
#endif
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
#ifdef BATCHLM_Q_VECTOR
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
