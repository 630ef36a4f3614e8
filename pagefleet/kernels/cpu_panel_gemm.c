// fp32 GEMM for the few rows of a decode step: y = x W^T (+ b), W in panels.
//
// Why: at decode, every step reads every weight once for a handful of rows (one
// per running sequence), so the step is bound by how fast the weights stream
// in from memory, not by arithmetic. oneDNN's packed GEMM streams them at about
// half of what one core can read (8 of 16 GB/s measured on a Xeon, SmolLM-135M
// shapes, 20 rows); this kernel prefetches its weight stream in software and
// reads it at 10.5 (BENCHMARKS.md, "the decode GEMM"). For hundreds of rows
// (prefill) the work is arithmetic-bound and oneDNN's blocking wins: the caller
// keeps oneDNN there (`cpu_gemm.py`).
//
// Layouts:
//   W packed  [P][K][16] floats, P = ceil(N / 32) * 2: panel p holds output
//             columns 16p..16p+15, k-major, so a panel is read in one forward
//             sweep; columns past N are zero.
//   x         [M][ldx]      y  [M][ldy]      b  [N] or NULL
//
// The work: for each pair of adjacent panels (32 output columns), for each tile
// of up to 12 rows, accumulate 12 x 32 outputs in 24 vector registers over all
// of K: per k, two panel loads and 12 broadcasts of x feed 24 FMAs. x is
// transposed per tile first ([K][rows]), so a tile's broadcasts are one
// contiguous run per k. The first tile of a pair streams the panels from
// memory with software prefetch ahead of it; the next tiles find them in L2.
// Threads split the panel pairs between them.
//
// Built only where the compiler targets AVX-512F (-march=native on such a CPU);
// elsewhere panel_gemm_supported() says 0 and oneDNN serves every shape.

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

int panel_gemm_supported(void);
int64_t panel_gemm_packed_floats(int n, int k);
void panel_gemm_pack_f32(const float *w, float *out, int n, int k);
int panel_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                   int64_t ldy, int m, int n, int k, int num_threads);

#define PANEL 16
#define TILE_ROWS 12
// How far ahead of its reads a tile prefetches a panel (floats: 2 KiB, 32 k-steps).
#define PREFETCH 512

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

#ifdef __AVX512F__
#include <immintrin.h>

int panel_gemm_supported(void) { return 1; }

static inline __mmask16 columns_mask(int cols) {
    if (cols >= PANEL) return 0xFFFF;
    return cols <= 0 ? 0 : (__mmask16)((1u << cols) - 1);
}

// One tile: `rows` (a compile-time constant in each instance) x 32 columns.
static inline __attribute__((always_inline)) void tile(
    const float *restrict xt, const float *restrict w0, const float *restrict bias,
    float *restrict y, int64_t ldy, int k, const int rows, int cols, int prefetch) {
    const float *w1 = w0 + (int64_t)k * PANEL;
    __mmask16 m0 = columns_mask(cols), m1 = columns_mask(cols - PANEL);
    __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + PANEL) : _mm512_setzero_ps();
    __m512 acc0[TILE_ROWS], acc1[TILE_ROWS];
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        acc0[r] = b0;
        acc1[r] = b1;
    }
    for (int kk = 0; kk < k; kk++) {
        __m512 v0 = _mm512_load_ps(w0 + (int64_t)kk * PANEL);
        __m512 v1 = _mm512_load_ps(w1 + (int64_t)kk * PANEL);
        if (prefetch) {
            _mm_prefetch((const char *)(w0 + (int64_t)kk * PANEL + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (int64_t)kk * PANEL + PREFETCH), _MM_HINT_T0);
        }
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            __m512 xv = _mm512_set1_ps(xt[kk * rows + r]);
            acc0[r] = _mm512_fmadd_ps(xv, v0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(xv, v1, acc1[r]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, m0, acc0[r]);
        _mm512_mask_storeu_ps(y + r * ldy + PANEL, m1, acc1[r]);
    }
}

#define TILE_CASE(r) \
    case r: tile(xt, w0, bias, y, ldy, k, r, cols, prefetch); break;

static void tile_any(const float *xt, const float *w0, const float *bias, float *y, int64_t ldy,
                     int k, int rows, int cols, int prefetch) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
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

int panel_gemm_supported(void) { return 0; }

int panel_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                   int64_t ldy, int m, int n, int k, int num_threads) {
    (void)x, (void)ldx, (void)w, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k;
    (void)num_threads;
    return 2;
}

#endif
