// minipd's portable vector layer: one float vector type, `Vec`, of Vec::L lanes, loaded from float32
// or bfloat16, for the instruction set the kernels are compiled for (kernel_build.py: -march=native,
// or MINIPD_KERNEL_ISA): AVX-512 (16 lanes), AVX2 with FMA (8), NEON (4), or plain C++ (1 lane, for
// any other CPU). Each kernel is written once over it. The operations are the few the kernels need;
// exp is the same degree-6 polynomial on every ISA (about 1 ulp), so results agree across builds up
// to the order of sums.
// ATen's at::vec::Vectorized was the other choice: its fast exp (exp_u20) is accurate to 20 ulp,
// and the kernels need lane-count-aware tiles anyway.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MINIPD_VEC_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINIPD_VEC_ISA "avx2"
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define MINIPD_VEC_ISA "neon"
#else
#define MINIPD_VEC_ISA "scalar"
#endif

namespace minipd_vec {

#if defined(__AVX512F__)
struct Vec {
  static constexpr int L = 16;
  static constexpr int REGISTERS = 32;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const uint16_t* p) {  // bfloat16: its bits are a float32's high half
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Vec round(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec scale2(Vec p, Vec n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p * 2^n, n whole
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
// volatile asm: GCC 12 drops a loop whose body is only _mm_prefetch calls as if it did nothing.
// prefetch_l2: into the core's L2 only, for lines wanted a while later.
inline void prefetch(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  static constexpr int L = 8;
  static constexpr int REGISTERS = 16;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const uint16_t* p) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
};
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
inline Vec round(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec scale2(Vec p, Vec n) {
  // 2^n built in the exponent field, in two halves: n reaches -150, below the normal range
  const __m256i ni = _mm256_cvtps_epi32(n.v);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return {_mm256_mul_ps(_mm256_mul_ps(p.v, a), b)};
}
inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline void prefetch(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

#elif defined(__ARM_NEON) && defined(__aarch64__)
struct Vec {
  static constexpr int L = 4;
  static constexpr int REGISTERS = 32;
  float32x4_t v;
  static Vec zero() { return {vdupq_n_f32(0.f)}; }
  static Vec set1(float x) { return {vdupq_n_f32(x)}; }
  static Vec load(const float* p) { return {vld1q_f32(p)}; }
  static Vec load(const uint16_t* p) { return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))}; }
  void store(float* p) const { vst1q_f32(p, v); }
};
inline Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {vdivq_f32(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {vfmsq_f32(c.v, a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {vminq_f32(a.v, b.v)}; }
inline Vec round(Vec a) { return {vrndnq_f32(a.v)}; }
inline Vec scale2(Vec p, Vec n) {
  const int32x4_t ni = vcvtnq_s32_f32(n.v);
  const int32x4_t half = vshrq_n_s32(ni, 1);
  const int32x4_t bias = vdupq_n_s32(127);
  const float32x4_t a = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, bias), 23));
  const float32x4_t b = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vsubq_s32(ni, half), bias), 23));
  return {vmulq_f32(vmulq_f32(p.v, a), b)};
}
inline float reduce_add(Vec a) { return vaddvq_f32(a.v); }
inline float reduce_max(Vec a) { return vmaxvq_f32(a.v); }
inline void prefetch(const void* p) { asm volatile("prfm pldl1keep, %0" : : "Q"(*static_cast<const char*>(p))); }
inline void prefetch_l2(const void* p) { asm volatile("prfm pldl2keep, %0" : : "Q"(*static_cast<const char*>(p))); }

#else
struct Vec {
  static constexpr int L = 1;
  static constexpr int REGISTERS = 16;
  float v;
  static Vec zero() { return {0.f}; }
  static Vec set1(float x) { return {x}; }
  static Vec load(const float* p) { return {*p}; }
  static Vec load(const uint16_t* p);
  void store(float* p) const { *p = v; }
};
inline Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
inline Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
inline Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
inline Vec operator/(Vec a, Vec b) { return {a.v / b.v}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {c.v - a.v * b.v}; }
inline Vec max(Vec a, Vec b) { return {a.v > b.v ? a.v : b.v}; }
inline Vec min(Vec a, Vec b) { return {a.v < b.v ? a.v : b.v}; }
inline Vec round(Vec a) { return {std::nearbyint(a.v)}; }
inline Vec scale2(Vec p, Vec n) { return {std::ldexp(p.v, static_cast<int>(n.v))}; }
inline float reduce_add(Vec a) { return a.v; }
inline float reduce_max(Vec a) { return a.v; }
inline void prefetch(const void* p) { __builtin_prefetch(p); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
#endif

// The lane sums of L vectors at once: lane i of the result is reduce_add(v[i]). A tree of
// shuffles and adds, about 3 operations per vector where L separate reductions take 2 log2(L).
#if defined(__AVX512F__)
inline Vec lane_sums(const Vec (&v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // within 128-bit lanes: even lanes of v[2i], odd of v[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: v[4i..4i+3], partial
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)))};
}
#elif defined(__AVX2__) && defined(__FMA__)
inline Vec lane_sums(const Vec (&v)[8]) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm256_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
    b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return {_mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31))};
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
inline Vec lane_sums(const Vec (&v)[4]) {
  return {vpaddq_f32(vpaddq_f32(v[0].v, v[1].v), vpaddq_f32(v[2].v, v[3].v))};
}
#else
inline Vec lane_sums(const Vec (&v)[1]) { return v[0]; }
#endif

// bfloat16, held as its bits (uint16_t): a float32's high half. Loads widen exactly; a store rounds
// to nearest even, as c10::BFloat16 and transformers do (NaN aside: the vector stores assume none,
// as -ffast-math does).
inline float to_float(float x) { return x; }
inline float to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void from_float(float x, float* p) { *p = x; }
inline void from_float(float x, uint16_t* p) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  *p = std::isnan(x) ? 0x7fc0 : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__)) && !(defined(__ARM_NEON) && defined(__aarch64__))
inline Vec Vec::load(const uint16_t* p) { return {to_float(*p)}; }
#endif
inline void store(Vec v, float* p) { v.store(p); }
#if defined(__AVX512F__)
inline void store(Vec v, uint16_t* p) {  // round to nearest even: add 0x7fff and the kept bit's last, keep 16
  const __m512i u = _mm512_castps_si512(v.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline void store(Vec v, uint16_t* p) {
  const __m256i u = _mm256_castps_si256(v.v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
inline void store(Vec v, uint16_t* p) {
  const uint32x4_t u = vreinterpretq_u32_f32(v.v);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  vst1_u16(p, vshrn_n_u32(vaddq_u32(u, vaddq_u32(odd, vdupq_n_u32(0x7fff))), 16));
}
#else
inline void store(Vec v, uint16_t* p) { from_float(v.v, p); }
#endif
// v rounded to bfloat16 and widened back (what an eager bfloat16 operator hands the next one)
inline Vec rounded_bf16(Vec v) {
  uint16_t b[Vec::L];
  store(v, b);
  return Vec::load(b);
}

// e^x: 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, and a degree-6 Taylor polynomial for e^r
inline Vec exp(Vec x) {
  x = min(max(x, Vec::set1(-104.f)), Vec::set1(88.7f));  // 0 and FLT_MAX beyond
  const Vec n = round(x * Vec::set1(1.44269504088896341f));
  Vec r = fnmadd(n, Vec::set1(0.693359375f), x);  // ln 2 in two parts
  r = fnmadd(n, Vec::set1(-2.12194440e-4f), r);
  Vec p = Vec::set1(1.f / 720);
  p = fmadd(p, r, Vec::set1(1.f / 120));
  p = fmadd(p, r, Vec::set1(1.f / 24));
  p = fmadd(p, r, Vec::set1(1.f / 6));
  p = fmadd(p, r, Vec::set1(0.5f));
  p = fmadd(p, r, Vec::set1(1.f));
  p = fmadd(p, r, Vec::set1(1.f));
  return scale2(p, n);
}

}  // namespace minipd_vec
