/* Paged decode attention for the CPU: one query token per sequence, reading every cached key and
 * value exactly once, straight from the paged cache (no gathered copy, no padding).
 *
 * Same contract as kernels/reference.py:paged_decode_attention. Layout:
 *   q, out:            [num_seqs, num_heads, head_dim], contiguous
 *   k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables:      [num_seqs, max_blocks] int32;  context_lens: [num_seqs] int32
 * dtype: 0 = float32, 1 = bfloat16 (q, caches and out share it). Accumulation is float32.
 * One task per (sequence, kv head) computes all the query heads of that group, so each K/V row is
 * read once; an online softmax runs block by block.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

typedef union { uint32_t bits[MAX_HEAD_DIM]; float values[MAX_HEAD_DIM]; } RowBuffer;

/* A row of d values as float32: in place for float32, widened into ``buffer`` for bfloat16. */
static inline const float *load_row(const void *base, int64_t index, int dtype, int d, RowBuffer *buffer) {
    if (dtype == 0) return (const float *)base + index;
    const uint16_t *src = (const uint16_t *)base + index;
    #pragma omp simd
    for (int i = 0; i < d; i++) buffer->bits[i] = (uint32_t)src[i] << 16;
    return buffer->values;
}

static void attend_group(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                         int context_len, void *out, int seq, int kv_head, int num_heads, int num_kv_heads,
                         int d, int block_size, float scale, int dtype) {
    const int group = num_heads / num_kv_heads;
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP], p[MAX_GROUP][MAX_BLOCK];
    RowBuffer row;
    for (int g = 0; g < group; g++) {
        int64_t qi = ((int64_t)seq * num_heads + kv_head * group + g) * d;
        const float *qrow = load_row(q, qi, dtype, d, &row);
        for (int i = 0; i < d; i++) { qf[g][i] = qrow[i] * scale; acc[g][i] = 0.0f; }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int64_t slot_stride = (int64_t)num_kv_heads * d;
    for (int start = 0; start < context_len; start += block_size) {
        const int n = context_len - start < block_size ? context_len - start : block_size;
        const int64_t first = (int64_t)table[start / block_size] * block_size * slot_stride + (int64_t)kv_head * d;
        for (int t = 0; t < n; t++) {
            const float *k = load_row(k_cache, first + t * slot_stride, dtype, d, &row);
            for (int g = 0; g < group; g++) {
                float s = 0.0f;
                #pragma omp simd reduction(+:s)
                for (int i = 0; i < d; i++) s += qf[g][i] * k[i];
                p[g][t] = s;
            }
        }
        for (int g = 0; g < group; g++) {
            float block_max = p[g][0];
            for (int t = 1; t < n; t++) block_max = p[g][t] > block_max ? p[g][t] : block_max;
            const float new_max = block_max > m[g] ? block_max : m[g];
            const float correction = expf(m[g] - new_max);
            l[g] *= correction;
            for (int i = 0; i < d; i++) acc[g][i] *= correction;
            for (int t = 0; t < n; t++) { p[g][t] = expf(p[g][t] - new_max); l[g] += p[g][t]; }
            m[g] = new_max;
        }
        for (int t = 0; t < n; t++) {
            const float *v = load_row(v_cache, first + t * slot_stride, dtype, d, &row);
            for (int g = 0; g < group; g++) {
                const float w = p[g][t];
                #pragma omp simd
                for (int i = 0; i < d; i++) acc[g][i] += w * v[i];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const int64_t oi = ((int64_t)seq * num_heads + kv_head * group + g) * d;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        if (dtype == 0) {
            for (int i = 0; i < d; i++) ((float *)out)[oi + i] = acc[g][i] * inv;
        } else {
            for (int i = 0; i < d; i++) ((uint16_t *)out)[oi + i] = f32_to_bf16(acc[g][i] * inv);
        }
    }
}

int berth_limits(int *max_group, int *max_head_dim, int *max_block) {
    *max_group = MAX_GROUP;
    *max_head_dim = MAX_HEAD_DIM;
    *max_block = MAX_BLOCK;
    return 0;
}

void berth_paged_decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                        const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, int max_blocks, float scale, int dtype, int num_threads) {
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        for (int h = 0; h < num_kv_heads; h++) {
            attend_group(q, k_cache, v_cache, block_tables + (int64_t)s * max_blocks, context_lens[s], out, s, h,
                         num_heads, num_kv_heads, head_dim, block_size, scale, dtype);
        }
    }
}
