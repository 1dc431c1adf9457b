/* kvcompile CPU store (quantize on write): a C template, specialized per store layout.
 *
 * templates/cpu_store.py compiles this file once per layout with -D definitions (below) and calls kvc_store
 * through ctypes. The effects are exactly those of kvcompile.store.store_reference (after its rotation, which
 * templates/cpu_rotate.c does first): an append of n_new[b] tokens to a sequence holding L = lengths[b] tokens
 *
 *   1. writes the chunk's sinks (positions p < S) to k_sink / v_sink;
 *   2. flushes positions [Q(L), Q(L')) (L' = L + n_new[b]) into packed storage -- read from the residual
 *      ring (p < L, slot p % W) or from the chunk (p >= L) -- quantized as kvcompile.quant.quantize does,
 *      into the sequence's blocks: packed index j = p - S is row j % BS of block table[b][j / BS];
 *   3. writes the newcomers that stay in full precision, p in [max(L, S, Q(L')), L'), to ring slot p % W;
 *   4. advances lengths[b].
 * Step 2 reads ring slots that step 3 may overwrite, so every flush of the call finishes before any ring
 * write (two phases, a barrier between them). Before anything is written, every block step 2 writes must be
 * reserved (a table entry >= 0, in the table's MB columns, naming one of the pool's NB blocks), else the call
 * writes nothing and says which row failed.
 *
 * Numerics, bit for bit as quant.quantize (this file is built with -ffp-contract=off and without fast-math:
 * every fp32 operation below is the reference's, in its order):
 *   - division is an IEEE division (never a reciprocal multiply);
 *   - torch.round is round half to even (__builtin_roundevenf);
 *   - fp16 scales and zero points: round to nearest even (the _Float16 conversion), then one step up or
 *     down through the int16 bit pattern when that went the wrong way (quant.round_to_dtype); fp8 e4m3
 *     scales the same way through the fp8 encoding below (up only); their int8 zero points are
 *     round_half_even(-min / scale), and an asymmetric code round_half_even(x / scale) + zero;
 *   - fp8 codes: integer arithmetic that gives torch 2.13's cast (checked exhaustively by the tests):
 *     round half to even; e4m3fn saturates to +-448 from 464 up (infinities included; torch 2.11 gives NaN
 *     beyond 464), e5m2 goes to inf from 61440 up (halfway, even); NaN stays NaN. (In the store
 *     x / scale is clamped to the format's maximum and a group holding NaN or inf gets codes 0, so
 *     saturation never decides a code there.)
 *   - saturation (quant.limits): the zero point is clamped to [-ZMAX, ZMAX] and the scale to [0, SMAX] before
 *     they are rounded, and an fp8 value x / scale to [-F, F] before it is encoded, with ternaries that keep
 *     -0.0 as torch.clamp does (a no-op for every group that fits the scale dtype);
 *   - non-finite input: a group holding NaN or +-inf stores NaN as its scale (and zero point) and 0 as each
 *     of its codes, in every format (quant.quantize).
 * Min and max are taken with ordered comparisons (x < m), so a group holding both +0.0 and -0.0 as its
 * extreme keeps the first one met; the reference's reduction order decides that case (it never arises from
 * model activations that are not exactly zero).
 *
 * Specialization (all compile-time):
 *   D, H (kv heads), S (sinks), W (ring slots, at least 1), R (residual), FL (flush), BS (packed tokens per
 *   block: a power of two, a multiple of FL)
 *   MODEL_T  dtype of the chunk, ring, sinks and unquantized codes: 0 fp32, 1 bf16, 2 fp16
 *   K_FMT / V_FMT     0 none (model dtype), 1 int asymmetric, 2 int symmetric, 3 fp8 e4m3, 4 fp8 e5m2
 *   K_BITS / V_BITS   8, 4, 3, 2 (ignored for none)
 *   K_AXIS / V_AXIS   0 token (groups of K_GROUP channels), 1 channel (groups of K_GROUP tokens)
 *   K_GROUP / V_GROUP
 *   K_SFMT / V_SFMT   scales (and zero points) stored as fp16 (0), fp32 (1), or fp8 e4m3 with an int8 zero point (2);
 *                     3: no scale stored (fp8 with one fixed scale, 1.0: Quant axis="tensor"; AXIS 0, GROUP D), a
 *                     poisoned token-head's codes are all 0x7F (the NaN code) instead of 0
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef _Float16 f16;

#define ESZ (MODEL_T == 0 ? 4 : 2) /* bytes per model-dtype element */
#define ROW (D * ESZ)              /* bytes per full-precision row */
#define BLK 64                     /* flush tokens per task (at most a block, at least a flush group) */

/* --------------------------------------------------------------------------- numerics */
static inline float model_to_f32(const void *row, int d) {
#if MODEL_T == 0
    return ((const float *)row)[d];
#elif MODEL_T == 1
    uint32_t u = (uint32_t)((const uint16_t *)row)[d] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
#else
    return (float)((const f16 *)row)[d];
#endif
}

/* Whether x[0, n) holds a NaN or +-inf: an integer max over the magnitude bits, which
 * reach the all-ones exponent exactly then. */
static inline __attribute__((always_inline)) int nonfinite(const float *x, int n) {
    int32_t m = 0;
    for (int d = 0; d < n; d++) {
        int32_t u;
        memcpy(&u, x + d, 4);
        u &= 0x7FFFFFFF;
        m = u > m ? u : m;
    }
    return m >= 0x7F800000;
}

/* One row into fp32; returns whether it holds a NaN or +-inf (bf16/fp16: checked in the conversion's own loop,
 * on 16-bit words). */
static inline int row_to_f32(const void *row, float *out) {
#if MODEL_T == 0
    memcpy(out, row, D * 4);
    return nonfinite(out, D);
#else
    const uint16_t *h = (const uint16_t *)row;
    int32_t m = 0;
    for (int d = 0; d < D; d++) {
        out[d] = model_to_f32(row, d);
        const int32_t u = h[d] & 0x7FFF;
        m = u > m ? u : m;
    }
    return m >= (MODEL_T == 1 ? 0x7F80 : 0x7C00);
#endif
}

/* fp32 x -> fp16 bits, rounded towards +inf (up) or -inf: RNE, then one step where it went the wrong way. */
static inline uint16_t f16_directed(float x, int up) {
    f16 y = (f16)x;
    const float yf = (float)y;
    uint16_t bits;
    memcpy(&bits, &y, 2);
    const int neg = bits >> 15; /* sign set (negative or -0): the magnitude grows with the pattern */
    if (up ? yf < x : yf > x) bits = (uint16_t)(bits + ((up ? !neg : neg) ? 1 : -1));
    return bits;
}

static inline float f16_bits_to_f32(uint16_t bits) {
    f16 y;
    memcpy(&y, &bits, 2);
    return (float)y;
}

static inline float e4m3_to_f32(uint8_t b) { /* b != 0x7F (NaN): never a scale put_scale rounds */
    const int e = (b >> 3) & 15, m = b & 7;
    return e ? __builtin_ldexpf((float)(8 + m), e - 10) : __builtin_ldexpf((float)m, -9);
}

/* round_half_even(m / 2**s) for non-negative m and 1 <= s <= 30. */
static inline int32_t shr_rne(int32_t m, int32_t s) {
    const int32_t q = m >> s, rem = m - (q << s), half = 1 << (s - 1);
    return q + (rem > half ? 1 : (rem == half ? (q & 1) : 0)); /* selects, not bool arithmetic: vectorizes */
}

/* The fp8 bit pattern of fp32 bits u, rounded half to even, as torch's cast. Branch-free
 * (every path computed, one selected), so a loop over it vectorizes. */
static inline int32_t fp8_encode_bits(int32_t u, int e4m3) {
    const int32_t sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFF;
    const int32_t M = e4m3 ? 3 : 2, BIAS = e4m3 ? 7 : 15;
    const int32_t SAT_BITS = e4m3 ? 0x43E80000 /* 464.0 */ : 0x47800000 /* 65536.0 */;
    const int32_t SHIFT = 23 - M, MIN_NORMAL_BITS = (127 + 1 - BIAS) << 23;
    /* normal: drop 23-M mantissa bits with RNE, then rebias (a mantissa carry bumps the exponent) */
    const int32_t normal = (a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1) - ((127 - BIAS) << 23)) >> SHIFT;
    /* subnormal: |y| / smallest subnormal, rounded half to even; m * 2**-s with 21 <= s <= 25 */
    const int32_t e = a >> 23, m = (a & 0x7FFFFF) | (e > 0 ? 0x800000 : 0);
    int32_t s = (150 - (BIAS - 1 + M)) - (e > 1 ? e : 1);
    s = s < 25 ? s : 25;
    const int32_t sub = shr_rne(m, s);
    const int32_t sat = a > 0x7F800000 ? 0x7F : (e4m3 ? 0x7E : 0x7C); /* NaN stays NaN */
    const int32_t code = a >= SAT_BITS ? sat : (a < MIN_NORMAL_BITS ? sub : normal);
    return code | sign;
}

static inline uint8_t fp8_encode(float y, int e4m3) {
    int32_t u;
    memcpy(&u, &y, 4);
    return (uint8_t)fp8_encode_bits(u, e4m3);
}

/* Round fp32 x to the scale dtype (sfmt: 0 fp16, 1 fp32, 2 fp8 e4m3, up only and 0 <= x <= 448) in the given
 * direction; store it at slot i of dst; return it as fp32. */
static inline float put_scale(void *dst, int64_t i, float x, int up, int sfmt) {
    if (sfmt == 1) {
        ((float *)dst)[i] = x;
        return x;
    }
    if (sfmt == 2) {
        uint8_t b = fp8_encode(x, 1);
        b = e4m3_to_f32(b) < x ? b + 1 : b; /* the next e4m3 value up is the next code */
        ((uint8_t *)dst)[i] = b;
        return e4m3_to_f32(b);
    }
    const uint16_t b = f16_directed(x, up);
    ((uint16_t *)dst)[i] = b;
    return f16_bits_to_f32(b);
}

/* quant.limits: the largest zero point magnitude and scale stored. fp16 scales: the largest fp16; fp32:
 * 2**127 and 2**(127 - k), k = the integer bits, 9 (e4m3), 16 (e5m2). */
static inline float zero_cap(int sfmt) { return sfmt == 1 ? 0x1p127f : 65504.0f; } /* not for fp8 scales */
static inline float scale_cap(int fmt, int bits, int sfmt) {
    const int k = fmt == 3 ? 9 : (fmt == 4 ? 16 : bits);
    return sfmt == 1 ? __builtin_ldexpf(1.0f, 127 - k) : (sfmt == 2 ? 448.0f : 65504.0f);
}

#define F32_NAN_BITS 0x7FC00000u /* torch's NaN (float('nan')) as fp32 and as fp16 */
#define F16_NAN_BITS 0x7E00u

/* Group statistics -> (scale, zero) stored at slot i, returned as fp32 (scale 0 -> 1 for dividing). A
 * poisoned group (bad: it holds NaN or +-inf) stores NaN for both and returns NaN. */
static inline __attribute__((always_inline)) void group_params(
        int fmt, int bits, int sfmt, float mn, float mx, float amax, int bad, void *scale, void *zero, int64_t i,
        float *s_out, float *z_out) {
    float s, z = 0.0f;
    if (sfmt == 3) { /* one fixed scale, 1.0, not stored; NaN marks a poisoned group for flush_range */
        *s_out = bad ? __builtin_nanf("") : 1.0f;
        *z_out = 0.0f;
        return;
    }
    const float smax = scale_cap(fmt, bits, sfmt), zmax = zero_cap(sfmt);
    if (bad) {
        if (sfmt == 1) {
            const uint32_t nan = F32_NAN_BITS;
            memcpy((float *)scale + i, &nan, 4);
            if (fmt == 1) memcpy((float *)zero + i, &nan, 4);
        } else if (sfmt == 2) { /* e4m3's NaN; the int8 zero point 0 */
            ((uint8_t *)scale)[i] = 0x7F;
            if (fmt == 1) ((int8_t *)zero)[i] = 0;
        } else {
            ((uint16_t *)scale)[i] = F16_NAN_BITS;
            if (fmt == 1) ((uint16_t *)zero)[i] = F16_NAN_BITS;
        }
        *s_out = *z_out = __builtin_nanf("");
        return;
    }
    if (fmt == 1 && sfmt == 2) { /* fp8 scale, int8 zero point: the scale also keeps -min / scale in int8 */
        float r = (mx - mn) / (float)((1 << bits) - 1);
        const float a = __builtin_fabsf(mn) / 127.0f;
        r = a > r ? a : r;
        r = r > smax ? smax : r;
        s = put_scale(scale, i, r, 1, sfmt);
        float zi = __builtin_rintf(-mn / (s == 0.0f ? 1.0f : s));
        zi = zi < -128.0f ? -128.0f : (zi > 127.0f ? 127.0f : zi);
        ((int8_t *)zero)[i] = (int8_t)zi;
        z = zi;
    } else if (fmt == 1) {
        float zc = mn < -zmax ? -zmax : mn;
        zc = zc > zmax ? zmax : zc;
        z = put_scale(zero, i, zc, 0, sfmt);
        float r = (mx - z) / (float)((1 << bits) - 1);
        r = r < 0.0f ? 0.0f : r; /* torch.clamp(r, 0, SMAX), -0.0 kept */
        r = r > smax ? smax : r;
        s = put_scale(scale, i, r, 1, sfmt);
    } else if (fmt == 2) {
        float r = amax / (float)((1 << (bits - 1)) - 1);
        r = r > smax ? smax : r;
        s = put_scale(scale, i, r, 1, sfmt);
    } else {
        float r = amax / (fmt == 3 ? 448.0f : 57344.0f);
        r = r > smax ? smax : r;
        s = put_scale(scale, i, r, 1, sfmt);
    }
    *s_out = s == 0.0f ? 1.0f : s;
    *z_out = z;
}

/* Codes of x[0, n) with per-element scale s (0 already replaced by 1) and zero point z (quant.quantize). An
 * element of a poisoned group (s NaN) gets some code here, without undefined behaviour (the clamps send NaN
 * to a bound before the cast); flush_range then zeroes the codes of poisoned groups. */
static inline __attribute__((always_inline)) void encode(
        int fmt, int bits, int sfmt, const float *x, const float *s, const float *z, uint8_t *c, int n) {
    if (fmt == 1 && sfmt == 2) { /* z: the int8 zero point, a count of steps */
        const float Q = (float)((1 << bits) - 1);
        for (int d = 0; d < n; d++) {
            float y = __builtin_rintf(x[d] / s[d]) + z[d];
            y = y >= 0.0f ? y : 0.0f; /* NaN -> 0 */
            y = y > Q ? Q : y;
            c[d] = (uint8_t)(int32_t)y;
        }
    } else if (fmt == 1) {
        const float Q = (float)((1 << bits) - 1);
        for (int d = 0; d < n; d++) {
            float y = __builtin_rintf((x[d] - z[d]) / s[d]); /* round half to even (the default mode) */
            y = y >= 0.0f ? y : 0.0f; /* NaN (a poisoned group) -> 0: the cast below stays defined */
            y = y > Q ? Q : y;
            c[d] = (uint8_t)(int32_t)y;
        }
    } else if (fmt == 2) {
        const float q = (float)((1 << (bits - 1)) - 1), off = (float)(1 << (bits - 1));
        for (int d = 0; d < n; d++) {
            float y = __builtin_rintf(x[d] / s[d]);
            y = y >= -q ? y : -q; /* NaN -> -q */
            y = y > q ? q : y;
            c[d] = (uint8_t)(int32_t)(y + off);
        }
    } else {
        /* three loops over buffers (no type punning or narrowing inside a loop): each one vectorizes. e4m3 needs
         * no clamp to [-448, 448]: its encoding saturates to 448 from 464 up, the code the clamp gives; e5m2
         * goes to inf from 61440 up, so a saturated group's x / scale is clamped first */
        union { float f[D]; int32_t i[D]; } y;
        int32_t w[D];
        if (fmt == 4)
            for (int d = 0; d < n; d++) {
                const float v = x[d] / s[d];
                y.f[d] = v < -57344.0f ? -57344.0f : (v > 57344.0f ? 57344.0f : v);
            }
        else
            for (int d = 0; d < n; d++) y.f[d] = x[d] / s[d];
        for (int d = 0; d < n; d++) w[d] = fp8_encode_bits(y.i[d], fmt == 3);
        for (int d = 0; d < n; d++) c[d] = (uint8_t)w[d];
    }
}

/* One row of D codes -> the little-endian bit stream of quant.pack. */
static inline __attribute__((always_inline)) void pack_row(int bits, const uint8_t *c, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, c, D);
    } else if (bits == 3) {
        for (int u = 0; u < D / 8; u++) {
            uint32_t w = 0;
            for (int i = 0; i < 8; i++) w |= (uint32_t)c[8 * u + i] << (3 * i);
            out[3 * u] = (uint8_t)w;
            out[3 * u + 1] = (uint8_t)(w >> 8);
            out[3 * u + 2] = (uint8_t)(w >> 16);
        }
    } else {
        const int per = 8 / bits;
        for (int j = 0; j < D / per; j++) {
            uint32_t w = 0;
            for (int i = 0; i < per; i++) w |= (uint32_t)c[per * j + i] << (bits * i);
            out[j] = (uint8_t)w;
        }
    }
}

/* min, max and max |x| of xg[0, n), in lanes of 8 when n allows (min and max are exact in any order). */
static inline __attribute__((always_inline)) void minmax(const float *xg, int n, float *mn_, float *mx_, float *am_) {
    float mn = xg[0], mx = xg[0], am = __builtin_fabsf(xg[0]);
    if (n % 8 == 0 && n >= 16) {
        float lmn[8], lmx[8], lam[8];
        for (int l = 0; l < 8; l++) lmn[l] = lmx[l] = xg[l], lam[l] = __builtin_fabsf(xg[l]);
        for (int e = 8; e < n; e += 8)
            for (int l = 0; l < 8; l++) {
                const float xe = xg[e + l], ae = __builtin_fabsf(xe);
                lmn[l] = xe < lmn[l] ? xe : lmn[l];
                lmx[l] = xe > lmx[l] ? xe : lmx[l];
                lam[l] = ae > lam[l] ? ae : lam[l];
            }
        mn = lmn[0], mx = lmx[0], am = lam[0];
        for (int l = 1; l < 8; l++) {
            mn = lmn[l] < mn ? lmn[l] : mn;
            mx = lmx[l] > mx ? lmx[l] : mx;
            am = lam[l] > am ? lam[l] : am;
        }
    } else {
        for (int e = 1; e < n; e++) {
            const float xe = xg[e], ae = __builtin_fabsf(xe);
            mn = xe < mn ? xe : mn;
            mx = xe > mx ? xe : mx;
            am = ae > am ? ae : am;
        }
    }
    *mn_ = mn;
    *mx_ = mx;
    *am_ = am;
}

/* --------------------------------------------------------------------------- flush */
typedef struct {
    const char *x;   /* chunk at (b, h), position L */
    int64_t sx_t;    /* chunk token stride, bytes */
    const char *res; /* ring at (b, h) */
    int64_t L;
} src_t;

static inline const void *src_row(const src_t *src, int64_t p) {
    return p < src->L ? src->res + (p % W) * ROW : src->x + (p - src->L) * src->sx_t;
}

/* Quantize positions [p0, p1) of one (sequence, head) into one of its blocks: codes/scale/zero at that
 * (block, head), whose row 0 holds position pb. For axis=channel, p0 - pb and p1 - p0 are whole groups. */
static inline __attribute__((always_inline)) void flush_range(
        int fmt, int bits, int axis, int group, int sfmt, const src_t *src, int64_t p0, int64_t p1, int64_t pb,
        uint8_t *codes, void *scale, void *zero) {
    if (fmt == 0) {
        for (int64_t p = p0; p < p1; p++) memcpy(codes + (p - pb) * ROW, src_row(src, p), ROW);
        return;
    }
    const int64_t rb = D * bits / 8;
    if (axis == 0) {
        const int ng = D / group;
        for (int64_t p = p0; p < p1; p++) {
            float x[D], sv[D], zv[D];
            uint8_t c[D];
            const int anybad = row_to_f32(src_row(src, p), x); /* then each group's own check (rare) */
            for (int gi = 0; gi < ng; gi++) {
                const float *xg = x + gi * group;
                float mn, mx, amax;
                minmax(xg, group, &mn, &mx, &amax);
                const int bad = anybad && nonfinite(xg, group);
                float s, z;
                group_params(fmt, bits, sfmt, mn, mx, amax, bad, scale, zero, (p - pb) * ng + gi, &s, &z);
                for (int e = 0; e < group; e++) {
                    sv[gi * group + e] = s;
                    zv[gi * group + e] = z;
                }
            }
            encode(fmt, bits, sfmt, x, sv, zv, c, D);
            if (anybad) /* a poisoned group's codes are 0 (its scale is NaN); with no scale stored, the NaN code */
                for (int d = 0; d < D; d++) c[d] = sv[d] == sv[d] ? c[d] : (sfmt == 3 ? 0x7F : 0);
            pack_row(bits, c, codes + (p - pb) * rb);
        }
    } else {
        float *x = (float *)malloc(sizeof(float) * group * D);
        uint8_t *c = (uint8_t *)malloc((size_t)group * D);
        for (int64_t pg = p0; pg < p1; pg += group) {
            int anybad = 0;
            for (int t = 0; t < group; t++) anybad |= row_to_f32(src_row(src, pg + t), x + t * D);
            float mn[D], mx[D], amax[D], sv[D], zv[D];
            for (int d = 0; d < D; d++) {
                mn[d] = mx[d] = x[d];
                amax[d] = __builtin_fabsf(x[d]);
            }
            for (int t = 1; t < group; t++)
                for (int d = 0; d < D; d++) {
                    const float xe = x[t * D + d], ae = __builtin_fabsf(xe);
                    mn[d] = xe < mn[d] ? xe : mn[d];
                    mx[d] = xe > mx[d] ? xe : mx[d];
                    amax[d] = ae > amax[d] ? ae : amax[d];
                }
            const int64_t g = (pg - pb) / group;
            for (int d = 0; d < D; d++) {
                int bad = 0;
                for (int t = 0; t < group && anybad; t++) bad |= nonfinite(x + t * D + d, 1); /* rare */
                group_params(fmt, bits, sfmt, mn[d], mx[d], amax[d], bad, scale, zero, g * D + d, sv + d, zv + d);
            }
            for (int t = 0; t < group; t++) {
                encode(fmt, bits, sfmt, x + t * D, sv, zv, c + t * D, D);
                if (anybad) /* a poisoned group's codes are 0 (its scale is NaN) */
                    for (int d = 0; d < D; d++) c[t * D + d] = sv[d] == sv[d] ? c[t * D + d] : 0;
                pack_row(bits, c + t * D, codes + (pg + t - pb) * rb);
            }
        }
        free(x);
        free(c);
    }
}

#define K_RB (K_FMT == 0 ? ROW : D * K_BITS / 8)
#define V_RB (V_FMT == 0 ? ROW : D * V_BITS / 8)
/* scales (and zero points) per (block, head) */
#define K_NSCALE (K_FMT == 0 ? 0 : (K_AXIS == 1 ? (BS / K_GROUP) * D : BS * (D / K_GROUP)))
#define V_NSCALE (V_FMT == 0 ? 0 : (V_AXIS == 1 ? (BS / V_GROUP) * D : BS * (D / V_GROUP)))
#if BS % FL || BS & (BS - 1)
#error "BS must be a power of two and a multiple of the flush group FL"
#endif
#define K_SBYTES (K_SFMT == 1 ? 4 : (K_SFMT == 2 ? 1 : (K_SFMT == 3 ? 0 : 2))) /* per scale, and per zero point */
#define V_SBYTES (V_SFMT == 1 ? 4 : (V_SFMT == 2 ? 1 : (V_SFMT == 3 ? 0 : 2)))

static inline int64_t boundary(int64_t L) {
    const int64_t e = L - S - R;
    return S + (e > 0 ? e / FL : 0) * FL;
}

/* One call's operands (kvc_store's arguments, and each row's length and append). */
typedef struct {
    const char *k, *v;
    int64_t ks_b, ks_h, ks_t, vs_b, vs_h, vs_t; /* bytes */
    uint8_t *k_codes, *v_codes;
    char *k_scale, *k_zero, *v_scale, *v_zero, *k_res, *v_res, *k_sink, *v_sink;
    const int64_t *Ls, *ns;
    const int32_t *table; /* [B, mb] block ids */
    int64_t mb, nblk;
    const int64_t *sb; /* bytes from one block to the next in k_codes, k_scale, k_zero, v_codes, v_scale, v_zero */
    int64_t ws, ss; /* ring and sink rows allocated per (sequence, head): the rows' strides (a store grows them) */
} call_t;

/* Flush tokens per task: BLK, but at most a block (so a task never straddles two) and at least a flush group
 * (so a per-channel group is never split). Powers of two, so TB divides BS and tasks align with blocks. */
#define TB (BLK < BS ? (BLK > FL ? BLK : FL) : BS)

/* Flush task: (sequence, head, k or v, ib-th piece of TB packed indices, aligned to TB, from Q(L)'s). */
static void flush_task(const call_t *a, int64_t task) {
    const int64_t bh = task / (2 * a->nblk), which = (task / a->nblk) % 2, ib = task % a->nblk;
    const int64_t b = bh / H, h = bh % H, L = a->Ls[b];
    const int64_t j0 = boundary(L) - S, j1 = boundary(L + a->ns[b]) - S; /* packed indices flushed */
    const int64_t t = j0 / TB + ib;
    const int64_t lo = t * TB > j0 ? t * TB : j0, hi = (t + 1) * TB < j1 ? (t + 1) * TB : j1;
    if (lo >= hi) return;
    const int64_t slot = t * TB / BS, pb = S + slot * BS;         /* the block, and the position of its row 0 */
    /* (block, head): a field's blocks lie sb[f] bytes apart (pools of their own, or fields of an engine's pages),
     * each [H, rows, ...] */
    const int64_t blk = a->table[b * a->mb + slot];
    if (which == 0) {
        const src_t src = {a->k + b * a->ks_b + h * a->ks_h, a->ks_t, a->k_res + bh * a->ws * ROW, L};
        flush_range(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SFMT, &src, S + lo, S + hi, pb,
                    a->k_codes + blk * a->sb[0] + h * BS * K_RB,
                    K_SFMT == 3 ? a->k_scale : a->k_scale + blk * a->sb[1] + h * K_NSCALE * K_SBYTES,
                    a->k_zero + (K_FMT == 1 ? blk * a->sb[2] + h * K_NSCALE * K_SBYTES : 0));
    } else {
        const src_t src = {a->v + b * a->vs_b + h * a->vs_h, a->vs_t, a->v_res + bh * a->ws * ROW, L};
        flush_range(V_FMT, V_BITS, V_AXIS, V_GROUP, V_SFMT, &src, S + lo, S + hi, pb,
                    a->v_codes + blk * a->sb[3] + h * BS * V_RB,
                    V_SFMT == 3 ? a->v_scale : a->v_scale + blk * a->sb[4] + h * V_NSCALE * V_SBYTES,
                    a->v_zero + (V_FMT == 1 ? blk * a->sb[5] + h * V_NSCALE * V_SBYTES : 0));
    }
}

/* Copy task of one (sequence, head): the chunk's sinks, and its newcomers that stay in full precision. */
static void copy_task(const call_t *a, int64_t bh) {
    const int64_t b = bh / H, h = bh % H, L = a->Ls[b], L2 = L + a->ns[b];
    const char *kx = a->k + b * a->ks_b + h * a->ks_h, *vx = a->v + b * a->vs_b + h * a->vs_h;
    for (int64_t p = L; p < L2 && p < S; p++) {
        memcpy(a->k_sink + (bh * a->ss + p) * ROW, kx + (p - L) * a->ks_t, ROW);
        memcpy(a->v_sink + (bh * a->ss + p) * ROW, vx + (p - L) * a->vs_t, ROW);
    }
    int64_t p = L > S ? L : S;
    const int64_t q1 = boundary(L2);
    for (p = p > q1 ? p : q1; p < L2; p++) {
        memcpy(a->k_res + (bh * a->ws + p % W) * ROW, kx + (p - L) * a->ks_t, ROW);
        memcpy(a->v_res + (bh * a->ws + p % W) * ROW, vx + (p - L) * a->vs_t, ROW);
    }
}

#define B_STACK 64

/* Append k, v [B, H, n, D] (model dtype, unit stride along D; strides in elements) to the store.
 * n_new: int32 [B] tokens each row appends, or NULL for n. table: int32 [B, mb] each row's block ids (-1:
 * none), naming blocks of a pool of nb. pool_sb: int64 [6] bytes from one block to the next in k_codes,
 * k_scale, k_zero, v_codes, v_scale, v_zero (each block's part of a field is [H, rows, ...], dense). Returns 0; or -1 - b when n_new[b] is not in [0, n]; or 1 + b when
 * a block row b would write is not reserved (a table entry < 0, or past the table's mb columns); or
 * 1 + B + b when one names no block of the pool (>= nb). Nothing is written unless it returns 0.
 * ws, ss: the ring slots and sink rows allocated per (sequence, head) -- k_res is [B, H, ws, D], k_sink
 * [B, H, ss, D]: a store grows them as its sequences do (at most W and S), and every slot p % W and sink p the
 * call writes is below them. */
int64_t kvc_store(
        const void *k, const void *v, int64_t ks_b, int64_t ks_h, int64_t ks_t, int64_t vs_b, int64_t vs_h,
        int64_t vs_t,
        uint8_t *k_codes, void *k_scale, void *k_zero, uint8_t *v_codes, void *v_scale, void *v_zero,
        void *k_res, void *v_res, void *k_sink, void *v_sink, int32_t *lengths, const int32_t *table,
        const int32_t *n_new, int64_t B, int64_t n, int64_t mb, int64_t nb, int64_t nthreads,
        const int64_t *pool_sb, int64_t ws, int64_t ss) {
    int64_t stack[2 * B_STACK];
    int64_t *Ls = B <= B_STACK ? stack : (int64_t *)malloc(sizeof(int64_t) * 2 * B), *ns = Ls + B;
    int64_t rc = 0;
    for (int64_t b = 0; b < B && !rc; b++) {
        Ls[b] = lengths[b];
        ns[b] = n_new ? n_new[b] : n;
        if (ns[b] < 0 || ns[b] > n) rc = -1 - b;
    }
    for (int64_t b = 0; b < B && !rc; b++) { /* the blocks the flush writes: slots [j0 / BS, ceil(j1 / BS)) */
        const int64_t j0 = boundary(Ls[b]) - S, j1 = boundary(Ls[b] + ns[b]) - S;
        for (int64_t slot = j0 / BS; j1 > j0 && slot < (j1 + BS - 1) / BS && !rc; slot++) {
            if (slot >= mb || table[b * mb + slot] < 0) rc = 1 + b;
            else if (table[b * mb + slot] >= nb) rc = 1 + B + b;
        }
    }
    if (!rc) {
        int64_t nblk = 0, work = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t j0 = boundary(Ls[b]) - S, j1 = boundary(Ls[b] + ns[b]) - S;
            const int64_t pieces = j1 > j0 ? (j1 + TB - 1) / TB - j0 / TB : 0;
            nblk = pieces > nblk ? pieces : nblk;
            work += (j1 - j0) + ns[b];
        }
        const call_t a = {(const char *)k, (const char *)v, ks_b * ESZ, ks_h * ESZ, ks_t * ESZ, vs_b * ESZ,
                          vs_h * ESZ, vs_t * ESZ, k_codes, v_codes, (char *)k_scale, (char *)k_zero,
                          (char *)v_scale, (char *)v_zero, (char *)k_res, (char *)v_res, (char *)k_sink,
                          (char *)v_sink, Ls, ns, table, mb, nblk, pool_sb, ws, ss};
        const int64_t ntask = B * H * 2 * nblk;
        if (nthreads > 1 && work * H * D >= 16384) {
#pragma omp parallel num_threads(nthreads)
            {
#pragma omp for schedule(dynamic, 1)
                for (int64_t task = 0; task < ntask; task++) flush_task(&a, task);
                /* implicit barrier: every flush has read the ring before any newcomer overwrites it */
#pragma omp for schedule(static)
                for (int64_t bh = 0; bh < B * H; bh++) copy_task(&a, bh);
            }
        } else { /* a decode step is too small to share: no OpenMP region at all */
            for (int64_t task = 0; task < ntask; task++) flush_task(&a, task);
            for (int64_t bh = 0; bh < B * H; bh++) copy_task(&a, bh);
        }
        for (int64_t b = 0; b < B; b++) lengths[b] = (int32_t)(Ls[b] + ns[b]);
    }
    if (Ls != stack) free(Ls);
    return rc;
}

/* The numerics helpers, element-wise, for exhaustive tests: fp16 directed rounding (up: 1, down: 0) and the
 * fp8 encoding (e4m3: 1, e5m2: 0). */
void kvc_round_f16(const float *x, uint16_t *out, int64_t N, int64_t up) {
    for (int64_t i = 0; i < N; i++) out[i] = f16_directed(x[i], (int)up);
}

void kvc_fp8_encode(const float *x, uint8_t *out, int64_t N, int64_t e4m3) {
    for (int64_t i = 0; i < N; i++) out[i] = fp8_encode(x[i], (int)e4m3);
}
