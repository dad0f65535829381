/* CPU kernels for the fp32 decode path of pdserve (see kernels/__init__.py for the Python side).
 *
 * Built at first use by kernels/build.py with -O3 -march=native -fopenmp -ffp-contract=off, so the
 * element-wise kernels round exactly as torch's separate mul/add ops do. Threads come from OpenMP; the
 * library resolves libgomp.so.1 to the copy torch already loaded, so torch and these kernels share one
 * thread pool. Vectors are GCC vector extensions of 8 floats, lowered to AVX2 (or SSE) instructions:
 * 16-float vectors measured 3-4x slower on an AVX-512 Xeon (gcc 12 splits their unaligned loads and
 * stalls on store forwarding), and AVX2 is what the AMD hosts of this machine kind have.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi __attribute__((vector_size(32), aligned(4)));
#define VL 8

static inline vf vsplat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
static inline vf vsel(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf vmax(vf a, vf b) { return vsel(a > b, a, b); }
static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
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
        for (int i = 0; i < d; i += VL) acc += vload(a + i) * vload(b + i);
        return hsum(acc);
    }
    float s = 0.f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* ---- paged decode attention ------------------------------------------------------------------ */

#define CHUNK 64 /* keys scored at once, per query head */

/* One (sequence, KV head): the G query heads sharing it attend over `len` keys read in place. */
static void attend_one(const float *q, const float *k_cache, const float *v_cache, const int64_t *rows,
                       int64_t len, float *out, int g_heads, int d, int bs, float scale) {
    float m[g_heads], l[g_heads], acc[g_heads * d];
    float s[g_heads][CHUNK + VL];
    for (int g = 0; g < g_heads; g++) m[g] = -INFINITY, l[g] = 0.f;
    memset(acc, 0, sizeof acc);
    for (int64_t start = 0; start < len; start += CHUNK) {
        int n = len - start < CHUNK ? (int)(len - start) : CHUNK;
        for (int t = 0; t < n; t++) {
            int64_t p = start + t;
            const float *k = k_cache + (rows[p / bs] * bs + p % bs) * d;
            for (int g = 0; g < g_heads; g++) s[g][t] = dot(q + g * d, k, d) * scale;
        }
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
        for (int t = 0; t < n; t++) {
            int64_t p = start + t;
            const float *v = v_cache + (rows[p / bs] * bs + p % bs) * d;
            for (int g = 0; g < g_heads; g++) {
                float w = s[g][t], *a = acc + g * d;
                for (int i = 0; i < d; i++) a[i] += w * v[i];
            }
        }
    }
    for (int g = 0; g < g_heads; g++)
        for (int i = 0; i < d; i++) out[g * d + i] = acc[g * d + i] / l[g];
}

/* q, out: [B, Hq, D]; k_cache, v_cache: [Hkv * num_blocks, bs, D]; rows: [Hkv, B, max_blocks] block
 * rows of those views (already offset by head); lens: [B] context lengths (>= 1). */
void pd_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *rows,
                         const int64_t *lens, float *out, int b, int hq, int hkv, int d, int bs,
                         int max_blocks, float scale) {
    int g_heads = hq / hkv;
#pragma omp parallel for collapse(2) schedule(static)
    for (int i = 0; i < b; i++)
        for (int h = 0; h < hkv; h++) {
            const int64_t *r = rows + ((int64_t)h * b + i) * max_blocks;
            int64_t off = ((int64_t)i * hq + (int64_t)h * g_heads) * d;
            attend_one(q + off, k_cache, v_cache, r, lens[i], out + off, g_heads, d, bs, scale);
        }
}

/* ---- element-wise glue of a decoder layer ---------------------------------------------------- */

/* If res: x += res. Then out = w * (x * (1 / sqrt(mean(x^2) + eps))), Hugging Face's RMSNorm order.
 * x, res, out: [t, h] contiguous. */
void pd_add_rms_norm(float *x, const float *res, const float *w, float *out, int t, int h, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)t * h >= (1 << 16))
    for (int r = 0; r < t; r++) {
        float *xr = x + (int64_t)r * h, *o = out + (int64_t)r * h;
        if (res)
            for (int i = 0; i < h; i++) xr[i] += res[(int64_t)r * h + i];
        float inv = 1.0f / sqrtf(dot(xr, xr, h) / (float)h + eps);
        for (int i = 0; i < h; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* out[r, i] = silu(gu[r, i]) * gu[r, n + i], silu(x) = x / (1 + exp(-x)); gu: [t, 2n], out: [t, n]. */
void pd_silu_mul(const float *gu, float *out, int t, int n) {
#pragma omp parallel for schedule(static) if ((int64_t)t * n >= (1 << 16))
    for (int r = 0; r < t; r++) {
        const float *g = gu + (int64_t)r * 2 * n, *u = g + n;
        float *o = out + (int64_t)r * n;
        int i = 0;
        for (; i + VL <= n; i += VL) {
            vf x = vload(g + i);
            vstore(o + i, x / (vsplat(1.f) + vexp(-x)) * vload(u + i));
        }
        for (; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

static inline void rotate(const float *x, const float *c, const float *s, float *y, int d) {
    int half = d / 2;
    for (int i = 0; i < half; i++) y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int i = half; i < d; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* qkv: [t, (hq + 2 hkv) d] (row stride `stride`); cos, sin: [t, d]. Writes rotated q to q_out [t, hq, d],
 * rotated k to k_out [t, hkv, d] and to k_cache, v to v_cache, both [hkv * slots, d] views, at rows
 * slot_rows[h * t + token]. */
void pd_rope_write_kv(const float *qkv, int64_t stride, const float *cos, const float *sin, float *q_out,
                      float *k_out, float *k_cache, float *v_cache, const int64_t *slot_rows, int t, int hq,
                      int hkv, int d) {
#pragma omp parallel for schedule(static) if ((int64_t)t * (hq + hkv) * d >= (1 << 16))
    for (int r = 0; r < t; r++) {
        const float *x = qkv + (int64_t)r * stride, *c = cos + (int64_t)r * d, *s = sin + (int64_t)r * d;
        for (int h = 0; h < hq; h++) rotate(x + h * d, c, s, q_out + ((int64_t)r * hq + h) * d, d);
        for (int h = 0; h < hkv; h++) {
            float *k = k_out + ((int64_t)r * hkv + h) * d;
            int64_t row = slot_rows[(int64_t)h * t + r];
            rotate(x + (hq + h) * d, c, s, k, d);
            memcpy(k_cache + row * d, k, d * sizeof(float));
            memcpy(v_cache + row * d, x + (hq + hkv + h) * d, d * sizeof(float));
        }
    }
}
