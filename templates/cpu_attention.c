/* kvcompile CPU decode attention over the packed KV store: a C template, specialized per store layout.
 *
 * templates/cpu.py compiles this file once per layout with -D definitions (below) and calls
 * kvc_attention through ctypes. The semantics are exactly those of kvcompile.store.attention_reference:
 * the n newest tokens' queries (already rotated when the policy rotates) attend to positions [0, L) of
 * their sequence, causally (or as an additive mask says: -inf hides a position), with the reference's rule
 * for non-finite values (a visible non-finite score makes the row NaN; a visible non-finite value makes its
 * channel NaN; hidden positions are never read; any non-finite output is NaN), over three regions found
 * from L alone (the
 * chunk of the n queries' own tokens, positions [L - n, L), is read from k_new/v_new when given):
 *
 *     p < S            sink      model dtype   k_sink[b, h, p]
 *     S <= p < Q(L)    packed    codes         k_codes[table[b, j / BS], h, j % BS] (j = p - S), scales by group
 *     Q(L) <= p < L    residual  model dtype   k_res[b, h, p % W], or a flat [N, H, D] by a map (res_map)
 *
 * Work is split flash-decoding style: each (sequence, kv head, split of positions) is one task that walks
 * its positions in tiles of TILE tokens (packed tiles: PT = min(TILE, BS), so that one never straddles two
 * blocks; with BS >= TILE, TILE divides BS). A tile is dequantized once into two small fp32 buffers (they stay
 * in L1) and used by every query row that shares the kv head (GQA ratio x query tokens), with an online
 * softmax; the splits are merged at the end. No full-precision copy of the cache is ever made. A sequence's
 * blocks lie anywhere in the pool, so no hardware prefetcher follows a walk from one block to the next: each
 * packed tile prefetches the same rows of the sequence's next block (one block ahead).
 *
 * kvc_attention_rows takes a prompt's queries as decode rows of their own positions (what the vLLM plugin's pages
 * need: kvcompile/pages.py) with the runs of rows that are one sequence (and share a block table), and
 * dequantizes each packed tile once for up to a group of them; every row gets the bits kvc_attention gives it.
 *
 * Vector code is written with GCC/Clang vector extensions (8 floats; 16 for the products on AVX-512),
 * which compile to AVX2/AVX-512 on x86 and NEON on ARM. Three x86 intrinsics stand where GCC's generic
 * code is poor, each with a generic fallback: FMA for the products, vpmovzxbd to widen code bytes, and
 * vpermps to give each lane its group's scale. Packed tiles are unpacked in "plane" order, the order the bytes
 * unpack in without shuffles: with `per` codes per packed unit (int4: 2, int2: 4, int3: 8 per 3 bytes),
 * channel d = j*per + i sits at i*(D/per) + j. Queries are permuted into the keys' plane order and values
 * accumulate in their own plane order (un-permuted once, at the end); full-precision tiles (sinks and the
 * residual ring) use the natural order with their own accumulator, so they are read without shuffles too.
 *
 * Specialization (all compile-time):
 *   D, S, W, R (residual), FL (flush), BS (packed tokens per block)
 * Nothing depends on the batch, on how many tokens a sequence holds, or on the head counts (H kv heads and G
 * query heads per kv head are arguments: index arithmetic only): one build serves every store of a layout.
 *   MODEL_T  dtype of residual/sink/unquantized codes: 0 fp32, 1 bf16, 2 fp16
 *   K_FMT / V_FMT     0 none (model dtype), 1 int asymmetric, 2 int symmetric, 3 fp8 e4m3, 4 fp8 e5m2
 *   K_BITS / V_BITS   8, 4, 3, 2 (ignored for none)
 *   K_AXIS / V_AXIS   0 token (groups of K_GROUP channels), 1 channel (groups of K_GROUP tokens)
 *   K_GROUP / V_GROUP
 *   K_SFMT / V_SFMT   scales (and zero points) stored as fp16 (0), fp32 (1), or fp8 e4m3 with an int8 zero point (2);
 *                     3: none stored (fp8 with one fixed scale, 1.0: Quant axis="tensor"; AXIS 0, GROUP D), a row
 *                     of NaN codes (0x7F: a poisoned token-head, the only rows that hold that code) reads NaN
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

/* TILE (positions per tile) and ROWS_MAX (query rows per kv head, G * n; more goes to the prefill path)
 * come from templates/cpu.py, like the layout. */
#define NV (D / 8)  /* 8-float vectors per row */

#if D % 8
#error "head_dim must be a multiple of 8"
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef _Float16 f16;

/* The products of attention (scores q.k and the p.v accumulation) run on the widest vectors the CPU has,
 * with fused multiply-adds where it has them: 16 floats on AVX-512, 8 otherwise. The dequantization keeps
 * separate multiplies and adds (the file is compiled with -ffp-contract=off, so nothing is fused unless
 * written as fmaw), which is what makes its values equal the reference's bit for bit. An FMA rounds once
 * where a multiply and an add round twice, so the error bound of the dot products only tightens. */
#if defined(__AVX512F__) && D % 16 == 0
#include <immintrin.h>
#define WV 16
typedef float vw __attribute__((vector_size(64)));
static inline vw fmaw(vw a, vw b, vw c) { return (vw)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif defined(__FMA__)
#include <immintrin.h>
#define WV 8
typedef float vw __attribute__((vector_size(32)));
static inline vw fmaw(vw a, vw b, vw c) { return (vw)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
#define WV 8
typedef float vw __attribute__((vector_size(32)));
static inline vw fmaw(vw a, vw b, vw c) { return a * b + c; }
#endif
#define NW (D / WV)  /* wide vectors per row */
static inline vw ldw(const float *p) { vw v; memcpy(&v, p, sizeof v); return v; }
static inline void stw(float *p, vw v) { memcpy(p, &v, sizeof v); }

static inline v8f ld(const float *p) { v8f v; memcpy(&v, p, 32); return v; }
static inline void st(float *p, v8f v) { memcpy(p, &v, 32); }
static inline v8f bcast(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
#ifdef __AVX2__
#include <immintrin.h>
/* eight bytes widened to eight 32-bit lanes: one vpmovzxbd (GCC 12 turns the generic form below into
 * scalar byte extracts and inserts, which made int8 unpacking slower than int4's) */
static inline v8u ldb(const uint8_t *p) { return (v8u)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#else
static inline v8u ldb(const uint8_t *p) { v8b b; memcpy(&b, p, 8); return __builtin_convertvector(b, v8u); }
#endif
static inline v8f to_f(v8u x) { return __builtin_convertvector((v8i)x, v8f); }

/* A wide vector's lanes summed down to 8 (lane i + lane i+8 on AVX-512). */
static inline v8f fold8(vw a) {
#if WV == 16
    return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return a;
#endif
}

/* Eight vectors -> one vector of their eight horizontal sums (a transpose folded into the additions). */
static inline v8f reduce8(const v8f a[8]) {
    v8f c[4], d[2];
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(d[0], d[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(d[0], d[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float model_at(const void *base, int64_t i) {
#if MODEL_T == 0
    return ((const float *)base)[i];
#elif MODEL_T == 1
    return bf16_to_f32(((const uint16_t *)base)[i]);
#else
    return (float)((const f16 *)base)[i];
#endif
}

/* An fp8 e4m3 scale's value; its NaN code (0x7F, a poisoned group) gives NaN. */
static float e4m3_decode(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e ? __builtin_ldexpf((float)(8 + m), e - 10) : __builtin_ldexpf((float)m, -9);
    return (b & 0x7F) == 0x7F ? __builtin_nanf("") : v;
}

/* ... read from a table of the 256 codes, filled when the library loads (a per-channel key group decodes D of
 * them a tile, and a call to ldexpf each cost as much as the tile's dot products) */
static float e4m3_table[256];
__attribute__((constructor)) static void fill_e4m3_table(void) {
    for (int b = 0; b < 256; b++) e4m3_table[b] = e4m3_decode((uint8_t)b);
}
static inline float e4m3_to_f32(uint8_t b) { return e4m3_table[b]; }

/* A stored scale as fp32: sfmt 0 fp16, 1 fp32, 2 fp8 e4m3. */
static inline float scale_at(const void *base, int64_t i, int sfmt) {
    return sfmt == 1 ? ((const float *)base)[i]
                     : (sfmt == 2 ? e4m3_to_f32(((const uint8_t *)base)[i]) : (float)((const f16 *)base)[i]);
}

/* A per-token scale as fp32: scale_at, or with no scale stored (sfmt 3) 1.0 -- NaN for a poisoned row, whose
 * codes are all the NaN code (finite values never encode to it: the store saturates them), so one byte says. */
static inline float row_scale(const void *base, int64_t i, int sfmt, const uint8_t *row) {
    return sfmt == 3 ? ((row[0] & 0x7F) == 0x7F ? __builtin_nanf("") : 1.0f) : scale_at(base, i, sfmt);
}

/* A stored zero point as the value it adds (x^ = code * s + z): stored as the scale is, or with fp8 scales an
 * int8 count z of steps s (x^ = (code - z) * s; code * s - z * s is exact in fp32, the same bits). */
static inline float zero_at(const void *base, int64_t i, int sfmt, float s) {
    return sfmt == 2 ? -(float)((const int8_t *)base)[i] * s : scale_at(base, i, sfmt);
}

/* exp(x) for x <= 0 (scores minus their running max), vectorizable; exactly 0 below -87 (and for -inf),
 * so a masked position weighs nothing. x is never NaN or +inf: scores are finite or -inf (a non-finite
 * visible score is replaced by -inf after it has made the row NaN), and a row with nothing visible skips
 * the tile.
 * Relative error below 2e-7 (2**-22): range reduction by ln 2 with a two-part constant, then the degree-7
 * Taylor polynomial of e^r for |r| <= ln2/2 (truncation below 1e-8). */
static inline float kexp(float x) {
    const int hidden = x < -87.0f;
    x = hidden ? -87.0f : x;
    float k = __builtin_roundevenf(x * 1.44269504088896341f);
    float r = x - k * 0.693145751953125f;
    r = r - k * 1.428606765330187045e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &e, 4);
    return hidden ? 0.0f : p * two_k;
}

/* kexp on eight lanes, with the same operations (so the same results): round-to-nearest-even of x*log2(e)
 * by adding and subtracting 1.5 * 2**23 (exact for |x*log2(e)| < 2**22), and the hidden lanes cleared. */
static inline v8f kexp8(v8f x) {
    const v8i hidden = x < bcast(-87.0f);
    x = (v8f)(((v8i)x & ~hidden) | ((v8i)bcast(-87.0f) & hidden));
    const v8f k = (x * bcast(1.44269504088896341f) + bcast(12582912.0f)) - bcast(12582912.0f);
    v8f r = x - k * bcast(0.693145751953125f);
    r = r - k * bcast(1.428606765330187045e-06f);
    v8f p = bcast(1.0f / 5040.0f);
    p = p * r + bcast(1.0f / 720.0f);
    p = p * r + bcast(1.0f / 120.0f);
    p = p * r + bcast(1.0f / 24.0f);
    p = p * r + bcast(1.0f / 6.0f);
    p = p * r + bcast(0.5f);
    p = p * r + bcast(1.0f);
    p = p * r + bcast(1.0f);
    const v8i e = (__builtin_convertvector(k, v8i) + 127) << 23;
    return (v8f)((v8i)(p * (v8f)e) & ~hidden);
}

static inline int plane_channel(int idx, int per) { /* the channel sitting at plane-order index idx */
    return (idx % (D / per)) * per + idx / (D / per);
}

/* fp8 bytes -> floats by integer arithmetic (no table, no dependence on denormal modes for normals). */
static inline v8f fp8_decode(v8u w, int e5m2) {
    const v8u sign = (w & 0x80u) << 24;
    v8u e, m;
    v8f sub, mag;
    if (e5m2) {
        e = (w >> 2) & 31u;
        m = w & 3u;
        sub = to_f(m) * bcast(1.0f / 65536.0f);                    /* m * 2^-16 */
        mag = (v8f)(((e + 112u) << 23) | (m << 21));
    } else {
        e = (w >> 3) & 15u;
        m = w & 7u;
        sub = to_f(m) * bcast(1.0f / 512.0f);                      /* m * 2^-9 */
        mag = (v8f)(((e + 120u) << 23) | (m << 20));
    }
    const v8i is_sub = (v8i)(e == 0u);
    v8u bits = (v8u)((is_sub & (v8i)sub) | (~is_sub & (v8i)mag));
    return (v8f)(bits | sign);
}

#ifdef __F16C__
/* fp8 bytes -> floats through the CPU's fp16 conversion, exactly, subnormals included (the test runs it with
 * denormals flushed too): an e5m2 byte is the high byte of an fp16 of the same value, and e4m3's sign and
 * magnitude bits placed where an fp16 has them give its value over FP8_UNIT(3) = 2**8 (bias 7 against 15).
 * The kernel multiplies that factor back into the scale instead of into each value: s * 2**8 is exact for any
 * fp8 scale (at most 2**120: the largest float over 448), so x * (s * 2**8) is the reference's single rounding
 * of (x * 2**8) * s. Seven vector operations per sixteen codes where the integer decode above takes thirty.
 * (Only finite codes are ever stored: a group holding NaN or inf stores a NaN scale, which makes every
 * element NaN in the product, and codes 0.) */
typedef uint16_t v8h __attribute__((vector_size(16)));
static inline v8f fp8_decode_h(const uint8_t *p, int e5m2) {
    const v8h w = (v8h)_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const v8h h = e5m2 ? w << 8 : ((w << 7) & 0x3F80) | ((w << 8) & 0x8000);
    return (v8f)_mm256_cvtph_ps((__m128i)h);
}
#ifdef __AVX2__
/* the same on sixteen codes: the integer steps run once on sixteen 16-bit lanes */
typedef uint16_t v16h __attribute__((vector_size(32)));
static inline void fp8_decode_h16(const uint8_t *p, int e5m2, float *out) {
    const v16h w = (v16h)_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const v16h h = e5m2 ? w << 8 : ((w << 7) & 0x3F80) | ((w << 8) & 0x8000);
    st(out, (v8f)_mm256_cvtph_ps(_mm256_castsi256_si128((__m256i)h)));
    st(out + 8, (v8f)_mm256_cvtph_ps(_mm256_extracti128_si256((__m256i)h, 1)));
}
#endif
#define FP8_UNIT(fmt) ((fmt) == 3 ? 256.0f : 1.0f)
#else
#define FP8_UNIT(fmt) 1.0f
#endif

/* One packed row (one token of one head) -> codes in plane order (nat: natural order), as floats with the
 * symmetric offset removed (fp8: the decoded value over FP8_UNIT). */
static inline __attribute__((always_inline)) void unpack_row(int fmt, int bits, const uint8_t *row, float *out,
                                                             int nat) {
    const float off = fmt == 2 ? (float)(1 << (bits - 1)) : 0.0f;
    const int per = bits == 8 ? 1 : (bits == 3 ? 8 : 8 / bits);
    if (nat && fmt < 3 && (bits == 2 || bits == 3 || bits == 4)) {
        /* natural order (pre-RoPE keys, rotated in natural order): code d sits at bit bits*d of the row's
         * little-endian bit stream (int3's 3-byte units too), so channels 8k .. 8k+7 are the `bits` bytes from
         * row + k*bits, one word broadcast to eight lanes and shifted per lane */
        const v8u sh = (v8u){0, 1, 2, 3, 4, 5, 6, 7} * (uint32_t)bits;
        const uint32_t mask = (1u << bits) - 1;
        for (int k = 0; k < NV; k++) {
            uint32_t w = 0;
            for (int y = 0; y < bits; y++) w |= (uint32_t)row[k * bits + y] << (8 * y);
            st(out + 8 * k, to_f((((v8u){} + w) >> sh) & mask) - off);
        }
    } else if (fmt >= 3) {
#ifdef __F16C__
#ifdef __AVX2__
        if (D % 16 == 0)
            for (int k = 0; k < D; k += 16) fp8_decode_h16(row + k, fmt == 4, out + k);
        else
#endif
            for (int k = 0; k < NV; k++) st(out + 8 * k, fp8_decode_h(row + 8 * k, fmt == 4));
#else
        for (int k = 0; k < NV; k++) st(out + 8 * k, fp8_decode(ldb(row + 8 * k), fmt == 4));
#endif
    } else if (bits == 8) {
        for (int k = 0; k < NV; k++) st(out + 8 * k, to_f(ldb(row + 8 * k)) - off);
    } else if (bits == 4 && D % 16 == 0) {
        for (int k = 0; k < D / 16; k++) {
            const v8u b = ldb(row + 8 * k);
            st(out + 8 * k, to_f(b & 15u) - off);
            st(out + D / 2 + 8 * k, to_f(b >> 4) - off);
        }
    } else if (bits == 2 && D % 32 == 0) {
        for (int k = 0; k < D / 32; k++) {
            const v8u b = ldb(row + 8 * k);
            for (int i = 0; i < 4; i++) st(out + i * (D / 4) + 8 * k, to_f((b >> (2 * i)) & 3u) - off);
        }
    } else if (bits == 3 && D % 64 == 0) { /* eight 3-byte units at a time, one plane per shift */
        for (int j0 = 0; j0 < D / 8; j0 += 8) {
            uint32_t w[8];
            for (int l = 0; l < 8; l++) {
                const uint8_t *u = row + 3 * (j0 + l);
                w[l] = (uint32_t)u[0] | (uint32_t)u[1] << 8 | (uint32_t)u[2] << 16;
            }
            v8u words;
            memcpy(&words, w, 32);
            for (int i = 0; i < 8; i++) st(out + i * (D / 8) + j0, to_f((words >> (3 * i)) & 7u) - off);
        }
    } else { /* any width: unit j holds codes j*per .. j*per + per - 1 in per*bits/8 little-endian bytes */
        const int nb = per * bits / 8;
        for (int j = 0; j < D / per; j++) {
            uint32_t w = 0;
            for (int y = 0; y < nb; y++) w |= (uint32_t)row[nb * j + y] << (8 * y);
            for (int i = 0; i < per; i++)
                out[nat ? j * per + i : i * (D / per) + j] = (float)((w >> (bits * i)) & ((1u << bits) - 1)) - off;
        }
    }
}

/* codes * scale (+ zero point: asymmetric codes only, as in the reference) */
static inline v8f affine(int fmt, v8f x, v8f s, v8f z) { return fmt == 1 ? x * s + z : x * s; }

/* Pre-RoPE keys (kvcompile.store.apply_rope): each dequantized key row is rotated by its position's cos/sin,
 * out[d] = k[d] * cos[r][d] + k[perm[d]] * sin[r][d] in natural channel order (perm: d's partner; sin carries the
 * form's sign), r = p + off clamped to [0, T): two roundings and a rounded sum (no fma: -ffp-contract=off), as
 * torch. rope_form finds the two forms whose partners lie a fixed distance away, so that the rotation runs on
 * contiguous vectors: "half" (transformers' rotate_half, over the first 2*hr channels: partner d +- hr) and
 * "pairs" (gpt-fast, over the first rd channels: partner d ^ 1); past the rotary channels the partner is the
 * channel itself (cos 1, sin 0: the same formula). Any other permutation takes the indexed loop. */
enum { ROPE_ANY = 0, ROPE_HALF = 1, ROPE_PAIRS = 2 };

/* The form of perm [D] (ROPE_*) and its span: hr for "half", rd for "pairs", 0 for any other. */
static int rope_form(const int32_t *perm, int *span) {
    int hr = perm[0], ok = hr > 0 && 2 * hr <= D;
    for (int d = 0; ok && d < D; d++) ok = perm[d] == (d < hr ? d + hr : d < 2 * hr ? d - hr : d);
    if (ok) {
        *span = hr;
        return ROPE_HALF;
    }
    int rd = 0;
    while (rd + 1 < D && perm[rd] == rd + 1 && perm[rd + 1] == rd) rd += 2;
    ok = rd > 0;
    for (int d = rd; ok && d < D; d++) ok = perm[d] == d;
    *span = ok ? rd : 0;
    return ok ? ROPE_PAIRS : ROPE_ANY;
}

/* One key row k [D] (natural order) rotated into o [D] with the cos/sin rows c, s: in place (o == k) for the two
 * forms' vector paths (each step reads both channels of its pairs before it writes them), not the indexed loop. */
static inline __attribute__((always_inline)) void rope_row(const float *k, const float *c, const float *s, float *o,
                                                           int form, int span, const int32_t *perm) {
    if (form == ROPE_HALF && span == D / 2 && (D / 2) % WV == 0) { /* the whole head: the widest vectors */
        for (int d = 0; d < D / 2; d += WV) {
            const vw a = ldw(k + d), b = ldw(k + d + D / 2);
            stw(o + d, a * ldw(c + d) + b * ldw(s + d));
            stw(o + d + D / 2, b * ldw(c + d + D / 2) + a * ldw(s + d + D / 2));
        }
    } else if (form == ROPE_HALF && span % 8 == 0) {
        const int hr = span;
        for (int d = 0; d < hr; d += 8) {
            const v8f a = ld(k + d), b = ld(k + d + hr);
            st(o + d, a * ld(c + d) + b * ld(s + d));
            st(o + d + hr, b * ld(c + d + hr) + a * ld(s + d + hr));
        }
        for (int d = 2 * hr; d < D; d += 8) {
            const v8f a = ld(k + d);
            st(o + d, a * ld(c + d) + a * ld(s + d));
        }
    } else if (form == ROPE_PAIRS && span % 8 == 0) {
        for (int d = 0; d < span; d += 8) {
            const v8f a = ld(k + d), b = __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6);
            st(o + d, a * ld(c + d) + b * ld(s + d));
        }
        for (int d = span; d < D; d += 8) {
            const v8f a = ld(k + d);
            st(o + d, a * ld(c + d) + a * ld(s + d));
        }
    } else {
        for (int d = 0; d < D; d++) o[d] = k[d] * c[d] + k[perm[d]] * s[d];
    }
}

/* The compact table (kvc_rope_compact). Where a table's rows repeat themselves as the two forms' do, bit for bit --
 * "half": cos[r][d + hr] == cos[r][d] and sin[r][d + hr] == -sin[r][d], d < hr; "pairs": the same for d + 1, d
 * even; past the rotary channels cos 1 and sin +0 -- row r is all in cc[r * rd .. (r + 1) * rd): cos, then sin, of
 * the first channel of each pair (rd: the rotary channels), half the bytes of its cos and sin rows, contiguous. The
 * kernel reads the rows r < Tc there (Tc: the rows checked so, from row 0), the others in the full table. The second
 * channel of a pair gets k * c + k' * (-s), -s being exactly its table entry: the same products and sum. */
static int rope_compact_width(int form, int span) { /* rd, or 0 when the form has no compact rotation */
    if (form == ROPE_HALF && span % 8 == 0) return 2 * span;
    if (form == ROPE_PAIRS && span % 8 == 0) return span;
    return 0;
}

typedef float v4f __attribute__((vector_size(16)));
static inline v4f ld4(const float *p) { v4f v; memcpy(&v, p, 16); return v; }

/* One key row k [D] (natural order) rotated into o [D] (o == k allowed) with the compact row cc (rd =
 * rope_compact_width). */
static inline __attribute__((always_inline)) void rope_row_compact(const float *k, const float *cc, float *o,
                                                                   int form, int span) {
    int rd;
    if (form == ROPE_HALF && span == D / 2 && (D / 2) % WV == 0) { /* the whole head: the widest vectors */
        for (int d = 0; d < D / 2; d += WV) {
            const vw a = ldw(k + d), b = ldw(k + d + D / 2), c = ldw(cc + d), s = ldw(cc + D / 2 + d);
            stw(o + d, a * c + b * s);
            stw(o + d + D / 2, b * c + a * (-s));
        }
        return;
    } else if (form == ROPE_HALF) {
        const int hr = span;
        rd = 2 * hr;
        for (int d = 0; d < hr; d += 8) {
            const v8f a = ld(k + d), b = ld(k + d + hr), c = ld(cc + d), s = ld(cc + hr + d);
            st(o + d, a * c + b * s);
            st(o + d + hr, b * c + a * (-s));
        }
    } else {
        rd = span;
        const v8u odd = {0, 0x80000000u, 0, 0x80000000u, 0, 0x80000000u, 0, 0x80000000u};
        for (int d = 0; d < rd; d += 8) {
            const v4f c4 = ld4(cc + d / 2), s4 = ld4(cc + rd / 2 + d / 2);
            const v8f c = __builtin_shufflevector(c4, c4, 0, 0, 1, 1, 2, 2, 3, 3);
            const v8f s = (v8f)((v8u)__builtin_shufflevector(s4, s4, 0, 0, 1, 1, 2, 2, 3, 3) ^ odd);
            const v8f a = ld(k + d), b = __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6);
            st(o + d, a * c + b * s);
        }
    }
    for (int d = rd; d < D; d += 8) { /* past the rotary channels: cos 1, sin +0, as in the table */
        const v8f a = ld(k + d);
        st(o + d, a * bcast(1.0f) + a * bcast(0.0f));
    }
}

/* One sequence's rotation, as kvc_attention receives it: the full table cs, sn [T, D] with the partners perm, their
 * form and span, the compact table cc of the rows below Tc (rd floats a row; Tc 0: none), the sequence's offset. */
typedef struct {
    const float *cs, *sn, *cc;
    const int32_t *perm;
    int64_t T, Tc, off;
    int form, span, rd;
} rope_t;

/* The rotation of the tables cs, sn [T, D] with the partners perm, and the compact table cc of Tc rows (NULL, 0:
 * none; not used where the form has no compact width), for a sequence of offset off. */
static rope_t rope_init(const float *cs, const float *sn, const float *cc, const int32_t *perm, int64_t T,
                        int64_t Tc, int64_t off) {
    rope_t rp = {cs, sn, cc, perm, T, 0, off, ROPE_ANY, 0, 0};
    rp.form = rope_form(perm, &rp.span);
    rp.rd = rope_compact_width(rp.form, rp.span);
    rp.Tc = cc && rp.rd ? Tc : 0; /* rows read from the compact table */
    return rp;
}

/* The key row k of position p rotated into o (o == k: in place, for the forms with a compact width rd) from its
 * table row r = p + off clamped to [0, T): the compact row below Tc, else the full one. */
static inline __attribute__((always_inline)) void rope_at(const rope_t *rp, int64_t p, const float *k, float *o) {
    int64_t r = p + rp->off;
    r = r < 0 ? 0 : (r > rp->T - 1 ? rp->T - 1 : r);
    if (r < rp->Tc)
        rope_row_compact(k, rp->cc + r * rp->rd, o, rp->form, rp->span);
    else
        rope_row(k, rp->cs + r * D, rp->sn + r * D, o, rp->form, rp->span, rp->perm);
}

/* Prefetch the full-table cos/sin rows of the TILE positions after the tile that starts at p0 (the compact rows are
 * contiguous: the hardware prefetcher follows them, and prefetching them too measured no faster). */
static inline void prefetch_rope(const rope_t *rp, int64_t p0) {
    int64_t r0 = p0 + TILE + rp->off, r1 = r0 + TILE;
    r0 = r0 < rp->Tc ? rp->Tc : (r0 > rp->T ? rp->T : r0);
    r1 = r1 < 0 ? 0 : (r1 > rp->T ? rp->T : r1);
    for (int64_t o = r0 * D; o < r1 * D; o += 16) {
        __builtin_prefetch(rp->cs + o, 0, 3);
        __builtin_prefetch(rp->sn + o, 0, 3);
    }
}

/* A tile of nt key rows kt (natural order) at positions p0 .. rotated into out (natural order). */
static inline __attribute__((always_inline)) void rope_tile(const rope_t *rp, const float *kt, float *out, int nt,
                                                            int64_t p0) {
    for (int t = 0; t < nt; t++) rope_at(rp, p0 + t, kt + t * D, out + t * D);
}

/* Rows [q0, q0 + nt) of int2/int4 codes (fmt 1 or 2) in natural order (pre-RoPE keys), unpacked and scaled in one
 * pass on the widest vectors: channels WV*k .. WV*k + WV-1 lie in one or two aligned 32-bit words of a row of whole
 * words (code d at bit bits*d), broadcast to the lanes and shifted per lane; then code * scale (+ zero point), the
 * same operations as unpack_row and the affine step below. Scales per channel (axis 1), or per token in groups of a
 * multiple of WV channels. rp (or NULL): each row is rotated right after, as the positions p0 .. of rope_at. */
typedef uint32_t vwu __attribute__((vector_size(WV * 4)));
typedef int32_t vwi __attribute__((vector_size(WV * 4)));
#define NAT_WIDE(fmt, bits, axis, group) \
    (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ && ((fmt) == 1 || (fmt) == 2) && ((bits) == 2 || (bits) == 4) && \
     (D * (bits)) % 32 == 0 && D % WV == 0 && ((axis) == 1 || (group) % WV == 0))
static inline __attribute__((always_inline)) void dequant_nat_wide(
        int fmt, int bits, int axis, int group, int sfmt,
        const uint8_t *codes, const void *scale, const void *zero, int64_t q0, int nt, float *out, const rope_t *rp,
        int64_t p0) {
    const int row_bytes = D * bits / 8, per_word = 32 / bits; /* codes per word */
    const uint32_t mask = (1u << bits) - 1;
    const vw off = (vw){} + (fmt == 2 ? (float)(1 << (bits - 1)) : 0.0f);
    vwu sh, hi; /* per lane: its code's shift within its word; all ones where that word is the second */
    for (int l = 0; l < WV; l++) {
        sh[l] = (uint32_t)((l % per_word) * bits);
        hi[l] = l >= per_word ? ~0u : 0u;
    }
    float sv[D], zv[D];
    int64_t cur = -1;
    /* the common case, the whole head in the "half" form with every row of the tile in the compact table: rotated
     * from registers, row t with the compact row hc + t * D */
    const float *hc = rp && rp->form == ROPE_HALF && rp->span == D / 2 && (D / 2) % WV == 0 && p0 + rp->off >= 0 &&
                      p0 + nt - 1 + rp->off < rp->Tc ? rp->cc + (p0 + rp->off) * D : NULL;
    for (int t = 0; t < nt; t++) {
        const int64_t qi = q0 + t;
        const uint8_t *row = codes + qi * row_bytes;
        float *o = out + t * D;
        vw kv[NW];
        if (axis == 1 && qi / group != cur) {
            cur = qi / group;
            for (int d = 0; d < D; d++) {
                sv[d] = scale_at(scale, cur * D + d, sfmt);
                zv[d] = fmt == 1 ? zero_at(zero, cur * D + d, sfmt, sv[d]) : 0.0f;
            }
        }
        for (int k = 0; k < NW; k++) {
            const int bit0 = WV * k * bits; /* the vector's first code; WV * bits is 16, 32 or 64 bits */
            uint32_t w[2];
            memcpy(w, row + (bit0 / 32) * 4, WV * bits > 32 ? 8 : 4);
            vwu x = (vwu){} + w[0];
            if (WV * bits > 32) x = (x & ~hi) | (((vwu){} + w[1]) & hi);
            const vw c = __builtin_convertvector((vwi)((x >> (sh + (uint32_t)(bit0 % 32))) & mask), vw) - off;
            vw sk, zk;
            if (axis == 1) {
                sk = ldw(sv + WV * k);
                zk = ldw(zv + WV * k);
            } else {
                const int64_t gi = qi * (D / group) + (WV * k) / group;
                const float s1 = scale_at(scale, gi, sfmt);
                sk = (vw){} + s1;
                zk = (vw){} + (fmt == 1 ? zero_at(zero, gi, sfmt, s1) : 0.0f);
            }
            kv[k] = fmt == 1 ? c * sk + zk : c * sk;
        }
        if (hc) { /* rope_row_compact's first case */
            for (int k = 0; k < NW / 2; k++) {
                const vw a = kv[k], b = kv[k + NW / 2];
                const vw c = ldw(hc + t * D + WV * k), s = ldw(hc + t * D + D / 2 + WV * k);
                stw(o + WV * k, a * c + b * s);
                stw(o + D / 2 + WV * k, b * c + a * (-s));
            }
        } else {
            for (int k = 0; k < NW; k++) stw(o + WV * k, kv[k]);
            if (rp) rope_at(rp, p0 + t, o, o); /* rotated in place while the row is in L1 (rp->rd != 0) */
        }
    }
}

/* Dequantize rows [q0, q0 + nt) of one block of one head into out[nt][D], plane order (nat: natural order).
 * codes/scale/zero point at that (block, head)'s first row. */
static inline __attribute__((always_inline)) void dequant_packed(
        int fmt, int bits, int axis, int group, int sfmt,
        const uint8_t *codes, const void *scale, const void *zero, int64_t q0, int nt, float *out, int nat) {
    if (fmt == 0) { /* unquantized: model dtype [BS, D], natural order */
        for (int t = 0; t < nt; t++)
            for (int d = 0; d < D; d++) out[t * D + d] = model_at(codes, (q0 + t) * D + d);
        return;
    }
    if (nat && NAT_WIDE(fmt, bits, axis, group)) {
        dequant_nat_wide(fmt, bits, axis, group, sfmt, codes, scale, zero, q0, nt, out, NULL, 0);
        return;
    }
    const int row_bytes = D * bits / 8;
    const int per = nat || bits == 8 ? 1 : (bits == 3 ? 8 : 8 / bits); /* the order's planes (1: natural) */
    const int run = axis == 0 ? group / per : 0; /* plane-order run of channels sharing a per-token scale */
    const float unit = FP8_UNIT(fmt); /* fp8's decode factor, folded into the scale */
    float sv[D], zv[D];
    int64_t cur = -1;
    int lane_group[D]; /* per token: the group of the channel at each plane-order index */
    for (int idx = 0; idx < D; idx++) lane_group[idx] = axis == 0 ? plane_channel(idx, per) / group : 0;
    for (int t = 0; t < nt; t++) {
        const int64_t qi = q0 + t;
        float *o = out + t * D;
        unpack_row(fmt, bits, codes + qi * row_bytes, o, nat);
        if (axis == 1) { /* per channel: one scale vector per group of tokens */
            const int64_t g = qi / group;
            if (g != cur) {
                cur = g;
                for (int idx = 0; idx < D; idx++) {
                    const int c = plane_channel(idx, per);
                    const float s1 = scale_at(scale, g * D + c, sfmt);
                    sv[idx] = s1 * unit;
                    zv[idx] = fmt == 1 ? zero_at(zero, g * D + c, sfmt, s1) : 0.0f;
                }
            }
            for (int k = 0; k < NV; k++) st(o + 8 * k, affine(fmt, ld(o + 8 * k), ld(sv + 8 * k), ld(zv + 8 * k)));
        } else if (run >= 8 && run % 8 == 0 && (D / per) % 8 == 0) { /* per token: each 8-vector lies inside one group */
            const int ng = D / group; /* at most D / 8 groups: each scale and zero point is converted once */
            float sg[D / 8], zg[D / 8];
            for (int gi = 0; gi < ng; gi++) {
                const float s1 = row_scale(scale, qi * ng + gi, sfmt, codes + qi * row_bytes);
                sg[gi] = s1 * unit;
                zg[gi] = fmt == 1 ? zero_at(zero, qi * ng + gi, sfmt, s1) : 0.0f;
            }
            for (int k = 0; k < NV; k++) {
                const int gi = ((k % (NV / per)) * 8) / run;
                st(o + 8 * k, affine(fmt, ld(o + 8 * k), bcast(sg[gi]), bcast(zg[gi])));
            }
#ifdef __AVX2__
        } else if (D / group <= 8) { /* per token, several groups per vector: each lane picks its group's scale */
            const int ng = D / group;
            float sg[8] = {0}, zg[8] = {0};
            for (int gi = 0; gi < ng; gi++) {
                const float s1 = row_scale(scale, qi * ng + gi, sfmt, codes + qi * row_bytes);
                sg[gi] = s1 * unit;
                zg[gi] = fmt == 1 ? zero_at(zero, qi * ng + gi, sfmt, s1) : 0.0f;
            }
            const __m256 sgv = _mm256_loadu_ps(sg), zgv = _mm256_loadu_ps(zg);
            for (int k = 0; k < NV; k++) {
                const __m256i gidx = _mm256_loadu_si256((const __m256i *)(lane_group + 8 * k));
                const v8f sk = (v8f)_mm256_permutevar8x32_ps(sgv, gidx), zk = (v8f)_mm256_permutevar8x32_ps(zgv, gidx);
                st(o + 8 * k, affine(fmt, ld(o + 8 * k), sk, zk));
            }
#endif
        } else { /* per token, groups narrower than a vector of a plane */
            const int ng = D / group;
            for (int idx = 0; idx < D; idx++) {
                const int gi = plane_channel(idx, per) / group;
                const float s1 = row_scale(scale, qi * ng + gi, sfmt, codes + qi * row_bytes), s = s1 * unit;
                const float z = fmt == 1 ? zero_at(zero, qi * ng + gi, sfmt, s1) : 0.0f;
                o[idx] = fmt == 1 ? o[idx] * s + z : o[idx] * s;
            }
        }
    }
}

/* Full-precision rows (sink or ring slots) into out[nt][D], natural order. */
static inline void gather_model(const void *base, const int64_t *rows, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
#if MODEL_T == 0
        memcpy(out + t * D, (const float *)base + rows[t] * D, D * 4);
#else
        for (int d = 0; d < D; d++) out[t * D + d] = model_at(base, rows[t] * D + d);
#endif
    }
}

/* The D-element rows (gather_model's) of full-precision positions p0 .. p0 + nt - 1 of kv head h: in its ring,
 * whose first row is ring0 (slot p % W), or, with a map m (the kernels' res_map), in a flat [n, H, D], position p
 * at row p < m[2] ? m[0] + p : m[1] + p. Returns 1 at a row outside it. */
static inline int residual_rows(const int64_t *m, int64_t n, int64_t H, int64_t h, int64_t ring0, int64_t p0,
                                int nt, int64_t *rows) {
    for (int t = 0; t < nt; t++) {
        const int64_t p = p0 + t, r = m ? (p < m[2] ? m[0] + p : m[1] + p) : 0;
        if (m && (r < 0 || r >= n)) return 1;
        rows[t] = m ? r * H + h : ring0 + p % W;
    }
    return 0;
}

#define K_PER (K_FMT == 0 || K_BITS == 8 ? 1 : (K_BITS == 3 ? 8 : 8 / K_BITS))
#define V_PER (V_FMT == 0 || V_BITS == 8 ? 1 : (V_BITS == 3 ? 8 : 8 / V_BITS))
#define K_ROW_BYTES (K_FMT == 0 ? D * (MODEL_T == 0 ? 4 : 2) : D * K_BITS / 8)
#define V_ROW_BYTES (V_FMT == 0 ? D * (MODEL_T == 0 ? 4 : 2) : D * V_BITS / 8)
/* scales (and zero points) per (block, head) */
#define K_NSCALE (K_FMT == 0 ? 0 : (K_AXIS == 1 ? (BS / K_GROUP) * D : BS * (D / K_GROUP)))
#define V_NSCALE (V_FMT == 0 ? 0 : (V_AXIS == 1 ? (BS / V_GROUP) * D : BS * (D / V_GROUP)))
#define PT (TILE < BS ? TILE : BS) /* positions per packed tile: a tile never straddles two blocks */
#if BS % FL || BS & (BS - 1) || TILE & (TILE - 1) || TILE % 8
#error "BS and TILE must be powers of two (TILE at least 8), BS a multiple of the flush group FL"
#endif
#define K_SBYTES (K_SFMT == 1 ? 4 : (K_SFMT == 2 ? 1 : (K_SFMT == 3 ? 0 : 2))) /* per scale, and per zero point */
#define V_SBYTES (V_SFMT == 1 ? 4 : (V_SFMT == 2 ? 1 : (V_SFMT == 3 ? 0 : 2)))

/* Prefetch the bytes one tile of rows [r0, r0 + nt) of one (block, head) reads: codes, scales, zero points
 * (codes, scale, zero: that (block, head)'s first byte of each). */
static inline __attribute__((always_inline)) void prefetch_tile(
        int fmt, int bits, int axis, int group, int sbytes, const char *codes, const char *scale,
        const char *zero, int64_t r0, int nt) {
    const int64_t rb = fmt == 0 ? D * (MODEL_T == 0 ? 4 : 2) : D * bits / 8;
    const char *c = codes + r0 * rb;
    for (int64_t o = 0; o < nt * rb; o += 64) __builtin_prefetch(c + o, 0, 3);
    if (fmt == 0) return;
    const int64_t per_row = axis == 1 ? D : D / group;             /* scales per scale row */
    const int64_t s0 = axis == 1 ? r0 / group : r0, ns = axis == 1 ? (nt + group - 1) / group : nt;
    const int64_t off = s0 * per_row * sbytes, len = ns * per_row * sbytes;
    for (int64_t o = 0; o < len; o += 64) __builtin_prefetch(scale + off + o, 0, 3);
    if (fmt == 1)
        for (int64_t o = 0; o < len; o += 64) __builtin_prefetch(zero + off + o, 0, 3);
}

/* The first byte of (block blk, head h) in a pool field whose blocks lie sb bytes apart, each [H, rows, ...]
 * with a head's part per_head bytes long: pools of their own (sb = H * per_head) or fields of one engine's
 * pages (sb = the page's bytes). */
static inline const char *at_block(const void *base, int64_t sb, int64_t blk, int64_t h, int64_t per_head) {
    return (const char *)base + blk * sb + h * per_head;
}

/* The block of the pool (nb blocks) holding packed position p0 of sequence b, from its row of the block table (mb
 * entries); -1 when the table names none there. */
static inline int64_t block_of(const int32_t *table, int64_t b, int64_t mb, int64_t nb, int64_t p0) {
    const int64_t slot = (p0 - S) / BS;
    const int64_t blk = slot < mb ? table[b * mb + slot] : -1;
    return blk >= 0 && blk < nb ? blk : -1;
}

/* (block blk, kv head h)'s first byte in each of the pool's fields -- key codes, scales, zero points, then the
 * values' -- whose blocks lie pool_sb[f] bytes apart (pools of their own, or fields of one engine's pages). */
typedef struct {
    const char *kc, *ks, *kz, *vc, *vs, *vz;
} block_t;

static inline block_t block_at(const uint8_t *k_codes, const void *k_scale, const void *k_zero,
                               const uint8_t *v_codes, const void *v_scale, const void *v_zero,
                               const int64_t *pool_sb, int64_t blk, int64_t h) {
    block_t x;
    x.kc = at_block(k_codes, pool_sb[0], blk, h, BS * K_ROW_BYTES);
    x.ks = at_block(k_scale, pool_sb[1], blk, h, K_NSCALE * K_SBYTES);
    x.kz = K_FMT == 1 ? at_block(k_zero, pool_sb[2], blk, h, K_NSCALE * K_SBYTES) : (const char *)k_zero;
    x.vc = at_block(v_codes, pool_sb[3], blk, h, BS * V_ROW_BYTES);
    x.vs = at_block(v_scale, pool_sb[4], blk, h, V_NSCALE * V_SBYTES);
    x.vz = V_FMT == 1 ? at_block(v_zero, pool_sb[5], blk, h, V_NSCALE * V_SBYTES) : (const char *)v_zero;
    return x;
}

typedef struct {
    float m[ROWS_MAX], l[ROWS_MAX];
    float acc_plane[ROWS_MAX][D]; /* packed tiles, values' plane order */
    float acc_nat[ROWS_MAX][D];   /* sink and residual tiles, natural order */
} partial_t;

static inline int64_t n_tiles(int64_t a, int64_t b, int64_t t) { return b > a ? (b - a + t - 1) / t : 0; }

/* A row of length L: its sink [0, s_end), packed [S, p_end) and residual [r_beg, L) positions, and their tiles. */
typedef struct {
    int64_t L, s_end, p_end, r_beg, t_sink, t_pack, t_res, nt_all;
} regions_t;

static inline regions_t regions(int64_t L) {
    regions_t x;
    int64_t qb = L - S - R;
    qb = S + (qb > 0 ? qb / FL : 0) * FL;
    x.L = L;
    x.s_end = L < S ? L : S;
    x.p_end = qb < L ? qb : L;
    x.r_beg = qb > S ? qb : S;
    x.t_sink = n_tiles(0, x.s_end, TILE);
    x.t_pack = n_tiles(S, x.p_end, PT);
    x.t_res = n_tiles(x.r_beg, L, TILE);
    x.nt_all = x.t_sink + x.t_pack + x.t_res;
    return x;
}

/* Rows of query heads whose scores (and values) one pass over a tile computes: on AVX-512 two, whose partial sums
 * of eight keys stay in its 32 registers beside a query vector a row and a key vector (three rows measured no
 * faster than two on a prompt's rows of Gemma 3's shape); one on 16 registers. */
#if WV == 16
#define ROWB 2
#else
#define ROWB 1
#endif

/* The scaled scores sc[j][t] = (q[j] . k[t]) * sm_scale of nrows (<= ROWB) query rows against nt keys (kt, rows
 * past nt zero up to a multiple of 8): for each key, q[0:WV] * k[0:WV], then one FMA a vector on, folded to
 * eight lanes and reduced with seven other keys' -- what each row computes alone, so every row's bits are the
 * same however the rows are blocked. */
static inline __attribute__((always_inline)) void scores_rows(float sc[][TILE], float qv[][D], const float *kt,
                                                              int nt, float sm_scale, const int nrows) {
    for (int t0 = 0; t0 < nt; t0 += 8) { /* eight tokens' dot products, reduced together */
        vw w[ROWB][8];
        for (int j = 0; j < nrows; j++) {
            const vw q0 = ldw(qv[j]);
            for (int u = 0; u < 8; u++) w[j][u] = q0 * ldw(kt + (t0 + u) * D);
        }
        for (int k = 1; k < NW; k++) {
            vw qk[ROWB];
            for (int j = 0; j < nrows; j++) qk[j] = ldw(qv[j] + WV * k);
            for (int u = 0; u < 8; u++) {
                const vw kk = ldw(kt + (t0 + u) * D + WV * k);
                for (int j = 0; j < nrows; j++) w[j][u] = fmaw(qk[j], kk, w[j][u]);
            }
        }
        for (int j = 0; j < nrows; j++) {
            v8f a[8];
            for (int u = 0; u < 8; u++) a[u] = fold8(w[j][u]);
            st(sc[j] + t0, reduce8(a) * bcast(sm_scale));
        }
    }
}

/* Accumulators of wide vectors one pass over a tile's values keeps per row (values_rows). */
#define VCH 8

/* acc[j] += sum over t of p[j][t] * v[t] for nrows (<= ROWB) rows j (acc: acc_base + row[j] * D, p: sc[row[j]]),
 * the t in order, VCH vectors of channels at a time: each value vector loaded once for the rows -- every
 * channel's chain of FMAs the one a row alone computes. vis (one row): only the positions it marks. */
static inline __attribute__((always_inline)) void values_rows(float *acc_base, const int64_t *row, float sc[][TILE],
                                                              const float *vt, int nt, const int32_t *vis,
                                                              const int nrows) {
    for (int c0 = 0; c0 < NW; c0 += VCH) {
        const int cn = NW - c0 < VCH ? NW - c0 : VCH;
        vw acc[ROWB][VCH];
        for (int j = 0; j < nrows; j++)
            for (int c = 0; c < cn; c++) acc[j][c] = ldw(acc_base + row[j] * D + WV * (c0 + c));
        for (int t = 0; t < nt; t++) {
            if (vis && !vis[t]) continue;
            vw e[ROWB];
            for (int j = 0; j < nrows; j++) e[j] = (vw){} + sc[row[j]][t];
            const float *vr = vt + t * D + WV * c0;
            for (int c = 0; c < cn; c++) {
                const vw x = ldw(vr + WV * c);
                for (int j = 0; j < nrows; j++) acc[j][c] = fmaw(e[j], x, acc[j][c]);
            }
        }
        for (int j = 0; j < nrows; j++)
            for (int c = 0; c < cn; c++) stw(acc_base + row[j] * D + WV * (c0 + c), acc[j][c]);
    }
}

/* Scores of one tile for every query row, softmax update, value accumulation. */
static inline __attribute__((always_inline)) void attend_tile(
        partial_t *P, float qv[][D], float *acc_base, float *other_acc, float *kt, const float *vt,
        int nt, int64_t p0, int64_t GN, int64_t n, int64_t L, int64_t b, int64_t h, float sm_scale, const float *mask,
        int64_t mask_sb, int64_t mask_sh, int64_t mask_si, int64_t mask_w) {
    float scs[ROWS_MAX][TILE] __attribute__((aligned(32)));
    if (nt % 8) memset((float *)kt + nt * D, 0, sizeof(float) * D * (8 - nt % 8));
    const int causal_tail = !mask && p0 + nt - 1 > L - n; /* only the newest tile can hide future keys */
    const int64_t G = GN / n; /* query heads per kv head */
    /* every row's scores, ROWB rows at a time: each key vector loaded once for them (each row's dot product
     * is the same chain of operations, in the same order, as one row alone) */
    int64_t r0 = 0;
    for (; r0 + ROWB <= GN; r0 += ROWB) scores_rows(scs + r0, qv + r0, kt, nt, sm_scale, ROWB);
    for (; r0 < GN; r0++) scores_rows(scs + r0, qv + r0, kt, nt, sm_scale, 1);
    /* each row's softmax update; then the values, ROWB rows at a time where no position of theirs is hidden */
    int64_t open_rows[ROWS_MAX];
    int n_open = 0;
    int32_t vis_of[ROWS_MAX][TILE] __attribute__((aligned(32)));
    for (int64_t r = 0; r < GN; r++) {
        const int64_t i = r % n, hq = h * G + r / n;
        float *sc = scs[r];
        int32_t *vis = vis_of[r];
        /* visibility (attention_reference): causal, or the mask's (-inf and past its width: hidden); lanes
         * past the tile are hidden. A visible score that is not finite makes the row NaN (its running sum
         * becomes NaN, which nothing undoes) and takes no part in the softmax (-inf); so do hidden ones, whose
         * values are never read. Eight lanes at a time; the common decode tile (no mask, no causal tail)
         * needs no per-position visibility at all. */
        const int nt8 = (nt + 7) & ~7;
        const int masked = mask || causal_tail;
        if (mask) {
            const float *mr = mask + b * mask_sb + hq * mask_sh + i * mask_si;
            for (int t = 0; t < nt; t++) {
                const float mv = p0 + t < mask_w ? mr[p0 + t] : -INFINITY;
                vis[t] = mv != -INFINITY ? -1 : 0;
                sc[t] += mv;
            }
        } else if (causal_tail) {
            for (int t = 0; t < nt; t++) vis[t] = p0 + t <= L - n + i ? -1 : 0;
        }
        if (masked)
            for (int t = nt; t < nt8; t++) vis[t] = 0;
        const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
        v8i badv = {}, hidv = {};
        v8f mxv = bcast(P->m[r]);
        for (int t = 0; t < nt8; t += 8) {
            v8i vv;
            if (masked)
                memcpy(&vv, vis + t, 32);
            else
                vv = (lane + t) < nt;
            const v8f sv = ld(sc + t);
            const v8i fin = (v8i)((v8f)((v8i)sv & 0x7FFFFFFF) <= bcast(FLT_MAX)); /* false for NaN */
            const v8i ok = vv & fin;
            badv |= vv & ~fin;
            hidv |= ~vv;
            const v8f s2 = (v8f)((ok & (v8i)sv) | (~ok & (v8i)bcast(-INFINITY)));
            st(sc + t, s2);
            const v8i gt = s2 > mxv;
            mxv = (v8f)((gt & (v8i)s2) | (~gt & (v8i)mxv));
        }
        int32_t bad = 0, hidden = 0;
        float mx = mxv[0];
        for (int l = 0; l < 8; l++) {
            bad |= badv[l];
            mx = mxv[l] > mx ? mxv[l] : mx;
        }
        hidden = masked && (hidv[0] | hidv[1] | hidv[2] | hidv[3] | hidv[4] | hidv[5] | hidv[6] | hidv[7]);
        if (bad) P->l[r] = NAN;
        if (mx == -INFINITY) continue; /* nothing visible yet: the running state is unchanged */
        const float corr = kexp(P->m[r] - mx);
        P->m[r] = mx;
        v8f ls = bcast(0.0f);
        for (int t = 0; t < nt8; t += 8) {
            const v8f e = kexp8(ld(sc + t) - bcast(mx));
            st(sc + t, e);
            ls += e;
        }
        const float lsum = ((ls[0] + ls[1]) + (ls[2] + ls[3])) + ((ls[4] + ls[5]) + (ls[6] + ls[7]));
        P->l[r] = P->l[r] * corr + lsum;
        float *ar = acc_base + r * D;
        const vw c = (vw){} + corr;
        for (int k = 0; k < NW; k++) stw(ar + WV * k, ldw(ar + WV * k) * c);
        if (corr != 1.0f) {
            float *orow = other_acc + r * D;
            for (int k = 0; k < NW; k++) stw(orow + WV * k, ldw(orow + WV * k) * c);
        }
        /* values: every visible position (a NaN or inf there poisons its channel even at weight 0, as in the
         * reference); a hidden one is skipped, since 0 * NaN would poison a row that does not see it */
        if (hidden)
            values_rows(acc_base, &r, scs, vt, nt, vis, 1);
        else
            open_rows[n_open++] = r;
    }
    int j0 = 0;
    for (; j0 + ROWB <= n_open; j0 += ROWB) values_rows(acc_base, open_rows + j0, scs, vt, nt, NULL, ROWB);
    for (; j0 < n_open; j0++) values_rows(acc_base, open_rows + j0, scs, vt, nt, NULL, 1);
}

static void merge(const partial_t *part, float *out, int64_t B, int64_t H, int64_t G, int64_t n, int64_t ns);

/* Returns 0; or 1 + b when the block table of sequence b does not name a block of the pool (nb blocks) for
 * each of its packed positions (those tiles are skipped: the output is then meaningless). */
int64_t kvc_attention(
        const float *q,              /* [B, H*G, n, D] fp32, rotated when the policy rotates */
        const uint8_t *k_codes, const void *k_scale, const void *k_zero,
        const uint8_t *v_codes, const void *v_scale, const void *v_zero,
        const void *k_res, const void *v_res, const void *k_sink, const void *v_sink,
        const int32_t *lengths,
        const int32_t *table,        /* [B, mb] block ids of each sequence's packed tokens */
        int64_t mb, int64_t nb,
        int64_t ws, int64_t ss,      /* ring slots and sink rows allocated per (b, h): [B, H, ws, D], [B, H, ss, D] */
        const float *mask,           /* additive, or NULL for causal; indexed [b, hq, i, p]; p >= mask_w: hidden */
        int64_t mask_sb, int64_t mask_sh, int64_t mask_si, int64_t mask_w,
        float *out,                  /* [B, H*G, n, D] fp32 */
        int64_t B, int64_t H, int64_t G, /* kv heads, query heads per kv head */
        int64_t n, float sm_scale, int64_t ns, int64_t nthreads,
        const float *k_new, const float *v_new, /* [B, H, n, D] fp32 as stored (rotated, model dtype), or NULL */
        const float *rope_cos, const float *rope_sin, int64_t rope_T, /* pre-RoPE keys: [T, D] each, or NULL */
        const int32_t *rope_perm, const int32_t *rope_off,              /* [D] partner channels, [B] offsets */
        const float *rope_cc, int64_t rope_Tc, /* the compact table [Tc, rd] of rows 0 .. Tc - 1, or NULL, 0 */
        const int64_t *pool_sb,      /* bytes from one block to the next in k_codes, k_scale, k_zero, v_*: [6] */
        const int64_t *res_map, int64_t res_n) {
    /* res_map: NULL (rings), or [B, 3] (h0, h1, before) per row: the full-precision positions are then rows of
     * k_res, v_res as one flat [res_n, H, D] (position p at row p < before ? h0 + p : h1 + p: residual_rows) instead
     * of rings; a row outside it returns 1 + B + b. */
    /* ns: splits of each (sequence, kv head)'s positions, merged at the end (templates/cpu.py chooses). A task
     * is one split of one kv head; with pre-RoPE keys, one split of every kv head, walked tile by tile with the
     * heads inside, so that a tile's cos/sin rows (shared by the heads; compact: half as many bytes per position
     * as a whole fp32 key row) are read once and then from L1. */
    const int64_t GN = G * n;
    const int64_t nparts = B * H * ns, ntask = rope_cos ? B * ns : nparts;
    partial_t *part = (partial_t *)aligned_alloc(64, ((sizeof(partial_t) * nparts + 63) / 64) * 64);
    int64_t bad = 0;
    const rope_t rope0 = rope_cos ? rope_init(rope_cos, rope_sin, rope_cc, rope_perm, rope_T, rope_Tc, 0)
                                  : (rope_t){0};

#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < ntask; task++) {
        const int64_t b = task / (ntask / B), split = task % ns;
        const int64_t h0 = rope_cos ? 0 : (task / ns) % H, h1 = rope_cos ? H : h0 + 1; /* the task's kv heads */
        const regions_t rg = regions(lengths[b]);
        const int64_t L = rg.L, s_end = rg.s_end, p_end = rg.p_end, r_beg = rg.r_beg;
        const int64_t t_sink = rg.t_sink, t_pack = rg.t_pack, nt_all = rg.nt_all;
        const int64_t tile0 = nt_all * split / ns, tile1 = nt_all * (split + 1) / ns;

        /* queries, natural and keys' plane order (one kv head; pre-RoPE keys read q itself: natural order) */
        float q_nat[ROWS_MAX][D], q_plane[ROWS_MAX][D];
        for (int64_t h = h0; h < h1; h++) {
            partial_t *P = part + (b * H + h) * ns + split;
            for (int64_t r = 0; r < GN; r++) {
                const float *src = q + ((b * H + h) * GN + r) * D; /* [b, h * G + r / n, r % n] */
                if (!rope_cos)
                    for (int idx = 0; idx < D; idx++) {
                        q_nat[r][idx] = src[idx];
                        q_plane[r][idx] = src[plane_channel(idx, K_PER)];
                    }
                P->m[r] = -INFINITY;
                P->l[r] = 0.0f;
                memset(P->acc_plane[r], 0, sizeof(float) * D);
                memset(P->acc_nat[r], 0, sizeof(float) * D);
            }
        }
        float kt[TILE * D] __attribute__((aligned(64))), vt[TILE * D] __attribute__((aligned(64)));
        /* pre-RoPE keys rotated, natural order: in place, but for a permutation only the indexed loop takes */
        float kr_any[TILE * D] __attribute__((aligned(64)));
        float *kr = rope0.rd ? kt : kr_any;
        rope_t rope = rope0;
        rope.off = rope_cos ? rope_off[b] : 0;
        int64_t rows[TILE];
        for (int64_t tile = tile0; tile < tile1; tile++) {
            if (rope_cos && tile + 1 < tile1) { /* the next tile's cos/sin rows (TILE positions on from here) */
                const int64_t pt = tile < t_sink ? tile * TILE
                                   : tile < t_sink + t_pack ? S + (tile - t_sink) * PT
                                                            : r_beg + (tile - t_sink - t_pack) * TILE;
                prefetch_rope(&rope, pt);
            }
            for (int64_t h = h0; h < h1; h++) { /* pre-RoPE keys: every kv head; else the task's one */
                const int64_t bh = b * H + h;
                partial_t *P = part + bh * ns + split;
                float(*qn)[D] = rope_cos ? (float(*)[D])(q + bh * GN * D) : q_nat;
                int64_t p0;
                int nt;
                if (tile < t_sink) {
                    p0 = tile * TILE;
                    nt = s_end - p0 < TILE ? s_end - p0 : TILE;
                    for (int t = 0; t < nt; t++) rows[t] = bh * ss + p0 + t;
                    gather_model(k_sink, rows, nt, kt);
                    gather_model(v_sink, rows, nt, vt);
                    if (rope_cos) rope_tile(&rope, kt, kr, nt, p0);
                    attend_tile(P, qn, &P->acc_nat[0][0], &P->acc_plane[0][0], rope_cos ? kr : kt, vt, nt, p0, GN, n, L,
                                b, h, sm_scale, mask, mask_sb, mask_sh, mask_si, mask_w);
                } else if (tile < t_sink + t_pack) {
                    p0 = S + (tile - t_sink) * PT;
                    nt = p_end - p0 < PT ? p_end - p0 : PT;
                    const int64_t slot = (p0 - S) / BS, r0 = (p0 - S) % BS, blk = block_of(table, b, mb, nb, p0);
                    if (blk < 0) {
#pragma omp atomic write
                        bad = 1 + b;
                        continue;
                    }
                    const block_t f = block_at(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, pool_sb, blk, h);
                    const char *kc = f.kc, *ks = f.ks, *kz = f.kz, *vc = f.vc, *vs = f.vs, *vz = f.vz;
                    /* the same rows of the next block, one block ahead: no hardware prefetcher follows the jump */
                    const int64_t nxt = p0 + BS < p_end && slot + 1 < mb ? table[b * mb + slot + 1] : -1;
                    if (nxt >= 0 && nxt < nb) {
                        const int nn = p_end - (p0 + BS) < PT ? p_end - (p0 + BS) : PT;
                        const block_t x = block_at(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, pool_sb, nxt, h);
                        prefetch_tile(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SBYTES, x.kc, x.ks, x.kz, r0, nn);
                        prefetch_tile(V_FMT, V_BITS, V_AXIS, V_GROUP, V_SBYTES, x.vc, x.vs, x.vz, r0, nn);
                    }
                    /* pre-RoPE keys in natural order, rotated (as each row is dequantized where the wide natural
                     * path and an in-place form allow, unless the queries' own chunk replaces rows below), else in
                     * plane order */
                    const int fused = NAT_WIDE(K_FMT, K_BITS, K_AXIS, K_GROUP) && rope_cos && rope.rd &&
                                      !(k_new && p0 + nt > L - n);
                    if (fused)
                        dequant_nat_wide(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SFMT, (const uint8_t *)kc, ks, kz, r0, nt,
                                         kt, &rope, p0);
                    else if (rope_cos)
                        dequant_packed(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SFMT, (const uint8_t *)kc, ks, kz, r0, nt, kt, 1);
                    else
                        dequant_packed(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SFMT, (const uint8_t *)kc, ks, kz, r0, nt, kt, 0);
                    dequant_packed(V_FMT, V_BITS, V_AXIS, V_GROUP, V_SFMT, (const uint8_t *)vc, vs, vz, r0, nt, vt, 0);
                    if (k_new) /* the queries' own chunk, in full precision where it is already packed */
                        for (int t = 0; t < nt; t++) {
                            const int64_t j = p0 + t - (L - n);
                            if (j < 0) continue;
                            const float *kx = k_new + (bh * n + j) * D, *vx = v_new + (bh * n + j) * D;
                            for (int idx = 0; idx < D; idx++) {
                                kt[t * D + idx] = kx[rope_cos ? idx : plane_channel(idx, K_PER)];
                                vt[t * D + idx] = vx[plane_channel(idx, V_PER)];
                            }
                        }
                    if (rope_cos && !fused) rope_tile(&rope, kt, kr, nt, p0);
                    attend_tile(P, K_FMT == 0 || rope_cos ? qn : q_plane, &P->acc_plane[0][0], &P->acc_nat[0][0],
                                rope_cos ? kr : kt, vt, nt, p0, GN, n, L, b, h, sm_scale, mask, mask_sb, mask_sh,
                                mask_si, mask_w);
                } else {
                    p0 = r_beg + (tile - t_sink - t_pack) * TILE;
                    nt = L - p0 < TILE ? L - p0 : TILE;
                    if (residual_rows(res_map ? res_map + 3 * b : NULL, res_n, H, h, bh * ws, p0, nt, rows)) {
#pragma omp atomic write
                        bad = 1 + B + b;
                        continue;
                    }
                    gather_model(k_res, rows, nt, kt);
                    gather_model(v_res, rows, nt, vt);
                    if (rope_cos) rope_tile(&rope, kt, kr, nt, p0);
                    attend_tile(P, qn, &P->acc_nat[0][0], &P->acc_plane[0][0], rope_cos ? kr : kt, vt, nt, p0, GN, n, L,
                                b, h, sm_scale, mask, mask_sb, mask_sh, mask_si, mask_w);
                }
            }
        }
    }

    merge(part, out, B, H, G, n, ns);
    free(part);
    return bad;
}

/* The ns splits P[0 .. ns) of (sequence b, kv head h) merged in order, the values' plane order undone, into its
 * rows of out. */
static void merge_one(const partial_t *P, float *out, int64_t b, int64_t h, int64_t H, int64_t G, int64_t n,
                      int64_t ns) {
    const int64_t GN = G * n;
    for (int64_t r = 0; r < GN; r++) {
        float mx = -INFINITY;
        for (int64_t s = 0; s < ns; s++) {
            const float m = P[s].m[r];
            mx = m > mx ? m : mx;
        }
        float l = 0.0f, acc_p[D], acc_n[D];
        for (int d = 0; d < D; d++) acc_p[d] = acc_n[d] = 0.0f;
        for (int64_t s = 0; s < ns; s++) {
            const float w = mx == -INFINITY ? 0.0f : kexp(P[s].m[r] - mx);
            l += w * P[s].l[r];
            for (int d = 0; d < D; d++) {
                acc_p[d] += w * P[s].acc_plane[r][d];
                acc_n[d] += w * P[s].acc_nat[r][d];
            }
        }
        /* a query that sees no key gets zeros; a NaN sum (a non-finite score) makes the row NaN */
        const float inv = l == 0.0f ? 0.0f : 1.0f / l;
        float *dst = out + (((b * H + h) * G + r / n) * n + r % n) * D;
        for (int d = 0; d < D; d++) dst[d] = acc_n[d] * inv;
        for (int idx = 0; idx < D; idx++) dst[plane_channel(idx, V_PER)] += acc_p[idx] * inv;
        for (int d = 0; d < D; d++) dst[d] = __builtin_fabsf(dst[d]) <= FLT_MAX ? dst[d] : NAN; /* inf: NaN */
    }
}

/* Every (sequence, kv head)'s splits merged (merge_one). Serial: B*H*rows*D numbers, less work than waking a
 * thread. */
static void merge(const partial_t *part, float *out, int64_t B, int64_t H, int64_t G, int64_t n, int64_t ns) {
    for (int64_t bh = 0; bh < B * H; bh++) merge_one(part + bh * ns, out, bh / H, bh % H, H, G, n, ns);
}

/* The split of a row's ns whose tiles include its tile tau (of nt_all): kvc_attention's cut. */
static inline int64_t split_of(int64_t tau, int64_t nt_all, int64_t ns) {
    int64_t s = 0;
    while (s + 1 < ns && nt_all * (s + 1) / ns <= tau) s++;
    return s;
}

/* A prompt's queries through the pages, each the decode row of its own position (one query a row: n = 1, causal
 * or as its row of an additive mask says, keys after RoPE -- no chunk of its own, no rotary tables). Rows
 * [first[g], first[g + 1]) are positions of one sequence in ascending order and share a block table (a sliding
 * window's rows whose window starts in the same page: their masks hide the rest). Each row's output is the bits
 * kvc_attention gives it -- its own splits of its own tiles, each split's tiles in order, merged the same way --
 * but a packed tile is dequantized once for every row of the group that reads it (kvc_attention: once a row, so a
 * prompt of P tokens dequantized ~P^2/2 tiles' worth). A task is one group of one kv head; the rows' sinks and rings are their own.
 * Arguments as kvc_attention's (n = 1), then first [ngroups + 1] and ring_of [B]: row b reads the ring of row
 * ring_of[b] of k_res, v_res (rows of one sequence whose full-precision positions begin at the same position
 * share one), or NULL: its own; then the mask as kvc_attention's (n = 1), or NULL; then res_map as kvc_attention's
 * (each row's own; ring_of unused). Returns as kvc_attention. */
int64_t kvc_attention_rows(
        const float *q, const uint8_t *k_codes, const void *k_scale, const void *k_zero,
        const uint8_t *v_codes, const void *v_scale, const void *v_zero,
        const void *k_res, const void *v_res, const void *k_sink, const void *v_sink,
        const int32_t *lengths, const int32_t *table, int64_t mb, int64_t nb, int64_t ws, int64_t ss,
        float *out, int64_t B, int64_t H, int64_t G, float sm_scale, int64_t ns, int64_t nthreads,
        const int64_t *pool_sb, const int32_t *first, int64_t ngroups, const int32_t *ring_of,
        const float *mask, int64_t mask_sb, int64_t mask_sh, int64_t mask_si, int64_t mask_w,
        const int64_t *res_map, int64_t res_n) {
    const int64_t GN = G;
    int64_t bad = 0, most = 0;
    for (int64_t g = 0; g < ngroups; g++) most = first[g + 1] - first[g] > most ? first[g + 1] - first[g] : most;
    /* each thread's scratch, reused task after task: its group's partials (merged into out as the task ends),
     * queries and regions -- not a partial for every row of the call, whose fresh pages cost more than the
     * dequantization saved */
    const int64_t nth = nthreads > 0 ? nthreads : 1;
    const size_t part_bytes = sizeof(partial_t) * most * ns, q_bytes = sizeof(float) * most * GN * D * 2;
    const size_t per_thread = ((part_bytes + q_bytes + sizeof(regions_t) * most + 63) / 64) * 64;
    char *scratch = (char *)aligned_alloc(64, per_thread * nth);

#pragma omp parallel for schedule(dynamic, 1) num_threads(nth)
    for (int64_t task = 0; task < ngroups * H; task++) {
        const int64_t g = task / H, h = task % H, b0 = first[g], nr = first[g + 1] - b0;
        char *mine = scratch + per_thread * omp_get_thread_num();
        partial_t *part = (partial_t *)mine; /* row r's split s: part[r * ns + s] */
        float *qn = (float *)(mine + part_bytes), *qp = qn + nr * GN * D;
        regions_t *rg = (regions_t *)(mine + part_bytes + q_bytes);
        int64_t tp_max = 0, p_end_max = S;
        for (int64_t r = 0; r < nr; r++) {
            const int64_t b = b0 + r, bh = b * H + h;
            rg[r] = regions(lengths[b]);
            tp_max = rg[r].t_pack > tp_max ? rg[r].t_pack : tp_max;
            p_end_max = rg[r].p_end > p_end_max ? rg[r].p_end : p_end_max;
            for (int64_t i = 0; i < GN; i++) {
                const float *src = q + (bh * GN + i) * D;
                for (int idx = 0; idx < D; idx++) {
                    qn[(r * GN + i) * D + idx] = src[idx];
                    qp[(r * GN + i) * D + idx] = src[plane_channel(idx, K_PER)];
                }
            }
            for (int64_t sp = 0; sp < ns; sp++) {
                partial_t *P = part + r * ns + sp;
                for (int64_t i = 0; i < GN; i++) {
                    P->m[i] = -INFINITY;
                    P->l[i] = 0.0f;
                    memset(P->acc_plane[i], 0, sizeof(float) * D);
                    memset(P->acc_nat[i], 0, sizeof(float) * D);
                }
            }
        }
        float kt[TILE * D] __attribute__((aligned(64))), vt[TILE * D] __attribute__((aligned(64)));
        int64_t rows[TILE];
        /* each row's sinks first (its tiles 0 .. t_sink - 1) */
        for (int64_t r = 0; r < nr; r++) {
            const int64_t b = b0 + r, bh = b * H + h;
            for (int64_t tile = 0; tile < rg[r].t_sink; tile++) {
                partial_t *P = part + r * ns + split_of(tile, rg[r].nt_all, ns);
                const int64_t p0 = tile * TILE;
                const int nt = rg[r].s_end - p0 < TILE ? rg[r].s_end - p0 : TILE;
                for (int t = 0; t < nt; t++) rows[t] = bh * ss + p0 + t;
                gather_model(k_sink, rows, nt, kt);
                gather_model(v_sink, rows, nt, vt);
                attend_tile(P, (float(*)[D])(qn + r * GN * D), &P->acc_nat[0][0], &P->acc_plane[0][0], kt, vt, nt, p0,
                            GN, 1, rg[r].L, b, h, sm_scale, mask, mask_sb, mask_sh, mask_si, mask_w);
            }
        }
        /* the packed tiles, each dequantized once for the rows that read it: the longest row first, since a row
         * zeroes the tile's keys past its own positions (attend_tile) and every later row reads fewer */
        for (int64_t j = 0; j < tp_max; j++) {
            const int64_t p0 = S + j * PT;
            const int nt = p_end_max - p0 < PT ? p_end_max - p0 : PT;
            const int64_t r0 = (p0 - S) % BS, blk = block_of(table, b0, mb, nb, p0);
            if (blk < 0) { /* as kvc_attention: the tile is skipped and the call says which sequence */
#pragma omp atomic write
                bad = 1 + b0;
                continue;
            }
            const block_t f = block_at(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, pool_sb, blk, h);
            dequant_packed(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SFMT, (const uint8_t *)f.kc, f.ks, f.kz, r0, nt, kt, 0);
            dequant_packed(V_FMT, V_BITS, V_AXIS, V_GROUP, V_SFMT, (const uint8_t *)f.vc, f.vs, f.vz, r0, nt, vt, 0);
            for (int64_t r = nr - 1; r >= 0; r--) {
                if (j >= rg[r].t_pack) continue;
                const int64_t b = b0 + r;
                partial_t *P = part + r * ns + split_of(rg[r].t_sink + j, rg[r].nt_all, ns);
                const int nr_t = rg[r].p_end - p0 < PT ? rg[r].p_end - p0 : PT;
                attend_tile(P, (float(*)[D])((K_FMT == 0 ? qn : qp) + r * GN * D), &P->acc_plane[0][0],
                            &P->acc_nat[0][0], kt, vt, nr_t, p0, GN, 1, rg[r].L, b, h, sm_scale, mask, mask_sb,
                            mask_sh, mask_si, mask_w);
            }
        }
        /* each row's residual positions from its ring (its last tiles) */
        for (int64_t r = 0; r < nr; r++) {
            const int64_t b = b0 + r, bh = (ring_of ? ring_of[b] : b) * H + h;
            for (int64_t k = 0; k < rg[r].t_res; k++) {
                partial_t *P = part + r * ns + split_of(rg[r].t_sink + rg[r].t_pack + k, rg[r].nt_all, ns);
                const int64_t p0 = rg[r].r_beg + k * TILE;
                const int nt = rg[r].L - p0 < TILE ? rg[r].L - p0 : TILE;
                if (residual_rows(res_map ? res_map + 3 * b : NULL, res_n, H, h, bh * ws, p0, nt, rows)) {
#pragma omp atomic write
                    bad = 1 + B + b; /* (the row's own map) */
                    continue;
                }
                gather_model(k_res, rows, nt, kt);
                gather_model(v_res, rows, nt, vt);
                attend_tile(P, (float(*)[D])(qn + r * GN * D), &P->acc_nat[0][0], &P->acc_plane[0][0], kt, vt, nt, p0,
                            GN, 1, rg[r].L, b, h, sm_scale, mask, mask_sb, mask_sh, mask_si, mask_w);
            }
        }
        for (int64_t r = 0; r < nr; r++) merge_one(part + r * ns, out, b0 + r, h, H, G, 1, ns);
    }
    free(scratch);
    return bad;
}

/* The fp8 decode the kernel uses (unpack_row, then the factor it folds into the scale), over N codes, N a
 * multiple of D: for the tests. */
void kvc_fp8_decode(const uint8_t *codes, float *out, int64_t N, int64_t e5m2) {
    const int fmt = e5m2 ? 4 : 3;
    for (int64_t i = 0; i < N; i += D) {
        unpack_row(fmt, 8, codes + i, out + i, 0);
        for (int k = 0; k < NV; k++) st(out + i + 8 * k, ld(out + i + 8 * k) * bcast(FP8_UNIT(fmt)));
    }
}

/* The compact table of the full one cs, sn [T, D] with partners perm (see rope_row_compact), written into cc [T, rd]
 * (rd = kvc_rope_width(perm)) for the rows 0 .. Tc - 1 whose values repeat exactly as the form's do; returns Tc (0 when
 * the form has no compact rotation). One pass over the table: templates/cpu.py calls it once per table and version. */
/* Present in the copies whose kvc_attention takes the rows' widths (ws, ss): older ones (a benchmark's "before")
 * take rings and sinks allocated whole, [B, H, W, D] and [B, H, S, D]. */
int64_t kvc_row_strides(void) { return 1; }
/* Present in the copies whose kvc_attention_rows takes a mask (older ones: causal rows only). */
int64_t kvc_rows_mask(void) { return 1; }
/* Present in the copies whose kernels read the full-precision positions from a flat tensor by a map (res_map). */
int64_t kvc_res_map(void) { return 1; }

int64_t kvc_rope_width(const int32_t *perm) {
    int span = 0;
    const int form = rope_form(perm, &span);
    return rope_compact_width(form, span);
}

int64_t kvc_rope_compact(const float *cs, const float *sn, int64_t T, const int32_t *perm, float *cc) {
    int span = 0;
    const int form = rope_form(perm, &span), rd = rope_compact_width(form, span), h = rd / 2;
    if (!rd) return 0;
    for (int64_t r = 0; r < T; r++) {
        uint32_t c[D], s[D], bad = 0;
        memcpy(c, cs + r * D, sizeof c);
        memcpy(s, sn + r * D, sizeof s);
        if (form == ROPE_HALF) { /* pairs (j, j + span) */
            for (int j = 0; j < h; j++) bad |= (c[j] ^ c[j + span]) | (s[j] ^ s[j + span] ^ 0x80000000u);
            memcpy(cc + r * rd, c, h * 4);
            memcpy(cc + r * rd + h, s, h * 4);
        } else { /* pairs (2j, 2j + 1) */
            for (int j = 0; j < h; j++) {
                bad |= (c[2 * j] ^ c[2 * j + 1]) | (s[2 * j] ^ s[2 * j + 1] ^ 0x80000000u);
                memcpy(cc + r * rd + j, c + 2 * j, 4);
                memcpy(cc + r * rd + h + j, s + 2 * j, 4);
            }
        }
        for (int d = rd; d < D; d++) bad |= (c[d] ^ 0x3f800000u) | s[d]; /* 1.0f, +0.0f */
        if (bad) return r;
    }
    return T;
}

/* For the tests. kvc_rope_rows: key rows kt [N, D] (natural order) of one sequence (offset off) at positions
 * p0 .. p0 + N - 1 rotated as the decode kernel rotates pre-RoPE keys (rope_tile) into out [N, D], with the compact
 * table cc of rows below Tc (or NULL, 0).
 * kvc_dequant_keys: rows [q0, q0 + nt) of one (block, head) of packed keys (codes, scales and zero points at its
 * first row) dequantized as the kernel does, in natural order (nat, pre-RoPE keys) or its plane order. */
void kvc_rope_rows(const float *kt, float *out, int64_t N, int64_t p0, int64_t off, const float *cs,
                   const float *sn, int64_t T, const int32_t *perm, const float *cc, int64_t Tc) {
    const rope_t rp = rope_init(cs, sn, cc, perm, T, Tc, off);
    for (int64_t i = 0; i < N; i++) rope_tile(&rp, kt + i * D, out + i * D, 1, p0 + i);
}

void kvc_dequant_keys(const uint8_t *codes, const void *scale, const void *zero, int64_t q0, int64_t nt, int64_t nat,
                      float *out) {
    if (nat)
        dequant_packed(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SFMT, codes, scale, zero, q0, nt, out, 1);
    else
        dequant_packed(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SFMT, codes, scale, zero, q0, nt, out, 0);
}

/* kvc_rope_keys: rows [q0, q0 + nt) of one (block, head) of packed pre-RoPE keys, at positions p0 .. of a sequence
 * of offset off, dequantized and rotated as the decode kernel does a packed tile (rotated as each row is dequantized
 * where it fuses the two) into out [nt, D]; returns whether it fused them. */
int64_t kvc_rope_keys(const uint8_t *codes, const void *scale, const void *zero, int64_t q0, int64_t nt, int64_t p0,
                      int64_t off, const float *cs, const float *sn, int64_t T, const int32_t *perm, const float *cc,
                      int64_t Tc, float *out) {
    const rope_t rp = rope_init(cs, sn, cc, perm, T, Tc, off);
    const int fused = NAT_WIDE(K_FMT, K_BITS, K_AXIS, K_GROUP) && rp.rd;
    float kt[BS * D];
    if (fused) {
        dequant_nat_wide(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SFMT, codes, scale, zero, q0, nt, out, &rp, p0);
        return 1;
    }
    dequant_packed(K_FMT, K_BITS, K_AXIS, K_GROUP, K_SFMT, codes, scale, zero, q0, nt, kt, 1);
    rope_tile(&rp, kt, out, nt, p0);
    return 0;
}
