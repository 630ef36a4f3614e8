// Decode attention over the paged KV cache, read in place (the CPU path).
//
// One query token per sequence attends over its whole context. The torch path
// gathers every sequence's K and V out of the paged cache into contiguous
// tensors in every layer (a write and two reads of the context per layer);
// this kernel walks the block table and reads each cached K/V row once.
//
// Work item: one sequence and a range of its KV heads, all of them when there
// are enough sequences to keep every thread busy (then each cached row, all KV
// heads side by side, is read whole and in order), one each otherwise (a lone
// long sequence still spreads over the threads). Each K row loaded serves the
// dot products of every query head sharing its KV head. Two passes over the
// context: scores (kept in a per-item buffer, context x heads floats), then a
// softmax and the weighted sum of V. Items are spread over OpenMP threads; the
// library links the process's libgomp (the one torch loaded), as inductor's
// kernels do.
//
// bf16: where the CPU multiplies bf16 itself (AVX512-BF16) and head_dim is a multiple
// of 32, an item multiplies bf16 pairs with fp32 sums (`DEFINE_PAIRS_ITEM` below: each
// key's scores 16 keys at a time, P rounded to bf16, V rows of consecutive keys
// interleaved into pairs once per KV head); elsewhere bf16 is widened to fp32.
//
// Layouts (all row-major):
//   q         [num_seqs, num_heads, head_dim]  row strides given (q_seq, q_head)
//   k_cache   [num_blocks, block_size, num_kv_heads, head_dim]   contiguous
//   v_cache   the same
//   tables    [num_seqs, tables_stride] int32: block ids, the first
//             ceil(context / block_size) used
//   contexts  [num_seqs] int32: tokens of context (cached + this step's one)
//   out       [num_seqs, num_heads, head_dim]  contiguous
//
// Options: `window` > 0 keeps only the last `window` keys of each context (the
// query at position len - 1 sees positions > len - 1 - window): the blocks
// wholly before them are never read (they may be back in the pool). `soft_cap`
// > 0 maps each scaled score s to soft_cap * tanh(s / soft_cap) before the softmax.
// `sinks` (NULL: none), one float per query head, joins each head's softmax
// denominator as a logit with no value (gpt-oss's attention sinks).
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_scalar.h"

// Blocks sit anywhere in the pool, so the hardware prefetcher, which stops at page
// boundaries, restarts at every block: ask for the next block while this one is used.
static inline void prefetch_block(const void* p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char*)p + off, 0, 3);
}

// Each query head's softmax over its nk scores (rows `stride` apart), soft-capped
// first, its sink (NULL: none) joining the sum: the scores become exp(s - max), and
// inv[g] 1 / their sum.
static void softmax_heads(float* scores, int nh, int nk, int64_t stride, float soft_cap,
                          const float* sinks, float* inv) {
    for (int g = 0; g < nh; g++) {
        float* sg = scores + (size_t)g * stride;
        float mx = sinks ? sinks[g] : -FLT_MAX, sum = 0.0f;
        if (soft_cap > 0.0f)
            for (int t = 0; t < nk; t++) sg[t] = soft_cap * tanhf(sg[t] / soft_cap);
        for (int t = 0; t < nk; t++) mx = sg[t] > mx ? sg[t] : mx;
        if (sinks) sum = expf(sinks[g] - mx);
        for (int t = 0; t < nk; t++) {
            sg[t] = expf(sg[t] - mx);
            sum += sg[t];
        }
        inv[g] = 1.0f / sum;
    }
}

#define KEYS 32  // keys per step of the bf16 pairs item's weighted sum

#if BF16_PAIRS
// rows[i]: KV head kv's row of token t + i in the cache, for i < n.
static inline void cache_rows(const uint16_t** rows, const uint16_t* cache, const int32_t* table,
                              int t, int n, int block_size, int64_t row, int kv, int head_dim) {
    int b = t / block_size, j = t % block_size;
    const uint16_t* block = cache + (int64_t)table[b] * block_size * row + (int64_t)kv * head_dim;
    for (int i = 0; i < n; i++, j++) {
        if (j == block_size) {
            j = 0;
            block = cache + (int64_t)table[++b] * block_size * row + (int64_t)kv * head_dim;
        }
        rows[i] = block + j * row;
    }
}

// Ask for KV head kv's rows of tokens t..t + n - 1 while others are used.
static inline void prefetch_rows(const uint16_t* cache, const int32_t* table, int t, int n,
                                 int block_size, int64_t row, int kv, int head_dim) {
    const uint16_t* rows[32];
    cache_rows(rows, cache, table, t, n, block_size, row, kv, head_dim);
    for (int i = 0; i < n; i++) prefetch_block(rows[i], sizeof(uint16_t) * head_dim);
}

// 32 bf16 (16 pairs) from anywhere.
static inline v16u load_pairs(const uint16_t* p) { return (v16u)_mm512_loadu_si512(p); }
#endif

// One work item: sequence s, KV heads [kv_begin, kv_end), so query heads
// [kv_begin * group, kv_end * group). HEAD_DIM is a literal for the common
// sizes (the loops unroll and the accumulators stay in registers) and the
// runtime value otherwise.
#define DEFINE_ITEM(NAME, T, LOAD, STORE, HEAD_DIM)                                          \
    static int NAME(const T* q, int64_t q_seq, int64_t q_head, const T* k_cache,              \
                    const T* v_cache, const int32_t* table, int len, T* out, int num_heads,   \
                    int num_kv_heads, int head_dim_arg, int block_size, float scale, int s,   \
                    int kv_begin, int kv_end, int window, float soft_cap,                     \
                    const float* sinks) {                                                     \
        const int head_dim = HEAD_DIM;                                                        \
        (void)head_dim_arg;                                                                   \
        const int group = num_heads / num_kv_heads;                                           \
        const int h0 = kv_begin * group, nh = (kv_end - kv_begin) * group;                    \
        const int64_t row = (int64_t)num_kv_heads * head_dim; /* one token in a block */      \
        const int lo = window > 0 && len > window ? len - window : 0; /* first key read */   \
        const int nk = len - lo;                                                              \
        float* buf = malloc(sizeof(float) * (size_t)nh * ((size_t)nk + 2 * head_dim));        \
        if (buf == NULL) return 1;                                                            \
        float* scores = buf;                         /* [nh, nk]: key t at t - lo */          \
        float* qf = buf + (size_t)nh * nk;           /* [nh, head_dim], scaled */             \
        float* acc = qf + (size_t)nh * head_dim;     /* [nh, head_dim] */                     \
        for (int g = 0; g < nh; g++) {                                                        \
            const T* qs = q + s * q_seq + (int64_t)(h0 + g) * q_head;                         \
            for (int i = 0; i < head_dim; i++) qf[g * head_dim + i] = LOAD(qs[i]) * scale;    \
        }                                                                                     \
        /* Pass 1: scores, block by block through the table, from the window's first. */      \
        for (int b = lo / block_size, t0 = b * block_size; t0 < len; b++, t0 += block_size) { \
            const int n = len - t0 < block_size ? len - t0 : block_size;                      \
            const int j0 = lo > t0 ? lo - t0 : 0;                                             \
            const T* kb = k_cache + (int64_t)table[b] * block_size * row;                     \
            if (t0 + block_size < len) /* the next block is elsewhere: fetch it meanwhile */  \
                prefetch_block(k_cache + (int64_t)table[b + 1] * block_size * row,            \
                               (size_t)block_size * row * sizeof(T));                         \
            /* Head outer, token inner: the head's query stays in registers, the block */ \
            /* (block_size rows, every KV head) in L1. */                                    \
            for (int g = 0; g < nh; g++) {                                                    \
                const T* kh = kb + (int64_t)((h0 + g) / group) * head_dim;                    \
                const float* qg = qf + g * head_dim;                                          \
                float* sg = scores + (size_t)g * nk + t0 - lo;                                \
                for (int j = j0; j < n; j++) {                                                \
                    const T* kr = kh + j * row;                                               \
                    float dot = 0.0f;                                                         \
                    for (int i = 0; i < head_dim; i++) dot += qg[i] * LOAD(kr[i]);            \
                    sg[j] = dot;                                                              \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        /* Softmax per query head; 1 / sum is applied once, at the end. */                    \
        float inv[nh];                                                                        \
        softmax_heads(scores, nh, nk, nk, soft_cap, sinks ? sinks + h0 : NULL, inv);          \
        /* Pass 2: the weighted sum of V. */                                                  \
        memset(acc, 0, sizeof(float) * (size_t)nh * head_dim);                               \
        for (int b = lo / block_size, t0 = b * block_size; t0 < len; b++, t0 += block_size) { \
            const int n = len - t0 < block_size ? len - t0 : block_size;                      \
            const int j0 = lo > t0 ? lo - t0 : 0;                                             \
            const T* vb = v_cache + (int64_t)table[b] * block_size * row;                     \
            if (t0 + block_size < len)                                                        \
                prefetch_block(v_cache + (int64_t)table[b + 1] * block_size * row,            \
                               (size_t)block_size * row * sizeof(T));                         \
            /* Head outer, token inner: the head's accumulator stays in registers. */      \
            for (int g = 0; g < nh; g++) {                                                    \
                const T* vh = vb + (int64_t)((h0 + g) / group) * head_dim;                    \
                const float* pg = scores + (size_t)g * nk + t0 - lo;                          \
                float a[head_dim];                                                            \
                float* ag = acc + g * head_dim;                                               \
                for (int i = 0; i < head_dim; i++) a[i] = ag[i];                              \
                for (int j = j0; j < n; j++) {                                                \
                    const T* vr = vh + j * row;                                               \
                    const float p = pg[j];                                                    \
                    for (int i = 0; i < head_dim; i++) a[i] += p * LOAD(vr[i]);               \
                }                                                                             \
                for (int i = 0; i < head_dim; i++) ag[i] = a[i];                              \
            }                                                                                 \
        }                                                                                     \
        for (int g = 0; g < nh; g++) {                                                        \
            T* os = out + ((int64_t)s * num_heads + h0 + g) * head_dim;                       \
            for (int i = 0; i < head_dim; i++) os[i] = STORE(acc[g * head_dim + i] * inv[g]); \
        }                                                                                     \
        free(buf);                                                                            \
        return 0;                                                                             \
    }

// The entry point: items spread over OpenMP threads, each by the bf16 pairs item PAIRS
// where that is not NULL, else by the loaded items. Returns non-zero when a score
// buffer could not be allocated.
#define DEFINE_DECODE(NAME, T, LOAD, STORE, PAIRS)                                               \
    DEFINE_ITEM(NAME##_d64, T, LOAD, STORE, 64)                                               \
    DEFINE_ITEM(NAME##_d128, T, LOAD, STORE, 128)                                             \
    DEFINE_ITEM(NAME##_any, T, LOAD, STORE, head_dim_arg)                                     \
    int NAME(const T* q, int64_t q_seq, int64_t q_head, const T* k_cache, const T* v_cache,  \
             const int32_t* tables, int64_t tables_stride, const int32_t* contexts, T* out,  \
             int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,     \
             float scale, int window, float soft_cap, const float* sinks, int num_threads) {  \
        int (*run)(const T*, int64_t, int64_t, const T*, const T*, const int32_t*, int, T*,   \
                   int, int, int, int, float, int, int, int, int, float, const float*) = PAIRS; \
        if (run == NULL)                                                                       \
            run = head_dim == 64 ? NAME##_d64 : head_dim == 128 ? NAME##_d128 : NAME##_any;    \
        /* Whole sequences when there are at least two per thread, else one KV head each. */  \
        const int per_item = num_seqs >= 2 * num_threads ? num_kv_heads : 1;                   \
        const int per_seq = num_kv_heads / per_item;                                           \
        int failed = 0;                                                                        \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")              \
        for (int64_t item = 0; item < (int64_t)num_seqs * per_seq; item++) {                   \
            const int s = (int)(item / per_seq), kv = (int)(item % per_seq) * per_item;        \
            if (run(q, q_seq, q_head, k_cache, v_cache, tables + (int64_t)s * tables_stride,   \
                    contexts[s], out, num_heads, num_kv_heads, head_dim, block_size, scale, s, \
                    kv, kv + per_item, window, soft_cap, sinks)) {                             \
                _Pragma("omp atomic write") failed = 1;                                        \
            }                                                                                  \
        }                                                                                      \
        return failed;                                                                         \
    }

#if BF16_PAIRS
// Lane i: the sum of the 16 lanes of v[i] (a transposing tree of adds: 45 instructions
// for 16 sums).
static inline v16 sum_lanes16(const v16* v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128 bits: v[2i]'s and v[2i + 1]'s pairs of sums */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps((__m512)v[2 * i], (__m512)v[2 * i + 1]),
                             _mm512_unpackhi_ps((__m512)v[2 * i], (__m512)v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128 bits: v[4i..4i + 3]'s sums over those bits */
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]),
                                                                 _mm512_castps_pd(a[2 * i + 1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]),
                                                                 _mm512_castps_pd(a[2 * i + 1]))));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    return (v16)_mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                              _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// One work item on bf16 pairs (head_dim a multiple of 32). Scores: each key's dot
// products over head_dim pairs leave 16 partial sums, summed 16 keys at a time
// (sum_lanes16), then scaled. Values: P is rounded to bf16; for each 32 keys, the V rows
// of consecutive keys are interleaved into pairs once (vpunpck{l,h}wd, which leaves the
// columns of a 32 in the order 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, ...: undone at the
// end) and serve every query head of their KV head.
#define DEFINE_PAIRS_ITEM(NAME, HEAD_DIM)                                                    \
    static int NAME(const uint16_t* q, int64_t q_seq, int64_t q_head,                         \
                    const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table,   \
                    int len, uint16_t* out, int num_heads, int num_kv_heads, int head_dim_arg, \
                    int block_size, float scale, int s, int kv_begin, int kv_end, int window, \
                    float soft_cap, const float* sinks) {                                     \
        const int head_dim = HEAD_DIM, nv = HEAD_DIM / 32, nx = HEAD_DIM / 16;                \
        (void)head_dim_arg;                                                                   \
        const int group = num_heads / num_kv_heads;                                           \
        const int h0 = kv_begin * group, nh = (kv_end - kv_begin) * group;                    \
        const int64_t row = (int64_t)num_kv_heads * head_dim;                                 \
        const int lo = window > 0 && len > window ? len - window : 0;                         \
        const int nk = len - lo, stride = (nk + 31) / 32 * 32;                                \
        const size_t floats = (size_t)nh * stride * 3 / 2 + (size_t)nh * (head_dim / 2 + head_dim) \
                              + (size_t)16 * nx * 16;                                         \
        float* buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);              \
        if (buf == NULL) return 1;                                                            \
        float* scores = buf;                                 /* [nh, stride] */               \
        uint16_t* pb = (uint16_t*)(scores + (size_t)nh * stride); /* [nh, stride] bf16 */     \
        v16u* vpairs = (v16u*)(scores + (size_t)nh * stride * 3 / 2); /* [16, nx] */          \
        v16u* qv = vpairs + 16 * nx;                         /* [nh, nv] */                   \
        v16* acc = (v16*)(qv + (size_t)nh * nv);             /* [nh, nx] */                   \
        for (int g = 0; g < nh; g++)                                                          \
            memcpy(qv + (size_t)g * nv, q + s * q_seq + (int64_t)(h0 + g) * q_head,            \
                   sizeof(uint16_t) * head_dim);                                              \
        const uint16_t *krow[16], *vrow[KEYS];                                                \
        /* Pass 1: scores, 16 keys at a time. */                                              \
        for (int t0 = lo; t0 < len; t0 += 16) {                                               \
            const int n = len - t0 < 16 ? len - t0 : 16;                                      \
            for (int kv = kv_begin; kv < kv_end; kv++) {                                      \
                cache_rows(krow, k_cache, table, t0, n, block_size, row, kv, head_dim);       \
                if (t0 + 16 < len)                                                            \
                    prefetch_rows(k_cache, table, t0 + 16, len - t0 < 32 ? len - t0 - 16 : 16, \
                                  block_size, row, kv, head_dim);                             \
                for (int g = (kv - kv_begin) * group; g < (kv - kv_begin + 1) * group; g++) { \
                    const v16u* qg = qv + (size_t)g * nv;                                     \
                    v16 part[16];                                                             \
                    for (int j = 0; j < 16; j++) {                                            \
                        part[j] = splat(0.0f);                                                \
                        if (j < n)                                                            \
                            for (int x = 0; x < nv; x++)                                      \
                                part[j] = dot_pairs(part[j], qg[x], load_pairs(krow[j] + 32 * x)); \
                    }                                                                         \
                    *(v16*)(scores + (size_t)g * stride + t0 - lo) = sum_lanes16(part) * splat(scale); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        float inv[nh];                                                                        \
        softmax_heads(scores, nh, nk, stride, soft_cap, sinks ? sinks + h0 : NULL, inv);      \
        for (int g = 0; g < nh; g++) /* P in bf16, zero past the context */                   \
            for (int t = 0; t < stride; t++)                                                  \
                pb[(size_t)g * stride + t] = t < nk ? bf16_store(scores[(size_t)g * stride + t]) : 0; \
        /* Pass 2: the weighted sum of V, 32 keys (16 pairs) at a time. */                    \
        memset(acc, 0, sizeof(v16) * (size_t)nh * nx);                                        \
        for (int t0 = lo; t0 < len; t0 += KEYS) {                                             \
            const int n = len - t0 < KEYS ? len - t0 : KEYS, np = (n + 1) / 2;                \
            for (int kv = kv_begin; kv < kv_end; kv++) {                                      \
                cache_rows(vrow, v_cache, table, t0, n, block_size, row, kv, head_dim);       \
                if (t0 + KEYS < len)                                                          \
                    prefetch_rows(v_cache, table, t0 + KEYS,                                  \
                                  len - t0 < 2 * KEYS ? len - t0 - KEYS : KEYS, block_size, row, \
                                  kv, head_dim);                                              \
                for (int i = 0; i < np; i++) {                                                \
                    const uint16_t* a = vrow[2 * i];                                          \
                    const uint16_t* b = 2 * i + 1 < n ? vrow[2 * i + 1] : NULL;               \
                    for (int x = 0; x < nv; x++) {                                            \
                        const __m512i va = (__m512i)load_pairs(a + 32 * x);                   \
                        const __m512i vb = b ? (__m512i)load_pairs(b + 32 * x) : _mm512_setzero_si512(); \
                        vpairs[i * nx + 2 * x] = (v16u)_mm512_unpacklo_epi16(va, vb);         \
                        vpairs[i * nx + 2 * x + 1] = (v16u)_mm512_unpackhi_epi16(va, vb);     \
                    }                                                                         \
                }                                                                             \
                for (int g = (kv - kv_begin) * group; g < (kv - kv_begin + 1) * group; g++) { \
                    const uint16_t* pg = pb + (size_t)g * stride + t0 - lo;                   \
                    v16 a[nx];                                                                \
                    for (int x = 0; x < nx; x++) a[x] = acc[(size_t)g * nx + x];              \
                    for (int i = 0; i < np; i++) {                                            \
                        uint32_t pair;                                                        \
                        memcpy(&pair, pg + 2 * i, sizeof pair);                               \
                        const v16u pp = splat_pair(pair);                                     \
                        for (int x = 0; x < nx; x++) a[x] = dot_pairs(a[x], pp, vpairs[i * nx + x]); \
                    }                                                                         \
                    for (int x = 0; x < nx; x++) acc[(size_t)g * nx + x] = a[x];              \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int g = 0; g < nh; g++) { /* the columns back in order */                        \
            uint16_t* os = out + ((int64_t)s * num_heads + h0 + g) * head_dim;                \
            const float* ag = (const float*)(acc + (size_t)g * nx);                           \
            for (int x = 0; x < nv; x++)                                                      \
                for (int lane = 0; lane < 16; lane++) {                                       \
                    const int col = 32 * x + 8 * (lane / 4) + lane % 4;                       \
                    os[col] = bf16_store(ag[32 * x + lane] * inv[g]);                         \
                    os[col + 4] = bf16_store(ag[32 * x + 16 + lane] * inv[g]);                \
                }                                                                             \
        }                                                                                     \
        free(buf);                                                                            \
        return 0;                                                                             \
    }

DEFINE_PAIRS_ITEM(pairs_d64, 64)
DEFINE_PAIRS_ITEM(pairs_d128, 128)
DEFINE_PAIRS_ITEM(pairs_any, head_dim_arg)
#define BF16_PAIRS_ITEM \
    (head_dim % 32 ? NULL : head_dim == 64 ? pairs_d64 : head_dim == 128 ? pairs_d128 : pairs_any)
#else
#define BF16_PAIRS_ITEM NULL
#endif

DEFINE_DECODE(paged_decode_f32, float, f32_load, f32_store, NULL)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_load, bf16_store, BF16_PAIRS_ITEM)
