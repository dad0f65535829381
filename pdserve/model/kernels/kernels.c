/* CPU kernels for the fp32 decode path of pdserve (see kernels/__init__.py for the Python side).
 *
 * Built at first use by kernels/build.py with -O3 -march=native -fopenmp -ffp-contract=off, so the
 * element-wise kernels round exactly as torch's separate mul/add ops do. Threads come from OpenMP; the
 * library resolves libgomp.so.1 to the copy torch already loaded, so torch and these kernels share one
 * thread pool. Vectors are GCC vector extensions of 8 floats, lowered to AVX2 (or SSE) instructions:
 * 16-float vectors measured 3-4x slower on an AVX-512 Xeon (gcc 12 splits their unaligned loads and
 * stalls on store forwarding), and AVX2 is what the AMD hosts of this machine kind have. The attention
 * sums use FMA explicitly (their order differs from torch's anyway). The skinny GEMM is in gemm.c.
 */
#include "attend.h"

static void decode_attention_for(const float *q, const float *k_cache, const float *v_cache, const int64_t *rows,
                                 const int64_t *lens, float *out, int b, int hq, int hkv, int d, int bs,
                                 int max_blocks, float scale);
static void add_rms_norm_for(float *x, const float *res, const float *w, float *out, int t, int h, float eps);
static void silu_mul_for(const float *gu, float *out, int t, int n);
static void rope_write_kv_for(const float *qkv, int64_t stride, const float *cos, const float *sin, float *q_out,
                              float *k_out, float *k_cache, float *v_cache, const int64_t *slot_rows, int t, int hq,
                              int hkv, int d);

/* Keys ahead of the one being gathered whose K and V rows are prefetched into L2 (prefetcht1), a row per
 * key: spread out, they keep misses in flight across the scattered 4 KiB blocks. Measured on Zen 4, quiet
 * (`benchmarks/bench_decode_parts.py --weights q8_0 --input-len 256`, its cold attention over 30 layers of
 * 16 x 192 keys, 142 MB): 8.6-9.1 ms, where a burst prefetch of the whole next block into L1 (prefetcht0)
 * took 10.9-11.8 ms (its 128 prefetches fill the L1 miss buffers). 16 to 96 keys ahead, prefetcht2, or K also
 * into L1 4 keys ahead were within noise of this (variants built from a scratch copy, not kept). */
#define KEYS_AHEAD 24

/* One (sequence, KV head): the G query heads sharing it attend over `len` keys read in place, CHUNK
 * keys at a time; rows KEYS_AHEAD keys on are prefetched into L2 as each key is gathered, and value rows
 * into L1 while their keys are scored. */
static inline __attribute__((always_inline)) void attend_one(
        const float *q, const float *k_cache, const float *v_cache, const int64_t *rows, int64_t len, float *out,
        int g_heads, int d, int bs, float scale) {
    float m[g_heads], l[g_heads], acc[g_heads * d];
    float s[g_heads][CHUNK + VL];
    const float *kr[CHUNK], *vr[CHUNK];
    int64_t block_floats = (int64_t)bs * d, blk = 0, ablk = KEYS_AHEAD / bs; /* ablk, aoff: key KEYS_AHEAD on */
    int off = 0, aoff = KEYS_AHEAD % bs;
    for (int g = 0; g < g_heads; g++) m[g] = -INFINITY, l[g] = 0.f;
    memset(acc, 0, sizeof acc);
    for (int64_t start = 0; start < len; start += CHUNK) {
        int n = len - start < CHUNK ? (int)(len - start) : CHUNK;
        for (int t = 0; t < n; t++) {
            if (start + t + KEYS_AHEAD < len) {
                int64_t row = rows[ablk] * block_floats + (int64_t)aoff * d;
                for (int i = 0; i < d; i += 16) {
                    __builtin_prefetch(k_cache + row + i, 0, 2);
                    __builtin_prefetch(v_cache + row + i, 0, 2);
                }
                if (++aoff == bs) aoff = 0, ablk++;
            }
            kr[t] = k_cache + rows[blk] * block_floats + (int64_t)off * d;
            vr[t] = v_cache + rows[blk] * block_floats + (int64_t)off * d;
            if (++off == bs) off = 0, blk++;
        }
        score_keys(q, kr, vr, n, s, g_heads, d, scale);
        softmax_update(s, n, m, l, acc, g_heads, d);
        accumulate_values(s, vr, n, acc, g_heads, d);
    }
    for (int g = 0; g < g_heads; g++)
        for (int i = 0; i < d; i++) out[g * d + i] = acc[g * d + i] / l[g];
}

/* q, out: [B, Hq, D]; k_cache, v_cache: [Hkv * num_blocks, bs, D]; rows: [Hkv, B, max_blocks] block
 * rows of those views (already offset by head); lens: [B] context lengths (>= 1). */
void pd_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *rows,
                         const int64_t *lens, float *out, int b, int hq, int hkv, int d, int bs,
                         int max_blocks, float scale) {
#pragma omp parallel
    decode_attention_for(q, k_cache, v_cache, rows, lens, out, b, hq, hkv, d, bs, max_blocks, scale);
}

/* The functions named *_for below are the work of the pd_* entry points for the threads of an enclosing
 * parallel region (orphaned `omp for` loops, ending in a barrier; serial outside one): the pd_* functions open
 * the region around them, pd_qdecode_forward opens one around a whole decode step. Same loops, same rounding. */
static void decode_attention_for(const float *q, const float *k_cache, const float *v_cache, const int64_t *rows,
                                 const int64_t *lens, float *out, int b, int hq, int hkv, int d, int bs,
                                 int max_blocks, float scale) {
    int g_heads = hq / hkv;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int i = 0; i < b; i++)
        for (int h = 0; h < hkv; h++) {
            const int64_t *r = rows + ((int64_t)h * b + i) * max_blocks;
            int64_t off = ((int64_t)i * hq + (int64_t)h * g_heads) * d;
            if (d == 64)  /* a constant head size lets the compiler unroll the vector loops */
                attend_one(q + off, k_cache, v_cache, r, lens[i], out + off, g_heads, 64, bs, scale);
            else
                attend_one(q + off, k_cache, v_cache, r, lens[i], out + off, g_heads, d, bs, scale);
        }
}

/* ---- element-wise glue of a decoder layer ---------------------------------------------------- */

/* If res: x += res. Then out = w * (x * (1 / sqrt(mean(x^2) + eps))), Hugging Face's RMSNorm order.
 * x, res, out: [t, h] contiguous. */
void pd_add_rms_norm(float *x, const float *res, const float *w, float *out, int t, int h, float eps) {
#pragma omp parallel if ((int64_t)t * h >= (1 << 16))
    add_rms_norm_for(x, res, w, out, t, h, eps);
}

static void add_rms_norm_for(float *x, const float *res, const float *w, float *out, int t, int h, float eps) {
#pragma omp for schedule(static)
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
#pragma omp parallel if ((int64_t)t * n >= (1 << 16))
    silu_mul_for(gu, out, t, n);
}

static void silu_mul_for(const float *gu, float *out, int t, int n) {
#pragma omp for schedule(static)
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
#pragma omp parallel if ((int64_t)t * (hq + hkv) * d >= (1 << 16))
    rope_write_kv_for(qkv, stride, cos, sin, q_out, k_out, k_cache, v_cache, slot_rows, t, hq, hkv, d);
}

static void rope_write_kv_for(const float *qkv, int64_t stride, const float *cos, const float *sin, float *q_out,
                              float *k_out, float *k_cache, float *v_cache, const int64_t *slot_rows, int t, int hq,
                              int hkv, int d) {
#pragma omp for schedule(static)
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

/* ---- a whole decode step on quantized weights, in one call ------------------------------------------ */

/* qgemm.c: pd_qgemm's work for the threads of an enclosing parallel region, y (+)= bias. */
void pd_qgemm_for(int fmt, const float *x, int64_t ldx, const uint8_t *wp, float *y, int m, int n, int k,
                  const float *bias, void *scratch);

typedef struct { /* one linear layer's packed blocks (pdserve.model.quant) */
    const uint8_t *w;
    const float *bias; /* [n] or NULL */
    int fmt, n, k;
} pd_qlinear;

typedef struct { /* one decoder layer (pdserve.model.fused_decode) */
    const float *attn_norm, *mlp_norm;
    pd_qlinear qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [Hkv * num_blocks * bs, D] each */
} pd_qlayer;

typedef struct { /* one step of t decodes: x [t, hidden] (updated in place) and the scratch rows it uses */
    float *x;
    const float *cos, *sin;                     /* [t, d] */
    const int64_t *slot_rows, *rows, *lens;     /* as pd_rope_write_kv and pd_decode_attention take them */
    float *h, *qkv, *q, *k, *attn, *o, *gu, *act, *dn; /* [t, hidden], [t, qkv n], [t, hq d], [t, hkv d], ... */
    void *qscratch;                             /* the int8 kernel's quantized rows (pd_qscratch_bytes) */
    int t, hidden, hq, hkv, d, inter, bs, max_blocks;
    int i8; /* 1: Q8_0 weights multiply int8-quantized rows (qgemm.c's FMT_Q8_0_I8) this step */
    float eps, scale;
} pd_qstep;

#define QFMT(lin) ((lin).fmt == 1 && s->i8 ? 3 : (lin).fmt) /* FMT_Q8_0 -> FMT_Q8_0_I8 */

/* The decoder layers of LlamaModel.forward for a step of decodes only, in one parallel region: per layer
 * x's RMSNorm, q|k|v, rotary + KV write, decode attention, o, x += o and RMSNorm, gate|up, SiLU * up, down,
 * x += down; the same kernels and loops as the separate calls, so the same results bit for bit. */
void pd_qdecode_forward(const pd_qlayer *layers, int num_layers, const pd_qstep *s) {
    int t = s->t, hidden = s->hidden, qkv_n = (s->hq + 2 * s->hkv) * s->d;
#pragma omp parallel
    for (int i = 0; i < num_layers; i++) {
        const pd_qlayer *l = layers + i;
        add_rms_norm_for(s->x, NULL, l->attn_norm, s->h, t, hidden, s->eps);
        pd_qgemm_for(QFMT(l->qkv), s->h, hidden, l->qkv.w, s->qkv, t, l->qkv.n, l->qkv.k, l->qkv.bias, s->qscratch);
        rope_write_kv_for(s->qkv, qkv_n, s->cos, s->sin, s->q, s->k, l->k_cache, l->v_cache, s->slot_rows, t,
                          s->hq, s->hkv, s->d);
        decode_attention_for(s->q, l->k_cache, l->v_cache, s->rows, s->lens, s->attn, t, s->hq, s->hkv, s->d,
                             s->bs, s->max_blocks, s->scale);
        pd_qgemm_for(QFMT(l->o), s->attn, l->o.k, l->o.w, s->o, t, l->o.n, l->o.k, l->o.bias, s->qscratch);
        add_rms_norm_for(s->x, s->o, l->mlp_norm, s->h, t, hidden, s->eps);
        pd_qgemm_for(QFMT(l->gate_up), s->h, hidden, l->gate_up.w, s->gu, t, l->gate_up.n, l->gate_up.k, NULL,
                     s->qscratch);
        silu_mul_for(s->gu, s->act, t, s->inter);
        pd_qgemm_for(QFMT(l->down), s->act, s->inter, l->down.w, s->dn, t, l->down.n, l->down.k, NULL, s->qscratch);
#pragma omp for schedule(static)
        for (int r = 0; r < t; r++)
            for (int c = 0; c < hidden; c++) s->x[(int64_t)r * hidden + c] += s->dn[(int64_t)r * hidden + c];
    }
}
