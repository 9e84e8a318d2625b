/* Weight-only int8 linear for the CPU: out = x @ (q * scales[:, None]).T (+ bias), float32 in and out.
 *
 *   x:      [M, K] float32, contiguous          q:    [N, K] int8, contiguous (a row per output)
 *   scales: [N] float32 (one per output row)    bias: [N] float32 or NULL
 *   out:    [M, N] float32
 *
 * The weights are read as int8 (a quarter of float32's bytes) and widened to float32 in registers;
 * products and sums are float32 and each output is scaled once: out[m][n] = scales[n] * sum_k x[m][k] q[n][k].
 * Activations stay float32 (no per-batch quantization), so a row's result does not depend on the other
 * rows of the batch.
 *
 * Work: each thread takes a run of GROUP output rows at a time (their int8 weights stay in L1/L2) and
 * goes over the batch in chunks of MC rows (kept in L2), computing tiles of MR x rows by NR outputs with
 * MR * NR accumulators in registers: per 8 values of k, NR weight vectors are widened once and used by
 * MR rows. With AVX2 + FMA (what -march=native gives on AMD Zen 2/3 and every AVX-512 CPU) the tile is
 * 8-lane intrinsics; otherwise plain C that the compiler vectorises as it can. ``berth_int8_isa`` names it.
 */
#include <stdint.h>
#include <string.h>

#define MR 4     /* batch rows per tile */
#define NR 3     /* output rows per tile: 4 x 3 accumulators + 3 weights + 1 x = 16 registers */
#define GROUP 48 /* output rows a thread keeps hot while it walks the batch */
#define MC 64    /* batch rows per chunk */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ISA "avx2"

static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* res[i][j] = sum_k xr[i][k] * wr[j][k] for i < R (R batch rows: a tile for each of 1..MR, so that a
 * batch of one computes one row, not MR copies of it). */
#define DEFINE_TILE(NAME, R)                                                                                  \
    static inline void NAME(const float *const xr[MR], const int8_t *const wr[NR], int64_t K, float res[MR][NR]) { \
        __m256 acc[R][NR];                                                                                    \
        for (int i = 0; i < R; i++)                                                                           \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                                     \
        int64_t k = 0;                                                                                        \
        for (; k + 8 <= K; k += 8) {                                                                          \
            __m256 wv[NR];                                                                                    \
            for (int j = 0; j < NR; j++) wv[j] = widen8(wr[j] + k);                                           \
            for (int i = 0; i < R; i++) {                                                                     \
                __m256 xv = _mm256_loadu_ps(xr[i] + k);                                                       \
                for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);               \
            }                                                                                                 \
        }                                                                                                     \
        for (int i = 0; i < R; i++)                                                                           \
            for (int j = 0; j < NR; j++) res[i][j] = hsum(acc[i][j]);                                         \
        for (; k < K; k++)                                                                                    \
            for (int i = 0; i < R; i++)                                                                       \
                for (int j = 0; j < NR; j++) res[i][j] += xr[i][k] * (float)wr[j][k];                         \
    }
DEFINE_TILE(tile1, 1)
DEFINE_TILE(tile2, 2)
DEFINE_TILE(tile3, 3)
DEFINE_TILE(tile4, 4)

static inline void tile(const float *const xr[MR], int rows, const int8_t *const wr[NR], int64_t K,
                        float res[MR][NR]) {
    switch (rows) {
        case 1: tile1(xr, wr, K, res); break;
        case 2: tile2(xr, wr, K, res); break;
        case 3: tile3(xr, wr, K, res); break;
        default: tile4(xr, wr, K, res);
    }
}
#else
#define ISA "none"

static inline void tile(const float *const xr[MR], int rows, const int8_t *const wr[NR], int64_t K,
                        float res[MR][NR]) {
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < NR; j++) {
            const float *a = xr[i];
            const int8_t *b = wr[j];
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int64_t k = 0; k < K; k++) s += a[k] * (float)b[k];
            res[i][j] = s;
        }
}
#endif

const char *berth_int8_isa(void) { return ISA; }

/* Output rows [n0, n1) for every batch row. Tiles past the last output row repeat it and are not stored. */
static void rows(const float *x, const int8_t *q, const float *scales, const float *bias, float *out,
                 int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        int64_t m1 = m0 + MC < M ? m0 + MC : M;
        for (int64_t n = n0; n < n1; n += NR) {
            const int8_t *wr[NR];
            for (int j = 0; j < NR; j++) wr[j] = q + (n + j < n1 ? n + j : n1 - 1) * K;
            for (int64_t m = m0; m < m1; m += MR) {
                const float *xr[MR];
                for (int i = 0; i < MR; i++) xr[i] = x + (m + i < m1 ? m + i : m1 - 1) * K;
                float res[MR][NR] = {{0}};
                tile(xr, m1 - m < MR ? (int)(m1 - m) : MR, wr, K, res);
                for (int i = 0; i < MR && m + i < m1; i++)
                    for (int j = 0; j < NR && n + j < n1; j++)
                        out[(m + i) * N + n + j] = res[i][j] * scales[n + j] + (bias ? bias[n + j] : 0.0f);
            }
        }
    }
}

void berth_int8_linear(const float *x, const int8_t *q, const float *scales, const float *bias, float *out,
                       int64_t M, int64_t N, int64_t K, int num_threads) {
    int64_t groups = (N + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * GROUP, n1 = n0 + GROUP < N ? n0 + GROUP : N;
        rows(x, q, scales, bias, out, M, N, K, n0, n1);
    }
}
