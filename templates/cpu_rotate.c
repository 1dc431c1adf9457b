/* kvcompile CPU rotation: the Hadamard rotation of rows of D channels, specialized per (D, BLK).
 *
 * templates/cpu_rotate.py compiles this file once per head size and calls kvc_rotate through ctypes. The result
 * is kvcompile.store.rotate_reference's, bit for bit: each row's D channels, in blocks of BLK (a power of two
 * dividing D; kvcompile.store.rotation_block), go through the fast Walsh-Hadamard transform in float64 --
 * log2(BLK) butterfly stages, stage h (h = 1, 2, 4, ...) replacing each pair (x[j], x[j + h]) of a group of 2h
 * channels with (x[j] + x[j + h], x[j] - x[j + h]) -- then one multiplication by the float64 constant s =
 * 1 / sqrt(BLK), then, for a finite value, the clamp to [-hi, hi] (the output dtype's largest finite value:
 * kvcompile.quant.saturate). Every operation is one IEEE float64 addition, subtraction or multiplication in a
 * fixed order (built with -ffp-contract=off and without fast-math), so a row's result never depends on the
 * rows around it, the thread that computed it or the machine's vector width.
 *
 * Input rows are float32 (IN_F64 0) or float64 (1), output rows float32 (OUT_F64 0: the float64 result rounded
 * to nearest even, as a torch cast) or float64 (1: for a bf16 or fp16 result, which torch then casts).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#if (BLK & (BLK - 1)) || D % BLK || BLK > MAX_BLK
#error "BLK must be a power of two dividing D, at most MAX_BLK (cpu_rotate.py)"
#endif

/* Stage h over the whole row: groups of 2h channels never straddle two blocks (2h divides BLK, BLK divides D). */
static inline __attribute__((always_inline)) void stage(double *t, const int h) {
    for (int g = 0; g < D; g += 2 * h) {
        for (int j = g; j < g + h; j++) {
            double a = t[j], c = t[j + h];
            t[j] = a + c;
            t[j + h] = a - c;
        }
    }
}

/* One row: IN_F64 / OUT_F64 are constants at each call (the four instantiations below). */
static inline __attribute__((always_inline)) void rotate_row(const void *src, const int in_f64, void *dst,
                                                              const int out_f64, double s, double hi) {
    double t[D];
    for (int c = 0; c < D; c++) t[c] = in_f64 ? ((const double *)src)[c] : (double)((const float *)src)[c];
#define ST(h) if ((h) < BLK) stage(t, (h));
    ST(1) ST(2) ST(4) ST(8) ST(16) ST(32) ST(64) ST(128) ST(256) ST(512)
#undef ST
    for (int c = 0; c < D; c++) {
        double v = t[c] * s;
        if (isfinite(v)) v = v > hi ? hi : (v < -hi ? -hi : v);
        if (out_f64)
            ((double *)dst)[c] = v;
        else
            ((float *)dst)[c] = (float)v;
    }
}

#define ROWS(IN, OUT, IT, OT)                                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                         \
    for (int64_t r = 0; r < rows; r++) rotate_row((const IT *)x + r * D, IN, (OT *)y + r * D, OUT, s, hi);

/* rows x D elements from x (row stride D) into y (row stride D); nt threads (a few rows stay on one). */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("prefer-vector-width=512")))
#endif
void kvc_rotate(const void *x, int64_t in_f64, void *y, int64_t out_f64, int64_t rows, double s, double hi,
                int64_t nt) {
    const int threads = rows >= 1024 ? (int)nt : 1;
    if (in_f64 && out_f64) {
        ROWS(1, 1, double, double)
    } else if (in_f64) {
        ROWS(1, 0, double, float)
    } else if (out_f64) {
        ROWS(0, 1, float, double)
    } else {
        ROWS(0, 0, float, float)
    }
}
