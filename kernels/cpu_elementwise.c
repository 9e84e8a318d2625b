/* A decoder layer's elementwise steps on the CPU, float32, each one pass over its rows.
 *
 * PyTorch runs each of them as several operations, each reading and writing the whole activation:
 * the residual add, then RMSNorm as square, mean, add, rsqrt, multiply, multiply; rotary as two
 * multiplies, a negation, a concatenation and an add for the queries and again for the keys, then
 * a scatter of the keys and values into the KV cache. Here:
 *
 *   berth_add_rms_norm: h += delta (when given), out = weight * (h * rsqrt(mean(h^2) + eps));
 *   berth_rotary_kv:    the queries rotated into their own tensor, the keys rotated and the values
 *                       copied straight into their KV cache slots, from the fused Q/K/V output (and
 *                       the rotated keys into a tensor of their own too, when asked: prefill reads
 *                       a chunk's own keys from there rather than back from the cache; without a
 *                       cache, as for an int8 one that the caller writes, only there).
 *
 * Arithmetic as PyTorch's reference (kernels/cpu_elementwise.py names it): the same products and
 * sums in the same order per element, compiled with -ffp-contract=off so that no multiply and add
 * fuse into one rounding. Only the sum of squares is added in another order (16 partial sums).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define LANES 16

static float sum_of_squares(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * x[i + j];
    float total = 0.0f;
    for (int j = 0; j < LANES; j++) total += acc[j];
    for (; i < n; i++) total += x[i] * x[i];
    return total;
}

void berth_add_rms_norm(float *h, const float *delta, const float *weight, float *out, int64_t rows, int64_t dim,
                        float eps, int threads) {
    int parallel = threads > 1 && rows * dim >= 32768;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * dim;
        if (delta) {
            const float *d = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) x[i] = x[i] + d[i];
        }
        float mean = sum_of_squares(x, dim) / (float)dim;
        float inv = 1.0f / sqrtf(mean + eps);
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (x[i] * inv);
    }
}

/* x rotated by the rows c, s of the cos and sin tables into y, as x * cos + rotate_half(x) * sin on
 * the first ``rot`` dimensions (rotate_half(x) = cat(-x[half:], x[:half])); the rest copied. */
static inline void rotate(const float *x, const float *c, const float *s, int64_t rot, int64_t dim, float *y) {
    int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++) y[i] = x[i] * c[i] - x[i + half] * s[i];
    for (int64_t i = half; i < rot; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
    for (int64_t i = rot; i < dim; i++) y[i] = x[i];
}

/* n floats from src to dst, past the caches where the vector width allows (dst aligned to it, n a
 * multiple of it): a streaming store writes whole lines without first reading them in. A KV slot's
 * row lands in a block last touched many layers ago, its lines and page long gone from the caches, and
 * reading each line in before overwriting it made the KV write of a decode step 9-12 times as slow as
 * the same write into lines already cached (AMD EPYC, 64 requests: 0.46 against 0.05 ms a layer). */
static inline void store_row(float *dst, const float *src, int64_t n) {
#if defined(__AVX512F__)
    if (((uintptr_t)dst & 63) == 0 && n % 16 == 0) {
        for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
        return;
    }
#elif defined(__AVX__)
    if (((uintptr_t)dst & 31) == 0 && n % 8 == 0) {
        for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
        return;
    }
#endif
    memcpy(dst, src, (size_t)n * sizeof(float));
}

/* Streaming stores are weakly ordered: each thread fences its own before the caller reads the cache. */
static inline void store_fence(void) {
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence();
#endif
}

#define MAX_KV_ROW 4096  /* floats: a token's keys for every kv head (kv_heads * head_dim) */

void berth_rotary_kv(const float *qkv, int64_t tokens, int64_t row_stride, const int64_t *positions,
                     const float *cos_table, const float *sin_table, int64_t rot, int64_t heads, int64_t kv_heads,
                     int64_t dim, float *q_out, float *k_out, float *k_cache, float *v_cache, const int64_t *slots,
                     int threads) {
    int parallel = threads > 1 && tokens * (heads + 2 * kv_heads) * dim >= 32768;
    const int64_t kv_row = kv_heads * dim;
#pragma omp parallel num_threads(threads) if (parallel)
    {
        float keys[MAX_KV_ROW] __attribute__((aligned(64)));
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tokens; t++) {
            const float *row = qkv + t * row_stride;
            const float *c = cos_table + positions[t] * rot, *s = sin_table + positions[t] * rot;
            for (int64_t h = 0; h < heads; h++) rotate(row + h * dim, c, s, rot, dim, q_out + (t * heads + h) * dim);
            const float *k = row + heads * dim, *v = k + kv_row;
            if (!k_cache) {  /* another kind of cache, written by the caller: the rotated keys only */
                for (int64_t h = 0; h < kv_heads; h++) rotate(k + h * dim, c, s, rot, dim, k_out + t * kv_row + h * dim);
                continue;
            }
            const int64_t slot = slots[t] * kv_row;
            if (kv_row <= MAX_KV_ROW) {
                for (int64_t h = 0; h < kv_heads; h++) rotate(k + h * dim, c, s, rot, dim, keys + h * dim);
                store_row(k_cache + slot, keys, kv_row);
                store_row(v_cache + slot, v, kv_row);
                if (k_out) memcpy(k_out + t * kv_row, keys, (size_t)kv_row * sizeof(float));
            } else {
                for (int64_t h = 0; h < kv_heads; h++) rotate(k + h * dim, c, s, rot, dim, k_cache + slot + h * dim);
                memcpy(v_cache + slot, v, (size_t)kv_row * sizeof(float));
                if (k_out) memcpy(k_out + t * kv_row, k_cache + slot, (size_t)kv_row * sizeof(float));
            }
        }
        store_fence();
    }
}
