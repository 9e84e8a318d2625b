/* Paged decode attention for the CPU: one query token per sequence, reading every cached key and
 * value exactly once, straight from the paged cache (no gathered copy, no padding).
 *
 * Same contract as kernels/reference.py:paged_decode_attention. Layout:
 *   q, out:            [num_seqs, num_heads, head_dim], contiguous
 *   k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables:      [num_seqs, max_blocks] int32;  context_lens: [num_seqs] int32
 * dtype: 0 = float32, 1 = bfloat16 (q, caches and out share it). Accumulation is float32.
 * One task per (sequence, kv head) computes all the query heads of that group, so each K/V row is
 * read once; an online softmax runs block by block. With AVX-512 and head_dim 64 (the default
 * model's), a batch of sequences goes one task per sequence instead (see attend_sequence_64).
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

#if defined(__AVX512F__)
#include <immintrin.h>

/* The AVX-512 path for head_dim 64: one task per sequence takes each block whole (every kv head's
 * rows, contiguous in the cache) while it is in cache. Per query head and run of up to 16 tokens:
 * the scores as one vector, an online-softmax update with a vector exponential, then the weighted
 * values into four registers of accumulators. */

static inline __m512 exp512(__m512 x) { /* exp(x), x <= 0: 2^n * p(r), Cephes' polynomial */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline void load_row64(const void *base, int64_t index, int dtype, __m512 row[4]) {
    if (dtype == 0) {
        const float *src = (const float *)base + index;
        for (int j = 0; j < 4; j++) row[j] = _mm512_loadu_ps(src + 16 * j);
    } else {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int j = 0; j < 4; j++) {
            const __m256i half = _mm256_loadu_si256((const __m256i *)(src + 16 * j));
            row[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
        }
    }
}

static void attend_sequence_64(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                               int context_len, void *out, int seq, int num_heads, int num_kv_heads,
                               int block_size, float scale, int dtype) {
    enum { D = 64, MAX_HEADS = 64 };
    const int group = num_heads / num_kv_heads;
    __m512 qv[MAX_HEADS][4];
    float acc[MAX_HEADS][D] __attribute__((aligned(64)));
    float m[MAX_HEADS], l[MAX_HEADS];
    for (int h = 0; h < num_heads; h++) {
        load_row64(q, ((int64_t)seq * num_heads + h) * D, dtype, qv[h]);
        for (int j = 0; j < 4; j++) qv[h][j] = _mm512_mul_ps(qv[h][j], _mm512_set1_ps(scale));
        memset(acc[h], 0, sizeof acc[h]);
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const int64_t slot_stride = (int64_t)num_kv_heads * D;
    for (int start = 0, run; start < context_len; start += run) {
        const int block = table[start / block_size], offset = start % block_size;
        run = context_len - start < 16 ? context_len - start : 16;
        if (run > block_size - offset) run = block_size - offset;  /* a run of tokens stays in one block */
        const int64_t first = ((int64_t)block * block_size + offset) * slot_stride;
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            for (int g = 0; g < group; g++) {
                const int h = kvh * group + g;
                float s[16] __attribute__((aligned(64)));
                for (int t = 0; t < run; t++) {
                    __m512 k[4];
                    load_row64(k_cache, first + t * slot_stride + (int64_t)kvh * D, dtype, k);
                    __m512 a = _mm512_mul_ps(qv[h][0], k[0]), b = _mm512_mul_ps(qv[h][2], k[2]);
                    a = _mm512_fmadd_ps(qv[h][1], k[1], a);
                    b = _mm512_fmadd_ps(qv[h][3], k[3], b);
                    s[t] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
                }
                const __mmask16 valid = (__mmask16)((1u << run) - 1u);
                const __m512 scores = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, s);
                const float run_max = _mm512_reduce_max_ps(scores);
                const float new_max = run_max > m[h] ? run_max : m[h];
                const float correction = m[h] == -INFINITY ? 0.0f : expf(m[h] - new_max);
                const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
                l[h] = l[h] * correction + _mm512_reduce_add_ps(p);
                m[h] = new_max;
                _mm512_store_ps(s, p);
                __m512 o[4];
                for (int j = 0; j < 4; j++) o[j] = _mm512_mul_ps(_mm512_load_ps(acc[h] + 16 * j), _mm512_set1_ps(correction));
                for (int t = 0; t < run; t++) {
                    __m512 v[4];
                    load_row64(v_cache, first + t * slot_stride + (int64_t)kvh * D, dtype, v);
                    const __m512 w = _mm512_set1_ps(s[t]);
                    for (int j = 0; j < 4; j++) o[j] = _mm512_fmadd_ps(w, v[j], o[j]);
                }
                for (int j = 0; j < 4; j++) _mm512_store_ps(acc[h] + 16 * j, o[j]);
            }
        }
    }
    for (int h = 0; h < num_heads; h++) {
        const int64_t oi = ((int64_t)seq * num_heads + h) * D;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        if (dtype == 0) {
            for (int i = 0; i < D; i++) ((float *)out)[oi + i] = acc[h][i] * inv;
        } else {
            for (int i = 0; i < D; i++) ((uint16_t *)out)[oi + i] = f32_to_bf16(acc[h][i] * inv);
        }
    }
}
#define HAVE_SEQUENCE_64 1
#endif

int berth_limits(int *max_group, int *max_head_dim, int *max_block) {
    *max_group = MAX_GROUP;
    *max_head_dim = MAX_HEAD_DIM;
    *max_block = MAX_BLOCK;
    return 0;
}

void berth_paged_decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                        const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, int max_blocks, float scale, int dtype, int num_threads) {
#ifdef HAVE_SEQUENCE_64
    if (head_dim == 64 && num_heads <= 64 && num_seqs >= 4 * num_threads) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int s = 0; s < num_seqs; s++) {
            attend_sequence_64(q, k_cache, v_cache, block_tables + (int64_t)s * max_blocks, context_lens[s], out, s,
                               num_heads, num_kv_heads, block_size, scale, dtype);
        }
        return;
    }
#endif
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        for (int h = 0; h < num_kv_heads; h++) {
            attend_group(q, k_cache, v_cache, block_tables + (int64_t)s * max_blocks, context_lens[s], out, s, h,
                         num_heads, num_kv_heads, head_dim, block_size, scale, dtype);
        }
    }
}
