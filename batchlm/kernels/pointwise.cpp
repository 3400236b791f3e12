// batchlm::rms_norm, add_rms_norm, silu_mul and rope_write_kv: the element-wise work of a decoder layer, each
// one pass over its rows where torch runs a chain of ops (RMSNorm alone is five: pow, mean, add, rsqrt, mul).
//
// Contracts (checked at the top of each op). Tensors are float32 or bfloat16, one dtype per call; math is
// float32, bfloat16 inputs are widened on load and every output is rounded once (nearest even).
//   rms_norm(x (T, D), w (D,), eps) -> y (T, D)          y = x / sqrt(mean over D of x^2 + eps) * w
//   add_rms_norm(x (T, D), r (T, D), w (D,), eps) -> (h, y)
//                                                        h = x + r (rounded to the dtype), y = rms_norm(h, w)
//   silu_mul(gu (T, 2I)) -> (T, I)                       silu(gu[:, :I]) * gu[:, I:], silu(a) = a / (1 + e^-a)
//   rope_write_kv(qkv (T, H + 2KVH, hd), cos (T, hd), sin (T, hd), k_cache (NB, KVH, hd, bs),
//                 v_cache (NB * bs, KVH, hd), slots (T,) int64) -> q (T, H, hd)
//       every q and k head rotated, x * cos + swap_halves(x) * sin (sin carries rotate_half's sign, as
//       batchlm.rope builds its table; cos and sin may be (T, 1, hd)); token t's rotated k and its v are
//       written at slot s = slots[t] = block * bs + offset (k transposed within its block, as KVCache lays it
//       out); returns the rotated q. Slots must be distinct: two tokens never share one.
//
// Why kernels: as torch ops these are about sixty op calls a step, each a dispatch and a pass over memory,
// a large share of a small-batch decode step (`batchlm-bench forward --profile` shows it).
//
// Exactness: an output row depends only on its own input row and the weights. A row's sum of squares runs
// over D in 16 partial sums, combined in a fixed tree; nothing depends on T, on the other rows or on the
// thread, so these ops keep the model batch-invariant, as the attention and linear kernels do.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "scalar_math.h"

namespace {

using batchlm::combine;
using batchlm::exp_nonpositive;
using batchlm::kLanes;
using batchlm::narrow;
using batchlm::widen;

constexpr int64_t kGrainElements = 16384;  // elements per parallel task: less is not worth a second thread

// Calls f with a value of the element type: float or at::BFloat16 (callers have checked it is one of them).
template <typename F>
void by_dtype(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat)
    f(float{});
  else
    f(at::BFloat16{});
}

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

// 1 / sqrt(mean of the squares of h[0 .. D) + eps), the squares summed in kLanes partial sums, fixed tree.
inline float inv_rms(const float* h, int64_t D, float eps) {
  float acc[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(h[d + l], h[d + l], acc[l]);
  for (int l = 0; d < D; ++d, ++l) acc[l] = std::fma(h[d], h[d], acc[l]);
  return 1.0f / std::sqrt(combine(acc) / static_cast<float>(D) + eps);
}

template <typename T>
void norm_rows(const T* x, const T* r, const T* w, T* h_out, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, grain_rows(D), [&](int64_t begin, int64_t end) {
    std::vector<float> h(D), wf(D);
    for (int64_t d = 0; d < D; ++d) wf[d] = widen(w[d]);
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = x + t * D;
      if (r != nullptr) {  // h = x + r, rounded to the dtype: what the residual stream holds
        const T* rt = r + t * D;
        T* ht = h_out + t * D;
        for (int64_t d = 0; d < D; ++d) {
          ht[d] = narrow<T>(widen(xt[d]) + widen(rt[d]));
          h[d] = widen(ht[d]);
        }
      } else {
        for (int64_t d = 0; d < D; ++d) h[d] = widen(xt[d]);
      }
      const float inv = inv_rms(h.data(), D, eps);
      T* yt = y + t * D;
      for (int64_t d = 0; d < D; ++d) yt[d] = narrow<T>(h[d] * inv * wf[d]);
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous (T, D) tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "w must be a contiguous (D,) tensor of ", name, "'s dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "x");
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), D = x.size(1);
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), nullptr, y.data_ptr<scalar_t>(),
                        T, D, static_cast<float>(eps));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                double eps) {
  check_rows(x, w, "x");
  TORCH_CHECK(r.sizes() == x.sizes() && r.is_contiguous() && r.scalar_type() == x.scalar_type(),
              "r must be a contiguous tensor of x's shape and dtype");
  auto h = at::empty_like(x);
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), D = x.size(1);
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                        h.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), T, D, static_cast<float>(eps));
  });
  return {h, y};
}

// silu(a) * b with a vectorizable exp: e = exp(-|a|) <= 1, sigmoid(a) = 1 / (1 + e) for a >= 0, e / (1 + e) below.
inline float silu_times(float a, float b) {
  const float e = exp_nonpositive(-std::fabs(a));
  const float sigmoid = (a >= 0.0f ? 1.0f : e) / (1.0f + e);
  return a * sigmoid * b;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "gu must be a contiguous (T, 2I) tensor");
  TORCH_CHECK(gu.scalar_type() == at::kFloat || gu.scalar_type() == at::kBFloat16,
              "gu must be float32 or bfloat16, got ", gu.scalar_type());
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({T, I}, gu.options());
  by_dtype(gu.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = gu.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = src + t * 2 * I;
        const scalar_t* u = g + I;
        scalar_t* o = dst + t * I;
        for (int64_t i = 0; i < I; ++i) o[i] = narrow<scalar_t>(silu_times(widen(g[i]), widen(u[i])));
      }
    });
  });
  return out;
}

// x * cos + swap_halves(x) * sin for one head of hd elements, in float32.
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, float* out, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; ++d) {
    const float swapped = widen(x[d < half ? d + half : d - half]);
    out[d] = std::fma(swapped, widen(sin[d]), widen(x[d]) * widen(cos[d]));
  }
}

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous (T, H + 2KVH, hd) tensor");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "qkv must be float32 or bfloat16, got ", qkv.scalar_type());
  const int64_t T = qkv.size(0), heads = qkv.size(1), hd = qkv.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache (NB, KVH, hd, bs) and v_cache (NB * bs, KVH, hd) must be contiguous");
  const int64_t KVH = k_cache.size(1), bs = k_cache.size(3), num_slots = v_cache.size(0);
  const int64_t H = heads - 2 * KVH;
  TORCH_CHECK(H > 0 && hd % 2 == 0 && k_cache.size(2) == hd && v_cache.size(1) == KVH && v_cache.size(2) == hd &&
                  num_slots == k_cache.size(0) * bs,
              "qkv, k_cache and v_cache shapes do not match");
  for (const at::Tensor* t : {&cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "cos, sin, k_cache and v_cache must have qkv's dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * hd && sin.numel() == T * hd &&
                  cos.size(0) == T && sin.size(0) == T,
              "cos and sin must be contiguous (T, hd) or (T, 1, hd) tensors");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == T && slots.is_contiguous(),
              "slots must be a contiguous (T,) int64 tensor");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slots[", t, "] out of range");
  auto q = at::empty({T, H, hd}, qkv.options());
  by_dtype(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* qo = q.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows(heads * hd), [&](int64_t begin, int64_t end) {
      std::vector<float> rotated(hd);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = src + t * heads * hd;
        const scalar_t* ct = c + t * hd;
        const scalar_t* st = s + t * hd;
        const int64_t block = slot[t] / bs, offset = slot[t] % bs;
        for (int64_t n = 0; n < H + KVH; ++n) {
          rotate(row + n * hd, ct, st, rotated.data(), hd);
          if (n < H) {
            scalar_t* out = qo + (t * H + n) * hd;
            for (int64_t d = 0; d < hd; ++d) out[d] = narrow<scalar_t>(rotated[d]);
          } else {  // key head g: element d of key `offset` of the block is at ((block KVH + g) hd + d) bs + offset
            scalar_t* out = kc + ((block * KVH + (n - H)) * hd) * bs + offset;
            for (int64_t d = 0; d < hd; ++d) out[d * bs] = narrow<scalar_t>(rotated[d]);
          }
        }
        std::copy(row + (H + KVH) * hd, row + heads * hd, vc + slot[t] * KVH * hd);
      }
    });
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchlm, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(batchlm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_write_kv", &rope_write_kv);
}
