// Element loads and stores shared by the CPU attention kernels: every product and sum
// runs in fp32, whatever the cache's dtype.
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

#endif
