/* A decoder layer's elementwise steps on the CPU, float32 or bfloat16, each one pass over its rows.
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
 * In bfloat16 each of PyTorch's operations computes in float32 and rounds its result to bfloat16
 * (to nearest, ties to even): here each rounds where that operation would, so the residual add, a
 * rotated query or key and the norm's two multiplies round as PyTorch's do; the norm itself runs in
 * float32, as Hugging Face's LlamaRMSNorm (x.float(), then .to(bfloat16), then the weight).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define LANES 16

typedef uint16_t bf16_t;

static inline float widen(bf16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 to bfloat16 to nearest, ties to even: c10::BFloat16's rounding (a NaN stays a NaN). */
static inline bf16_t narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

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

static float sum_of_squares_bf16(const bf16_t *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += widen(x[i + j]) * widen(x[i + j]);
    float total = 0.0f;
    for (int j = 0; j < LANES; j++) total += acc[j];
    for (; i < n; i++) total += widen(x[i]) * widen(x[i]);
    return total;
}

static void add_rms_norm_row_f32(float *x, const float *d, const float *weight, float *o, int64_t dim, float eps) {
    if (d)
        for (int64_t i = 0; i < dim; i++) x[i] = x[i] + d[i];
    float inv = 1.0f / sqrtf(sum_of_squares(x, dim) / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (x[i] * inv);
}

/* h + delta rounded, as a bfloat16 add; the norm in float32, rounded, then times the weight, rounded */
static void add_rms_norm_row_bf16(bf16_t *x, const bf16_t *d, const bf16_t *weight, bf16_t *o, int64_t dim, float eps) {
    if (d)
        for (int64_t i = 0; i < dim; i++) x[i] = narrow(widen(x[i]) + widen(d[i]));
    float inv = 1.0f / sqrtf(sum_of_squares_bf16(x, dim) / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) o[i] = narrow(widen(weight[i]) * widen(narrow(widen(x[i]) * inv)));
}

/* rows of float32 (bf16 = 0) or bfloat16 (bf16 = 1) */
void berth_add_rms_norm(void *h, const void *delta, const void *weight, void *out, int64_t rows, int64_t dim,
                        float eps, int threads, int bf16) {
    int parallel = threads > 1 && rows * dim >= 32768;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16)
            add_rms_norm_row_bf16((bf16_t *)h + r * dim, delta ? (const bf16_t *)delta + r * dim : NULL, weight,
                                  (bf16_t *)out + r * dim, dim, eps);
        else
            add_rms_norm_row_f32((float *)h + r * dim, delta ? (const float *)delta + r * dim : NULL, weight,
                                 (float *)out + r * dim, dim, eps);
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

/* the same in bfloat16: each product rounded, then their sum (rotate_half's negation is exact) */
static inline void rotate_bf16(const bf16_t *x, const bf16_t *c, const bf16_t *s, int64_t rot, int64_t dim, bf16_t *y) {
    int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++)
        y[i] = narrow(widen(narrow(widen(x[i]) * widen(c[i]))) + widen(narrow(-widen(x[i + half]) * widen(s[i]))));
    for (int64_t i = half; i < rot; i++)
        y[i] = narrow(widen(narrow(widen(x[i]) * widen(c[i]))) + widen(narrow(widen(x[i - half]) * widen(s[i]))));
    for (int64_t i = rot; i < dim; i++) y[i] = x[i];
}

/* a head of elements of either width, rotated */
static inline void rotate_any(const void *x, const void *c, const void *s, int64_t rot, int64_t dim, void *y,
                              int bf16) {
    if (bf16)
        rotate_bf16(x, c, s, rot, dim, y);
    else
        rotate(x, c, s, rot, dim, y);
}

/* a row's bytes from src to dst, past the caches where the vector width allows (dst aligned to it, the
 * length a multiple of it): a streaming store writes whole lines without first reading them in. A KV slot's
 * row lands in a block last touched many layers ago, its lines and page long gone from the caches, and
 * reading each line in before overwriting it made the KV write of a decode step 9-12 times as slow as
 * the same write into lines already cached (AMD EPYC, 64 requests: 0.46 against 0.05 ms a layer). */
static inline void store_row(char *dst, const char *src, size_t bytes) {
#if defined(__AVX512F__)
    if (((uintptr_t)dst & 63) == 0 && bytes % 64 == 0) {
        for (size_t i = 0; i < bytes; i += 64)
            _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
        return;
    }
#elif defined(__AVX__)
    if (((uintptr_t)dst & 31) == 0 && bytes % 32 == 0) {
        for (size_t i = 0; i < bytes; i += 32)
            _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

/* Streaming stores are weakly ordered: each thread fences its own before the caller reads the cache. */
static inline void store_fence(void) {
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence();
#endif
}

#define MAX_KV_ROW 4096  /* elements: a token's keys for every kv head (kv_heads * head_dim) */

/* Elements of 4 bytes (float32, bf16 = 0) or 2 (bfloat16, bf16 = 1); row_stride, like every offset, in elements. */
void berth_rotary_kv(const void *qkv, int64_t tokens, int64_t row_stride, const int64_t *positions,
                     const void *cos_table, const void *sin_table, int64_t rot, int64_t heads, int64_t kv_heads,
                     int64_t dim, void *q_out, void *k_out, void *k_cache, void *v_cache, const int64_t *slots,
                     int threads, int bf16) {
    int parallel = threads > 1 && tokens * (heads + 2 * kv_heads) * dim >= 32768;
    const int64_t kv_row = kv_heads * dim;
    const size_t size = bf16 ? 2 : 4, row_bytes = (size_t)kv_row * size;
    const char *qkv_b = qkv, *cos_b = cos_table, *sin_b = sin_table;
    char *q_b = q_out, *k_out_b = k_out, *k_cache_b = k_cache, *v_cache_b = v_cache;
#define AT(base, elements) ((base) + (size_t)(elements) * size)
#pragma omp parallel num_threads(threads) if (parallel)
    {
        float keys[MAX_KV_ROW] __attribute__((aligned(64)));  /* room for a row of either width */
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tokens; t++) {
            const char *row = AT(qkv_b, t * row_stride);
            const char *c = AT(cos_b, positions[t] * rot), *s = AT(sin_b, positions[t] * rot);
            for (int64_t h = 0; h < heads; h++)
                rotate_any(AT(row, h * dim), c, s, rot, dim, AT(q_b, (t * heads + h) * dim), bf16);
            const char *k = AT(row, heads * dim), *v = AT(k, kv_row);
            if (!k_cache) {  /* another kind of cache, written by the caller: the rotated keys only */
                for (int64_t h = 0; h < kv_heads; h++)
                    rotate_any(AT(k, h * dim), c, s, rot, dim, AT(k_out_b, t * kv_row + h * dim), bf16);
                continue;
            }
            char *k_slot = AT(k_cache_b, slots[t] * kv_row), *v_slot = AT(v_cache_b, slots[t] * kv_row);
            if (kv_row <= MAX_KV_ROW) {
                char *rotated = (char *)keys;
                for (int64_t h = 0; h < kv_heads; h++) rotate_any(AT(k, h * dim), c, s, rot, dim, AT(rotated, h * dim), bf16);
                store_row(k_slot, rotated, row_bytes);
                store_row(v_slot, v, row_bytes);
                if (k_out) memcpy(AT(k_out_b, t * kv_row), rotated, row_bytes);
            } else {
                for (int64_t h = 0; h < kv_heads; h++) rotate_any(AT(k, h * dim), c, s, rot, dim, AT(k_slot, h * dim), bf16);
                memcpy(v_slot, v, row_bytes);
                if (k_out) memcpy(AT(k_out_b, t * kv_row), k_slot, row_bytes);
            }
        }
        store_fence();
    }
#undef AT
}
