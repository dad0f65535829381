/* Skinny GEMM for pdserve's decode steps: y[m, n] = x[m, k] @ W^T for a few rows (one per running
 * request), with W packed once into panels of PW = 16 output columns ([ceil(n / PW), k, PW], zero-padded),
 * so a panel streams from memory as consecutive cache lines.
 *
 * Two register tilings, chosen at compile time (-march=native):
 * - AVX-512: a tile of up to 16 rows x one 16-float register; every row tile walks the whole panel (the
 *   later ones from L2), with a software prefetch 4 KiB ahead.
 * - AVX2 + FMA: a tile of up to 6 rows x two 8-float registers (12 accumulators, 2 weight registers and
 *   a broadcast: 15 of the 16 ymm registers). The panel is walked in blocks of KC rows of k that all row
 *   tiles use while the block is in L1, so each weight is read from memory once; a software prefetch of
 *   one line per k, 4 KiB ahead, keeps the stream going while the FMAs run.
 * Anything else (no AVX2, or no FMA) has no GEMM: pd_gemm_panel_width() returns 0.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PW 16 /* panel width: output columns per panel, both tilings */

#if defined(__AVX512F__)
#define GEMM_ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMM_ISA 2
#else
#define GEMM_ISA 0
#endif

/* Panel width the packed weights use, or 0 when this CPU has no GEMM kernel. */
int pd_gemm_panel_width(void) { return GEMM_ISA ? PW : 0; }

/* Which tiling this build has: 512 (AVX-512), 2 (AVX2 + FMA) or 0 (none). */
int pd_gemm_isa(void) { return GEMM_ISA; }

/* w: [n, k] row-major -> wp: [ceil(n / PW), k, PW], zero-padded past column n. */
void pd_gemm_pack(const float *w, float *wp, int n, int k) {
    int64_t panels = (n + PW - 1) / PW;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int kk = 0; kk < k; kk++)
            for (int c = 0; c < PW; c++) {
                int64_t col = p * PW + c;
                wp[(p * k + kk) * PW + c] = col < n ? w[col * k + kk] : 0.f;
            }
}

static inline void store_cols(float *y, const float *tile, int cols) {
    memcpy(y, tile, cols * sizeof(float));
}

#if GEMM_ISA == 512
#define MR 16 /* rows of x per register tile: MR accumulators + a weight + a broadcast fit in 32 zmm */

/* One register tile: rows [0, m) of x times one panel; m is a compile-time constant after inlining. */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t ldx, const float *wp, int k,
                                                            int m, float *y, int64_t ldy, int cols) {
    __m512 acc[MR];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    for (int kk = 0; kk < k; kk++) {
        /* the hardware prefetcher alone streams the panel at ~2/3 of this speed (measured) */
        __builtin_prefetch((const char *)(wp + (int64_t)kk * PW) + 4096);
        __m512 w = _mm512_loadu_ps(wp + (int64_t)kk * PW);
        for (int r = 0; r < m; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + kk]), w, acc[r]);
    }
    for (int r = 0; r < m; r++) {
        if (cols == PW) {
            _mm512_storeu_ps(y + r * ldy, acc[r]);
        } else {
            float tmp[PW];
            _mm512_storeu_ps(tmp, acc[r]);
            store_cols(y + r * ldy, tmp, cols);
        }
    }
}

#define TILE_CASE(M) case M: gemm_tile(x, ldx, wp, k, M, y, ldy, cols); break;

static void gemm_tile_any(const float *x, int64_t ldx, const float *wp, int k, int m, float *y, int64_t ldy,
                          int cols) {
    switch (m) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
        TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12) TILE_CASE(13) TILE_CASE(14)
        TILE_CASE(15) TILE_CASE(16)
    }
}

/* Each thread streams a contiguous range of panels once; all row tiles use a panel while it is in cache. */
static void gemm_panels(const float *x, int64_t ldx, const float *wp, float *y, int m, int n, int k) {
    int64_t panels = (n + PW - 1) / PW;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int cols = n - p * PW < PW ? (int)(n - p * PW) : PW;
        for (int r0 = 0; r0 < m; r0 += MR)
            gemm_tile_any(x + r0 * ldx, ldx, wp + p * k * PW, k, m - r0 < MR ? m - r0 : MR,
                          y + (int64_t)r0 * n + p * PW, n, cols);
    }
}

#elif GEMM_ISA == 2
#define MR 6    /* rows per register tile: 12 accumulators + 2 weights + 1 broadcast = 15 ymm */
#define KC 128  /* rows of k per panel block: 8 KiB of panel, plus KC columns of x, stay in L1 */
/* Software prefetch distance, in floats: 4 KiB ahead, one line per k. Measured on Zen 3 (bench_gemm.py,
 * 16 rows, two runs): 36-39 ms with it, 50-56 ms with none or with a burst of prefetches per block, and
 * 41-49 ms at 3 or 6 KiB ahead. */
#define PF_DIST 1024

/* Row r of a tile: two named accumulators (an array of them made gcc 12 store all twelve to the stack on
 * every k, which halved the speed). */
#define ACC_LOAD(r) \
    __m256 c##r##a = m > r && !first ? _mm256_loadu_ps(acc + r * PW) : _mm256_setzero_ps(); \
    __m256 c##r##b = m > r && !first ? _mm256_loadu_ps(acc + r * PW + 8) : _mm256_setzero_ps();
#define ACC_FMA(r) \
    if (m > r) { \
        __m256 bc = _mm256_broadcast_ss(x + r * ldx + kk); \
        c##r##a = _mm256_fmadd_ps(bc, w0, c##r##a); \
        c##r##b = _mm256_fmadd_ps(bc, w1, c##r##b); \
    }
#define ACC_STORE(r) \
    if (m > r) { _mm256_storeu_ps(acc + r * PW, c##r##a); _mm256_storeu_ps(acc + r * PW + 8, c##r##b); }

/* acc[m][PW] (+)= x[0:m, 0:kc] @ panel block [kc, PW]; `first` starts from zero. m is a constant after
 * inlining, so the unused rows vanish and the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile_avx2(const float *x, int64_t ldx, const float *wp,
                                                            int kc, int m, float *acc, int first) {
    ACC_LOAD(0) ACC_LOAD(1) ACC_LOAD(2) ACC_LOAD(3) ACC_LOAD(4) ACC_LOAD(5)
    for (int kk = 0; kk < kc; kk++) {
        __builtin_prefetch(wp + kk * PW + PF_DIST);
        __m256 w0 = _mm256_loadu_ps(wp + kk * PW), w1 = _mm256_loadu_ps(wp + kk * PW + 8);
        ACC_FMA(0) ACC_FMA(1) ACC_FMA(2) ACC_FMA(3) ACC_FMA(4) ACC_FMA(5)
    }
    ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4) ACC_STORE(5)
}

#define TILE_CASE(M) case M: tile_avx2(x, ldx, wp, kc, M, acc, first); break;

static void tile_avx2_any(const float *x, int64_t ldx, const float *wp, int kc, int m, float *acc, int first) {
    switch (m) { TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) }
}

/* One panel for all m rows: block by block of k, every row tile per block; then write out. */
static void panel_avx2(const float *x, int64_t ldx, const float *wp, float *y, int m, int n, int k, int cols,
                       float *acc) {
    for (int k0 = 0; k0 < k; k0 += KC) {
        int kc = k - k0 < KC ? k - k0 : KC;
        const float *block = wp + (int64_t)k0 * PW;
        for (int r0 = 0; r0 < m; r0 += MR)
            tile_avx2_any(x + r0 * ldx + k0, ldx, block, kc, m - r0 < MR ? m - r0 : MR, acc + r0 * PW, k0 == 0);
    }
    for (int r = 0; r < m; r++) store_cols(y + (int64_t)r * n, acc + r * PW, cols);
}

static void gemm_panels(const float *x, int64_t ldx, const float *wp, float *y, int m, int n, int k) {
    int64_t panels = (n + PW - 1) / PW;
#pragma omp parallel
    {
        float acc[m * PW] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int cols = n - p * PW < PW ? (int)(n - p * PW) : PW;
            panel_avx2(x, ldx, wp + p * k * PW, y + p * PW, m, n, k, cols, acc);
        }
    }
}
#endif

/* x: [m, k] (row stride ldx), wp: packed [ceil(n / PW), k, PW], y: [m, n] contiguous. */
void pd_gemm(const float *x, int64_t ldx, const float *wp, float *y, int m, int n, int k) {
#if GEMM_ISA
    gemm_panels(x, ldx, wp, y, m, n, k);
#else
    (void)x, (void)ldx, (void)wp, (void)y, (void)m, (void)n, (void)k;
#endif
}
