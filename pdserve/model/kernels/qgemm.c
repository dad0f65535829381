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
 * pd_qdequant writes the fp32 weight back out ([n, k] row-major), pd_qdequant_bf16t the bf16 one transposed ([k, n]):
 * prefill's many rows multiply by them (pdserve.model.quant).
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
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

static inline uint16_t fp32_to_bf16(float f) { /* round to nearest even, as torch's .bfloat16() (finite f) */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* The weight of packed panels wp in bf16, transposed: wt [k, n] row-major, wt[kk][c] = bf16(w[c][kk]), each
 * value the fp32 weight pd_qdequant writes, rounded to nearest even (so bit for bit torch's
 * dequantize().bfloat16()). A panel's 16 columns at one k are 16 consecutive outputs: one vector each. Prefill's
 * many rows multiply by it in bf16 (pdserve.model.quant, where the CPU multiplies bf16 natively). */
void pd_qdequant_bf16t(int fmt, const uint8_t *wp, uint16_t *wt, int n, int k) {
    int64_t panels = (n + QW - 1) / QW, blocks = k / QK;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < blocks * panels; i++) { /* in output order: a thread writes whole rows of wt */
        int64_t b = i / panels, p = i % panels;
        const uint8_t *blk = wp + (p * blocks + b) * pd_qblock_bytes(fmt);
        const uint16_t *dh = (const uint16_t *)blk;
        int cols = n - p * QW < QW ? (int)(n - p * QW) : QW;
#if defined(__AVX512F__)
        if (cols == QW) { /* 16 columns: one vector per k, rounded as fp32_to_bf16 does */
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh));
            __m512 mv = fmt == FMT_Q8_0 ? _mm512_setzero_ps()
                                        : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dh + QW)));
            for (int kk = 0; kk < QK; kk++) {
                __m512 v;
                if (fmt == FMT_Q8_0) {
                    __m128i q = _mm_loadu_si128((const __m128i *)(blk + QW * 2 + kk * QW));
                    v = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
                } else {
                    const __m128i *pairs = (const __m128i *)(blk + QW * 4 + (kk / 2) * QW);
                    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(pairs));
                    q = _mm512_and_si512(_mm512_srli_epi32(q, (kk & 1) * 4), _mm512_set1_epi32(15));
                    v = _mm512_add_ps(_mm512_mul_ps(dv, _mm512_cvtepi32_ps(q)), mv);
                }
                __m512i bits = _mm512_castps_si512(v);
                __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
                bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
                _mm256_storeu_si256((__m256i *)(wt + (b * QK + kk) * (int64_t)n + p * QW),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
            }
            continue;
        }
#endif
        float d[QW], m[QW], v[QW];
        for (int c = 0; c < QW; c++) {
            d[c] = fp16_to_fp32(dh[c]);
            m[c] = fmt == FMT_Q8_0 ? 0.f : fp16_to_fp32(dh[QW + c]);
        }
        for (int kk = 0; kk < QK; kk++) {
            uint16_t *out = wt + (b * QK + kk) * (int64_t)n + p * QW;
            if (fmt == FMT_Q8_0) {
                const int8_t *q = (const int8_t *)blk + QW * 2 + kk * QW;
                for (int c = 0; c < QW; c++) v[c] = d[c] * (float)q[c];
            } else {
                const uint8_t *q = blk + QW * 4 + (kk / 2) * QW;
                int shift = (kk & 1) * 4;
                for (int c = 0; c < QW; c++) v[c] = d[c] * (float)((q[c] >> shift) & 15) + m[c];
            }
            for (int c = 0; c < cols; c++) out[c] = fp32_to_bf16(v[c]);
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

/* ---- Q8_0 weights x int8 rows (FMT_Q8_0_I8): the integer dot products of llama.cpp's Q8_0 x Q8_0 ----------
 * Each row of x is quantized per block of QK as ggml's quantize_row_q8_0 does (d = max|x| / 127, q = x / d
 * rounded half away from zero) but with an fp32 scale; then per block and column the exact int32 sum of
 * q_x * q_w (vpdpbusd: the weights made unsigned by + 128, so the row's 128 * sum(q_x) is taken back off), and
 * y += (d_w * d_x) * sum in fp32, block by block. Not the fp32 model's arithmetic: tested against a torch
 * reference that quantizes the rows the same way. The weight blocks are the same as FMT_Q8_0's: the 4 k x 16
 * columns of bytes that one vpdpbusd takes are transposed into column-major order in registers. */
#define FMT_Q8_0_I8 3
#if QGEMM_ISA == 512 && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define QGEMM_I8 512
#elif QGEMM_ISA && defined(__AVXVNNI__)
#define QGEMM_I8 2
#else
#define QGEMM_I8 0
#endif

/* Which int8-row kernel this build has: 512 (AVX-512 VNNI + VBMI), 2 (AVX-VNNI) or 0 (none: FMT_Q8_0 only). */
int pd_qgemm_i8_isa(void) { return QGEMM_I8; }

/* Bytes of scratch the int8-row kernel needs for m rows of k: the rows' int8 values, then per row and block
 * an fp32 scale and an int32 128 * sum. */
int64_t pd_qscratch_bytes(int m, int k) { return (int64_t)m * k + (int64_t)m * (k / QK) * 8 + 64; }

/* One block of QK values -> int8 q[QK] = round-half-away(x / d) with d = absmax / 127; returns the sum of q. */
static inline int32_t quantize_block(const float *xb, int8_t *qb, float *d) {
    float amax = 0.f;
    for (int i = 0; i < QK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
    float db = amax / 127.f, id = db > 0.f ? 1.f / db : 0.f;
    *d = db;
#if QGEMM_I8 == 512
    /* the same operations 16 lanes at a time (a scalar loop was ~2/5 of the int8-row products' time) */
    const __m512 vid = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f), zero = _mm512_setzero_ps();
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < QK; h += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xb + h), vid);
        __m512i iv = _mm512_cvttps_epi32(_mm512_roundscale_ps(_mm512_add_ps(_mm512_abs_ps(v), half),
                                                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
        iv = _mm512_mask_sub_epi32(iv, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), _mm512_setzero_si512(), iv);
        _mm_storeu_si128((__m128i *)(qb + h), _mm512_cvtepi32_epi8(iv));
        sum = _mm512_add_epi32(sum, iv);
    }
    return _mm512_reduce_add_epi32(sum);
#else
    int32_t sum = 0;
    for (int i = 0; i < QK; i++) {
        float v = xb[i] * id;
        int iv = (int)floorf(fabsf(v) + 0.5f);
        qb[i] = (int8_t)(v < 0.f ? -iv : iv);
        sum += qb[i];
    }
    return sum;
#endif
}

/* Rows of x -> int8 q [m, k], d [m, k / QK] fp32, off [m, k / QK] = 128 * sum of the block's q. */
static void quantize_rows_for(const float *x, int64_t ldx, int m, int k, int8_t *q, float *d, int32_t *off) {
    int blocks = k / QK;
#pragma omp for schedule(static)
    for (int r = 0; r < m; r++)
        for (int b = 0; b < blocks; b++) {
            int64_t at = (int64_t)r * blocks + b;
            off[at] = 128 * quantize_block(x + r * ldx + b * QK, q + (int64_t)r * k + b * QK, d + at);
        }
}

#if QGEMM_I8 == 512
#define MR8 16
static inline __attribute__((always_inline)) void qtile_i8(const int8_t *q, const float *xd, const int32_t *off,
                                                           int k, const uint8_t *panel, int blocks, int m, float *y,
                                                           int64_t ldy, int cols) {
    __m512 acc[MR8];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    /* byte 4 c + j of a group <- byte 16 j + c: column c's 4 k together */
    const __m512i perm = _mm512_set_epi8(
        63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11, 58, 42, 26, 10,
        57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
        51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + (int64_t)b * (QW * 2 + QK * QW);
        __builtin_prefetch(blk + 4096), __builtin_prefetch(blk + 4096 + 64), __builtin_prefetch(blk + 4096 + 128);
        __builtin_prefetch(blk + 4096 + 192), __builtin_prefetch(blk + 4096 + 256);
        __builtin_prefetch(blk + 4096 + 320), __builtin_prefetch(blk + 4096 + 384);
        __builtin_prefetch(blk + 4096 + 448), __builtin_prefetch(blk + 4096 + 512);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        __m512i w[QK / 4];
        for (int g = 0; g < QK / 4; g++)
            w[g] = _mm512_xor_si512(_mm512_permutexvar_epi8(
                perm, _mm512_loadu_si512((const void *)(blk + QW * 2 + g * 64))), flip);
        for (int r = 0; r < m; r++) {
            const int32_t *xq = (const int32_t *)(q + (int64_t)r * k + b * QK);
            __m512i s = _mm512_setzero_si512();
            for (int g = 0; g < QK / 4; g++) s = _mm512_dpbusd_epi32(s, w[g], _mm512_set1_epi32(xq[g]));
            s = _mm512_sub_epi32(s, _mm512_set1_epi32(off[(int64_t)r * blocks + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xd[(int64_t)r * blocks + b])),
                                     acc[r]);
        }
    }
    for (int r = 0; r < m; r++) {
        float tmp[QW];
        _mm512_storeu_ps(tmp, acc[r]);
        memcpy(y + r * ldy, tmp, cols * sizeof(float));
    }
}
#define QTILE_I8_CASE(M) case M: qtile_i8(q, xd, off, k, panel, blocks, M, y, ldy, cols); break;
static void qtile_i8_any(const int8_t *q, const float *xd, const int32_t *off, int k, const uint8_t *panel,
                         int blocks, int m, float *y, int64_t ldy, int cols) {
    switch (m) {
        QTILE_I8_CASE(1) QTILE_I8_CASE(2) QTILE_I8_CASE(3) QTILE_I8_CASE(4) QTILE_I8_CASE(5) QTILE_I8_CASE(6)
        QTILE_I8_CASE(7) QTILE_I8_CASE(8) QTILE_I8_CASE(9) QTILE_I8_CASE(10) QTILE_I8_CASE(11) QTILE_I8_CASE(12)
        QTILE_I8_CASE(13) QTILE_I8_CASE(14) QTILE_I8_CASE(15) QTILE_I8_CASE(16)
    }
}
#elif QGEMM_I8 == 2
#define MR8 4
/* 4 k x 16 columns (bytes 16 j + c) -> two registers of 8 columns x 4 k, made unsigned (+ 128). */
static inline __attribute__((always_inline)) void transpose_group(const uint8_t *g, __m256i *lo, __m256i *hi) {
    __m128i r0 = _mm_loadu_si128((const __m128i *)g), r1 = _mm_loadu_si128((const __m128i *)(g + 16));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(g + 32)), r3 = _mm_loadu_si128((const __m128i *)(g + 48));
    __m128i a = _mm_unpacklo_epi8(r0, r1), b = _mm_unpackhi_epi8(r0, r1);
    __m128i c = _mm_unpacklo_epi8(r2, r3), e = _mm_unpackhi_epi8(r2, r3);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    *lo = _mm256_xor_si256(_mm256_set_m128i(_mm_unpackhi_epi16(a, c), _mm_unpacklo_epi16(a, c)), flip);
    *hi = _mm256_xor_si256(_mm256_set_m128i(_mm_unpackhi_epi16(b, e), _mm_unpacklo_epi16(b, e)), flip);
}

#define I8_ACC_DECL(r) __m256 f##r##0 = _mm256_setzero_ps(), f##r##1 = _mm256_setzero_ps();
#define I8_ROW(r) \
    if (m > r) { \
        const int32_t *xq = (const int32_t *)(q + (int64_t)r * k + b * QK); \
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256(); \
        for (int g = 0; g < QK / 4; g++) { \
            __m256i bc = _mm256_set1_epi32(xq[g]); \
            s0 = _mm256_dpbusd_avx_epi32(s0, w[2 * g], bc); \
            s1 = _mm256_dpbusd_avx_epi32(s1, w[2 * g + 1], bc); \
        } \
        __m256i o = _mm256_set1_epi32(off[(int64_t)r * blocks + b]); \
        __m256 sx = _mm256_set1_ps(xd[(int64_t)r * blocks + b]); \
        f##r##0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s0, o)), _mm256_mul_ps(d0, sx), f##r##0); \
        f##r##1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s1, o)), _mm256_mul_ps(d1, sx), f##r##1); \
    }
#define I8_STORE(r) \
    if (m > r) { _mm256_storeu_ps(out + r * QW, f##r##0); _mm256_storeu_ps(out + r * QW + 8, f##r##1); }

static inline __attribute__((always_inline)) void qtile_i8(const int8_t *q, const float *xd, const int32_t *off,
                                                           int k, const uint8_t *panel, int blocks, int m, float *y,
                                                           int64_t ldy, int cols) {
    I8_ACC_DECL(0) I8_ACC_DECL(1) I8_ACC_DECL(2) I8_ACC_DECL(3)
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + (int64_t)b * (QW * 2 + QK * QW);
        for (int i = 0; i < 9; i++) __builtin_prefetch(blk + 4096 + 64 * i);
        __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        __m256i w[QK / 2]; /* (the compiler keeps these in L1 when registers run out) */
        for (int g = 0; g < QK / 4; g++) transpose_group(blk + QW * 2 + g * 64, &w[2 * g], &w[2 * g + 1]);
        I8_ROW(0) I8_ROW(1) I8_ROW(2) I8_ROW(3)
    }
    float out[MR8 * QW];
    I8_STORE(0) I8_STORE(1) I8_STORE(2) I8_STORE(3)
    for (int r = 0; r < m; r++) memcpy(y + r * ldy, out + r * QW, cols * sizeof(float));
}
#define QTILE_I8_CASE(M) case M: qtile_i8(q, xd, off, k, panel, blocks, M, y, ldy, cols); break;
static void qtile_i8_any(const int8_t *q, const float *xd, const int32_t *off, int k, const uint8_t *panel,
                         int blocks, int m, float *y, int64_t ldy, int cols) {
    switch (m) { QTILE_I8_CASE(1) QTILE_I8_CASE(2) QTILE_I8_CASE(3) QTILE_I8_CASE(4) }
}
#endif

/* pd_qgemm's work for the threads of an enclosing parallel region (orphaned `omp for` loops, each ending in a
 * barrier; serial outside one), y += bias when given. `scratch`: pd_qscratch_bytes(m, k) for FMT_Q8_0_I8. Each
 * thread streams a contiguous range of panels once; all row tiles use a panel while it is in cache. */
void pd_qgemm_for(int fmt, const float *x, int64_t ldx, const uint8_t *wp, float *y, int m, int n, int k,
                  const float *bias, void *scratch) {
#if QGEMM_ISA
    int64_t panels = (n + QW - 1) / QW;
    int blocks = k / QK, bb = pd_qblock_bytes(fmt == FMT_Q8_0_I8 ? FMT_Q8_0 : fmt);
#if QGEMM_I8
    int8_t *q = NULL;
    float *xd = NULL;
    int32_t *off = NULL;
    if (fmt == FMT_Q8_0_I8) {
        q = scratch;
        xd = (float *)(((uintptr_t)(q + (int64_t)m * k) + 63) & ~(uintptr_t)63);
        off = (int32_t *)(xd + (int64_t)m * blocks);
        quantize_rows_for(x, ldx, m, k, q, xd, off);
    }
#else
    (void)scratch;
#endif
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int cols = n - p * QW < QW ? (int)(n - p * QW) : QW;
        const uint8_t *panel = wp + p * blocks * bb;
        for (int r0 = 0; r0 < m;) {
#if QGEMM_I8
            if (fmt == FMT_Q8_0_I8) {
                int mr = m - r0 < MR8 ? m - r0 : MR8;
                qtile_i8_any(q + (int64_t)r0 * k, xd + (int64_t)r0 * blocks, off + (int64_t)r0 * blocks, k, panel,
                             blocks, mr, y + (int64_t)r0 * n + p * QW, n, cols);
                r0 += mr;
                continue;
            }
#endif
            int mr = m - r0 < MR ? m - r0 : MR;
            qtile_any(fmt, x + r0 * ldx, ldx, panel, blocks, bb, mr, y + (int64_t)r0 * n + p * QW, n, cols);
            r0 += mr;
        }
        if (bias)
            for (int r = 0; r < m; r++)
                for (int c = 0; c < cols; c++) y[(int64_t)r * n + p * QW + c] += bias[p * QW + c];
    }
#else
    (void)fmt, (void)x, (void)ldx, (void)wp, (void)y, (void)m, (void)n, (void)k, (void)bias, (void)scratch;
#endif
}

/* x: [m, k] (row stride ldx, k a multiple of QK), wp: packed panels of format fmt, y: [m, n] contiguous;
 * scratch: pd_qscratch_bytes(m, k) for FMT_Q8_0_I8 (else unused). */
void pd_qgemm(int fmt, const float *x, int64_t ldx, const uint8_t *wp, float *y, int m, int n, int k, void *scratch) {
#pragma omp parallel
    pd_qgemm_for(fmt, x, ldx, wp, y, m, n, k, NULL, scratch);
}
