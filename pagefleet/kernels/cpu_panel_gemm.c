// fp32 GEMM for the few rows of a decode step: y = x W^T (+ b), W in panels.
//
// Why: at decode, every step reads every weight once for a handful of rows (one
// per running sequence), so the step is bound by how fast the weights stream
// in from memory, not by arithmetic. oneDNN's packed GEMM streams them at about
// half of what one core can read (8 of 16 GB/s on a Xeon, SmolLM-135M shapes,
// 20 rows); this kernel prefetches its weight stream in software and reads it
// ~1.3x faster (BENCHMARKS.md, "the decode GEMM"). For hundreds of rows
// (prefill) the work is arithmetic-bound and oneDNN's blocking wins: the caller
// keeps oneDNN there (`layers/cpu_gemm.py`).
//
// Layouts (PANEL: the floats of one vector register, 16 on AVX-512, 8 on AVX2):
//   W packed  [P][K][PANEL] floats, P even: panel p holds output columns
//             PANEL*p .. PANEL*p + PANEL-1, k-major, so a panel is read in one
//             forward sweep; columns past N are zero.
//   x         [M][ldx]      y  [M][ldy]      b  [N] or NULL
//
// The work: for each pair of adjacent panels, for each tile of up to TILE_ROWS
// rows (12 on AVX-512, 6 on AVX2), accumulate TILE_ROWS x 2*PANEL outputs in
// registers over all of K: per k, two panel loads and TILE_ROWS broadcasts of x
// feed 2*TILE_ROWS FMAs. x is transposed per tile first ([K][rows]), so a
// tile's broadcasts are one contiguous run per k. The first tile of a pair
// streams the panels from memory with software prefetch ahead of it; the next
// tiles find them in cache. Threads split the panel pairs between them. The tile's
// inner loop lives in cpu_panel_tile.h, shared with the grouped experts (cpu_moe.c).
//
// Built for the vector unit the compiler targets (-march=native); on a CPU
// with neither AVX-512F nor AVX2+FMA, panel_gemm_supported() says 0 and
// oneDNN serves every shape.
//
// The bf16 twin (panel_gemm_bf16), built only where the compiler targets
// AVX512-BF16 (panel_gemm_bf16_supported() says 0 elsewhere): the same panels,
// tiles and threads, over bf16 weights and inputs with fp32 accumulation, by
// vdpbf16ps, which multiplies pairs of bf16 and adds both products to an fp32
// lane. So a panel holds its 16 columns' weights for two consecutive k side by
// side ([P][K2][16][2] bf16, K2 = ceil(K / 2), the odd K's last k padded with
// zero), one register per k pair, and the tile broadcasts x's pair
// (x[k], x[k+1]) as one 32-bit lane: per k pair, two panel loads and
// TILE_ROWS broadcasts feed 2 * TILE_ROWS vdpbf16ps. The bias (bf16, or NULL)
// is added in fp32 and y is rounded to bf16 once, to nearest even.

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

int panel_gemm_supported(void);
int panel_gemm_panel_width(void);
int64_t panel_gemm_packed_floats(int n, int k);
void panel_gemm_pack_f32(const float *w, float *out, int n, int k);
int panel_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                   int64_t ldy, int m, int n, int k, int num_threads);
int panel_gemm_bf16_supported(void);
int64_t panel_gemm_packed_bf16(int n, int k);
void panel_gemm_pack_bf16(const uint16_t *w, uint16_t *out, int n, int k);
int panel_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                    uint16_t *y, int64_t ldy, int m, int n, int k, int num_threads);

#include "cpu_panel_tile.h"

int panel_gemm_supported(void) { return SUPPORTED; }
int panel_gemm_panel_width(void) { return PANEL; }

int64_t panel_gemm_packed_floats(int n, int k) {
    int64_t pairs = (n + 2 * PANEL - 1) / (2 * PANEL);
    return pairs * 2 * PANEL * (int64_t)k;
}

void panel_gemm_pack_f32(const float *w, float *out, int n, int k) {
    int64_t panels = panel_gemm_packed_floats(n, k) / ((int64_t)PANEL * k);
    for (int64_t p = 0; p < panels; p++)
        for (int kk = 0; kk < k; kk++)
            for (int j = 0; j < PANEL; j++) {
                int64_t col = p * PANEL + j;
                out[(p * k + kk) * PANEL + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

#if SUPPORTED

// One tile: `rows` (a compile-time constant in each instance) x 2 * PANEL columns.
static inline __attribute__((always_inline)) void tile(
    const float *restrict xt, const float *restrict w0, const float *restrict bias,
    float *restrict y, int64_t ldy, int k, const int rows, int cols, int prefetch) {
    vmask m0 = columns_mask(cols), m1 = columns_mask(cols - PANEL);
    vec b0 = bias ? VMASK_LOAD(bias, m0) : VZERO();
    vec b1 = bias ? VMASK_LOAD(bias + PANEL, m1) : VZERO();
    vec acc0[TILE_ROWS], acc1[TILE_ROWS];
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        acc0[r] = b0;
        acc1[r] = b1;
    }
    tile_accumulate(xt, w0, k, rows, prefetch, acc0, acc1);
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        VMASK_STORE(y + r * ldy, m0, acc0[r]);
        VMASK_STORE(y + r * ldy + PANEL, m1, acc1[r]);
    }
}

#define TILE_CASE(r) \
    case r: tile(xt, w0, bias, y, ldy, k, r, cols, prefetch); break;

static void tile_any(const float *xt, const float *w0, const float *bias, float *y, int64_t ldy,
                     int k, int rows, int cols, int prefetch) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
#if TILE_ROWS > 6
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
#endif
    }
}

int panel_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                   int64_t ldy, int m, int n, int k, int num_threads) {
    if (m <= 0 || n <= 0) return 0;
    int tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    int pairs = (n + 2 * PANEL - 1) / (2 * PANEL);
    // xt: each tile's rows transposed, [tile][k][rows].
    float *xt = malloc((size_t)tiles * TILE_ROWS * k * sizeof(float));
    if (!xt) return 1;
    for (int t = 0; t < tiles; t++) {
        int r0 = t * TILE_ROWS, rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
        float *dst = xt + (int64_t)t * TILE_ROWS * k;
        for (int r = 0; r < rows; r++)
            for (int kk = 0; kk < k; kk++) dst[kk * rows + r] = x[(r0 + r) * ldx + kk];
    }
#pragma omp parallel num_threads(num_threads)
    {
        int threads = omp_get_num_threads(), me = omp_get_thread_num();
        int first = (int)((int64_t)pairs * me / threads);
        int last = (int)((int64_t)pairs * (me + 1) / threads);
        for (int p = first; p < last; p++) {
            const float *w0 = w + (int64_t)p * 2 * PANEL * k;
            const float *b = bias ? bias + p * 2 * PANEL : NULL;
            int cols = n - p * 2 * PANEL;
            for (int t = 0; t < tiles; t++) {
                int r0 = t * TILE_ROWS, rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
                tile_any(xt + (int64_t)t * TILE_ROWS * k, w0, b, y + r0 * ldy + p * 2 * PANEL,
                         ldy, k, rows, cols, t == 0);
            }
        }
    }
    free(xt);
    return 0;
}

#else

int panel_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                   int64_t ldy, int m, int n, int k, int num_threads) {
    (void)x, (void)ldx, (void)w, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k;
    (void)num_threads;
    return 2;
}

#endif

// ---- bf16 weights and inputs, fp32 accumulation (AVX512-BF16) ----

int64_t panel_gemm_packed_bf16(int n, int k) {
    int64_t pairs = (n + 2 * BF16_PANEL - 1) / (2 * BF16_PANEL);
    return pairs * 2 * BF16_PANEL * (int64_t)((k + 1) / 2) * 2;
}

void panel_gemm_pack_bf16(const uint16_t *w, uint16_t *out, int n, int k) {
    int64_t k2 = (k + 1) / 2;
    int64_t panels = panel_gemm_packed_bf16(n, k) / (BF16_PANEL * k2 * 2);
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k2; kk++)
            for (int j = 0; j < BF16_PANEL; j++)
                for (int h = 0; h < 2; h++) {
                    int64_t col = p * BF16_PANEL + j, kin = 2 * kk + h;
                    out[((p * k2 + kk) * BF16_PANEL + j) * 2 + h] =
                        col < n && kin < k ? w[col * k + kin] : 0;
                }
}

#if BF16_SUPPORTED

int panel_gemm_bf16_supported(void) { return 1; }

_Static_assert(PANEL == BF16_PANEL, "the f32 column masks serve the bf16 tiles");

static inline __m512 bf16_bias(const uint16_t *bias, __mmask16 m) {
    if (!bias) return _mm512_setzero_ps();
    __m256i raw = _mm256_maskz_loadu_epi16(m, bias);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline void bf16_store_row(uint16_t *y, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// One tile: `rows` x 2 * BF16_PANEL columns; xt holds the tile's x pairs, [K2][rows].
static inline __attribute__((always_inline)) void tile_bf16(
    const uint32_t *restrict xt, const uint16_t *restrict w0, const uint16_t *restrict bias,
    uint16_t *restrict y, int64_t ldy, int k2, const int rows, int cols, int prefetch) {
    __mmask16 m0 = columns_mask(cols), m1 = columns_mask(cols - BF16_PANEL);
    __m512 b0 = bf16_bias(bias, m0), b1 = bf16_bias(bias ? bias + BF16_PANEL : NULL, m1);
    __m512 acc0[TILE_ROWS], acc1[TILE_ROWS];
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        acc0[r] = b0;
        acc1[r] = b1;
    }
    tile_accumulate_bf16(xt, w0, k2, rows, prefetch, acc0, acc1);
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        bf16_store_row(y + r * ldy, m0, acc0[r]);
        bf16_store_row(y + r * ldy + BF16_PANEL, m1, acc1[r]);
    }
}

#define TILE_BF16_CASE(r) \
    case r: tile_bf16(xt, w0, bias, y, ldy, k2, r, cols, prefetch); break;

static void tile_bf16_any(const uint32_t *xt, const uint16_t *w0, const uint16_t *bias,
                          uint16_t *y, int64_t ldy, int k2, int rows, int cols, int prefetch) {
    switch (rows) {
        TILE_BF16_CASE(1) TILE_BF16_CASE(2) TILE_BF16_CASE(3) TILE_BF16_CASE(4)
        TILE_BF16_CASE(5) TILE_BF16_CASE(6) TILE_BF16_CASE(7) TILE_BF16_CASE(8)
        TILE_BF16_CASE(9) TILE_BF16_CASE(10) TILE_BF16_CASE(11) TILE_BF16_CASE(12)
    }
}

// Each tile's rows as (x[2kk], x[2kk+1]) pairs, transposed: [tile][K2][rows].
static void transpose_pairs(const uint16_t *x, int64_t ldx, uint32_t *xt, int m, int k) {
    int k2 = (k + 1) / 2, tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    for (int t = 0; t < tiles; t++) {
        int r0 = t * TILE_ROWS, rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
        uint32_t *dst = xt + (int64_t)t * TILE_ROWS * k2;
        for (int r = 0; r < rows; r++) {
            const uint16_t *row = x + (int64_t)(r0 + r) * ldx;
            for (int kk = 0; kk < k2; kk++) {
                uint32_t hi = 2 * kk + 1 < k ? row[2 * kk + 1] : 0;
                dst[kk * rows + r] = (uint32_t)row[2 * kk] | hi << 16;
            }
        }
    }
}

int panel_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                    uint16_t *y, int64_t ldy, int m, int n, int k, int num_threads) {
    if (m <= 0 || n <= 0) return 0;
    int k2 = (k + 1) / 2;
    int tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    int pairs = (n + 2 * BF16_PANEL - 1) / (2 * BF16_PANEL);
    uint32_t *xt = malloc((size_t)tiles * TILE_ROWS * k2 * sizeof(uint32_t));
    if (!xt) return 1;
    transpose_pairs(x, ldx, xt, m, k);
#pragma omp parallel num_threads(num_threads)
    {
        int threads = omp_get_num_threads(), me = omp_get_thread_num();
        int first = (int)((int64_t)pairs * me / threads);
        int last = (int)((int64_t)pairs * (me + 1) / threads);
        for (int p = first; p < last; p++) {
            const uint16_t *w0 = w + (int64_t)p * 2 * BF16_PANEL * 2 * k2;
            const uint16_t *b = bias ? bias + p * 2 * BF16_PANEL : NULL;
            int cols = n - p * 2 * BF16_PANEL;
            for (int t = 0; t < tiles; t++) {
                int r0 = t * TILE_ROWS, rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
                tile_bf16_any(xt + (int64_t)t * TILE_ROWS * k2, w0, b,
                              y + r0 * ldy + p * 2 * BF16_PANEL, ldy, k2, rows, cols, t == 0);
            }
        }
    }
    free(xt);
    return 0;
}

#else

int panel_gemm_bf16_supported(void) { return 0; }

int panel_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                    uint16_t *y, int64_t ldy, int m, int n, int k, int num_threads) {
    (void)x, (void)ldx, (void)w, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k;
    (void)num_threads;
    return 2;
}

#endif
