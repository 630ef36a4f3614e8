// Prompt-chunk attention over the paged KV cache, read in place (the CPU path).
//
// Each chunk of a step's prompts attends over its sequence's context: the
// tokens cached before it and, causally, its own (already stored in the cache
// by the time this runs). torch's CPU flash kernel needs the chunk's K/V
// gathered out of the cache, a second call over the cached context and a merge
// of the two by their log-sum-exps; it also runs its block products through
// general GEMM calls sized for larger matrices. This kernel does the whole
// chunk in one pass, flash style, with the products written for the shapes
// attention has (head_dim 64 or 128, a few query heads per KV head). fp32, and
// bf16 in one of two ways (below: "bf16").
//
// The algorithm, for one work item (a chunk, one KV head, a tile of up to
// TILE_TOKENS (16) of the chunk's tokens; its rows are those tokens times the query
// heads that share the KV head):
//   1. The tile's queries are copied, scaled by scale * log2(e), so the
//      softmax is a power of two (exp2 is cheaper than exp and exact here).
//   2. Keys are visited KEYS (32) at a time, up to the tile's last position
//      (the causal upper triangle beyond it is never touched). For each 32:
//      S = Q K^T (rows x 32) from a transposed copy of the chunk's keys
//      (made once per chunk and KV head, step 0 below, so 32 keys' values of
//      one dimension are two vector loads); keys past a row's position are
//      masked; the running maximum m, the running sum l (a vector of 16
//      partial sums, reduced at the end) and the output rows O are rescaled
//      by exp2(m_old - m_new); P = exp2(S - m); O += P V, V's rows read from
//      the cache in place.
//   3. out = O / l.
// Step 0, before the items: each chunk's keys for each KV head are copied out
// of the cache transposed, [ceil(context / 32), head_dim, 32], in parallel.
// Items are then spread over OpenMP threads, the costliest (a chunk's last
// tiles, which see the most keys) first.
//
// Why these shapes: both products are register-blocked so that every load
// feeds several FMAs (S: 8 rows x 32 keys, 16 accumulators; P V: 4 rows x 64
// columns, 16 accumulators), written with GCC's vector extensions (AVX-512
// where the CPU has it, narrower vectors otherwise); torch's flash kernel
// calls a general GEMM for each pair of blocks instead.
//
// Layouts (row-major):
//   q        [num_tokens, num_heads, head_dim]  row strides given (q_tok, q_head)
//   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   contiguous
//   v_cache  the same
//   starts   [num_chunks] int32: the chunk's first row in q and out
//   lens     [num_chunks] int32: its tokens
//   cached   [num_chunks] int32: its sequence's tokens cached before it
//   tables   [num_chunks, tables_stride] int32: the sequence's block ids
//   out      [num_tokens, num_heads, head_dim]  contiguous; the chunks' rows written
//
// bf16: where the CPU multiplies bf16 itself (AVX512-BF16: vdpbf16ps multiplies two
// pairs of bf16 and adds both products to an fp32 lane), both products take bf16
// pairs, with fp32 sums, as GPU flash attention does: step 0 copies the keys as
// [ceil(context / 32), head_dim / 2, 32] pairs (k[2i], k[2i + 1]) of each key and the
// values as [ceil(context / 32), 16, head_dim] pairs (v[2j][c], v[2j + 1][c]) of
// consecutive keys; S takes the tile's queries as they are (pairs along head_dim,
// broadcast) and is scaled in fp32 afterwards; P is rounded to bf16 pairs of
// consecutive keys for P V. The softmax and O stay fp32. Elsewhere bf16 is loaded to
// fp32 and runs the fp32 path.
//
// Options: `window` > 0 narrows the row at position p to keys p - window < j <= p:
// a tile starts at the 32 keys holding its first row's first key, keys before a
// row's window are masked with the causal ones, and step 0 reads nothing of the
// cache before the chunk's first window (those blocks may be back in the pool).
// A row may then see no key of a 32 (its window starts later): that 32 leaves it
// as it was. `soft_cap` > 0 maps each scaled score s to soft_cap * tanh(s / soft_cap)
// before the mask (in the base-2 domain: c' = soft_cap * log2(e)). `sinks` (NULL:
// none), a logit per query head with no value (gpt-oss): a row's running max and sum
// start from it (m = sink * log2(e), l = 1) instead of from nothing.
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_scalar.h"

int attention_bf16_pairs(void) { return BF16_PAIRS; }

#define KEYS 32          // keys per step of the online softmax (two vectors)
#define TILE_TOKENS 16   // chunk tokens per work item (fewer for groups over 8 heads)
#define MAX_ROWS 128     // rows per work item: tile tokens x query heads per KV head
#define LOG2E 1.4426950408889634f
#define VD 4             // output vectors (of 16) per pass of P V: 4 rows x 4 in registers

typedef uint16_t v16h __attribute__((vector_size(32)));
// Unaligned views for loads and stores.
typedef float v16_u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t v16h_u __attribute__((vector_size(32), aligned(2), may_alias));

static inline v16 f32_load16(const float* p) { return *(const v16_u*)p; }
static inline v16 bf16_load16(const uint16_t* p) {
    v16u wide = __builtin_convertvector(*(const v16h_u*)p, v16u) << 16;
    return (v16)wide;
}


// Lane by lane: where mask, a, else b.
static inline v16 select(v16i mask, v16 a, v16 b) { return (v16)(((v16i)a & mask) | ((v16i)b & ~mask)); }

static inline float hmax(v16 x) {
    float m = x[0];
    for (int i = 1; i < 16; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float hsum(v16 x) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}

// 2^x for x <= 0, lanes below -126 (masked keys among them) give exactly 0.
// Split x = n + f, n an integer and f in [-0.5, 0.5]; 2^f by a degree-7
// Taylor polynomial (relative error ~1e-9, under fp32's rounding), 2^n into the exponent.
static inline v16 exp2_neg(v16 x) {
    const v16i dead = x < splat(-126.0f);
    x = select(dead, splat(-126.0f), x);
    const v16 n = __builtin_convertvector(__builtin_convertvector(x - splat(0.5f), v16i), v16);
    // convertvector truncates toward zero; x - 0.5 <= 0, so the truncation is a ceiling:
    // n = ceil(x - 0.5) = round(x) (ties aside, which only move f to the interval's end).
    const v16 f = x - n;
    v16 p = splat(1.5252734e-5f);
    p = p * f + splat(1.5403530e-4f);
    p = p * f + splat(1.3333558e-3f);
    p = p * f + splat(9.6181291e-3f);
    p = p * f + splat(5.5504109e-2f);
    p = p * f + splat(2.4022651e-1f);
    p = p * f + splat(6.9314718e-1f);
    p = p * f + splat(1.0f);
    const v16i bits = (v16i)p + (__builtin_convertvector(n, v16i) << 23);
    return (v16)(bits & ~dead);
}

// One row's step of the online softmax over 32 keys k0..k0 + 31: scores s_lo, s_hi
// (base 2) are soft-capped (cap2 > 0), masked (keys past the row's position `pos`
// and, with a window, before it), then the running max m and sum l are moved on;
// writes the row's P (32 floats) and alpha, the factor its O is rescaled by.
static inline void softmax_row(v16 s_lo, v16 s_hi, int k0, int pos, int masked, int window,
                               float cap2, float* m, v16* l, float* alpha, float* p) {
    if (cap2 > 0.0f)
        for (int x = 0; x < 16; x++) {
            s_lo[x] = cap2 * tanhf(s_lo[x] / cap2);
            s_hi[x] = cap2 * tanhf(s_hi[x] / cap2);
        }
    if (masked) {
        const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const v16 at = splat((float)k0) + lane, row_pos = splat((float)pos);
        const v16 at_hi = at + splat(16.0f);
        v16i dead_lo = at > row_pos, dead_hi = at_hi > row_pos;
        if (window > 0) {
            const v16 before = row_pos - splat((float)window);
            dead_lo |= at <= before;
            dead_hi |= at_hi <= before;
        }
        s_lo = select(dead_lo, splat(-FLT_MAX), s_lo);
        s_hi = select(dead_hi, splat(-FLT_MAX), s_hi);
    }
    const float mx = hmax(select(s_lo > s_hi, s_lo, s_hi));
    if (mx == -FLT_MAX) { /* no key of these 32 in the row's window */
        *alpha = 1.0f;
        *(v16*)p = *(v16*)(p + 16) = splat(0.0f);
        return;
    }
    const float m_new = mx > *m ? mx : *m;
    *alpha = *m == m_new ? 1.0f : exp2f(*m - m_new);
    *m = m_new;
    const v16 e_lo = exp2_neg(s_lo - splat(m_new));
    const v16 e_hi = exp2_neg(s_hi - splat(m_new));
    *l = *l * splat(*alpha) + (e_lo + e_hi);
    *(v16*)p = e_lo;
    *(v16*)(p + 16) = e_hi;
}

// A work item's rows before their first key: O = 0, m and l from the sink or nothing.
static inline void start_rows(int rows, int group, int t0, int kv, int cached, int head_dim,
                              const float* sinks, float* o, float* m, v16* l, int* pos) {
    memset(o, 0, sizeof(float) * (size_t)rows * head_dim);
    for (int r = 0; r < rows; r++) {
        const int h = kv * group + r % group;
        m[r] = sinks ? sinks[h] * LOG2E : -FLT_MAX;
        l[r] = splat(0.0f);
        if (sinks) l[r][0] = 1.0f;
        pos[r] = cached + t0 + r / group;
    }
}

// O[r] = O[r] * alpha[r] + sum_j P[r][j] V[j] for four rows and VD vectors of their
// columns: 16 accumulators in registers, each V row loaded once for the four rows.
#define DEFINE_PV(NAME, T, LOAD16)                                                             \
    static inline void NAME##_pv4(float* o, const float* p, const float* alpha,                \
                                  const T* const* vrow, int n, int col, int head_dim) {        \
        v16 acc[4][VD];                                                                         \
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {                                   \
            const v16 a = splat(alpha[i]);                                                      \
            _Pragma("GCC unroll 4") for (int x = 0; x < VD; x++)                                \
                acc[i][x] = *(const v16*)(o + (size_t)i * head_dim + x * 16) * a;               \
        }                                                                                       \
        for (int j = 0; j < n; j++) {                                                           \
            v16 vv[VD];                                                                         \
            _Pragma("GCC unroll 4") for (int x = 0; x < VD; x++)                                \
                vv[x] = LOAD16(vrow[j] + col + x * 16);                                         \
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {                               \
                const v16 pij = splat(p[i * KEYS + j]);                                         \
                _Pragma("GCC unroll 4") for (int x = 0; x < VD; x++) acc[i][x] += pij * vv[x];  \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)                                     \
            _Pragma("GCC unroll 4") for (int x = 0; x < VD; x++)                                \
                *(v16*)(o + (size_t)i * head_dim + x * 16) = acc[i][x];                         \
    }                                                                                           \
    /* The same for the last rows of a tile or the last columns of a head. */                  \
    static inline void NAME##_pv(float* o, const float* p, const float* alpha,                 \
                                 const T* const* vrow, int n, int col, int head_dim, int nr,    \
                                 int w) {                                                       \
        for (int i = 0; i < nr; i++) {                                                          \
            float* oi = o + (size_t)i * head_dim;                                               \
            for (int x = 0; x < w; x++) {                                                       \
                v16 acc = *(const v16*)(oi + x * 16) * splat(alpha[i]);                         \
                for (int j = 0; j < n; j++)                                                     \
                    acc += splat(p[i * KEYS + j]) * LOAD16(vrow[j] + col + x * 16);             \
                *(v16*)(oi + x * 16) = acc;                                                     \
            }                                                                                   \
        }                                                                                       \
    }

// One work item, K transposed in fp32 and V read in place. HEAD_DIM is a literal for the common sizes (accumulators in
// registers, loops unrolled) and the runtime value otherwise (a multiple of 16).
#define DEFINE_TILE(NAME, PV, T, LOAD, STORE, LOAD16, HEAD_DIM)                                   \
    static void NAME(const T* q, int64_t q_tok, int64_t q_head, const float* kt,               \
                     const float* vp, const T* v_cache, const int32_t* table, int start,        \
                     int cached, int t0, int t1, T* out, int num_heads, int num_kv_heads,       \
                     int head_dim_arg, int block_size, float scale, int kv, float* work,        \
                     int window, float soft_cap, const float* sinks) {                          \
        const int head_dim = HEAD_DIM;                                                          \
        (void)head_dim_arg;                                                                     \
        (void)vp;                                                                               \
        const int vd = head_dim / 16;                                                           \
        const int group = num_heads / num_kv_heads;                                             \
        const int rows = (t1 - t0) * group;                                                     \
        const int64_t row_stride = (int64_t)num_kv_heads * head_dim;                            \
        float* qs = work;                              /* [rows, head_dim] */                   \
        float* o = qs + (size_t)MAX_ROWS * head_dim;   /* [rows, head_dim] */                   \
        float* p = o + (size_t)MAX_ROWS * head_dim;    /* [rows, KEYS] */                       \
        float m[MAX_ROWS], alpha[MAX_ROWS];                                                     \
        int pos[MAX_ROWS];                                                                      \
        v16 l[MAX_ROWS];                                                                        \
        const float qscale = scale * LOG2E;                                                     \
        for (int r = 0; r < rows; r++) {                                                        \
            const int tok = t0 + r / group, h = kv * group + r % group;                         \
            const T* src = q + (int64_t)(start + tok) * q_tok + (int64_t)h * q_head;            \
            for (int i = 0; i < head_dim; i++) qs[r * head_dim + i] = LOAD(src[i]) * qscale;    \
        }                                                                                       \
        start_rows(rows, group, t0, kv, cached, head_dim, sinks, o, m, l, pos);                 \
        const int first_pos = cached + t0, kend = cached + t1;                                  \
        const int kstart = window > 0 && first_pos >= window ? first_pos - window + 1 : 0;      \
        const float cap2 = soft_cap * LOG2E;                                                    \
        for (int k0 = kstart / KEYS * KEYS; k0 < kend; k0 += KEYS) {                            \
            const float* ktile = kt + (size_t)(k0 / KEYS) * head_dim * KEYS;                    \
            const int n = kend - k0 < KEYS ? kend - k0 : KEYS;                                  \
            const int masked = k0 + KEYS - 1 > first_pos || window > 0;                         \
            /* S = Q K^T, eight rows by 32 keys: 16 accumulators, and each load of a */        \
            /* query element (broadcast) or key column serves several FMAs. */                 \
            for (int r0 = 0; r0 < rows; r0 += 8) {                                              \
                const int nr = rows - r0 < 8 ? rows - r0 : 8;                                   \
                v16 acc[8][2];                                                                  \
                for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = splat(0.0f);                \
                const float* qr = qs + (size_t)r0 * head_dim;                                   \
                if (nr == 8) {                                                                  \
                    for (int d = 0; d < head_dim; d++) {                                        \
                        const v16 k_lo = *(const v16*)(ktile + d * KEYS);                       \
                        const v16 k_hi = *(const v16*)(ktile + d * KEYS + 16);                  \
                        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                   \
                            const v16 qv = splat(qr[i * head_dim + d]);                         \
                            acc[i][0] += qv * k_lo;                                             \
                            acc[i][1] += qv * k_hi;                                             \
                        }                                                                       \
                    }                                                                           \
                } else {                                                                        \
                    for (int d = 0; d < head_dim; d++) {                                        \
                        const v16 k_lo = *(const v16*)(ktile + d * KEYS);                       \
                        const v16 k_hi = *(const v16*)(ktile + d * KEYS + 16);                  \
                        for (int i = 0; i < nr; i++) {                                          \
                            const v16 qv = splat(qr[i * head_dim + d]);                         \
                            acc[i][0] += qv * k_lo;                                             \
                            acc[i][1] += qv * k_hi;                                             \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
                /* Mask, then the online softmax's bookkeeping, row by row. */                 \
                for (int i = 0; i < nr; i++)                                                    \
                    softmax_row(acc[i][0], acc[i][1], k0, pos[r0 + i], masked, window, cap2,    \
                                &m[r0 + i], &l[r0 + i], &alpha[r0 + i],                         \
                                p + (size_t)(r0 + i) * KEYS);                                   \
            }                                                                                   \
            /* O = O * alpha + P V, four rows at a time: one V row load serves four FMAs. */   \
            const T* vrow[KEYS];                                                                \
            for (int j = 0; j < n; j++) { /* (P is 0 before the window: no row read there) */ \
                const int t = k0 + j < kstart ? kstart : k0 + j;                                \
                vrow[j] = v_cache + ((int64_t)table[t / block_size] * block_size +              \
                                     t % block_size) * row_stride + (int64_t)kv * head_dim;     \
            }                                                                                   \
            for (int r0 = 0; r0 < rows; r0 += 4) {                                              \
                const int nr = rows - r0 < 4 ? rows - r0 : 4;                                   \
                for (int c = 0; c < vd; c += VD) {                                              \
                    float* oc = o + (size_t)r0 * head_dim + c * 16;                             \
                    const float* pr = p + (size_t)r0 * KEYS;                                    \
                    if (nr == 4 && vd - c >= VD)                                                \
                        PV##_pv4(oc, pr, alpha + r0, vrow, n, c * 16, head_dim);              \
                    else                                                                        \
                        PV##_pv(oc, pr, alpha + r0, vrow, n, c * 16, head_dim, nr,            \
                                  vd - c < VD ? vd - c : VD);                                   \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < rows; r++) {                                                        \
            const int tok = t0 + r / group, h = kv * group + r % group;                         \
            T* dst = out + ((int64_t)(start + tok) * num_heads + h) * head_dim;                 \
            const float inv = 1.0f / hsum(l[r]);                                                \
            for (int i = 0; i < head_dim; i++) dst[i] = STORE(o[r * head_dim + i] * inv);       \
        }                                                                                       \
    }

// Step 0 for one KV head's 32 keys k0..k0 + 31 of a chunk: the keys transposed to fp32,
// [head_dim][32] (zero past the context and before its first window).
#define DEFINE_PACK(NAME, T, LOAD)                                                              \
    static void NAME(float* kdst, float* vdst, const T* k_cache, const T* v_cache,              \
                     const int32_t* table, int k0, int len, int from, int block_size,           \
                     int64_t row_stride, int kv, int head_dim) {                                \
        (void)vdst;                                                                             \
        (void)v_cache;                                                                          \
        for (int j = 0; j < KEYS; j++) {                                                        \
            const int t = k0 + j;                                                               \
            if (t >= len || t < from) {                                                         \
                for (int d = 0; d < head_dim; d++) kdst[d * KEYS + j] = 0.0f;                   \
                continue;                                                                       \
            }                                                                                   \
            const T* src = k_cache +                                                            \
                           ((int64_t)table[t / block_size] * block_size + t % block_size) *     \
                               row_stride +                                                     \
                           (int64_t)kv * head_dim;                                              \
            for (int d = 0; d < head_dim; d++) kdst[d * KEYS + j] = LOAD(src[d]);               \
        }                                                                                       \
    }

// The fp32 path's work items and step 0, for one element type.
#define DEFINE_LOADED(NAME, T, LOAD, STORE, LOAD16)                                            \
    DEFINE_PV(NAME, T, LOAD16)                                                                  \
    DEFINE_TILE(NAME##_d64, NAME, T, LOAD, STORE, LOAD16, 64)                                   \
    DEFINE_TILE(NAME##_d128, NAME, T, LOAD, STORE, LOAD16, 128)                                 \
    DEFINE_TILE(NAME##_any, NAME, T, LOAD, STORE, LOAD16, head_dim_arg)                         \
    DEFINE_PACK(NAME##_pack, T, LOAD)

#if BF16_PAIRS
// O[r] = O[r] * alpha[r] + sum over key pairs of P[r] pair . V pair, for four rows and VD
// vectors of 16 columns (each V load a pair of keys' 16 columns, for the four rows).
static inline void pairs_pv4(float* o, const uint32_t* p2, const float* alpha,
                             const uint32_t* vp, int np, int col, int head_dim) {
    v16 acc[4][VD];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
        for (int x = 0; x < VD; x++)
            acc[i][x] = *(const v16*)(o + (size_t)i * head_dim + x * 16) * splat(alpha[i]);
    for (int jp = 0; jp < np; jp++) {
        v16u vv[VD];
#pragma GCC unroll 4
        for (int x = 0; x < VD; x++) vv[x] = *(const v16u*)(vp + (size_t)jp * head_dim + col + x * 16);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const v16u pij = splat_pair(p2[i * (KEYS / 2) + jp]);
#pragma GCC unroll 4
            for (int x = 0; x < VD; x++) acc[i][x] = dot_pairs(acc[i][x], pij, vv[x]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
        for (int x = 0; x < VD; x++) *(v16*)(o + (size_t)i * head_dim + x * 16) = acc[i][x];
}

// The same for the last rows of a tile or the last columns of a head.
static inline void pairs_pv(float* o, const uint32_t* p2, const float* alpha,
                            const uint32_t* vp, int np, int col, int head_dim, int nr, int w) {
    for (int i = 0; i < nr; i++) {
        float* oi = o + (size_t)i * head_dim;
        for (int x = 0; x < w; x++) {
            v16 acc = *(const v16*)(oi + x * 16) * splat(alpha[i]);
            for (int jp = 0; jp < np; jp++)
                acc = dot_pairs(acc, splat_pair(p2[i * (KEYS / 2) + jp]),
                                *(const v16u*)(vp + (size_t)jp * head_dim + col + x * 16));
            *(v16*)(oi + x * 16) = acc;
        }
    }
}

// One work item on bf16 pairs (kt, vp: the chunk's packed keys and values for this KV
// head, from step 0).
#define DEFINE_PAIRS_TILE(NAME, HEAD_DIM)                                                       \
    static void NAME(const uint16_t* q, int64_t q_tok, int64_t q_head, const uint32_t* kt,     \
                     const uint32_t* vp, const uint16_t* v_cache, const int32_t* table,         \
                     int start, int cached, int t0, int t1, uint16_t* out, int num_heads,       \
                     int num_kv_heads, int head_dim_arg, int block_size, float scale, int kv,   \
                     float* work, int window, float soft_cap, const float* sinks) {             \
        const int head_dim = HEAD_DIM, half = HEAD_DIM / 2;                                     \
        (void)head_dim_arg;                                                                     \
        (void)v_cache;                                                                          \
        (void)table;                                                                            \
        (void)block_size;                                                                       \
        const int vd = head_dim / 16;                                                           \
        const int group = num_heads / num_kv_heads;                                             \
        const int rows = (t1 - t0) * group;                                                     \
        uint32_t* q2 = (uint32_t*)work;                 /* [rows, half]: query pairs */         \
        float* o = work + (size_t)MAX_ROWS * head_dim;  /* [rows, head_dim] */                  \
        uint32_t* p2 = (uint32_t*)(o + (size_t)MAX_ROWS * head_dim); /* [rows, KEYS / 2] */     \
        float m[MAX_ROWS], alpha[MAX_ROWS];                                                     \
        int pos[MAX_ROWS];                                                                      \
        v16 l[MAX_ROWS];                                                                        \
        float pf[KEYS] __attribute__((aligned(64)));                                            \
        const v16 qscale = splat(scale * LOG2E);                                                \
        for (int r = 0; r < rows; r++) {                                                        \
            const int tok = t0 + r / group, h = kv * group + r % group;                         \
            memcpy(q2 + (size_t)r * half,                                                       \
                   q + (int64_t)(start + tok) * q_tok + (int64_t)h * q_head,                    \
                   sizeof(uint16_t) * head_dim);                                                \
        }                                                                                       \
        start_rows(rows, group, t0, kv, cached, head_dim, sinks, o, m, l, pos);                 \
        const int first_pos = cached + t0, kend = cached + t1;                                  \
        const int kstart = window > 0 && first_pos >= window ? first_pos - window + 1 : 0;      \
        const float cap2 = soft_cap * LOG2E;                                                    \
        for (int k0 = kstart / KEYS * KEYS; k0 < kend; k0 += KEYS) {                            \
            const uint32_t* ktile = kt + (size_t)(k0 / KEYS) * half * KEYS;                     \
            const uint32_t* vtile = vp + (size_t)(k0 / KEYS) * (KEYS / 2) * head_dim;           \
            const int n = kend - k0 < KEYS ? kend - k0 : KEYS;                                  \
            const int masked = k0 + KEYS - 1 > first_pos || window > 0;                         \
            /* S = Q K^T, eight rows by 32 keys, a pair of head_dim per vdpbf16ps. */          \
            for (int r0 = 0; r0 < rows; r0 += 8) {                                              \
                const int nr = rows - r0 < 8 ? rows - r0 : 8;                                   \
                v16 acc[8][2];                                                                  \
                for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = splat(0.0f);                \
                const uint32_t* qr = q2 + (size_t)r0 * half;                                    \
                if (nr == 8) {                                                                  \
                    for (int d2 = 0; d2 < half; d2++) {                                         \
                        const v16u k_lo = *(const v16u*)(ktile + d2 * KEYS);                    \
                        const v16u k_hi = *(const v16u*)(ktile + d2 * KEYS + 16);               \
                        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                   \
                            const v16u qv = splat_pair(qr[i * half + d2]);                      \
                            acc[i][0] = dot_pairs(acc[i][0], qv, k_lo);                         \
                            acc[i][1] = dot_pairs(acc[i][1], qv, k_hi);                         \
                        }                                                                       \
                    }                                                                           \
                } else {                                                                        \
                    for (int d2 = 0; d2 < half; d2++) {                                         \
                        const v16u k_lo = *(const v16u*)(ktile + d2 * KEYS);                    \
                        const v16u k_hi = *(const v16u*)(ktile + d2 * KEYS + 16);               \
                        for (int i = 0; i < nr; i++) {                                          \
                            const v16u qv = splat_pair(qr[i * half + d2]);                      \
                            acc[i][0] = dot_pairs(acc[i][0], qv, k_lo);                         \
                            acc[i][1] = dot_pairs(acc[i][1], qv, k_hi);                         \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
                /* Scale, the online softmax, and P rounded to pairs of keys. */               \
                for (int i = 0; i < nr; i++) {                                                  \
                    const int r = r0 + i;                                                       \
                    softmax_row(acc[i][0] * qscale, acc[i][1] * qscale, k0, pos[r], masked,     \
                                window, cap2, &m[r], &l[r], &alpha[r], pf);                     \
                    *(v16u*)(p2 + (size_t)r * (KEYS / 2)) =                                     \
                        bf16_pairs(*(const v16*)pf, *(const v16*)(pf + 16));                    \
                }                                                                               \
            }                                                                                   \
            /* O = O * alpha + P V, four rows at a time, a pair of keys per vdpbf16ps. */      \
            const int np = (n + 1) / 2;                                                         \
            for (int r0 = 0; r0 < rows; r0 += 4) {                                              \
                const int nr = rows - r0 < 4 ? rows - r0 : 4;                                   \
                for (int c = 0; c < vd; c += VD) {                                              \
                    float* oc = o + (size_t)r0 * head_dim + c * 16;                             \
                    const uint32_t* pr = p2 + (size_t)r0 * (KEYS / 2);                          \
                    if (nr == 4 && vd - c >= VD)                                                \
                        pairs_pv4(oc, pr, alpha + r0, vtile, np, c * 16, head_dim);             \
                    else                                                                        \
                        pairs_pv(oc, pr, alpha + r0, vtile, np, c * 16, head_dim, nr,           \
                                 vd - c < VD ? vd - c : VD);                                    \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < rows; r++) {                                                        \
            const int tok = t0 + r / group, h = kv * group + r % group;                         \
            uint16_t* dst = out + ((int64_t)(start + tok) * num_heads + h) * head_dim;          \
            const float inv = 1.0f / hsum(l[r]);                                                \
            for (int i = 0; i < head_dim; i++) dst[i] = bf16_store(o[r * head_dim + i] * inv);  \
        }                                                                                       \
    }

DEFINE_PAIRS_TILE(pairs_d64, 64)
DEFINE_PAIRS_TILE(pairs_d128, 128)
DEFINE_PAIRS_TILE(pairs_any, head_dim_arg)

typedef uint16_t u16_alias __attribute__((may_alias));

// Step 0 of the bf16 pairs path for one KV head's 32 keys k0..k0 + 31 of a chunk: the
// keys' pairs along head_dim, [head_dim / 2][32], and the values' pairs of consecutive
// keys, [16][head_dim] (zero past the context and before its first window).
static void pairs_pack(uint32_t* kdst, uint32_t* vdst, const uint16_t* k_cache,
                       const uint16_t* v_cache, const int32_t* table, int k0, int len, int from,
                       int block_size, int64_t row_stride, int kv, int head_dim) {
    u16_alias* vhalves = (u16_alias*)vdst;
    for (int j = 0; j < KEYS; j++) {
        const int t = k0 + j;
        u16_alias* vj = vhalves + (size_t)(j / 2) * head_dim * 2 + (j & 1);
        if (t >= len || t < from) {
            for (int d2 = 0; d2 < head_dim / 2; d2++) kdst[d2 * KEYS + j] = 0;
            for (int c = 0; c < head_dim; c++) vj[2 * c] = 0;
            continue;
        }
        const int64_t at =
            ((int64_t)table[t / block_size] * block_size + t % block_size) * row_stride +
            (int64_t)kv * head_dim;
        const uint16_t *ks = k_cache + at, *vs = v_cache + at;
        for (int d2 = 0; d2 < head_dim / 2; d2++)
            kdst[d2 * KEYS + j] = (uint32_t)ks[2 * d2] | (uint32_t)ks[2 * d2 + 1] << 16;
        for (int c = 0; c < head_dim; c++) vj[2 * c] = vs[c];
    }
}
#endif

// The entry point, over the work items NAME##_d64/_d128/_any and step 0 NAME##_pack of
// one path: KW its packed words, K_SET and V_SET the words it packs per 32 keys of one
// KV head (V_SET 0: V is read in place). Returns non-zero when a buffer could not be
// allocated.
#define DEFINE_PREFILL(ENTRY, T, KW, NAME, K_SET, V_SET)                                       \
    int ENTRY(const T* q, int64_t q_tok, int64_t q_head, const T* k_cache, const T* v_cache,   \
              const int32_t* starts, const int32_t* lens, const int32_t* cached,                \
              const int32_t* tables, int64_t tables_stride, T* out, int num_chunks,             \
              int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,       \
              int window, float soft_cap, const float* sinks, int num_threads) {                \
        void (*run)(const T*, int64_t, int64_t, const KW*, const KW*, const T*, const int32_t*, \
                    int, int, int, int, T*, int, int, int, int, float, int, float*, int, float, \
                    const float*) =                                                             \
            head_dim == 64 ? NAME##_d64 : head_dim == 128 ? NAME##_d128 : NAME##_any;           \
        const int64_t row_stride = (int64_t)num_kv_heads * head_dim;                            \
        const int group = num_heads / num_kv_heads;                                             \
        const int tile_tokens = group * TILE_TOKENS <= MAX_ROWS ? TILE_TOKENS : MAX_ROWS / group; \
        if (tile_tokens < 1) return 1;                                                          \
        /* Where each chunk's packed keys start, in units of 32 keys. */                       \
        int64_t* kt_at = malloc(sizeof(int64_t) * ((size_t)num_chunks + 1));                    \
        int64_t* tiles_at = malloc(sizeof(int64_t) * ((size_t)num_chunks + 1));                 \
        if (kt_at == NULL || tiles_at == NULL) {                                                \
            free(kt_at);                                                                        \
            free(tiles_at);                                                                     \
            return 1;                                                                           \
        }                                                                                       \
        kt_at[0] = tiles_at[0] = 0;                                                             \
        for (int c = 0; c < num_chunks; c++) {                                                  \
            kt_at[c + 1] = kt_at[c] + (cached[c] + lens[c] + KEYS - 1) / KEYS;                  \
            tiles_at[c + 1] = tiles_at[c] + (lens[c] + tile_tokens - 1) / tile_tokens;           \
        }                                                                                       \
        const size_t k_set = K_SET, v_set = V_SET;                                              \
        const size_t sets = (size_t)kt_at[num_chunks] * num_kv_heads;                           \
        KW* kt = aligned_alloc(64, (sets * k_set * sizeof(KW) + 63) / 64 * 64);                 \
        KW* vp = v_set ? aligned_alloc(64, (sets * v_set * sizeof(KW) + 63) / 64 * 64) : NULL;  \
        const size_t work_floats = (size_t)MAX_ROWS * (2 * head_dim + KEYS);                    \
        float* work = aligned_alloc(64, sizeof(float) * work_floats * num_threads);             \
        int failed = kt == NULL || work == NULL || (v_set && vp == NULL);                       \
        if (!failed) {                                                                          \
            const int64_t items = tiles_at[num_chunks] * num_kv_heads;                          \
            _Pragma("omp parallel num_threads(num_threads)") {                                  \
                /* Step 0: each chunk's keys (and values) packed, 32 keys x one KV head each. */ \
                _Pragma("omp for schedule(static)")                                             \
                for (int64_t col = 0; col < (int64_t)sets; col++) {                             \
                    const int64_t set = col / num_kv_heads;                                     \
                    const int kv = (int)(col % num_kv_heads);                                   \
                    int c = 0;                                                                  \
                    while (kt_at[c + 1] <= set) c++;                                            \
                    /* the chunk's first window: keys before it are never read */              \
                    const int from = window > 0 && cached[c] >= window ? cached[c] - window + 1 : 0; \
                    const size_t at = (size_t)kv * kt_at[num_chunks] + set;                     \
                    NAME##_pack(kt + at * k_set, vp ? vp + at * v_set : NULL, k_cache, v_cache, \
                                tables + (int64_t)c * tables_stride,                            \
                                (int)(set - kt_at[c]) * KEYS, cached[c] + lens[c], from,        \
                                block_size, row_stride, kv, head_dim);                          \
                }                                                                               \
                float* mine = work + work_floats * omp_get_thread_num();                        \
                /* The items: last tiles (most keys) first. */                                 \
                _Pragma("omp for schedule(dynamic, 1)")                                         \
                for (int64_t item = 0; item < items; item++) {                                  \
                    const int64_t rev = items - 1 - item;                                       \
                    const int kv = (int)(rev % num_kv_heads);                                   \
                    const int64_t tile = rev / num_kv_heads;                                    \
                    int c = 0;                                                                  \
                    while (tiles_at[c + 1] <= tile) c++;                                        \
                    const int t0 = (int)(tile - tiles_at[c]) * tile_tokens;                     \
                    const int t1 = t0 + tile_tokens < lens[c] ? t0 + tile_tokens : lens[c];     \
                    const size_t at = (size_t)kv * kt_at[num_chunks] + kt_at[c];                \
                    run(q, q_tok, q_head, kt + at * k_set, vp ? vp + at * v_set : NULL,         \
                        v_cache, tables + (int64_t)c * tables_stride, starts[c], cached[c], t0, \
                        t1, out, num_heads, num_kv_heads, head_dim, block_size, scale, kv,      \
                        mine, window, soft_cap, sinks);                                         \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        free(kt);                                                                               \
        free(vp);                                                                               \
        free(work);                                                                             \
        free(kt_at);                                                                            \
        free(tiles_at);                                                                         \
        return failed;                                                                          \
    }

DEFINE_LOADED(f32, float, f32_load, f32_store, f32_load16)
DEFINE_PREFILL(paged_prefill_f32, float, float, f32, (size_t)KEYS * head_dim, 0)
#if BF16_PAIRS
DEFINE_PREFILL(paged_prefill_bf16, uint16_t, uint32_t, pairs, (size_t)KEYS / 2 * head_dim,
               (size_t)KEYS / 2 * head_dim)
#else
DEFINE_LOADED(bf16, uint16_t, bf16_load, bf16_store, bf16_load16)
DEFINE_PREFILL(paged_prefill_bf16, uint16_t, float, bf16, (size_t)KEYS * head_dim, 0)
#endif
