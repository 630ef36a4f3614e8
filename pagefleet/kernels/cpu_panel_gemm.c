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
// tiles find them in cache. Threads split the panel pairs between them.
//
// Built for the vector unit the compiler targets (-march=native); on a CPU
// with neither AVX-512F nor AVX2+FMA, panel_gemm_supported() says 0 and
// oneDNN serves every shape.

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

int panel_gemm_supported(void);
int panel_gemm_panel_width(void);
int64_t panel_gemm_packed_floats(int n, int k);
void panel_gemm_pack_f32(const float *w, float *out, int n, int k);
int panel_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                   int64_t ldy, int m, int n, int k, int num_threads);

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
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
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
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#else
#define SUPPORTED 0
#define PANEL 16
#define TILE_ROWS 12
#endif

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
    const float *w1 = w0 + (int64_t)k * PANEL;
    vmask m0 = columns_mask(cols), m1 = columns_mask(cols - PANEL);
    vec b0 = bias ? VMASK_LOAD(bias, m0) : VZERO();
    vec b1 = bias ? VMASK_LOAD(bias + PANEL, m1) : VZERO();
    vec acc0[TILE_ROWS], acc1[TILE_ROWS];
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        acc0[r] = b0;
        acc1[r] = b1;
    }
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
