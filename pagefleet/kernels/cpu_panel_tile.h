// The panel GEMM's register tile, shared by the decode GEMM (`cpu_panel_gemm.c`) and the
// grouped experts (`cpu_moe.c`): the vector unit's macros and the inner loops that
// accumulate `rows` x 2 * PANEL outputs over all of K. Each caller initialises the
// accumulators and stores them its own way (a bias and a plain store; SiLU-and-mul; a
// routing weight).
//
// Layouts (see cpu_panel_gemm.c): a panel pair is two panels of PANEL output columns,
// k-major ([K][PANEL] floats each; bf16: [K2][PANEL][2], pairs of consecutive k side by
// side), the second right after the first; xt is the tile's rows transposed, [K][rows]
// (bf16: [K2][rows] of (x[2kk], x[2kk+1]) pairs in one 32-bit word).
#ifndef PAGEFLEET_CPU_PANEL_TILE_H
#define PAGEFLEET_CPU_PANEL_TILE_H

#include <stdint.h>

// How far ahead of its reads a tile prefetches a panel (floats: 2 KiB).
#define PREFETCH 512

// The vector unit: PANEL floats a register, TILE_ROWS rows a tile (2 x TILE_ROWS
// accumulators, two panel registers and a broadcast within the register file).
#if defined(__AVX512F__)
#include <immintrin.h>
#define SUPPORTED 1
#define PANEL 16
#define TILE_ROWS 12
typedef __m512 vec;
typedef __mmask16 vmask;
static inline vmask columns_mask(int cols) {
    if (cols >= PANEL) return 0xFFFF;
    return cols <= 0 ? 0 : (vmask)((1u << cols) - 1);
}
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_load_ps(p)
#define VMASK_LOAD(p, m) _mm512_maskz_loadu_ps((m), (p))
#define VMASK_STORE(p, m, v) _mm512_mask_storeu_ps((p), (m), (v))
#define VSTOREU(p, v) _mm512_storeu_ps((p), (v))
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VADD(a, b) _mm512_add_ps((a), (b))
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SUPPORTED 1
#define PANEL 8
#define TILE_ROWS 6
typedef __m256 vec;
typedef __m256i vmask;
static inline vmask columns_mask(int cols) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_load_ps(p)
#define VMASK_LOAD(p, m) _mm256_maskload_ps((p), (m))
#define VMASK_STORE(p, m, v) _mm256_maskstore_ps((p), (m), (v))
#define VSTOREU(p, v) _mm256_storeu_ps((p), (v))
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VADD(a, b) _mm256_add_ps((a), (b))
#else
#define SUPPORTED 0
#define PANEL 16
#define TILE_ROWS 12
#endif

#define BF16_PANEL 16

#if SUPPORTED

// acc0/acc1[r] += sum over k of x[r][k] * panel0/panel1[k][:], for r < rows.
static inline __attribute__((always_inline)) void tile_accumulate(
    const float *restrict xt, const float *restrict w0, int k, const int rows, int prefetch,
    vec *restrict acc0, vec *restrict acc1) {
    const float *w1 = w0 + (int64_t)k * PANEL;
    for (int kk = 0; kk < k; kk++) {
        vec v0 = VLOAD(w0 + (int64_t)kk * PANEL);
        vec v1 = VLOAD(w1 + (int64_t)kk * PANEL);
        if (prefetch) {
            _mm_prefetch((const char *)(w0 + (int64_t)kk * PANEL + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (int64_t)kk * PANEL + PREFETCH), _MM_HINT_T0);
        }
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            vec xv = VSET1(xt[kk * rows + r]);
            acc0[r] = VFMA(xv, v0, acc0[r]);
            acc1[r] = VFMA(xv, v1, acc1[r]);
        }
    }
}

#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_SUPPORTED 1

// The bf16 twin: acc0/acc1[r] += sum over k pairs of vdpbf16ps(x pair, panel pair).
static inline __attribute__((always_inline)) void tile_accumulate_bf16(
    const uint32_t *restrict xt, const uint16_t *restrict w0, int k2, const int rows,
    int prefetch, __m512 *restrict acc0, __m512 *restrict acc1) {
    const uint16_t *w1 = w0 + (int64_t)k2 * 2 * BF16_PANEL;
    for (int kk = 0; kk < k2; kk++) {
        __m512bh v0 = (__m512bh)_mm512_load_si512(w0 + (int64_t)kk * 2 * BF16_PANEL);
        __m512bh v1 = (__m512bh)_mm512_load_si512(w1 + (int64_t)kk * 2 * BF16_PANEL);
        if (prefetch) {
            _mm_prefetch((const char *)(w0 + (int64_t)kk * 2 * BF16_PANEL + 2 * PREFETCH),
                         _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (int64_t)kk * 2 * BF16_PANEL + 2 * PREFETCH),
                         _MM_HINT_T0);
        }
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xt[kk * rows + r]);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], xv, v0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], xv, v1);
        }
    }
}

// fp32 -> bf16, round to nearest even (vcvtneps2bf16), 16 lanes.
static inline __m256i bf16_round(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// bf16 -> fp32 (exact), 16 lanes.
static inline __m512 bf16_widen(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

#else
#define BF16_SUPPORTED 0
#endif

#endif
