/* Paged attention for the CPU, straight from the paged cache (no gathered copy, no padding): decode
 * (berth_paged_decode: one query token per sequence, reading every cached key and value exactly
 * once) and prefill (berth_paged_prefill: a chunk of query tokens per sequence, causal; its own
 * section below, after the decode kernel, whose helpers it shares). The file keeps its first name,
 * cpu_decode.c, which other code and documents name.
 *
 * Decode: same contract as kernels/reference.py:paged_decode_attention. Layout:
 *   q, out:            [num_seqs, num_heads, head_dim], contiguous
 *   k_cache, v_cache:  [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables:      [num_seqs, max_blocks] int32;  context_lens: [num_seqs] int32
 * dtype (of q and out): 0 = float32, 1 = bfloat16. kv_dtype (of the caches): the same codes, or
 * 2 = int8 rows of head_dim values followed by their float32 scale (kernels/kv_quant.py: head_dim + 4
 * bytes a row, so the caches' last dimension is head_dim + 4). Accumulation is float32.
 * window: 0 for full attention; else the query (at context_len - 1) sees only the last ``window``
 * positions, transformers' sliding window, and the loops start at the first of them: the blocks
 * before it are never read, so a step costs the window, not the context.
 * For head_dim 64 (the default model's), vectorised code chosen when the kernel is compiled for the
 * CPU at hand: AVX-512 (runs of 16 tokens in 16-lane registers) or AVX2 + FMA (runs of 8 in 8-lane
 * registers), the same algorithm and the same bytes read; ``berth_isa`` names the path built. One
 * task per sequence goes through its blocks in order; a block's token slots hold every kv head's
 * rows side by side, so each run of them is taken for every kv head (each key and value row loaded
 * once for all the query heads of its group) while it is in cache, and an online softmax runs per
 * run. As each row is computed, the same row PREFETCH_AHEAD blocks on is fetched into L2: the
 * blocks lie anywhere in the cache, where the hardware prefetcher loses the stream. With too few
 * sequences to keep the threads busy, each is split into parts (runs of blocks), each with its own
 * softmax state, merged at the end (split-K).
 * Other head sizes: the plain C loop, one task per (sequence, kv head) computing all the query
 * heads of that group, so each K/V row is read once; an online softmax runs block by block.
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

/* A row of d values as float32: in place for float32, widened into ``buffer`` for bfloat16, scaled
 * into it for int8 (``index`` then counts bytes, and the row's scale follows its d values). */
static inline const float *load_row(const void *base, int64_t index, int dtype, int d, RowBuffer *buffer) {
    if (dtype == 0) return (const float *)base + index;
    if (dtype == 2) {
        const int8_t *src = (const int8_t *)base + index;
        float scale;
        memcpy(&scale, src + d, sizeof scale);
        #pragma omp simd
        for (int i = 0; i < d; i++) buffer->values[i] = (float)src[i] * scale;
        return buffer->values;
    }
    const uint16_t *src = (const uint16_t *)base + index;
    #pragma omp simd
    for (int i = 0; i < d; i++) buffer->bits[i] = (uint32_t)src[i] << 16;
    return buffer->values;
}

/* Elements of a cache row: head_dim values, and for int8 the 4 bytes of its scale. */
static inline int cache_row(int d, int kv_dtype) { return kv_dtype == 2 ? d + 4 : d; }

/* The first position the query of a sequence of ``context_len`` tokens sees. */
static inline int window_start(int context_len, int window) {
    return window > 0 && context_len > window ? context_len - window : 0;
}

static void attend_group(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                         int context_len, void *out, int seq, int kv_head, int num_heads, int num_kv_heads,
                         int d, int block_size, float scale, int dtype, int kv_dtype, int window) {
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
    const int64_t slot_stride = (int64_t)num_kv_heads * cache_row(d, kv_dtype);
    for (int start = window_start(context_len, window), n; start < context_len; start += n) {
        /* the rest of start's block: whole blocks but for the window's first */
        const int room = block_size - start % block_size;
        n = context_len - start < room ? context_len - start : room;
        const int64_t first = ((int64_t)table[start / block_size] * block_size + start % block_size) * slot_stride
                              + (int64_t)kv_head * cache_row(d, kv_dtype);
        for (int t = 0; t < n; t++) {
            const float *k = load_row(k_cache, first + t * slot_stride, kv_dtype, d, &row);
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
            const float *v = load_row(v_cache, first + t * slot_stride, kv_dtype, d, &row);
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <stdlib.h>
/* Blocks ahead of the one computing whose rows are fetched, into the L2 cache (T1). Fetched into L1
 * (T0), a run's worth in a burst, they most likely evicted the rows still to be read: decode
 * attention read 11-12 GB/s of float32 where T1 reads 16-18 (AMD EPYC, AVX-512, 2 threads). One,
 * two or four blocks ahead differed by less than the noise. */
#define PREFETCH_AHEAD 2
#define HINT _MM_HINT_T1
#if defined(__AVX512F__)
#define RUN 16
#else
#define RUN 8
#endif

/* One query head's online softmax over a span of the context: its query (times the scale), the
 * running max of its scores, the sum of their exponentials and the sum of the values weighted by
 * them (not yet divided by that sum). Spans of one sequence merge by their maxima. */
typedef struct {
    float q[64] __attribute__((aligned(64)));
    float acc[64] __attribute__((aligned(64)));
    float m, l;
} HeadState;

/* Prefetch the key row and the value row ``offset`` bytes after ``k`` and ``v``, ``bytes`` long (every
 * cache line they touch), when ``k`` is not NULL. The rows of the block PREFETCH_AHEAD blocks on are fetched one at a time, each as the
 * same row of the block at hand is computed: spread so, the fetches keep the memory busy all along
 * without flooding the core's queue of misses or evicting the rows still to be read. */
static inline __attribute__((always_inline)) void prefetch_rows(const char *k, const char *v, int64_t offset,
                                                                  int bytes) {
    if (k == NULL) return;
    for (int b = 0; b < bytes; b += 64) {
        _mm_prefetch(k + offset + b, HINT);
        _mm_prefetch(v + offset + b, HINT);
    }
    if (bytes % 64) {  /* int8 rows (68 bytes) start anywhere in a line: their last byte's too */
        _mm_prefetch(k + offset + bytes - 1, HINT);
        _mm_prefetch(v + offset + bytes - 1, HINT);
    }
}

/* The float32 scale after an int8 row's 64 values (``index`` counts bytes). The vector paths load
 * the values as they are and fold the scale in once per row instead of once per value: into the
 * row's score after its dot products for keys, into its softmax weight for values. */
static inline float int8_scale(const void *base, int64_t index) {
    float scale;
    memcpy(&scale, (const int8_t *)base + index + 64, sizeof scale);
    return scale;
}

#endif
#if defined(__AVX512F__)

/* The AVX-512 path for head_dim 64: attend_run_64 below, which attend_span_64 calls for each run of
 * each block of a sequence, every kv head in turn. Per query head and run of up to 16 tokens: the
 * scores as one vector, an online-softmax update with a vector exponential, then the weighted
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

static inline __attribute__((always_inline)) void load_row64(const void *base, int64_t index, int dtype,
                                                              __m512 row[4]) {
    if (dtype == 0) {
        const float *src = (const float *)base + index;
        for (int j = 0; j < 4; j++) row[j] = _mm512_loadu_ps(src + 16 * j);
    } else if (dtype == 1) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int j = 0; j < 4; j++) {
            const __m256i half = _mm256_loadu_si256((const __m256i *)(src + 16 * j));
            row[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
        }
    } else {  /* int8: the values, not yet times the row's scale (int8_scale) */
        const int8_t *src = (const int8_t *)base + index;
        for (int j = 0; j < 4; j++)
            row[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16 * j))));
    }
}

/* Lane t of the result is the sum of the 16 lanes of v[t]: sixteen dot products finished with 15
 * shuffle-and-add steps, instead of a horizontal reduction per token. */
static inline __attribute__((always_inline)) __m512 transpose_sum16(const __m512 v[16]) {
    __m512 w[8], x[4], z[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3] */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: one partial sum of each of v4i .. v4i+3 */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)  /* fold the four 128-bit lanes of each x into two */
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One run of ``run`` tokens (up to 16, within one block; its first key row at ``first``, the next
 * ``slot_stride`` elements on) for NG query heads (1 to 4, a constant after inlining) that share its
 * kv head, whose states are st[0 .. NG-1]: each key and value row is loaded once for all of them.
 * NG x 16 dot products reduced together, an online-softmax update with a vector exponential, then
 * the weighted values into registers of accumulators. */
static inline __attribute__((always_inline)) void attend_run_64(
        const int NG, const void *k_cache, const void *v_cache, int64_t first, int64_t slot_stride, int run,
        int kv_dtype, HeadState *st, const char *pk, const char *pv, int64_t slot_bytes, int row_bytes) {
    __m512 qv[4][4], acc[4][4], part[4][16];
    float p[4][16] __attribute__((aligned(64))), ks[16] __attribute__((aligned(64))), vs[16] __attribute__((aligned(64)));
    for (int g = 0; g < NG; g++) {
        for (int j = 0; j < 4; j++) {
            qv[g][j] = _mm512_load_ps(st[g].q + 16 * j);
            acc[g][j] = _mm512_load_ps(st[g].acc + 16 * j);
        }
    }
    for (int t = 0; t < run; t++) {
        __m512 k[4];
        prefetch_rows(pk, pv, t * slot_bytes, row_bytes);
        load_row64(k_cache, first + t * slot_stride, kv_dtype, k);
        if (kv_dtype == 2) {
            ks[t] = int8_scale(k_cache, first + t * slot_stride);
            vs[t] = int8_scale(v_cache, first + t * slot_stride);
        }
        for (int g = 0; g < NG; g++) {
            __m512 a = _mm512_mul_ps(qv[g][0], k[0]), b = _mm512_mul_ps(qv[g][2], k[2]);
            a = _mm512_fmadd_ps(qv[g][1], k[1], a);
            b = _mm512_fmadd_ps(qv[g][3], k[3], b);
            part[g][t] = _mm512_add_ps(a, b);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int t = run; t < 16; t++) part[g][t] = _mm512_setzero_ps();  /* a short run's unused lanes */
    const __mmask16 valid = (__mmask16)((1u << run) - 1u);
    for (int g = 0; g < NG; g++) {
        __m512 dots = transpose_sum16(part[g]);
        if (kv_dtype == 2) dots = _mm512_mul_ps(dots, _mm512_maskz_load_ps(valid, ks));
        const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, dots);
        const float run_max = _mm512_reduce_max_ps(scores);
        if (run_max > st[g].m) {  /* a new maximum: rescale what was summed under the old one */
            const float correction = st[g].m == -INFINITY ? 0.0f : expf(st[g].m - run_max);
            st[g].l *= correction;
            for (int j = 0; j < 4; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], _mm512_set1_ps(correction));
            st[g].m = run_max;
        }
        const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(scores, _mm512_set1_ps(st[g].m))));
        st[g].l += _mm512_reduce_add_ps(e);
        _mm512_store_ps(p[g], kv_dtype == 2 ? _mm512_mul_ps(e, _mm512_maskz_load_ps(valid, vs)) : e);
    }
    for (int t = 0; t < run; t++) {
        __m512 v[4];
        load_row64(v_cache, first + t * slot_stride, kv_dtype, v);
        for (int g = 0; g < NG; g++) {
            const __m512 w = _mm512_set1_ps(p[g][t]);
            for (int j = 0; j < 4; j++) acc[g][j] = _mm512_fmadd_ps(w, v[j], acc[g][j]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < 4; j++) _mm512_store_ps(st[g].acc + 16 * j, acc[g][j]);
}

#endif  /* __AVX512F__ */

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)

/* The AVX2 + FMA path for head_dim 64, for CPUs without AVX-512 (AMD Zen 2/3, older Xeons): the
 * AVX-512 path's algorithm in 8-lane registers, so a row is eight vectors and a run is 8 tokens.
 * The bytes read per step are the same, each once; only the vector width differs. */

static inline __m256 exp256(__m256 x) { /* exp(x), x <= 0: 2^n * p(r), Cephes' polynomial */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n through the exponent bits: n >= -126 after the clamp above, so the result is normal */
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline float reduce_max256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float reduce_add256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

/* Vectors j0 .. j0+n-1 of a row of 64 values (8 to a vector) as float32, into row[0 .. n-1]. */
static inline __attribute__((always_inline)) void load_row64(const void *base, int64_t index, int dtype, int j0,
                                                              int n, __m256 row[]) {
    if (dtype == 0) {
        const float *src = (const float *)base + index;
        for (int j = 0; j < n; j++) row[j] = _mm256_loadu_ps(src + 8 * (j0 + j));
    } else if (dtype == 1) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int j = 0; j < n; j++) {
            const __m128i half = _mm_loadu_si128((const __m128i *)(src + 8 * (j0 + j)));
            row[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
        }
    } else {  /* int8: the values, not yet times the row's scale (int8_scale) */
        const int8_t *src = (const int8_t *)base + index;
        for (int j = 0; j < n; j++)
            row[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8 * (j0 + j)))));
    }
}

/* Lane t of the result is the sum of the 8 lanes of v[t]: eight dot products finished together. */
static inline __attribute__((always_inline)) __m256 transpose_sum8(const __m256 v[8]) {
    const __m256 w0 = _mm256_hadd_ps(v[0], v[1]), w1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 w2 = _mm256_hadd_ps(v[4], v[5]), w3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 x0 = _mm256_hadd_ps(w0, w1), x1 = _mm256_hadd_ps(w2, w3);  /* per 128-bit half: v0..v3, v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(x0, x1, 0x20), _mm256_permute2f128_ps(x0, x1, 0x31));
}

/* As the AVX-512 attend_run_64, in runs of up to 8 tokens. With sixteen registers the queries stay
 * in memory (operands of the multiplies), and the weighted values go in four passes over the run, a
 * quarter of the row each, so that the accumulators of every head stay in registers. */
static inline __attribute__((always_inline)) void attend_run_64(
        const int NG, const void *k_cache, const void *v_cache, int64_t first, int64_t slot_stride, int run,
        int kv_dtype, HeadState *st, const char *pk, const char *pv, int64_t slot_bytes, int row_bytes) {
    __m256 part[4][8];
    float p[4][8] __attribute__((aligned(32))), ks[8] __attribute__((aligned(32))), vs[8] __attribute__((aligned(32)));
    for (int t = 0; t < run; t++) {
        __m256 k[8];
        prefetch_rows(pk, pv, t * slot_bytes, row_bytes);
        load_row64(k_cache, first + t * slot_stride, kv_dtype, 0, 8, k);
        if (kv_dtype == 2) {
            ks[t] = int8_scale(k_cache, first + t * slot_stride);
            vs[t] = int8_scale(v_cache, first + t * slot_stride);
        }
        for (int g = 0; g < NG; g++) {
            const float *q = st[g].q;
            __m256 a = _mm256_mul_ps(_mm256_load_ps(q), k[0]), b = _mm256_mul_ps(_mm256_load_ps(q + 8), k[1]);
            for (int j = 2; j < 8; j += 2) {
                a = _mm256_fmadd_ps(_mm256_load_ps(q + 8 * j), k[j], a);
                b = _mm256_fmadd_ps(_mm256_load_ps(q + 8 * j + 8), k[j + 1], b);
            }
            part[g][t] = _mm256_add_ps(a, b);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int t = run; t < 8; t++) part[g][t] = _mm256_setzero_ps();  /* a short run's unused lanes */
    if (kv_dtype == 2)
        for (int t = run; t < 8; t++) ks[t] = vs[t] = 0.0f;
    const __m256 valid = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)run),
                                       _CMP_LT_OQ);
    for (int g = 0; g < NG; g++) {
        __m256 dots = transpose_sum8(part[g]);
        if (kv_dtype == 2) dots = _mm256_mul_ps(dots, _mm256_load_ps(ks));
        const __m256 scores = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), dots, valid);
        const float run_max = reduce_max256(scores);
        if (run_max > st[g].m) {  /* a new maximum: rescale what was summed under the old one */
            const float correction = st[g].m == -INFINITY ? 0.0f : expf(st[g].m - run_max);
            st[g].l *= correction;
            for (int i = 0; i < 64; i += 8)
                _mm256_store_ps(st[g].acc + i, _mm256_mul_ps(_mm256_load_ps(st[g].acc + i), _mm256_set1_ps(correction)));
            st[g].m = run_max;
        }
        const __m256 e = _mm256_and_ps(valid, exp256(_mm256_sub_ps(scores, _mm256_set1_ps(st[g].m))));
        st[g].l += reduce_add256(e);
        _mm256_store_ps(p[g], kv_dtype == 2 ? _mm256_mul_ps(e, _mm256_load_ps(vs)) : e);
    }
    for (int j0 = 0; j0 < 8; j0 += 2) {  /* values 8 j0 .. 8 j0 + 15 of every row */
        __m256 acc[4][2];
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < 2; j++) acc[g][j] = _mm256_load_ps(st[g].acc + 8 * (j0 + j));
        for (int t = 0; t < run; t++) {
            __m256 v[2];
            load_row64(v_cache, first + t * slot_stride, kv_dtype, j0, 2, v);
            for (int g = 0; g < NG; g++) {
                const __m256 w = _mm256_broadcast_ss(&p[g][t]);
                for (int j = 0; j < 2; j++) acc[g][j] = _mm256_fmadd_ps(w, v[j], acc[g][j]);
            }
        }
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < 2; j++) _mm256_store_ps(st[g].acc + 8 * (j0 + j), acc[g][j]);
    }
}

#endif  /* AVX2 + FMA without AVX-512 */

#ifdef RUN  /* a vector path was built */
#include <omp.h>

#define MIN_PART 4        /* blocks: the shortest part a sequence is split into */

/* Every query head of sequence ``seq`` over its positions begin .. end-1, into st[0 .. num_heads-1]
 * (started here). Block by block: a block's token slots hold every kv head's rows side by side, so
 * each run of them is taken for all kv heads in turn while it is in cache, and the block
 * PREFETCH_AHEAD later is fetched row by row meanwhile (the blocks of a sequence lie anywhere in the cache,
 * where the hardware prefetcher loses the stream). */
static void attend_span_64(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                           int begin, int end, int seq, int num_heads, int num_kv_heads, int block_size,
                           float scale, int dtype, int kv_dtype, HeadState *st) {
    enum { D = 64 };
    const int group = num_heads / num_kv_heads;
    RowBuffer buffer;
    for (int h = 0; h < num_heads; h++) {
        const float *qrow = load_row(q, ((int64_t)seq * num_heads + h) * D, dtype, D, &buffer);
        for (int i = 0; i < D; i++) { st[h].q[i] = qrow[i] * scale; st[h].acc[i] = 0.0f; }
        st[h].m = -INFINITY;
        st[h].l = 0.0f;
    }
    if (begin >= end) return;
    const int row = cache_row(D, kv_dtype);
    const int64_t slot_stride = (int64_t)num_kv_heads * row;  /* elements from a token slot to the next */
    const int esize = kv_dtype == 0 ? 4 : kv_dtype == 1 ? 2 : 1, last = (end - 1) / block_size;
    for (int start = begin; start < end;) {
        const int b = start / block_size, block_end = (b + 1) * block_size < end ? (b + 1) * block_size : end;
        for (int run; start < block_end; start += run) {
            run = block_end - start < RUN ? block_end - start : RUN;
            const int64_t first = ((int64_t)table[b] * block_size + start % block_size) * slot_stride;
            /* the same slots PREFETCH_AHEAD blocks on, fetched while this run computes */
            const int64_t ahead = b + PREFETCH_AHEAD <= last
                                  ? ((int64_t)table[b + PREFETCH_AHEAD] * block_size + start % block_size) * slot_stride : -1;
            for (int kvh = 0; kvh < num_kv_heads; kvh++) {
                const char *pk = ahead < 0 ? NULL : (const char *)k_cache + (ahead + kvh * row) * esize;
                const char *pv = ahead < 0 ? NULL : (const char *)v_cache + (ahead + kvh * row) * esize;
                for (int g0 = 0; g0 < group; g0 += 4, pk = pv = NULL) {  /* the first heads fetch for the rest */
                    HeadState *heads = st + kvh * group + g0;
/* NG and the kv dtype as constants, so each inlined copy keeps only its own dtype's loads */
#define ATTEND_KV(NG, KV) attend_run_64(NG, k_cache, v_cache, first + kvh * row, slot_stride, run, KV, heads, pk, \
                                        pv, slot_stride * esize, row * esize)
#define ATTEND(NG) (kv_dtype == 0 ? ATTEND_KV(NG, 0) : kv_dtype == 1 ? ATTEND_KV(NG, 1) : ATTEND_KV(NG, 2))
                    switch (group - g0 < 4 ? group - g0 : 4) {
                        case 1: ATTEND(1); break;
                        case 2: ATTEND(2); break;
                        case 3: ATTEND(3); break;
                        default: ATTEND(4); break;
                    }
#undef ATTEND
#undef ATTEND_KV
                }
            }
        }
    }
}

/* Sequence ``seq``'s output from its heads' states. */
static void finish_64(const HeadState *st, void *out, int seq, int num_heads, int dtype) {
    for (int h = 0; h < num_heads; h++) {
        const int64_t oi = ((int64_t)seq * num_heads + h) * 64;
        const float inv = st[h].l > 0.0f ? 1.0f / st[h].l : 0.0f;
        for (int i = 0; i < 64; i++) {
            if (dtype == 0) ((float *)out)[oi + i] = st[h].acc[i] * inv;
            else ((uint16_t *)out)[oi + i] = f32_to_bf16(st[h].acc[i] * inv);
        }
    }
}

/* How many parts each sequence's span is split into: one while there are sequences enough to keep
 * every thread busy (8 a thread: dynamic scheduling evens out their lengths); else enough parts for
 * about 8 tasks a thread, none shorter than MIN_PART blocks. */
static int parts_per_sequence(int num_seqs, const int32_t *context_lens, int window, int block_size,
                              int num_threads) {
    if (num_threads <= 1 || num_seqs >= 8 * num_threads) return 1;
    int longest = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int span = context_lens[s] - window_start(context_lens[s], window);
        longest = span > longest ? span : longest;
    }
    const int blocks = (longest + block_size - 1) / block_size;
    int parts = (8 * num_threads + num_seqs - 1) / num_seqs;
    if (parts > blocks / MIN_PART) parts = blocks / MIN_PART;
    return parts > 1 ? parts : 1;
}

/* head_dim 64 on the vector path. A task per sequence, or, with fewer sequences than threads can
 * share, per part of one (a run of its blocks; split-K): each part's heads keep their own softmax
 * state, merged by their maxima once all are done. Returns -1, computing nothing, where the states
 * cannot be allocated. */
static int decode_64(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                     const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                     int block_size, int max_blocks, float scale, int dtype, int kv_dtype, int window,
                     int num_threads) {
    const int parts = parts_per_sequence(num_seqs, context_lens, window, block_size, num_threads);
    const int64_t tasks = (int64_t)num_seqs * parts;
    /* the heads' states: a set per thread, or with split sequences a set per task */
    HeadState *states = aligned_alloc(64, (parts == 1 ? num_threads : tasks) * num_heads * sizeof(HeadState));
    if (states == NULL) return -1;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < tasks; task++) {
        const int s = (int)(task / parts), part = (int)(task % parts), context_len = context_lens[s];
        const int first = window_start(context_len, window);
        /* the part's share of the span's blocks, cut at block edges */
        const int b0 = first / block_size, blocks = context_len > first ? (context_len - 1) / block_size + 1 - b0 : 0;
        const int lo = (b0 + (int)((int64_t)blocks * part / parts)) * block_size;
        const int hi = (b0 + (int)((int64_t)blocks * (part + 1) / parts)) * block_size;
        HeadState *st = states + (parts == 1 ? omp_get_thread_num() : task) * num_heads;
        attend_span_64(q, k_cache, v_cache, block_tables + (int64_t)s * max_blocks, lo > first ? lo : first,
                       hi < context_len ? hi : context_len, s, num_heads, num_kv_heads, block_size, scale, dtype,
                       kv_dtype, st);
        if (parts == 1) finish_64(st, out, s, num_heads, dtype);
    }
    if (parts > 1) {
        #pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int s = 0; s < num_seqs; s++) {
            HeadState *st = states + (int64_t)s * parts * num_heads;  /* part 0's states, into which the rest merge */
            for (int h = 0; h < num_heads; h++) {
                float m = -INFINITY;
                for (int part = 0; part < parts; part++) {
                    const float mp = st[(int64_t)part * num_heads + h].m;
                    m = mp > m ? mp : m;
                }
                float l = 0.0f, acc[64] = {0};
                for (int part = 0; part < parts; part++) {
                    const HeadState *x = st + (int64_t)part * num_heads + h;
                    if (x->m == -INFINITY) continue;  /* an empty part */
                    const float w = expf(x->m - m);
                    l += w * x->l;
                    for (int i = 0; i < 64; i++) acc[i] += w * x->acc[i];
                }
                st[h].l = l;
                memcpy(st[h].acc, acc, sizeof acc);
            }
            finish_64(st, out, s, num_heads, dtype);
        }
    }
    free(states);
    return 0;
}
#define HAVE_HEADS_64 1
#endif

/* ------------------------------------------------------------------------------------------------
 * Prefill: a chunk of queries per sequence over the cache (which holds the chunk's own rows), as
 * kernels/reference.py:paged_prefill_attention. Flash attention in float32 on the vector path: a
 * task takes one sequence, one kv head and a block of its chunk's tokens, whose query rows (each
 * token times the group's query heads) it keeps as float32, scaled, with their outputs and softmax
 * states. It goes through the keys those rows see in chunks of PF_KC: each chunk's keys are read
 * once from the paged cache into a float32 scratch (int8 rows dequantized there), keys transposed
 * into strips of PF_SW so that a score tile is broadcast query values times key vectors, values as
 * rows. Every row block of PF_RB query rows then takes the chunk: its scores tile (PF_RB rows x
 * PF_SW keys in registers), the causal and window mask, an online-softmax update per row, and the
 * weighted values (PF_RP rows x PF_DC vectors in registers). Each key and value loaded into a
 * register serves PF_RB (scores) or PF_RP (values) query rows, where decode's serve the few heads of
 * one token. Rows are token-major (row r: token r / group, head r % group), so a row block's keys
 * run from its first row's window start to its last row's position; the diagonal's few masked
 * scores are computed and discarded.
 * Head sizes that are a multiple of the vector (16 on AVX-512, 8 on AVX2), up to MAX_HEAD_DIM, take
 * this path; any other, or a build without a vector path, returns -1 and the caller runs the
 * reference.
 * ------------------------------------------------------------------------------------------------ */

#ifdef RUN  /* a vector path was built */
#if defined(__AVX512F__)
typedef __m512 vf;
typedef __mmask16 vmask;
#define VL 16
#define PF_RB 12  /* query rows of a row block: scores tile PF_RB x PF_SV vectors, 24 of 32 registers */
#define PF_SV 2
#define PF_RP 6   /* the weighted values' tile: PF_RP rows x PF_DC vectors, 24 registers */
#define PF_DC 4
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vloada(const float *p) { return _mm512_load_ps(p); }
static inline void vstorea(float *p, vf x) { _mm512_store_ps(p, x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vexp(vf x) { return exp512(x); }
static inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline float vhsum(vf x) { return _mm512_reduce_add_ps(x); }
/* lanes whose column col + i lies in lo .. hi */
static inline vmask vrange(int col, int lo, int hi) {
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(col));
    return _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32(lo), _MM_CMPINT_NLT)
           & _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32(hi), _MM_CMPINT_LE);
}
static inline vf vselect(vmask m, vf yes, vf no) { return _mm512_mask_blend_ps(m, no, yes); }
#else
typedef __m256 vf;
typedef __m256 vmask;
#define VL 8
#define PF_RB 6   /* 16 registers: scores tile 6 x 2 vectors, weighted values 2 x 4 */
#define PF_SV 2
#define PF_RP 2
#define PF_DC 4
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vloada(const float *p) { return _mm256_load_ps(p); }
static inline void vstorea(float *p, vf x) { _mm256_store_ps(p, x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vexp(vf x) { return exp256(x); }
static inline float vhmax(vf x) { return reduce_max256(x); }
static inline float vhsum(vf x) { return reduce_add256(x); }
static inline vmask vrange(int col, int lo, int hi) {
    const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(col));
    const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), idx), above = _mm256_cmpgt_epi32(
        idx, _mm256_set1_epi32(hi));
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_or_si256(below, above), _mm256_set1_epi32(-1)));
}
static inline vf vselect(vmask m, vf yes, vf no) { return _mm256_blendv_ps(no, yes, m); }
#endif

#define PF_SW (PF_SV * VL)   /* keys a strip: the scores tile's width */
#define PF_KC 256            /* keys a chunk: its keys and values as float32, 64 KiB each at head_dim 64 */
#define PF_PS (PF_KC + VL)   /* floats from a row of scores to the next (not a multiple of 1 KiB: no aliasing) */
#define PF_MAX_ROWS 512      /* query rows a task at most: tokens x group, its queries and outputs in L2 */
#define PF_AHEAD 8         /* keys ahead of the one packing whose rows are fetched */
#define PF_MIN_ROWS 48       /* ... and at least, where the chunk allows, so each key chunk read serves as many */

/* A thread's scratch: the chunk's keys (strips of PF_SW keys, [d][PF_SW] each) and values ([key][d]),
 * a row block's scores, and the task's queries, outputs and softmax states. */
typedef struct {
    float *kt, *v, *p, *q, *o, *m, *l, *corr;
    int *pos, *lo;
    uint16_t *pb;  /* bfloat16 queries' weights (PF_BF16) */
} PrefillScratch;

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *query_start_loc, *context_lens;
    void *out;
    int num_heads, num_kv_heads, d, block_size, max_blocks, dtype, kv_dtype, window;
    float scale;
} PrefillArgs;

/* Key position p's row of kv head kvh in the caches (elements of ``row``, the cache's row; sequence table
 * ``table``), and, PF_AHEAD keys on while those are before ``end``, its rows fetched into L2 meanwhile: a
 * sequence's blocks lie anywhere in the cache. */
static inline int64_t key_row(const PrefillArgs *a, const int32_t *table, int kvh, int p, int end, int row,
                              int esize) {
    if (p + PF_AHEAD < end) {
        const int pa = p + PF_AHEAD;
        const int64_t ahead = (((int64_t)table[pa / a->block_size] * a->block_size + pa % a->block_size)
                               * a->num_kv_heads + kvh) * row * esize;
        prefetch_rows((const char *)a->k_cache, (const char *)a->v_cache, ahead, row * esize);
    }
    return (((int64_t)table[p / a->block_size] * a->block_size + p % a->block_size) * a->num_kv_heads + kvh) * row;
}

/* Keys c0 .. c0+n-1 of kv head ``kvh`` from the cache into the scratch as float32: keys transposed into
 * strips (zeros past n to the strip's end), values as rows. */
static void pack_chunk(const PrefillArgs *a, const int32_t *table, int kvh, int c0, int n, PrefillScratch *w) {
    const int d = a->d, row = cache_row(d, a->kv_dtype), esize = a->kv_dtype == 0 ? 4 : a->kv_dtype == 1 ? 2 : 1;
    for (int j = 0; j < n; j++) {
        const int64_t at = key_row(a, table, kvh, c0 + j, c0 + n, row, esize);
        float *kt = w->kt + (int64_t)(j / PF_SW) * d * PF_SW + j % PF_SW, *v = w->v + (int64_t)j * d;
        if (a->kv_dtype == 0) {
            const float *k = (const float *)a->k_cache + at, *vs = (const float *)a->v_cache + at;
            for (int i = 0; i < d; i++) kt[i * PF_SW] = k[i];
            memcpy(v, vs, (size_t)d * sizeof(float));
        } else if (a->kv_dtype == 1) {
            const uint16_t *k = (const uint16_t *)a->k_cache + at, *vs = (const uint16_t *)a->v_cache + at;
            for (int i = 0; i < d; i++) {
                const uint32_t kb = (uint32_t)k[i] << 16;
                memcpy(kt + i * PF_SW, &kb, 4);
            }
            #pragma omp simd
            for (int i = 0; i < d; i++) ((uint32_t *)v)[i] = (uint32_t)vs[i] << 16;
        } else {  /* int8 values times the row's scale, as kv_quant.dequantize */
            const int8_t *k = (const int8_t *)a->k_cache + at, *vs = (const int8_t *)a->v_cache + at;
            float ks, vsc;
            memcpy(&ks, k + d, 4);
            memcpy(&vsc, vs + d, 4);
            for (int i = 0; i < d; i++) kt[i * PF_SW] = (float)k[i] * ks;
            #pragma omp simd
            for (int i = 0; i < d; i++) v[i] = (float)vs[i] * vsc;
        }
    }
    for (int j = n; j % PF_SW; j++) {
        float *kt = w->kt + (int64_t)(j / PF_SW) * d * PF_SW + j % PF_SW;
        for (int i = 0; i < d; i++) kt[i * PF_SW] = 0.0f;
    }
}

/* Scores of PF_RB query rows (q: [PF_RB][d]) against NV vectors of keys (of strip s, from vector c0 on). */
static inline __attribute__((always_inline)) void scores_strip(const int NV, const float *q, const float *kt, int s,
                                                                int c0, int d, float *p) {
    vf acc[PF_RB][PF_SV];
    for (int r = 0; r < PF_RB; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = vzero();
    const float *k = kt + (int64_t)s * d * PF_SW + c0 * VL;
    for (int i = 0; i < d; i++) {
        vf kv[PF_SV];
        for (int c = 0; c < NV; c++) kv[c] = vloada(k + i * PF_SW + c * VL);
        for (int r = 0; r < PF_RB; r++) {
            const vf qb = vset1(q[r * d + i]);
            for (int c = 0; c < NV; c++) acc[r][c] = vfma(qb, kv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < PF_RB; r++)
        for (int c = 0; c < NV; c++) vstorea(p + r * PF_PS + s * PF_SW + (c0 + c) * VL, acc[r][c]);
}

/* Scores of PF_RB query rows against the chunk's key vectors v0 .. v1-1 (VL keys each), into p: whole
 * strips, and a last one of a single vector where that is all the diagonal needs. */
static void scores_tile(const float *q, const float *kt, int v0, int v1, int d, float *p) {
    int s = v0 / PF_SV;
    for (; (s + 1) * PF_SV <= v1; s++) scores_strip(PF_SV, q, kt, s, 0, d, p);
    if (s * PF_SV < v1) scores_strip(1, q, kt, s, 0, d, p);  /* PF_SV is 2: one vector left */
}

/* Outputs o ([PF_RB][d]) times corr, plus the weights p times the chunk's values a .. b-1: NV vectors of
 * each row's values, from value i0 on. */
static inline __attribute__((always_inline)) void values_part(const int NV, const float *p, const float *v,
                                                               const float *corr, int a, int b, int d, int i0,
                                                               float *o) {
    for (int r0 = 0; r0 < PF_RB; r0 += PF_RP) {
        vf acc[PF_RP][PF_DC];
        for (int r = 0; r < PF_RP; r++)
            for (int c = 0; c < NV; c++) acc[r][c] = vmul(vloada(o + (r0 + r) * d + i0 + c * VL), vset1(corr[r0 + r]));
        for (int j = a; j < b; j++) {
            vf vv[PF_DC];
            for (int c = 0; c < NV; c++) vv[c] = vloada(v + (int64_t)j * d + i0 + c * VL);
            for (int r = 0; r < PF_RP; r++) {
                const vf w = vset1(p[(r0 + r) * PF_PS + j]);
                for (int c = 0; c < NV; c++) acc[r][c] = vfma(w, vv[c], acc[r][c]);
            }
        }
        for (int r = 0; r < PF_RP; r++)
            for (int c = 0; c < NV; c++) vstorea(o + (r0 + r) * d + i0 + c * VL, acc[r][c]);
    }
}

/* All d values of the PF_RB rows: PF_DC vectors at a time, then the 1 .. PF_DC-1 left. */
static void values_tile(const float *p, const float *v, const float *corr, int a, int b, int d, float *o) {
    int i0 = 0;
    for (; i0 + PF_DC * VL <= d; i0 += PF_DC * VL) values_part(PF_DC, p, v, corr, a, b, d, i0, o);
    switch ((d - i0) / VL) {  /* PF_DC is 4 */
        case 1: values_part(1, p, v, corr, a, b, d, i0, o); break;
        case 2: values_part(2, p, v, corr, a, b, d, i0, o); break;
        case 3: values_part(3, p, v, corr, a, b, d, i0, o); break;
        default: break;
    }
}

#if defined(__AVX512BF16__)
/* bfloat16 queries over a bfloat16 or int8 cache, with AVX512-BF16: the products that PyTorch's bfloat16
 * attention takes in bfloat16, taken so here, two at a time (vdpbf16ps: pairs of bfloat16 products summed
 * into float32 lanes), half the instructions of the float32 tiles. Queries stay bfloat16 (the scale goes
 * on their scores), keys are bfloat16 (int8 rows dequantized and rounded, as kv_quant.dequantize to
 * bfloat16 does), and the weights are rounded to bfloat16 before they multiply the values, as PyTorch's
 * flash attention rounds them; sums stay float32. Layouts, in pairs: keys in strips of [d/2][PF_SW][2]
 * (a pair of a key's values a lane), values in pairs of keys [key/2][d][2], queries [row][d/2][2]. */
#define PF_BF16 1

static inline uint32_t bf16_pair(float lo, float hi) {
    return (uint32_t)f32_to_bf16(lo) | (uint32_t)f32_to_bf16(hi) << 16;
}

/* Keys c0 .. c0+n-1 of kv head kvh as bfloat16 pairs: keys into strips (zeros past n to the strip's
 * end), values into pairs of keys (a zero key after an odd n). */
static void pack_chunk_bf16(const PrefillArgs *a, const int32_t *table, int kvh, int c0, int n,
                            PrefillScratch *w) {
    const int d = a->d, half = d / 2, row = cache_row(d, a->kv_dtype), esize = a->kv_dtype == 1 ? 2 : 1;
    uint32_t *kt = (uint32_t *)w->kt;
    uint16_t *v = (uint16_t *)w->v;
    for (int j = 0; j < n; j++) {
        const int64_t at = key_row(a, table, kvh, c0 + j, c0 + n, row, esize);
        uint32_t *kp = kt + (int64_t)(j / PF_SW) * half * PF_SW + j % PF_SW;
        uint16_t *vp = v + (int64_t)(j / 2) * d * 2 + j % 2;
        if (a->kv_dtype == 1) {
            const uint16_t *k = (const uint16_t *)a->k_cache + at, *vs = (const uint16_t *)a->v_cache + at;
            for (int i = 0; i < half; i++) kp[i * PF_SW] = (uint32_t)k[2 * i] | (uint32_t)k[2 * i + 1] << 16;
            for (int i = 0; i < d; i++) vp[2 * i] = vs[i];
        } else {  /* int8 values times the row's scale, rounded to bfloat16 */
            const int8_t *k = (const int8_t *)a->k_cache + at, *vs = (const int8_t *)a->v_cache + at;
            float ks, vsc;
            memcpy(&ks, k + d, 4);
            memcpy(&vsc, vs + d, 4);
            for (int i = 0; i < half; i++)
                kp[i * PF_SW] = bf16_pair((float)k[2 * i] * ks, (float)k[2 * i + 1] * ks);
            for (int i = 0; i < d; i++) vp[2 * i] = f32_to_bf16((float)vs[i] * vsc);
        }
    }
    for (int j = n; j % PF_SW; j++) {
        uint32_t *kp = kt + (int64_t)(j / PF_SW) * half * PF_SW + j % PF_SW;
        for (int i = 0; i < half; i++) kp[i * PF_SW] = 0;
    }
    if (n % 2) {
        uint16_t *vp = v + (int64_t)(n / 2) * d * 2 + 1;
        for (int i = 0; i < d; i++) vp[2 * i] = 0;
    }
}

static inline __attribute__((always_inline)) void scores_strip_bf16(const int NV, const uint32_t *q,
                                                                     const uint32_t *kt, int s, int d, float *p) {
    const int half = d / 2;
    __m512 acc[PF_RB][PF_SV];
    for (int r = 0; r < PF_RB; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = _mm512_setzero_ps();
    const uint32_t *k = kt + (int64_t)s * half * PF_SW;
    for (int i = 0; i < half; i++) {
        __m512bh kv[PF_SV];
        for (int c = 0; c < NV; c++) kv[c] = (__m512bh)_mm512_load_si512((const void *)(k + i * PF_SW + c * VL));
        for (int r = 0; r < PF_RB; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[r * d + i]);  /* rows d floats apart */
            for (int c = 0; c < NV; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, kv[c]);
        }
    }
    for (int r = 0; r < PF_RB; r++)
        for (int c = 0; c < NV; c++) _mm512_store_ps(p + r * PF_PS + s * PF_SW + c * VL, acc[r][c]);
}

static void scores_tile_bf16(const uint32_t *q, const uint32_t *kt, int v0, int v1, int d, float *p) {
    int s = v0 / PF_SV;
    for (; (s + 1) * PF_SV <= v1; s++) scores_strip_bf16(PF_SV, q, kt, s, d, p);
    if (s * PF_SV < v1) scores_strip_bf16(1, q, kt, s, d, p);
}

/* As values_part, the weights pb (bfloat16) times the values of the key pairs a/2 .. (b+1)/2-1 (weights
 * outside a .. b-1 are zero). */
static inline __attribute__((always_inline)) void values_part_bf16(const int NV, const uint16_t *pb,
                                                                    const uint16_t *v, const float *corr, int a,
                                                                    int b, int d, int i0, float *o) {
    for (int r0 = 0; r0 < PF_RB; r0 += PF_RP) {
        __m512 acc[PF_RP][PF_DC];
        for (int r = 0; r < PF_RP; r++)
            for (int c = 0; c < NV; c++)
                acc[r][c] = _mm512_mul_ps(_mm512_load_ps(o + (r0 + r) * d + i0 + c * VL),
                                          _mm512_set1_ps(corr[r0 + r]));
        for (int jp = a / 2; jp < (b + 1) / 2; jp++) {
            __m512bh vv[PF_DC];
            for (int c = 0; c < NV; c++)
                vv[c] = (__m512bh)_mm512_load_si512((const void *)(v + ((int64_t)jp * d + i0 + c * VL) * 2));
            for (int r = 0; r < PF_RP; r++) {
                uint32_t pair;
                memcpy(&pair, pb + (r0 + r) * PF_PS + 2 * jp, 4);
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int c = 0; c < NV; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, vv[c]);
            }
        }
        for (int r = 0; r < PF_RP; r++)
            for (int c = 0; c < NV; c++) _mm512_store_ps(o + (r0 + r) * d + i0 + c * VL, acc[r][c]);
    }
}

static void values_tile_bf16(const uint16_t *pb, const uint16_t *v, const float *corr, int a, int b, int d,
                             float *o) {
    int i0 = 0;
    for (; i0 + PF_DC * VL <= d; i0 += PF_DC * VL) values_part_bf16(PF_DC, pb, v, corr, a, b, d, i0, o);
    switch ((d - i0) / VL) {
        case 1: values_part_bf16(1, pb, v, corr, a, b, d, i0, o); break;
        case 2: values_part_bf16(2, pb, v, corr, a, b, d, i0, o); break;
        case 3: values_part_bf16(3, pb, v, corr, a, b, d, i0, o); break;
        default: break;
    }
}
#endif  /* __AVX512BF16__ */

/* Sequence s's tokens t0 .. t1-1 of its chunk, the query heads of kv head kvh. */
static void prefill_task(const PrefillArgs *a, int s, int kvh, int t0, int t1, PrefillScratch *w) {
    const int d = a->d, group = a->num_heads / a->num_kv_heads;
    const int start = a->query_start_loc[s], q_len = a->query_start_loc[s + 1] - start;
    const int first_pos = a->context_lens[s] - q_len;
    const int rows = (t1 - t0) * group, padded = (rows + PF_RB - 1) / PF_RB * PF_RB, esize = a->dtype == 0 ? 4 : 2;
#ifdef PF_BF16
    const int bf16 = a->dtype == 1;  /* the pairwise bfloat16 products: queries kept as they are, unscaled */
#else
    const int bf16 = 0;
#endif
    const float score_scale = bf16 ? a->scale : 1.0f;  /* float32 queries carry the scale */
    RowBuffer buffer;
    for (int r = 0; r < padded; r++) {
        float *q = w->q + (int64_t)r * d;
        if (r < rows) {
            const int t = t0 + r / group;
            if (r % group == 0 && t + 4 < t1) {  /* the queries 4 tokens on, into L2: a task's rows are strided */
                const char *ahead = (const char *)a->q
                                    + ((int64_t)(start + t + 4) * a->num_heads + kvh * group) * d * esize;
                for (int b = 0; b < group * d * esize; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
            }
            const int64_t qi = ((int64_t)(start + t) * a->num_heads + kvh * group + r % group) * d;
            if (bf16) {
                memcpy(q, (const uint16_t *)a->q + qi, (size_t)d * 2);  /* [d/2] pairs in the row's first d * 2 bytes */
            } else {
                const float *src = load_row(a->q, qi, a->dtype, d, &buffer);
                for (int i = 0; i < d; i++) q[i] = src[i] * a->scale;
            }
            w->pos[r] = first_pos + t;
            w->lo[r] = window_start(w->pos[r] + 1, a->window);
        } else {  /* padding: no query, the last row's keys */
            memset(q, 0, (size_t)d * sizeof(float));
            w->pos[r] = w->pos[rows - 1];
            w->lo[r] = w->lo[rows - 1];
        }
        memset(w->o + (int64_t)r * d, 0, (size_t)d * sizeof(float));
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    const int32_t *table = a->block_tables + (int64_t)s * a->max_blocks;
    const int key_end = w->pos[padded - 1] + 1;
    for (int c0 = w->lo[0]; c0 < key_end; c0 += PF_KC) {
        const int n = key_end - c0 < PF_KC ? key_end - c0 : PF_KC;
#ifdef PF_BF16
        if (bf16) pack_chunk_bf16(a, table, kvh, c0, n, w);
        else
#endif
            pack_chunk(a, table, kvh, c0, n, w);
        for (int rb = 0; rb < padded; rb += PF_RB) {
            /* the block's keys in this chunk, as columns: from its first row's window start to its last row */
            const int ca = w->lo[rb] > c0 ? w->lo[rb] - c0 : 0;
            const int cb = w->pos[rb + PF_RB - 1] + 1 - c0 < n ? w->pos[rb + PF_RB - 1] + 1 - c0 : n;
            if (ca >= cb) continue;
            const int j0 = ca / VL * VL, j1 = (cb + VL - 1) / VL * VL;  /* whole vectors of scores */
            float *p = w->p;
#ifdef PF_BF16
            if (bf16)
                scores_tile_bf16((const uint32_t *)(w->q + (int64_t)rb * d), (const uint32_t *)w->kt, j0 / VL, j1 / VL,
                                 d, p);
            else
#endif
                scores_tile(w->q + (int64_t)rb * d, w->kt, j0 / VL, j1 / VL, d, p);
            const vf sv = vset1(score_scale);
            for (int r = 0; r < PF_RB; r++) {
                /* the row's keys in this chunk: columns lo .. hi */
                const int R = rb + r, lo = w->lo[R] - c0, hi = w->pos[R] - c0 < n - 1 ? w->pos[R] - c0 : n - 1;
                float *pr = p + r * PF_PS;
                vf mx = vset1(-INFINITY);
                for (int j = j0; j < j1; j += VL)
                    mx = vmax(mx, vselect(vrange(j, lo, hi), vmul(vloada(pr + j), sv), vset1(-INFINITY)));
                const float run_max = vhmax(mx);
                if (run_max == -INFINITY) {  /* none of this chunk's keys for this row */
                    w->corr[rb + r] = 1.0f;
                    for (int j = j0; j < j1; j += VL) vstorea(pr + j, vzero());
#ifdef PF_BF16
                    if (bf16) memset(w->pb + r * PF_PS + j0, 0, (size_t)(j1 - j0) * 2);
#endif
                    continue;
                }
                const float m_new = run_max > w->m[R] ? run_max : w->m[R];
                const float corr = w->m[R] == -INFINITY ? 0.0f : expf(w->m[R] - m_new);
                w->corr[rb + r] = corr;
                w->m[R] = m_new;
                vf sum = vzero();
                const vf mv = vset1(m_new);
                for (int j = j0; j < j1; j += VL) {
                    const vf e = vselect(vrange(j, lo, hi), vexp(vsub(vmul(vloada(pr + j), sv), mv)), vzero());
#ifdef PF_BF16
                    if (bf16)
                        _mm256_storeu_si256((__m256i *)(w->pb + r * PF_PS + j), (__m256i)_mm512_cvtneps_pbh(e));
                    else
#endif
                        vstorea(pr + j, e);
                    sum = vadd(sum, e);
                }
                w->l[R] = w->l[R] * corr + vhsum(sum);
            }
#ifdef PF_BF16
            if (bf16)
                values_tile_bf16(w->pb, (const uint16_t *)w->v, w->corr + rb, ca, cb, d, w->o + (int64_t)rb * d);
            else
#endif
                values_tile(p, w->v, w->corr + rb, ca, cb, d, w->o + (int64_t)rb * d);
        }
    }
    for (int r = 0; r < rows; r++) {
        const int64_t oi = ((int64_t)(start + t0 + r / group) * a->num_heads + kvh * group + r % group) * d;
        const float inv = w->l[r] > 0.0f ? 1.0f / w->l[r] : 0.0f, *o = w->o + (int64_t)r * d;
        if (a->dtype == 0) {
            for (int i = 0; i < d; i++) ((float *)a->out)[oi + i] = o[i] * inv;
        } else {
            for (int i = 0; i < d; i++) ((uint16_t *)a->out)[oi + i] = f32_to_bf16(o[i] * inv);
        }
    }
}

/* Tasks: (sequence, first token, end token) blocks of each chunk, each taken for every kv head. A
 * block has at most PF_MAX_ROWS query rows; fewer where the blocks would otherwise be too few to keep
 * every thread busy (about 8 tasks a thread), but not under PF_MIN_ROWS. A chunk is cut into blocks of
 * equal size. */
static int prefill_vec(const PrefillArgs *a, int num_seqs, int num_threads) {
    const int group = a->num_heads / a->num_kv_heads;
    int64_t tokens = 0;
    for (int s = 0; s < num_seqs; s++) tokens += a->query_start_loc[s + 1] - a->query_start_loc[s];
    if (tokens == 0) return 0;
    const int most = PF_MAX_ROWS / group > 0 ? PF_MAX_ROWS / group : 1;
    const int least = (PF_MIN_ROWS + group - 1) / group < most ? (PF_MIN_ROWS + group - 1) / group : most;
    int64_t per = (tokens * a->num_kv_heads + 8 * num_threads - 1) / (8 * num_threads);
    const int block = per > most ? most : per < least ? least : (int)per;
    int64_t blocks = 0;
    for (int s = 0; s < num_seqs; s++)
        blocks += (a->query_start_loc[s + 1] - a->query_start_loc[s] + block - 1) / block;
    int32_t *list = malloc((size_t)blocks * 3 * sizeof(int32_t));
    const int max_rows = (block * group + PF_RB - 1) / PF_RB * PF_RB;
    const size_t floats = (size_t)PF_KC * a->d * 2 + (size_t)PF_RB * PF_PS * 2 + (size_t)max_rows * (2 * a->d + 3);
    const size_t per_thread = (floats * sizeof(float) + (size_t)max_rows * 2 * sizeof(int) + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, per_thread * num_threads);
    if (list == NULL || scratch == NULL) {
        free(list);
        free(scratch);
        return -1;
    }
    int64_t at = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = a->query_start_loc[s + 1] - a->query_start_loc[s], n = (q_len + block - 1) / block;
        for (int b = 0; b < n; b++) {  /* n blocks of equal size, within one token */
            list[3 * at] = s;
            list[3 * at + 1] = (int)((int64_t)q_len * b / n);
            list[3 * at + 2] = (int)((int64_t)q_len * (b + 1) / n);
            at++;
        }
    }
    const int64_t tasks = blocks * a->num_kv_heads;
    #pragma omp parallel num_threads(num_threads)
    {
        float *base = (float *)(scratch + per_thread * omp_get_thread_num());
        PrefillScratch w;
        w.kt = base;
        w.v = w.kt + (size_t)PF_KC * a->d;
        w.p = w.v + (size_t)PF_KC * a->d;
        w.pb = (uint16_t *)(w.p + (size_t)PF_RB * PF_PS);
        w.q = w.p + (size_t)PF_RB * PF_PS * 2;
        w.o = w.q + (size_t)max_rows * a->d;
        w.m = w.o + (size_t)max_rows * a->d;
        w.l = w.m + max_rows;
        w.corr = w.l + max_rows;
        w.pos = (int *)(w.corr + max_rows);
        w.lo = w.pos + max_rows;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int32_t *e = list + 3 * (task / a->num_kv_heads);
            prefill_task(a, e[0], (int)(task % a->num_kv_heads), e[1], e[2], &w);
        }
    }
    free(list);
    free(scratch);
    return 0;
}
#define HAVE_PREFILL 1
#endif  /* RUN: a vector path was built */

/* Quantize-on-write into an int8 cache: each (token, kv head) row of ``d`` values of ``key`` and
 * ``value`` (float32 or bfloat16 as ``dtype`` says; token t's rows at t * stride elements, its kv heads'
 * rows back to back) becomes d int8 values and their float32 scale in slot ``slots[t]`` of the caches,
 * as kernels/kv_quant.py's quantize does, bit for bit: scale = max|row| / 127 (at least 1e-30), each
 * value x / scale clamped to +-127 and rounded half to even. One pass over each row, where the
 * PyTorch ops took a dozen passes and temporaries a layer. Returns -1, writing nothing, where a slot
 * lies outside the caches' ``num_slots``. */
static inline void quantize_row(const void *src, int dtype, int d, int8_t *dst) {
    float x[MAX_HEAD_DIM], amax = 0.0f;
    if (dtype == 0) memcpy(x, src, (size_t)d * sizeof(float));
    else for (int i = 0; i < d; i++) { uint32_t u = (uint32_t)((const uint16_t *)src)[i] << 16; memcpy(x + i, &u, 4); }
    /* Comparisons, not fmaxf/fminf: without -ffinite-math-only GCC calls libm's for those, one value at a
     * time (a row took ~1,000 cycles); these vectorise and treat NaN as fmaxf/fminf did: skipped by the
     * maximum, clamped to -127. */
    #pragma omp simd reduction(max:amax)
    for (int i = 0; i < d; i++) { const float a = fabsf(x[i]); amax = a > amax ? a : amax; }
    float scale = amax / 127.0f;
    if (!(scale >= 1e-30f) && scale == scale) scale = 1e-30f;  /* clamp(min=1e-30), NaN kept */
    int i = 0;
#if defined(__AVX512F__)  /* GCC leaves the rounding loop below scalar: 16 values a step here */
    for (const __m512 s = _mm512_set1_ps(scale); i + 16 <= d; i += 16) {
        __m512 v = _mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), s), _mm512_set1_ps(-127.0f));  /* NaN: -127 */
        v = _mm512_roundscale_ps(_mm512_min_ps(v, _mm512_set1_ps(127.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
#elif defined(__AVX2__)
    for (const __m256 s = _mm256_set1_ps(scale); i + 8 <= d; i += 8) {
        __m256 v = _mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), s), _mm256_set1_ps(-127.0f));  /* NaN: -127 */
        v = _mm256_round_ps(_mm256_min_ps(v, _mm256_set1_ps(127.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(_mm256_cvtps_epi32(v)),
                                          _mm256_extracti128_si256(_mm256_cvtps_epi32(v), 1));
        _mm_storel_epi64((__m128i *)(dst + i), _mm_packs_epi16(w, w));
    }
#endif
    for (; i < d; i++) {
        float v = x[i] / scale;
        v = v > -127.0f ? v : -127.0f;
        v = v < 127.0f ? v : 127.0f;
        dst[i] = (int8_t)__builtin_roundevenf(v);  /* half to even, as torch.round */
    }
    memcpy(dst + d, &scale, sizeof scale);
}

int berth_write_kv_int8(const void *key, const void *value, int64_t key_stride, int64_t value_stride,
                        void *k_cache, void *v_cache, const int64_t *slots, int tokens, int kv_heads, int d,
                        int64_t num_slots, int dtype, int num_threads) {
    if (d > MAX_HEAD_DIM) return -1;
    for (int t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int esize = dtype == 0 ? 4 : 2, row = d + 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * kv_heads >= 512)
    for (int t = 0; t < tokens; t++) {
        for (int h = 0; h < kv_heads; h++) {
            const int64_t at = (slots[t] * kv_heads + h) * row;
            quantize_row((const char *)key + ((int64_t)t * key_stride + (int64_t)h * d) * esize, dtype, d,
                         (int8_t *)k_cache + at);
            quantize_row((const char *)value + ((int64_t)t * value_stride + (int64_t)h * d) * esize, dtype, d,
                         (int8_t *)v_cache + at);
        }
    }
    return 0;
}

/* The vector path this build runs for head_dim 64: "avx512", "avx2" or "none" (plain C for every shape). */
const char *berth_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(RUN)
    return "avx2";
#else
    return "none";
#endif
}

int berth_limits(int *max_group, int *max_head_dim, int *max_block) {
    *max_group = MAX_GROUP;
    *max_head_dim = MAX_HEAD_DIM;
    *max_block = MAX_BLOCK;
    return 0;
}

void berth_paged_decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                        const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, int max_blocks, float scale, int dtype, int kv_dtype,
                        int window, int num_threads) {
#ifdef HAVE_HEADS_64
    if (head_dim == 64 && decode_64(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                                    num_kv_heads, block_size, max_blocks, scale, dtype, kv_dtype, window,
                                    num_threads) == 0)
        return;
#endif
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        for (int h = 0; h < num_kv_heads; h++) {
            attend_group(q, k_cache, v_cache, block_tables + (int64_t)s * max_blocks, context_lens[s], out, s, h,
                         num_heads, num_kv_heads, head_dim, block_size, scale, dtype, kv_dtype, window);
        }
    }
}

/* Prefill attention (kernels/reference.py:paged_prefill_attention) on the vector path: q and out
 * [total_query_tokens, num_heads, head_dim], sequence s's queries at rows query_start_loc[s] ..
 * query_start_loc[s+1]-1, the caches as for decode, holding the chunks' own rows. Returns -1,
 * computing nothing, where this build has no vector path or head_dim is not a multiple of its
 * vector's lanes (the caller then runs the reference), or the scratch cannot be allocated. */
int berth_paged_prefill(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                        const int32_t *query_start_loc, const int32_t *context_lens, void *out, int num_seqs,
                        int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,
                        int dtype, int kv_dtype, int window, int num_threads) {
#ifdef HAVE_PREFILL
    if (head_dim % VL == 0 && head_dim <= MAX_HEAD_DIM) {
        const PrefillArgs a = {q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, num_heads,
                               num_kv_heads, head_dim, block_size, max_blocks, dtype, kv_dtype, window, scale};
        return prefill_vec(&a, num_seqs, num_threads);
    }
#endif
    (void)q; (void)k_cache; (void)v_cache; (void)block_tables; (void)query_start_loc; (void)context_lens;
    (void)out; (void)num_seqs; (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)block_size;
    (void)max_blocks; (void)scale; (void)dtype; (void)kv_dtype; (void)window; (void)num_threads;
    return -1;
}
