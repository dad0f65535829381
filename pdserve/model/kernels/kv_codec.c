/* CPU kernels of the KV codecs (pdserve/kv/codec.py is the torch reference they match bit for bit):
 * writing new keys and values as token records, and paged decode attention that reads the records of a
 * coded pool in place, decoding each CHUNK of keys and values into a small buffer on the stack before the
 * fp32 scoring and value sums of attend.h.
 *
 * A record (one token of one KV head) is its codes then its fp32 parameters:
 *   fp16 (saturated at +-65504), bf16: 2 bytes per element; fp8_e4m3: codes of x / s, then s = absmax / 448;
 *   int8: round(x / s) in [-127, 127], then s = absmax / 127; int4 (of x already rotated, see codec.py): two
 *   groups of d / 2, each round((x - lo) / s) in [0, 15] with s = (max - lo) / 15 and lo rounded to fp16
 *   first, two codes per byte (even element in the low nibble), then fp16 s0, lo0, s1, lo1.
 * A zero scale (an all-equal or all-zero row) is stored as 1. Rounding is to nearest even (nearbyintf in
 * the default rounding mode), as torch rounds.
 */
#include "attend.h"

enum { PD_FP16 = 1, PD_BF16 = 2, PD_FP8 = 3, PD_INT8 = 4, PD_INT4 = 5 };

static float fp8_table[256];

__attribute__((constructor)) static void fp8_init(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e ? ldexpf(1.f + m / 8.f, e - 7) : ldexpf((float)m, -9);
        if ((c & 0x7F) == 0x7F) v = NAN;
        fp8_table[c] = c & 0x80 ? -v : v;
    }
}

static inline uint8_t fp8_encode(float y) { /* |y| <= 448 */
    uint8_t sign = signbit(y) ? 0x80 : 0;
    float a = fabsf(y);
    if (a < 0.015625f) /* subnormals, steps of 2^-9; 8 steps is the smallest normal, 0x08 */
        return sign | (uint8_t)nearbyintf(a * 512.f);
    int e;
    float f = frexpf(a, &e); /* a = (1 + m / 8) * 2^(e - 1) */
    int m = (int)nearbyintf((f * 2.f - 1.f) * 8.f), ex = e - 1;
    if (m == 8) m = 0, ex++;
    int code = ((ex + 7) << 3) | m;
    return sign | (uint8_t)(code > 0x7E ? 0x7E : code);
}

static inline uint16_t bf16_encode(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float bf16_decode(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static inline float nonzero(float s) { return s > 0.f ? s : 1.f; }

/* n elements (even) -> n / 2 bytes of codes and params[0..1] = fp16 scale, minimum; dec[n] decoded. */
static void encode_int4_group(const float *x, int n, uint8_t *codes, _Float16 *params, float *dec) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; i++) lo = x[i] < lo ? x[i] : lo, hi = x[i] > hi ? x[i] : hi;
    _Float16 s16 = (_Float16)nonzero((hi - lo) / 15.f), lo16 = (_Float16)lo;
    float s = (float)s16;
    lo = (float)lo16;
    for (int i = 0; i < n; i += 2) {
        float a = nearbyintf((x[i] - lo) / s), b = nearbyintf((x[i + 1] - lo) / s);
        int qa = a < 0.f ? 0 : a > 15.f ? 15 : (int)a, qb = b < 0.f ? 0 : b > 15.f ? 15 : (int)b;
        codes[i / 2] = (uint8_t)(qa | (qb << 4));
        dec[i] = (float)qa * s + lo, dec[i + 1] = (float)qb * s + lo;
    }
    memcpy(params, &s16, 2), memcpy(params + 1, &lo16, 2);
}

/* One row x[d] -> its record; dec[d] gets what the record decodes to. */
static void encode_row(int codec, const float *x, int d, uint8_t *rec, float *dec) {
    float amax = 0.f;
    for (int i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    if (codec == PD_FP16) {
        for (int i = 0; i < d; i++) {
            _Float16 h = (_Float16)(x[i] < -65504.f ? -65504.f : x[i] > 65504.f ? 65504.f : x[i]);
            memcpy(rec + 2 * i, &h, 2), dec[i] = (float)h;
        }
    } else if (codec == PD_BF16) {
        for (int i = 0; i < d; i++) {
            uint16_t h = bf16_encode(x[i]);
            memcpy(rec + 2 * i, &h, 2), dec[i] = bf16_decode(h);
        }
    } else if (codec == PD_INT8 || codec == PD_FP8) {
        float top = codec == PD_INT8 ? 127.f : 448.f, s = nonzero(amax / top);
        for (int i = 0; i < d; i++) {
            float y = x[i] / s;
            y = y < -top ? -top : y > top ? top : y;
            if (codec == PD_INT8) {
                int8_t q = (int8_t)nearbyintf(y);
                rec[i] = (uint8_t)q, dec[i] = (float)q * s;
            } else {
                rec[i] = fp8_encode(y), dec[i] = fp8_table[rec[i]] * s;
            }
        }
        memcpy(rec + d, &s, 4);
    } else { /* PD_INT4 */
        for (int g = 0; g < 2; g++)
            encode_int4_group(x + g * d / 2, d / 2, rec + g * d / 4, (_Float16 *)(rec + d / 2) + 2 * g,
                              dec + g * d / 2);
    }
}

/* x: [n, d] rows; each goes to record rows[i] of `cache` (records of `tb` bytes); dec: [n, d] decoded. */
void pd_kv_encode(int codec, const float *x, int64_t n, int d, uint8_t *cache, const int64_t *rows, int tb,
                  float *dec) {
#pragma omp parallel for schedule(static) if (n * d >= (1 << 15))
    for (int64_t i = 0; i < n; i++) encode_row(codec, x + i * d, d, cache + rows[i] * tb, dec + i * d);
}

#if defined(__AVX2__) && defined(__F16C__)
/* Eight codes at a time in vector registers (AVX2 + F16C, what every host of this machine kind has); the
 * scalar loops below serve other CPUs and head sizes that are not a multiple of 16. */
static inline vf int8x8(const uint8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf fp16x8(const uint8_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf bf16x8(const uint8_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
/* e4m3 -> the fp16 whose exponent field is e4m3's (bias 15 instead of 7) and mantissa its 3 bits: that is the
 * value / 256 (subnormals included), so the caller scales by 256 more. */
static inline vf fp8x8(const uint8_t *p) {
    __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7));
    return (vf)_mm256_cvtph_ps(h);
}
/* 16 codes from 8 bytes, in element order (even element in the low nibble). */
static inline void int4x16(const uint8_t *p, vf *a, vf *b) {
    __m128i x = _mm_loadl_epi64((const __m128i *)p), m = _mm_set1_epi8(15);
    __m128i q = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
    *a = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    *b = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
}

static inline int decode_row_vec(int codec, const uint8_t *rec, int d, float *out) {
    if (d % 16) return 0;
    if (codec == PD_INT8 || codec == PD_FP8) {
        float s;
        memcpy(&s, rec + d, 4);
        vf sv = vsplat(codec == PD_FP8 ? s * 256.f : s);
        for (int i = 0; i < d; i += VL) vstore(out + i, (codec == PD_INT8 ? int8x8(rec + i) : fp8x8(rec + i)) * sv);
    } else if (codec == PD_INT4) {
        for (int g = 0; g < 2; g++) {
            _Float16 p[2];
            memcpy(p, rec + d / 2 + 4 * g, 4);
            vf s = vsplat((float)p[0]), lo = vsplat((float)p[1]), a, b;
            for (int i = g * d / 2; i < (g + 1) * d / 2; i += 16) {
                int4x16(rec + i / 2, &a, &b);
                vstore(out + i, a * s + lo), vstore(out + i + VL, b * s + lo);
            }
        }
    } else {
        for (int i = 0; i < d; i += VL) vstore(out + i, codec == PD_FP16 ? fp16x8(rec + 2 * i) : bf16x8(rec + 2 * i));
    }
    return 1;
}
#else
static inline int decode_row_vec(int codec, const uint8_t *rec, int d, float *out) { return 0; }
#endif

/* One record -> out[d]. */
static inline __attribute__((always_inline)) void decode_row(int codec, const uint8_t *rec, int d, float *out) {
    if (decode_row_vec(codec, rec, d, out)) return;
    if (codec == PD_INT8) {
        float s;
        memcpy(&s, rec + d, 4);
        for (int i = 0; i < d; i++) out[i] = (float)(int8_t)rec[i] * s;
    } else if (codec == PD_INT4) {
        _Float16 p[4];
        memcpy(p, rec + d / 2, 8);
        for (int g = 0; g < 2; g++) {
            float s = (float)p[2 * g], lo = (float)p[2 * g + 1];
            for (int i = g * d / 2; i < (g + 1) * d / 2; i += 2) {
                uint8_t c = rec[i / 2];
                out[i] = (float)(c & 15) * s + lo, out[i + 1] = (float)(c >> 4) * s + lo;
            }
        }
    } else if (codec == PD_FP8) {
        float s;
        memcpy(&s, rec + d, 4);
        for (int i = 0; i < d; i++) out[i] = fp8_table[rec[i]] * s;
    } else if (codec == PD_FP16) {
        for (int i = 0; i < d; i++) {
            _Float16 h;
            memcpy(&h, rec + 2 * i, 2), out[i] = (float)h;
        }
    } else {
        for (int i = 0; i < d; i++) {
            uint16_t h;
            memcpy(&h, rec + 2 * i, 2), out[i] = bf16_decode(h);
        }
    }
}

/* One (sequence, KV head) over a coded pool: CHUNK keys and values at a time decoded to the stack, then
 * scored and summed as the fp32 kernel does. Positions from `wfrom` on are read from the sequence's residual
 * window instead (`wk`, `wv`: its [bs, d] fp16 rows of this head; pdserve/kv/residual.py). */
static inline __attribute__((always_inline)) void attend_one_coded(
        int codec, const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const int64_t *rows,
        int64_t len, float *out, int g_heads, int d, int bs, int tb, float scale, const uint16_t *wk,
        const uint16_t *wv, int64_t wfrom) {
    float m[g_heads], l[g_heads], acc[g_heads * d];
    float s[g_heads][CHUNK + VL];
    float kbuf[CHUNK * d], vbuf[CHUNK * d];
    const float *kr[CHUNK], *vr[CHUNK];
    int64_t block_bytes = (int64_t)bs * tb, blk = 0;
    int off = 0;
    for (int g = 0; g < g_heads; g++) m[g] = -INFINITY, l[g] = 0.f;
    memset(acc, 0, sizeof acc);
    for (int64_t start = 0; start < len; start += CHUNK) {
        int n = len - start < CHUNK ? (int)(len - start) : CHUNK;
        for (int t = 0; t < n; t++) {
            if (start + t >= wfrom) {
                decode_row(PD_FP16, (const uint8_t *)(wk + (int64_t)off * d), d, kbuf + t * d);
                decode_row(PD_FP16, (const uint8_t *)(wv + (int64_t)off * d), d, vbuf + t * d);
            } else {
                int64_t at = rows[blk] * block_bytes + (int64_t)off * tb;
                decode_row(codec, k_cache + at, d, kbuf + t * d);
                decode_row(codec, v_cache + at, d, vbuf + t * d);
            }
            kr[t] = kbuf + t * d, vr[t] = vbuf + t * d;
            if (++off == bs) off = 0, blk++;
        }
        score_keys(q, kr, vr, n, s, g_heads, d, scale);
        softmax_update(s, n, m, l, acc, g_heads, d);
        accumulate_values(s, vr, n, acc, g_heads, d);
    }
    for (int g = 0; g < g_heads; g++)
        for (int i = 0; i < d; i++) out[g * d + i] = acc[g * d + i] / l[g];
}

/* As pd_decode_attention (kernels.c), over a coded pool: k_cache, v_cache [Hkv * num_blocks, bs, tb] bytes.
 * With a residual window (win_k, win_v [Hkv * win_rows, d] fp16, NULL: none): sequence i reads its positions
 * from win_from[i] on from rows win_base[i] + position % bs of each head's part. */
void pd_decode_attention_coded(int codec, const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                               const int64_t *rows, const int64_t *lens, float *out, int b, int hq, int hkv,
                               int d, int bs, int tb, int max_blocks, float scale, const uint16_t *win_k,
                               const uint16_t *win_v, const int64_t *win_base, const int64_t *win_from,
                               int64_t win_rows) {
    int g_heads = hq / hkv;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int i = 0; i < b; i++)
        for (int h = 0; h < hkv; h++) {
            const int64_t *r = rows + ((int64_t)h * b + i) * max_blocks;
            int64_t off = ((int64_t)i * hq + (int64_t)h * g_heads) * d;
            int64_t wfrom = win_k ? win_from[i] : lens[i], wat = win_k ? (h * win_rows + win_base[i]) * d : 0;
            const uint16_t *wk = win_k ? win_k + wat : NULL, *wv = win_k ? win_v + wat : NULL;
            if (d == 64)
                attend_one_coded(codec, q + off, k_cache, v_cache, r, lens[i], out + off, g_heads, 64, bs, tb, scale,
                                 wk, wv, wfrom);
            else
                attend_one_coded(codec, q + off, k_cache, v_cache, r, lens[i], out + off, g_heads, d, bs, tb, scale,
                                 wk, wv, wfrom);
        }
}
