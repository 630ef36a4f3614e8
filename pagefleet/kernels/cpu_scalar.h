// Element loads and stores, vectors and bf16 pair products shared by the CPU attention
// kernels. Every sum runs in fp32, whatever the cache's dtype; products take fp32, or
// bf16 pairs where the CPU multiplies bf16 itself (BF16_PAIRS: AVX512-BF16).
#ifndef PAGEFLEET_CPU_SCALAR_H
#define PAGEFLEET_CPU_SCALAR_H

#include <stdint.h>

static inline float bf16_load(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t bf16_store(float f) {
    // Round to nearest even, as torch converts; NaN stays NaN.
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_PAIRS 1
#include <immintrin.h>

// acc + a . b lane by lane, a and b 16 pairs of bf16 (vdpbf16ps: both products summed).
static inline v16 dot_pairs(v16 acc, v16u a, v16u b) {
    return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}

// One pair of bf16 (a 32-bit word) in every lane.
static inline v16u splat_pair(uint32_t x) { return (v16u)_mm512_set1_epi32((int)x); }

// 32 fp32 (lo's 16, then hi's) rounded to bf16, to nearest even: 16 pairs, in order.
static inline v16u bf16_pairs(v16 lo, v16 hi) {
    return (v16u)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
}
#else
#define BF16_PAIRS 0
#endif

#endif
