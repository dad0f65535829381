/* Skinny GEMM on quantized weights (pdserve --weights q8_0 | q4): y[m, n] = x[m, k] @ W^T for a few rows,
 * W kept as blocks of QK = 32 weights along k, each with an fp16 scale (and, for Q4_1, an fp16 minimum), the
 * blocks of QW = 16 output columns packed together (`pdserve.model.quant.pack`), panel by panel:
 *
 *   wp: [ceil(n / QW) panels][k / QK blocks][block bytes]
 *   Q8_0 block (544 bytes): d[16] fp16, then q[32 k][16 columns] int8;          w = d * q
 *   Q4_1 block (320 bytes): d[16] fp16, m[16] fp16, then [16 k pairs][16 columns] bytes, the low nibble for
 *                           k = 2j and the high one for k = 2j + 1 (0..15);        w = d * q + m
 *
 * (GGUF's Q4_0, w = d * (q - 8), is Q4_1 with m = -8 d.) So a panel streams as consecutive bytes: 1.0625 bytes
 * per weight for Q8_0 and 0.625 for Q4_1, as in the GGUF file, against 4 in fp32. The kernel dequantizes each
 * k's 16 weights into fp32 registers (a convert, a multiply and for Q4_1 an add per 16 weights, shared by all
 * the rows of a tile; rounded as gguf's and torch's dequantization round, so the weights multiplied are bit for
 * bit the fp32 model's of the same blocks) and accumulates in fp32 with FMAs in k order, as gemm.c does:
 * - AVX-512: tiles of up to 16 rows x one 16-float register, each tile walks the whole panel.
 * - AVX2 + FMA (+ F16C): tiles of up to 4 rows x two 8-float registers.
 * pd_qdequant writes the fp32 weight back out ([n, k] row-major): prefill's many rows use it (pdserve.model.quant).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QK 32
#define QW 16
#define FMT_Q8_0 1
#define FMT_Q4_1 2

#if defined(__AVX512F__)
#define QGEMM_ISA 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QGEMM_ISA 2
#else
#define QGEMM_ISA 0
#endif

/* Which build this is: 512 (AVX-512), 2 (AVX2 + FMA + F16C) or 0 (no quantized kernels). */
int pd_qgemm_isa(void) { return QGEMM_ISA; }

/* Bytes of one block of QW columns x QK weights, or 0 for an unknown format. */
int pd_qblock_bytes(int fmt) {
    return fmt == FMT_Q8_0 ? QW * 2 + QK * QW : fmt == FMT_Q4_1 ? QW * 4 + QK * QW / 2 : 0;
}

static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The fp32 weight [n, k] (row-major) of packed panels wp: what the kernel multiplies by. */
void pd_qdequant(int fmt, const uint8_t *wp, float *w, int n, int k) {
    int64_t panels = (n + QW - 1) / QW, blocks = k / QK, bb = pd_qblock_bytes(fmt);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *blk = wp + (p * blocks + b) * bb;
            const uint16_t *d = (const uint16_t *)blk;
            for (int c = 0; c < QW && p * QW + c < n; c++) {
                float *row = w + (p * QW + c) * (int64_t)k + b * QK, dc = fp16_to_fp32(d[c]);
                if (fmt == FMT_Q8_0) {
                    for (int kk = 0; kk < QK; kk++) row[kk] = dc * (float)(int8_t)blk[QW * 2 + kk * QW + c];
                } else {
                    float mc = fp16_to_fp32(d[QW + c]);
                    for (int j = 0; j < QK / 2; j++) {
                        uint8_t v = blk[QW * 4 + j * QW + c];
                        row[2 * j] = dc * (float)(v & 15) + mc;
                        row[2 * j + 1] = dc * (float)(v >> 4) + mc;
                    }
                }
            }
        }
}

#if QGEMM_ISA == 512
#define MR 16

/* Rows [0, m) of x times one panel (all its blocks); m is a constant after inlining. */
static inline __attribute__((always_inline)) void qtile(int fmt, const float *x, int64_t ldx, const uint8_t *panel,
                                                        int blocks, int bb, int m, float *y, int64_t ldy, int cols) {
    __m512 acc[MR];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + (int64_t)b * bb;
        const float *xb = x + b * QK;
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        if (fmt == FMT_Q8_0) {
            const uint8_t *q = blk + QW * 2;
            for (int kk = 0; kk < QK; kk++) {
                if ((kk & 3) == 0) __builtin_prefetch(q + kk * QW + 4096);
                __m512 w = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + kk * QW)))), d);
                for (int r = 0; r < m; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + kk]), w, acc[r]);
            }
        } else {
            __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + QW * 2)));
            const uint8_t *q = blk + QW * 4;
            const __m512i low = _mm512_set1_epi32(15);
            for (int j = 0; j < QK / 2; j++) {
                if ((j & 3) == 0) __builtin_prefetch(q + j * QW + 4096);
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * QW)));
                __m512 w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), d), mn);
                __m512 w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d), mn);
                for (int r = 0; r < m; r++) {
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + 2 * j]), w0, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + 2 * j + 1]), w1, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < m; r++) {
        if (cols == QW) {
            _mm512_storeu_ps(y + r * ldy, acc[r]);
        } else {
            float tmp[QW];
            _mm512_storeu_ps(tmp, acc[r]);
            memcpy(y + r * ldy, tmp, cols * sizeof(float));
        }
    }
}

#define QTILE_CASE(M) case M: qtile(fmt, x, ldx, panel, blocks, bb, M, y, ldy, cols); break;

static void qtile_any(int fmt, const float *x, int64_t ldx, const uint8_t *panel, int blocks, int bb, int m,
                      float *y, int64_t ldy, int cols) {
    switch (m) {
        QTILE_CASE(1) QTILE_CASE(2) QTILE_CASE(3) QTILE_CASE(4) QTILE_CASE(5) QTILE_CASE(6) QTILE_CASE(7)
        QTILE_CASE(8) QTILE_CASE(9) QTILE_CASE(10) QTILE_CASE(11) QTILE_CASE(12) QTILE_CASE(13) QTILE_CASE(14)
        QTILE_CASE(15) QTILE_CASE(16)
    }
}

#elif QGEMM_ISA == 2
#define MR 4 /* 8 accumulators + 2 weights + a broadcast + scales: within the 16 ymm registers */

static inline __attribute__((always_inline)) __m256 cvt8(__m128i bytes8, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

#define ACC_DECL(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
#define ACC_FMA(r, xk, w0, w1) \
    if (m > r) { \
        __m256 bc = _mm256_broadcast_ss(xb + r * ldx + (xk)); \
        a##r##0 = _mm256_fmadd_ps(bc, w0, a##r##0); \
        a##r##1 = _mm256_fmadd_ps(bc, w1, a##r##1); \
    }
#define ACC_ALL(xk, w0, w1) ACC_FMA(0, xk, w0, w1) ACC_FMA(1, xk, w0, w1) ACC_FMA(2, xk, w0, w1) ACC_FMA(3, xk, w0, w1)
#define ACC_STORE(r) \
    if (m > r) { _mm256_storeu_ps(out + r * QW, a##r##0); _mm256_storeu_ps(out + r * QW + 8, a##r##1); }

static inline __attribute__((always_inline)) void qtile(int fmt, const float *x, int64_t ldx, const uint8_t *panel,
                                                        int blocks, int bb, int m, float *y, int64_t ldy, int cols) {
    ACC_DECL(0) ACC_DECL(1) ACC_DECL(2) ACC_DECL(3)
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + (int64_t)b * bb;
        const float *xb = x + b * QK;
        __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        if (fmt == FMT_Q8_0) {
            const uint8_t *q = blk + QW * 2;
            for (int kk = 0; kk < QK; kk++) {
                if ((kk & 3) == 0) __builtin_prefetch(q + kk * QW + 4096);
                __m128i v = _mm_loadu_si128((const __m128i *)(q + kk * QW));
                __m256 w0 = _mm256_mul_ps(cvt8(v, 1), d0), w1 = _mm256_mul_ps(cvt8(_mm_srli_si128(v, 8), 1), d1);
                ACC_ALL(kk, w0, w1)
            }
        } else {
            __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32)));
            __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 48)));
            const uint8_t *q = blk + QW * 4;
            const __m128i low = _mm_set1_epi8(15);
            for (int j = 0; j < QK / 2; j++) {
                if ((j & 3) == 0) __builtin_prefetch(q + j * QW + 4096);
                __m128i v = _mm_loadu_si128((const __m128i *)(q + j * QW));
                __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
                __m256 w0 = _mm256_add_ps(_mm256_mul_ps(cvt8(lo, 0), d0), m0);
                __m256 w1 = _mm256_add_ps(_mm256_mul_ps(cvt8(_mm_srli_si128(lo, 8), 0), d1), m1);
                ACC_ALL(2 * j, w0, w1)
                w0 = _mm256_add_ps(_mm256_mul_ps(cvt8(hi, 0), d0), m0);
                w1 = _mm256_add_ps(_mm256_mul_ps(cvt8(_mm_srli_si128(hi, 8), 0), d1), m1);
                ACC_ALL(2 * j + 1, w0, w1)
            }
        }
    }
    float out[MR * QW];
    ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3)
    for (int r = 0; r < m; r++) memcpy(y + r * ldy, out + r * QW, cols * sizeof(float));
}

#define QTILE_CASE(M) case M: qtile(fmt, x, ldx, panel, blocks, bb, M, y, ldy, cols); break;

static void qtile_any(int fmt, const float *x, int64_t ldx, const uint8_t *panel, int blocks, int bb, int m,
                      float *y, int64_t ldy, int cols) {
    switch (m) { QTILE_CASE(1) QTILE_CASE(2) QTILE_CASE(3) QTILE_CASE(4) }
}
#endif

/* x: [m, k] (row stride ldx, k a multiple of QK), wp: packed panels of format fmt, y: [m, n] contiguous. Each
 * thread streams a contiguous range of panels once; all row tiles use a panel while it is in cache. */
void pd_qgemm(int fmt, const float *x, int64_t ldx, const uint8_t *wp, float *y, int m, int n, int k) {
#if QGEMM_ISA
    int64_t panels = (n + QW - 1) / QW;
    int blocks = k / QK, bb = pd_qblock_bytes(fmt);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int cols = n - p * QW < QW ? (int)(n - p * QW) : QW;
        const uint8_t *panel = wp + p * blocks * bb;
        for (int r0 = 0; r0 < m; r0 += MR)
            qtile_any(fmt, x + r0 * ldx, ldx, panel, blocks, bb, m - r0 < MR ? m - r0 : MR,
                      y + (int64_t)r0 * n + p * QW, n, cols);
    }
#else
    (void)fmt, (void)x, (void)ldx, (void)wp, (void)y, (void)m, (void)n, (void)k;
#endif
}
