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
        for (int g = 0; g < nh; g++) {                                                        \
            float* sg = scores + (size_t)g * nk;                                              \
            float mx = sinks ? sinks[h0 + g] : -FLT_MAX, sum = 0.0f;                          \
            if (soft_cap > 0.0f)                                                              \
                for (int t = 0; t < nk; t++) sg[t] = soft_cap * tanhf(sg[t] / soft_cap);      \
            for (int t = 0; t < nk; t++) mx = sg[t] > mx ? sg[t] : mx;                        \
            if (sinks) sum = expf(sinks[h0 + g] - mx);                                        \
            for (int t = 0; t < nk; t++) {                                                    \
                sg[t] = expf(sg[t] - mx);                                                     \
                sum += sg[t];                                                                 \
            }                                                                                 \
            inv[g] = 1.0f / sum;                                                              \
        }                                                                                     \
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

// The entry point: items spread over OpenMP threads. Returns non-zero when a
// score buffer could not be allocated.
#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                  \
    DEFINE_ITEM(NAME##_d64, T, LOAD, STORE, 64)                                               \
    DEFINE_ITEM(NAME##_d128, T, LOAD, STORE, 128)                                             \
    DEFINE_ITEM(NAME##_any, T, LOAD, STORE, head_dim_arg)                                     \
    int NAME(const T* q, int64_t q_seq, int64_t q_head, const T* k_cache, const T* v_cache,  \
             const int32_t* tables, int64_t tables_stride, const int32_t* contexts, T* out,  \
             int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,     \
             float scale, int window, float soft_cap, const float* sinks, int num_threads) {  \
        int (*run)(const T*, int64_t, int64_t, const T*, const T*, const int32_t*, int, T*,   \
                   int, int, int, int, float, int, int, int, int, float, const float*) =       \
            head_dim == 64 ? NAME##_d64 : head_dim == 128 ? NAME##_d128 : NAME##_any;          \
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

DEFINE_DECODE(paged_decode_f32, float, f32_load, f32_store)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_load, bf16_store)
