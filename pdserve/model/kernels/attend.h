/* Vector helpers and the blocks of paged decode attention (scoring, online softmax, value sums), shared
 * by the fp32 kernels (kernels.c) and the KV codec kernels (kv_codec.c). See kernels.c for the build. */
#ifndef PD_ATTEND_H
#define PD_ATTEND_H
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi __attribute__((vector_size(32), aligned(4)));
#define VL 8

static inline vf vsplat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
static inline vf vsel(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf vmax(vf a, vf b) { return vsel(a > b, a, b); }
#ifdef __AVX__
#include <immintrin.h>
/* Unaligned loads and stores as single instructions. A memcpy into the vector type looks equivalent, but
 * gcc 12 tuned for Zen 3 (-march=znver3) lowers it to two 16-byte halves stored to the stack and read
 * back as one 32-byte value: a store-forwarding stall on every load, which made the attention and SiLU
 * kernels 3-6x slower than torch on AMD EPYC hosts. */
static inline vf vload(const float *p) { return (vf)_mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, (__m256)v); }
#else
static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
#endif

/* a * b + c, fused where the CPU has FMA: only for the attention sums, whose order differs from torch's
 * anyway (the element-wise kernels keep torch's separate rounding). */
static inline vf vfma(vf a, vf b, vf c) {
#ifdef __FMA__
    return __builtin_ia32_vfmaddps256(a, b, c);
#else
    return a * b + c;
#endif
}

static inline float hsum(vf v) { /* a shuffle tree: 3 shuffles and 3 adds */
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
}

/* exp(x) for 16 lanes (Cephes expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp). */
static inline vf vexp(vf x) {
    x = vmax(x, vsplat(-87.3f));
    vf hi = vsplat(88.3f);
    x = vsel(x > hi, hi, x);
    const vf magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to the nearest integer */
    vf n = (x * vsplat(1.44269504088896341f) + magic) - magic;
    vf r = x - n * vsplat(0.693359375f) - n * vsplat(-2.12194440e-4f);
    vf y = vsplat(1.9875691500e-4f);
    y = y * r + vsplat(1.3981999507e-3f);
    y = y * r + vsplat(8.3334519073e-3f);
    y = y * r + vsplat(4.1665795894e-2f);
    y = y * r + vsplat(1.6666665459e-1f);
    y = y * r + vsplat(5.0000001201e-1f);
    y = y * r * r + r + vsplat(1.0f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)e;
}

static inline float dot(const float *a, const float *b, int d) {
    if (d % VL == 0) {
        vf acc = vsplat(0.f);
        for (int i = 0; i < d; i += VL) acc = vfma(vload(a + i), vload(b + i), acc);
        return hsum(acc);
    }
    float s = 0.f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* ---- paged decode attention ------------------------------------------------------------------ */

#define CHUNK 64 /* keys scored at once, per query head */

/* Online-softmax update of G query heads with n scored keys: s[g][t] becomes the weight of key t. */
static void softmax_update(float (*s)[CHUNK + VL], int n, float *m, float *l, float *acc, int g_heads,
                           int d) {
    for (int g = 0; g < g_heads; g++) {
        float mx = m[g];
        for (int t = 0; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
        float alpha = m[g] == -INFINITY ? 0.f : expf(m[g] - mx);
        m[g] = mx;
        for (int t = 0; t < n; t += VL) vstore(&s[g][t], vexp(vload(&s[g][t]) - vsplat(mx)));
        float sum = 0.f;
        for (int t = 0; t < n; t++) sum += s[g][t];
        l[g] = l[g] * alpha + sum;
        for (int i = 0; i < d; i++) acc[g * d + i] *= alpha;
    }
}

/* acc[g] += sum_t s[g][t] * v[t], D in vector registers (2 VL-multiple D) or scalar. Even and odd keys
 * go to separate sums: one chain of FMAs would wait on the FMA latency at every key. */
static inline __attribute__((always_inline)) void accumulate_values(
        float (*s)[CHUNK + VL], const float **vr, int n, float *restrict acc, int g_heads, int d) {
    if (d % (2 * VL) == 0) {
        for (int i = 0; i < d; i += 2 * VL)
            for (int g = 0; g < g_heads; g++) {
                vf a0 = vload(acc + g * d + i), a1 = vload(acc + g * d + i + VL), b0 = vsplat(0.f), b1 = b0;
                int t = 0;
                for (; t + 2 <= n; t += 2) {
                    vf w = vsplat(s[g][t]), u = vsplat(s[g][t + 1]);
                    a0 = vfma(w, vload(vr[t] + i), a0);
                    a1 = vfma(w, vload(vr[t] + i + VL), a1);
                    b0 = vfma(u, vload(vr[t + 1] + i), b0);
                    b1 = vfma(u, vload(vr[t + 1] + i + VL), b1);
                }
                if (t < n) {
                    vf w = vsplat(s[g][t]);
                    a0 = vfma(w, vload(vr[t] + i), a0);
                    a1 = vfma(w, vload(vr[t] + i + VL), a1);
                }
                vstore(acc + g * d + i, a0 + b0);
                vstore(acc + g * d + i + VL, a1 + b1);
            }
        return;
    }
    for (int t = 0; t < n; t++)
        for (int g = 0; g < g_heads; g++)
            for (int i = 0; i < d; i++) acc[g * d + i] += s[g][t] * vr[t][i];
}

/* out[0..3] = the horizontal sums of a0..a3. */
static inline void hsum4(vf a0, vf a1, vf a2, vf a3, float *out) {
#ifdef __AVX__
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1), _mm256_hadd_ps((__m256)a2, (__m256)a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
    out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
#endif
}

/* s[g][t] = scale * (q_g . k_t) for n keys, four keys at a time: four independent sums per query head
 * (one sum per dot waited on the FMA latency at every step), reduced together. */
static inline __attribute__((always_inline)) void score_keys(
        const float *q, const float **kr, const float **vr, int n, float (*s)[CHUNK + VL], int g_heads, int d,
        float scale) {
    int t = 0;
    if (d % VL == 0)
        for (; t + 4 <= n; t += 4) {
            /* the value rows of these keys, needed once the chunk's scores are done: they arrive
             * while the scores are computed (measured: 16-20 vs 21-25 ms for a cold batch-16 step's
             * attention, instead of prefetching each next value block with the key block) */
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < d; i += 16) __builtin_prefetch(vr[t + j] + i);
            for (int g = 0; g < g_heads; g++) {
                const float *qg = q + g * d;
                vf a0 = vsplat(0.f), a1 = a0, a2 = a0, a3 = a0;
                for (int i = 0; i < d; i += VL) {
                    vf qv = vload(qg + i);
                    a0 = vfma(qv, vload(kr[t] + i), a0);
                    a1 = vfma(qv, vload(kr[t + 1] + i), a1);
                    a2 = vfma(qv, vload(kr[t + 2] + i), a2);
                    a3 = vfma(qv, vload(kr[t + 3] + i), a3);
                }
                float sums[4];
                hsum4(a0, a1, a2, a3, sums);
                for (int j = 0; j < 4; j++) s[g][t + j] = sums[j] * scale;
            }
        }
    for (; t < n; t++)
        for (int g = 0; g < g_heads; g++) s[g][t] = dot(q + g * d, kr[t], d) * scale;
}

#endif
