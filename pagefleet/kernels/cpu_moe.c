// Routed gated experts in one call: out[t] = sum_j w[t, j] * expert_{id[t, j]}(x[t]), where
// expert_e(x) = down_e(unit(gate_e(x), up_e(x))) with optional biases on gate/up and down,
// and the gated unit one of (`moe_unit.kind`):
//
//   MOE_SILU            silu(gate) * up (Qwen3-MoE, Mixtral);
//   MOE_CLAMPED_SWIGLU  (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
//                       g = min(gate, limit) (gpt-oss).
//
// The (token, expert) pairs are grouped by expert with a stable counting sort (each
// expert's rows keep token order), and every expert with rows runs its gate/up GEMM,
// SiLU-and-mul and down GEMM over its contiguous block of rows, in the register tiles of
// the decode GEMM (`cpu_panel_tile.h`). One call per layer, four phases, the threads
// splitting each phase and meeting at a barrier between phases:
//
//   1. gather: each tile's rows of x (up to TILE_ROWS rows of one expert) transposed,
//      [K][rows], as the tile broadcasts them;
//   2. gate/up: work items (expert, gate/up panel pair) -> h = unit(gate, up), written
//      transposed for phase 3;
//   3. down: work items (expert, panel pair of the hidden size) -> y = w * (h W2^T + b2),
//      one row per (token, expert) pair, scaled by its routing weight;
//   4. combine: each token sums its pairs' rows in ascending expert order (the order the
//      torch reference, `layers/moe.py`, adds them in).
//
// Work items are numbered expert-major and each thread takes one contiguous run of them,
// so a thread streams a contiguous stretch of the experts' weights; an expert without
// rows is never read. Within an item, the first tile streams the panels from memory with
// software prefetch and the expert's later tiles find them in cache.
//
// Weights, per expert, at a fixed stride (`*_stride` elements) from one base pointer:
//   gate/up  the decode GEMM's panels of the [2 * IP, hidden] matrix whose rows are, for
//            each block b of PANEL intermediate columns, gate's rows of the block then
//            up's (IP: the intermediate size rounded up to PANEL, the extra rows zero), so
//            panel pair b holds gate and up of the same PANEL columns and the tile has
//            both in its two accumulators (`cpu_moe.pack`);
//   down     the decode GEMM's panels of [hidden, inter].
// Biases (optional, fp32 in both kernels), per expert at a fixed stride: gate/up's in the
// gate/up matrix's row order above ([2 * IP], the padding zero), so panel pair b's biases
// start at 2 * PANEL * b; down's [hidden]. A bias is added to its GEMM's sums before any
// rounding, as the reference's biased GEMM adds it. Padded intermediate columns have zero
// weights and biases, and both units map (0, 0) to 0: their h is 0.
//
// fp32 (moe_gated_experts_f32): every product and sum in fp32, as the reference's. bf16
// (moe_gated_experts_bf16, AVX512-BF16 only): bf16 inputs and weights, fp32 sums within each
// GEMM, and the reference's roundings to bf16 in between: gate and up, silu(gate), h, each
// expert's output, then its product with the routing weight, then each partial sum of a
// token's products; the clamped SwiGLU rounds alpha * g, its sigmoid, g times that, up + 1
// and the product, as the reference's bf16 tensor ops do. Routing weights come as fp32
// (the exact value of the caller's bf16 or fp32 weights).
//
// Each entry point returns 0, 1 when its scratch could not be allocated, 2 where it is not
// built for this CPU, 3 when an expert id is out of range, 4 for an unknown unit.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_panel_tile.h"

enum { MOE_SILU = 0, MOE_CLAMPED_SWIGLU = 1 };

// A call's gated unit and biases (NULL: none), each bias at its per-expert stride.
typedef struct {
    int kind;
    float limit, alpha;  // the clamped SwiGLU's
    const float *gate_up_bias, *down_bias;
    int64_t gate_up_bias_stride, down_bias_stride;
} moe_unit;

int moe_gated_experts_f32(const float *x, int64_t ldx, const int64_t *topk_ids,
                          const float *topk_weights, const float *w13, int64_t w13_stride,
                          const float *w2, int64_t w2_stride, const float *b13,
                          int64_t b13_stride, const float *b2, int64_t b2_stride, float *out,
                          int tokens, int top_k, int experts, int hidden, int inter,
                          int unit, float limit, float alpha, int num_threads);
int moe_gated_experts_bf16(const uint16_t *x, int64_t ldx, const int64_t *topk_ids,
                           const float *topk_weights, const uint16_t *w13, int64_t w13_stride,
                           const uint16_t *w2, int64_t w2_stride, const float *b13,
                           int64_t b13_stride, const float *b2, int64_t b2_stride,
                           uint16_t *out, int tokens, int top_k, int experts, int hidden,
                           int inter, int unit, float limit, float alpha, int num_threads);
#if SUPPORTED

// Rows of the interleaved gate/up matrix (2 * IP) for the fp32 or the bf16 panels.
static int moe_gate_up_rows(int inter, int dtype_bf16) {
    int width = dtype_bf16 ? BF16_PANEL : PANEL;
    return 2 * ((inter + width - 1) / width) * width;
}

// The routing, sorted: expert e's rows are offsets[e] .. offsets[e + 1] - 1, in token order.
typedef struct {
    int rows, active, tiles;
    int *offsets;     // [experts + 1]
    int *row_token;   // [rows]: the token of each sorted row
    float *row_weight;  // [rows]: its routing weight
    int *token_rows;  // [tokens][top_k]: each token's sorted rows, ascending (= by expert)
    int *active_experts;  // [active]: the experts with rows, ascending
    int *tile_expert, *tile_row0, *tile_rows;  // [tiles]
    void *block;      // the one allocation all of the above live in
} routing;

static void routing_free(routing *r) { free(r->block); }

// 0, 1 (no memory) or 3 (an id out of range).
static int route(routing *r, const int64_t *ids, const float *weights, int tokens, int top_k,
                 int experts) {
    int rows = tokens * top_k;
    size_t ints = (size_t)(experts + 1) + rows + rows + experts + 3 * (size_t)(rows + experts) +
                  experts;
    r->block = malloc(ints * sizeof(int) + (size_t)rows * sizeof(float));
    if (!r->block) return 1;
    int *p = r->block;
    r->offsets = p, p += experts + 1;
    r->row_token = p, p += rows;
    r->token_rows = p, p += rows;
    r->active_experts = p, p += experts;
    r->tile_expert = p, p += rows + experts;
    r->tile_row0 = p, p += rows + experts;
    r->tile_rows = p, p += rows + experts;
    int *next = p;  // [experts]: the next free row of each expert
    p += experts;
    r->row_weight = (float *)p;
    r->rows = rows;

    memset(r->offsets, 0, (size_t)(experts + 1) * sizeof(int));
    for (int i = 0; i < rows; i++) {
        if (ids[i] < 0 || ids[i] >= experts) return 3;
        r->offsets[ids[i] + 1]++;
    }
    r->active = r->tiles = 0;
    for (int e = 0; e < experts; e++) {
        int count = r->offsets[e + 1];
        r->offsets[e + 1] += r->offsets[e];
        next[e] = r->offsets[e];
        if (!count) continue;
        r->active_experts[r->active++] = e;
        for (int row0 = 0; row0 < count; row0 += TILE_ROWS) {
            r->tile_expert[r->tiles] = e;
            r->tile_row0[r->tiles] = r->offsets[e] + row0;
            r->tile_rows[r->tiles] = count - row0 < TILE_ROWS ? count - row0 : TILE_ROWS;
            r->tiles++;
        }
    }
    for (int i = 0; i < rows; i++) {
        int row = next[ids[i]]++;
        r->row_token[row] = i / top_k;
        r->row_weight[row] = weights[i];
        r->token_rows[i] = row;
    }
    // Each token's rows in ascending order: its experts in ascending order.
    for (int t = 0; t < tokens; t++) {
        int *list = r->token_rows + (int64_t)t * top_k;
        for (int a = 1; a < top_k; a++)
            for (int b = a; b > 0 && list[b - 1] > list[b]; b--) {
                int tmp = list[b];
                list[b] = list[b - 1];
                list[b - 1] = tmp;
            }
    }
    return 0;
}

// Thread `me` of `threads`: its run [first, last) of `items`.
static inline void my_items(int items, int me, int threads, int *first, int *last) {
    *first = (int)((int64_t)items * me / threads);
    *last = (int)((int64_t)items * (me + 1) / threads);
}

static inline float silu(float gate) { return gate / (1.0f + expf(-gate)); }

static inline float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// Expert e's bias from column col0 (NULL where the call has none).
static inline const float *expert_bias(const float *bias, int64_t stride, int e, int col0) {
    return bias ? bias + e * stride + col0 : NULL;
}

// A tile's bias (2 x PANEL columns; NULL: zero), lanes past `cols` zero.
static inline void tile_bias(const float *bias, int cols, vec *b0, vec *b1) {
    *b0 = *b1 = VZERO();
    if (!bias) return;
    *b0 = VMASK_LOAD(bias, columns_mask(cols));
    *b1 = VMASK_LOAD(bias + PANEL, columns_mask(cols - PANEL));
}

// gate[r][c] = unit(gate[r][c], up[r][c]) over a tile's rows.
static inline __attribute__((always_inline)) void apply_unit(
    float (*gate)[PANEL], const float (*up)[PANEL], int rows, const moe_unit *u) {
    if (u->kind == MOE_SILU) {
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < PANEL; c++) gate[r][c] = silu(gate[r][c]) * up[r][c];
        return;
    }
    float limit = u->limit, alpha = u->alpha;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < PANEL; c++) {
            float g = fminf(gate[r][c], limit);
            float v = fminf(fmaxf(up[r][c], -limit), limit);
            gate[r][c] = (v + 1.0f) * (g * sigmoid(g * alpha));
        }
}

// Gate/up tile: h (transposed, [inter][rows]) for PANEL intermediate columns from col0.
static inline __attribute__((always_inline)) void gate_up_tile(
    const float *xt, const float *w0, const float *bias, const moe_unit *u, float *ht,
    int hidden, const int rows, int col0, int inter, int prefetch) {
    vec acc0[TILE_ROWS], acc1[TILE_ROWS], b0, b1;
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = VZERO();
    tile_accumulate(xt, w0, hidden, rows, prefetch, acc0, acc1);
    tile_bias(bias, 2 * PANEL, &b0, &b1);
    float gate[TILE_ROWS][PANEL], up[TILE_ROWS][PANEL];
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        VSTOREU(gate[r], VADD(acc0[r], b0));
        VSTOREU(up[r], VADD(acc1[r], b1));
    }
    apply_unit(gate, (const float(*)[PANEL])up, rows, u);
    int cols = inter - col0 < PANEL ? inter - col0 : PANEL;
    for (int c = 0; c < cols; c++)
        for (int r = 0; r < rows; r++) ht[(col0 + c) * rows + r] = gate[r][c];
}

// Down tile: y rows (stride hidden) = weight * (h W2^T + bias) for 2 * PANEL columns from
// col0 (bias: the expert's from col0, or NULL).
static inline __attribute__((always_inline)) void down_tile(
    const float *ht, const float *w0, const float *bias, const float *weight, float *y,
    int hidden, int inter, const int rows, int col0, int prefetch) {
    vec acc0[TILE_ROWS], acc1[TILE_ROWS], b0, b1;
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = VZERO();
    tile_accumulate(ht, w0, inter, rows, prefetch, acc0, acc1);
    tile_bias(bias, hidden - col0, &b0, &b1);
    vmask m0 = columns_mask(hidden - col0), m1 = columns_mask(hidden - col0 - PANEL);
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        vec w = VSET1(weight[r]);
        VMASK_STORE(y + (int64_t)r * hidden + col0, m0, VMUL(VADD(acc0[r], b0), w));
        VMASK_STORE(y + (int64_t)r * hidden + col0 + PANEL, m1, VMUL(VADD(acc1[r], b1), w));
    }
}

#define GATE_UP_CASE(n) \
    case n: gate_up_tile(xt, w0, bias, u, ht, hidden, n, col0, inter, prefetch); break;
#define DOWN_CASE(n) \
    case n: down_tile(ht, w0, bias, weight, y, hidden, inter, n, col0, prefetch); break;

static void gate_up_any(const float *xt, const float *w0, const float *bias, const moe_unit *u,
                        float *ht, int hidden, int rows, int col0, int inter, int prefetch) {
    switch (rows) {
        GATE_UP_CASE(1) GATE_UP_CASE(2) GATE_UP_CASE(3) GATE_UP_CASE(4) GATE_UP_CASE(5)
        GATE_UP_CASE(6)
#if TILE_ROWS > 6
        GATE_UP_CASE(7) GATE_UP_CASE(8) GATE_UP_CASE(9) GATE_UP_CASE(10) GATE_UP_CASE(11)
        GATE_UP_CASE(12)
#endif
    }
}

static void down_any(const float *ht, const float *w0, const float *bias, const float *weight,
                     float *y, int hidden, int inter, int rows, int col0, int prefetch) {
    switch (rows) {
        DOWN_CASE(1) DOWN_CASE(2) DOWN_CASE(3) DOWN_CASE(4) DOWN_CASE(5) DOWN_CASE(6)
#if TILE_ROWS > 6
        DOWN_CASE(7) DOWN_CASE(8) DOWN_CASE(9) DOWN_CASE(10) DOWN_CASE(11) DOWN_CASE(12)
#endif
    }
}

int moe_gated_experts_f32(const float *x, int64_t ldx, const int64_t *topk_ids,
                          const float *topk_weights, const float *w13, int64_t w13_stride,
                          const float *w2, int64_t w2_stride, const float *b13,
                          int64_t b13_stride, const float *b2, int64_t b2_stride, float *out,
                          int tokens, int top_k, int experts, int hidden, int inter,
                          int unit, float limit, float alpha, int num_threads) {
    if (unit != MOE_SILU && unit != MOE_CLAMPED_SWIGLU) return 4;
    if (tokens <= 0) return 0;
    moe_unit u = {unit, limit, alpha, b13, b2, b13_stride, b2_stride};
    routing rt;
    int failed = route(&rt, topk_ids, topk_weights, tokens, top_k, experts);
    if (failed) {
        routing_free(&rt);
        return failed;
    }
    int rows = rt.rows;
    int blocks = moe_gate_up_rows(inter, 0) / (2 * PANEL);
    int pairs = (hidden + 2 * PANEL - 1) / (2 * PANEL);
    // xt: each tile's rows of x, [hidden][rows] from its first row's offset; ht likewise
    // [inter][rows]; y: one weighted output row per sorted row.
    float *xt = malloc((size_t)rows * hidden * sizeof(float));
    float *ht = malloc((size_t)rows * inter * sizeof(float));
    float *y = malloc((size_t)rows * hidden * sizeof(float));
    if (!xt || !ht || !y) {
        free(xt), free(ht), free(y), routing_free(&rt);
        return 1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        int threads = omp_get_num_threads(), me = omp_get_thread_num(), first, last;
#pragma omp for schedule(static)
        for (int t = 0; t < rt.tiles; t++) {
            int row0 = rt.tile_row0[t], n = rt.tile_rows[t];
            float *dst = xt + (int64_t)row0 * hidden;
            for (int r = 0; r < n; r++) {
                const float *src = x + (int64_t)rt.row_token[row0 + r] * ldx;
                for (int kk = 0; kk < hidden; kk++) dst[kk * n + r] = src[kk];
            }
        }
        my_items(rt.active * blocks, me, threads, &first, &last);
        for (int item = first; item < last; item++) {
            int e = rt.active_experts[item / blocks], b = item % blocks;
            const float *w0 = w13 + e * w13_stride + (int64_t)b * 2 * PANEL * hidden;
            for (int row0 = rt.offsets[e]; row0 < rt.offsets[e + 1]; row0 += TILE_ROWS) {
                int n = rt.offsets[e + 1] - row0 < TILE_ROWS ? rt.offsets[e + 1] - row0 : TILE_ROWS;
                gate_up_any(xt + (int64_t)row0 * hidden, w0,
                            expert_bias(u.gate_up_bias, u.gate_up_bias_stride, e, b * 2 * PANEL),
                            &u, ht + (int64_t)row0 * inter, hidden, n, b * PANEL, inter,
                            row0 == rt.offsets[e]);
            }
        }
#pragma omp barrier
        my_items(rt.active * pairs, me, threads, &first, &last);
        for (int item = first; item < last; item++) {
            int e = rt.active_experts[item / pairs], p = item % pairs;
            const float *w0 = w2 + e * w2_stride + (int64_t)p * 2 * PANEL * inter;
            for (int row0 = rt.offsets[e]; row0 < rt.offsets[e + 1]; row0 += TILE_ROWS) {
                int n = rt.offsets[e + 1] - row0 < TILE_ROWS ? rt.offsets[e + 1] - row0 : TILE_ROWS;
                down_any(ht + (int64_t)row0 * inter, w0,
                         expert_bias(u.down_bias, u.down_bias_stride, e, p * 2 * PANEL),
                         rt.row_weight + row0, y + (int64_t)row0 * hidden, hidden, inter, n,
                         p * 2 * PANEL, row0 == rt.offsets[e]);
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int t = 0; t < tokens; t++) {
            const int *list = rt.token_rows + (int64_t)t * top_k;
            float *o = out + (int64_t)t * hidden;
            for (int c = 0; c < hidden; c++) o[c] = 0.0f;
            for (int j = 0; j < top_k; j++) {
                const float *src = y + (int64_t)list[j] * hidden;
                for (int c = 0; c < hidden; c++) o[c] += src[c];
            }
        }
    }
    free(xt), free(ht), free(y), routing_free(&rt);
    return 0;
}

#else

int moe_gated_experts_f32(const float *x, int64_t ldx, const int64_t *topk_ids,
                          const float *topk_weights, const float *w13, int64_t w13_stride,
                          const float *w2, int64_t w2_stride, const float *b13,
                          int64_t b13_stride, const float *b2, int64_t b2_stride, float *out,
                          int tokens, int top_k, int experts, int hidden, int inter,
                          int unit, float limit, float alpha, int num_threads) {
    (void)x, (void)ldx, (void)topk_ids, (void)topk_weights, (void)w13, (void)w13_stride;
    (void)w2, (void)w2_stride, (void)b13, (void)b13_stride, (void)b2, (void)b2_stride;
    (void)out, (void)tokens, (void)top_k, (void)experts, (void)hidden, (void)inter;
    (void)unit, (void)limit, (void)alpha, (void)num_threads;
    return 2;
}

#endif

#if BF16_SUPPORTED  // (AVX512-BF16 implies AVX-512F: the routing above is built)

// The top half of an fp32 that holds a bf16 value exactly.
static inline uint16_t bf16_bits(float v) {
    union { float f; uint32_t u; } c;
    c.f = v;
    return (uint16_t)(c.u >> 16);
}

// Rounds every lane to bf16 and back (to nearest even).
static inline __m512 bf16_rounded(__m512 v) { return bf16_widen(bf16_round(v)); }

// A tile's bias (2 x BF16_PANEL columns; NULL: zero), lanes past `cols` zero.
static inline void tile_bias_bf16(const float *bias, int cols, __m512 *b0, __m512 *b1) {
    *b0 = *b1 = _mm512_setzero_ps();
    if (!bias) return;
    *b0 = _mm512_maskz_loadu_ps(columns_mask(cols), bias);
    *b1 = _mm512_maskz_loadu_ps(columns_mask(cols - BF16_PANEL), bias + BF16_PANEL);
}

// One row's clamped SwiGLU (gate and up already rounded to bf16), rounded where the
// reference rounds; into gate.
static inline void clamped_swiglu_row_bf16(float *gate, const float *up, const moe_unit *u) {
    __m512 limit = _mm512_set1_ps(u->limit), low = _mm512_set1_ps(-u->limit);
    __m512 g = _mm512_min_ps(_mm512_loadu_ps(gate), limit);
    float s[BF16_PANEL];
    _mm512_storeu_ps(s, bf16_rounded(_mm512_mul_ps(g, _mm512_set1_ps(u->alpha))));
    for (int c = 0; c < BF16_PANEL; c++) s[c] = sigmoid(s[c]);
    __m512 gs = bf16_rounded(_mm512_mul_ps(g, bf16_rounded(_mm512_loadu_ps(s))));
    __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_loadu_ps(up), low), limit);
    __m512 v1 = bf16_rounded(_mm512_add_ps(v, _mm512_set1_ps(1.0f)));
    _mm512_storeu_ps(gate, bf16_rounded(_mm512_mul_ps(v1, gs)));
}

// gate[r] = unit(gate[r], up[r]) over a tile's rows (both already rounded to bf16), rounded
// where the reference rounds.
static inline __attribute__((always_inline)) void apply_unit_bf16(
    float (*gate)[BF16_PANEL], const float (*up)[BF16_PANEL], int rows, const moe_unit *u) {
    if (u->kind != MOE_SILU) {
        for (int r = 0; r < rows; r++) clamped_swiglu_row_bf16(gate[r], up[r], u);
        return;
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < BF16_PANEL; c++) gate[r][c] = silu(gate[r][c]);
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        __m512 h = _mm512_mul_ps(bf16_rounded(_mm512_loadu_ps(gate[r])), _mm512_loadu_ps(up[r]));
        _mm512_storeu_ps(gate[r], bf16_rounded(h));
    }
}

// Gate/up tile: h as bf16 pairs (transposed, [K2][rows] x 2) for BF16_PANEL columns.
static inline __attribute__((always_inline)) void gate_up_tile_bf16(
    const uint32_t *xt, const uint16_t *w0, const float *bias, const moe_unit *u, uint16_t *ht,
    int hidden2, const int rows, int col0, int inter2, int prefetch) {
    __m512 acc0[TILE_ROWS], acc1[TILE_ROWS], b0, b1;
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    tile_accumulate_bf16(xt, w0, hidden2, rows, prefetch, acc0, acc1);
    tile_bias_bf16(bias, 2 * BF16_PANEL, &b0, &b1);
    float gate[TILE_ROWS][BF16_PANEL], up[TILE_ROWS][BF16_PANEL];
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(gate[r], bf16_rounded(_mm512_add_ps(acc0[r], b0)));
        _mm512_storeu_ps(up[r], bf16_rounded(_mm512_add_ps(acc1[r], b1)));
    }
    // Columns up to 2 * K2 (the pair that holds an odd size's last column): those past the
    // size have zero weights and biases, so their h is unit(0, 0) = 0, the pairs' padding.
    int cols = 2 * inter2 - col0 < BF16_PANEL ? 2 * inter2 - col0 : BF16_PANEL;
    apply_unit_bf16(gate, (const float(*)[BF16_PANEL])up, rows, u);
    for (int c = 0; c < cols; c++) {
        int col = col0 + c;
        for (int r = 0; r < rows; r++)
            ht[((col / 2) * rows + r) * 2 + (col & 1)] = (uint16_t)(bf16_bits(gate[r][c]));
    }
}

// Down tile: y rows (fp32, stride hidden) = bf16(bf16(h W2^T + bias) * weight).
static inline __attribute__((always_inline)) void down_tile_bf16(
    const uint32_t *ht, const uint16_t *w0, const float *bias, const float *weight, float *y,
    int hidden, int inter2, const int rows, int col0, int prefetch) {
    __m512 acc0[TILE_ROWS], acc1[TILE_ROWS], b0, b1;
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    tile_accumulate_bf16(ht, w0, inter2, rows, prefetch, acc0, acc1);
    tile_bias_bf16(bias, hidden - col0, &b0, &b1);
    __mmask16 m0 = columns_mask(hidden - col0), m1 = columns_mask(hidden - col0 - BF16_PANEL);
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        __m512 w = _mm512_set1_ps(weight[r]);
        __m512 v0 = bf16_rounded(_mm512_mul_ps(bf16_rounded(_mm512_add_ps(acc0[r], b0)), w));
        __m512 v1 = bf16_rounded(_mm512_mul_ps(bf16_rounded(_mm512_add_ps(acc1[r], b1)), w));
        _mm512_mask_storeu_ps(y + (int64_t)r * hidden + col0, m0, v0);
        _mm512_mask_storeu_ps(y + (int64_t)r * hidden + col0 + BF16_PANEL, m1, v1);
    }
}

#define GATE_UP_BF16_CASE(n) \
    case n: gate_up_tile_bf16(xt, w0, bias, u, ht, hidden2, n, col0, inter2, prefetch); break;
#define DOWN_BF16_CASE(n) \
    case n: down_tile_bf16(ht, w0, bias, weight, y, hidden, inter2, n, col0, prefetch); break;

static void gate_up_bf16_any(const uint32_t *xt, const uint16_t *w0, const float *bias,
                             const moe_unit *u, uint16_t *ht, int hidden2, int rows, int col0,
                             int inter2, int prefetch) {
    switch (rows) {
        GATE_UP_BF16_CASE(1) GATE_UP_BF16_CASE(2) GATE_UP_BF16_CASE(3) GATE_UP_BF16_CASE(4)
        GATE_UP_BF16_CASE(5) GATE_UP_BF16_CASE(6) GATE_UP_BF16_CASE(7) GATE_UP_BF16_CASE(8)
        GATE_UP_BF16_CASE(9) GATE_UP_BF16_CASE(10) GATE_UP_BF16_CASE(11) GATE_UP_BF16_CASE(12)
    }
}

static void down_bf16_any(const uint32_t *ht, const uint16_t *w0, const float *bias,
                          const float *weight, float *y, int hidden, int inter2, int rows,
                          int col0, int prefetch) {
    switch (rows) {
        DOWN_BF16_CASE(1) DOWN_BF16_CASE(2) DOWN_BF16_CASE(3) DOWN_BF16_CASE(4)
        DOWN_BF16_CASE(5) DOWN_BF16_CASE(6) DOWN_BF16_CASE(7) DOWN_BF16_CASE(8)
        DOWN_BF16_CASE(9) DOWN_BF16_CASE(10) DOWN_BF16_CASE(11) DOWN_BF16_CASE(12)
    }
}

int moe_gated_experts_bf16(const uint16_t *x, int64_t ldx, const int64_t *topk_ids,
                           const float *topk_weights, const uint16_t *w13, int64_t w13_stride,
                           const uint16_t *w2, int64_t w2_stride, const float *b13,
                           int64_t b13_stride, const float *b2, int64_t b2_stride,
                           uint16_t *out, int tokens, int top_k, int experts, int hidden,
                           int inter, int unit, float limit, float alpha, int num_threads) {
    if (unit != MOE_SILU && unit != MOE_CLAMPED_SWIGLU) return 4;
    if (tokens <= 0) return 0;
    moe_unit u = {unit, limit, alpha, b13, b2, b13_stride, b2_stride};
    routing rt;
    int failed = route(&rt, topk_ids, topk_weights, tokens, top_k, experts);
    if (failed) {
        routing_free(&rt);
        return failed;
    }
    int rows = rt.rows, hidden2 = (hidden + 1) / 2, inter2 = (inter + 1) / 2;
    int blocks = moe_gate_up_rows(inter, 1) / (2 * BF16_PANEL);
    int pairs = (hidden + 2 * BF16_PANEL - 1) / (2 * BF16_PANEL);
    // As the fp32 kernel's, with x and h as bf16 pairs (one 32-bit word per k pair).
    uint32_t *xt = malloc((size_t)rows * hidden2 * sizeof(uint32_t));
    uint32_t *ht = malloc((size_t)rows * inter2 * sizeof(uint32_t));
    float *y = malloc((size_t)rows * hidden * sizeof(float));
    if (!xt || !ht || !y) {
        free(xt), free(ht), free(y), routing_free(&rt);
        return 1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        int threads = omp_get_num_threads(), me = omp_get_thread_num(), first, last;
#pragma omp for schedule(static)
        for (int t = 0; t < rt.tiles; t++) {
            int row0 = rt.tile_row0[t], n = rt.tile_rows[t];
            uint32_t *dst = xt + (int64_t)row0 * hidden2;
            for (int r = 0; r < n; r++) {
                const uint16_t *src = x + (int64_t)rt.row_token[row0 + r] * ldx;
                for (int kk = 0; kk < hidden2; kk++) {
                    uint32_t hi = 2 * kk + 1 < hidden ? src[2 * kk + 1] : 0;
                    dst[kk * n + r] = (uint32_t)src[2 * kk] | hi << 16;
                }
            }
        }
        my_items(rt.active * blocks, me, threads, &first, &last);
        for (int item = first; item < last; item++) {
            int e = rt.active_experts[item / blocks], b = item % blocks;
            const uint16_t *w0 = w13 + e * w13_stride + (int64_t)b * 2 * BF16_PANEL * 2 * hidden2;
            for (int row0 = rt.offsets[e]; row0 < rt.offsets[e + 1]; row0 += TILE_ROWS) {
                int n = rt.offsets[e + 1] - row0 < TILE_ROWS ? rt.offsets[e + 1] - row0 : TILE_ROWS;
                gate_up_bf16_any(
                    xt + (int64_t)row0 * hidden2, w0,
                    expert_bias(u.gate_up_bias, u.gate_up_bias_stride, e, b * 2 * BF16_PANEL), &u,
                    (uint16_t *)(ht + (int64_t)row0 * inter2), hidden2, n, b * BF16_PANEL, inter2,
                    row0 == rt.offsets[e]);
            }
        }
#pragma omp barrier
        my_items(rt.active * pairs, me, threads, &first, &last);
        for (int item = first; item < last; item++) {
            int e = rt.active_experts[item / pairs], p = item % pairs;
            const uint16_t *w0 = w2 + e * w2_stride + (int64_t)p * 2 * BF16_PANEL * 2 * inter2;
            for (int row0 = rt.offsets[e]; row0 < rt.offsets[e + 1]; row0 += TILE_ROWS) {
                int n = rt.offsets[e + 1] - row0 < TILE_ROWS ? rt.offsets[e + 1] - row0 : TILE_ROWS;
                down_bf16_any(ht + (int64_t)row0 * inter2, w0,
                              expert_bias(u.down_bias, u.down_bias_stride, e, p * 2 * BF16_PANEL),
                              rt.row_weight + row0, y + (int64_t)row0 * hidden, hidden, inter2, n,
                              p * 2 * BF16_PANEL, row0 == rt.offsets[e]);
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int t = 0; t < tokens; t++) {
            const int *list = rt.token_rows + (int64_t)t * top_k;
            uint16_t *o = out + (int64_t)t * hidden;
            for (int c = 0; c < hidden; c += BF16_PANEL) {
                __mmask16 m = columns_mask(hidden - c);
                __m512 sum = _mm512_setzero_ps();
                for (int j = 0; j < top_k; j++)
                    sum = bf16_rounded(
                        _mm512_add_ps(sum, _mm512_maskz_loadu_ps(m, y + (int64_t)list[j] * hidden + c)));
                _mm256_mask_storeu_epi16(o + c, m, bf16_round(sum));
            }
        }
    }
    free(xt), free(ht), free(y), routing_free(&rt);
    return 0;
}

#else

int moe_gated_experts_bf16(const uint16_t *x, int64_t ldx, const int64_t *topk_ids,
                           const float *topk_weights, const uint16_t *w13, int64_t w13_stride,
                           const uint16_t *w2, int64_t w2_stride, const float *b13,
                           int64_t b13_stride, const float *b2, int64_t b2_stride,
                           uint16_t *out, int tokens, int top_k, int experts, int hidden,
                           int inter, int unit, float limit, float alpha, int num_threads) {
    (void)x, (void)ldx, (void)topk_ids, (void)topk_weights, (void)w13, (void)w13_stride;
    (void)w2, (void)w2_stride, (void)b13, (void)b13_stride, (void)b2, (void)b2_stride;
    (void)out, (void)tokens, (void)top_k, (void)experts, (void)hidden, (void)inter;
    (void)unit, (void)limit, (void)alpha, (void)num_threads;
    return 2;
}

#endif
