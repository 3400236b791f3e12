// Scalar helpers shared by the kernels: bfloat16 <-> float32 (bits, and element-wise widen / narrow), the
// fixed-tree sum of kLanes partial sums, and exp for arguments <= 0.
// Written without branches on the data, so that the compiler vectorizes the loops that call them.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace batchlm {

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does (NaN kept quiet)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// One element as float32 math reads it, and a float32 result rounded once into the element type.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return bf16_to_float(x.x); }

template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  return c10::BFloat16(float_to_bf16(x), c10::BFloat16::from_bits());
}

// Partial sums per reduction: a sum over n elements goes to acc[i % kLanes], then combine() adds the kLanes
// partial sums in one fixed tree, ((0+8) + (4+12)) + ..., so the result never depends on how the work was split.
constexpr int kLanes = 16;

inline float combine(float* acc) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// exp(x) for x <= 0 to about 2 ulp: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial, times 2^n.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

}  // namespace batchlm
