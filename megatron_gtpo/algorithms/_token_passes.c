/* Native CPU kernels of the [N, G, T] passes of GTPO and GRPO-S: float32 entropies, one thread.
 *
 * The contracts (shapes, what each output holds) are those of the torch implementations in token_passes.py, which
 * validates every argument and owns every buffer; this file only computes. Built by setup.py as the extension
 * megatron_gtpo.algorithms._token_passes_native; the Python functions take raw data pointers (ints) and sizes.
 *
 * Why C: the torch formulation needs ~15 elementwise passes over the batch (clamp, padding clear, reciprocal, row
 * select, three batched sums, ...), the loops below read each entropy twice and write each advantage once, so the
 * cost is that of the memory traffic (benchmarks/results/advantages.md).
 *
 * Accuracy of the second moment. gtpo_advantages takes each type's variance from (count, sum of bonus, sum of
 * squared bonus); in a normalisation scope that holds one outcome only, that variance is the sum of squared bonus
 * minus (sum of bonus)^2 / count, a tiny difference of large numbers when the entropies are nearly equal (entropy
 * spread 1e-3: the variance is ~1e-7 of the squared-bonus sum). Float32 sums of w and w^2 lost it entirely
 * (advantages off by 0.14 at spread 1e-3). So the kernel sums shifted data, in one pass: ref[t] = w of the first
 * valid row of the type at t, d = w - ref (small when the w are close, and exact or nearly so), and it accumulates
 * count, sum d and sum d^2 in float32, the spread of the w being all that goes through float32. Then, per position
 * in double: sum w = count * ref + sum d, coef, b = coef * sum w (the position's bonus sum, used by both moments)
 * and sum w^2 = count * ref^2 + 2 * ref * sum d + sum d^2, so that coef^2 * sum w^2 = coef^2 * SS + b^2 / count
 * (SS the centred sum of squares of w) to double rounding (~1e-16 relative) without a division. The cost: one more
 * array (ref) read and written per element than the former sums of w and w^2.
 *
 * Semantics kept exactly: a NaN entropy at a valid token propagates (comparisons with NaN are false, so the clamp
 * keeps it), padding positions contribute exactly 0 whatever they hold (a select, never a multiply by the mask).
 * Compiled with -fno-trapping-math (the selects become vector blends) and -fassociative-math -fno-signed-zeros (the
 * sums over positions become vector reductions, in double where they leave the kernel); never -ffinite-math-only
 * or -ffast-math, which would let the compiler drop the NaN semantics above.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
/* AVX2 where the CPU has it, chosen at load time (ifunc); baseline x86-64 (SSE2) otherwise. */
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

static inline float clamp_keeping_nan(float x, float low, float high) {
    x = x < low ? low : x;
    return x > high ? high : x;
}

/* Per-position sums of one type, on data shifted by a reference value (see the top of the file). */
typedef struct {
    float *count; /* number of valid rows */
    float *ref;   /* w of the first valid row seen at t (0 while there is none) */
    float *sum_d; /* sum of (w - ref) over valid rows */
    float *sum_d2; /* sum of (w - ref)^2 over valid rows */
} TypeSums;

/* Entropy weights of one response row, accumulated into its type's per-position sums, with w = H (successful) or
 * 1 / (H + eps) (failed): the first valid row at t sets ref[t] (a select, no branch), then count[t] += valid,
 * sum_d[t] += d, sum_d2[t] += d * d with d = w - ref[t] at a valid token and exactly 0 at padding. A NaN w at a
 * valid token makes d NaN (ref too, if it is the first), so it propagates to the moments. */
MULTIVERSION
static void accumulate_row(const float *restrict entropy, const uint8_t *restrict mask, int64_t T, int failed,
                           float low, float high, float eps, float *restrict count, float *restrict ref,
                           float *restrict sum_d, float *restrict sum_d2) {
    if (!failed) {
        for (int64_t t = 0; t < T; t++) {
            float w = clamp_keeping_nan(entropy[t], low, high);
            float r = (count[t] == 0.0f && mask[t]) ? w : ref[t];
            float d = mask[t] ? w - r : 0.0f;
            ref[t] = r;
            count[t] += (float)mask[t];
            sum_d[t] += d;
            sum_d2[t] += d * d;
        }
    } else {
        for (int64_t t = 0; t < T; t++) {
            float w = 1.0f / (clamp_keeping_nan(entropy[t], low, high) + eps);
            float r = (count[t] == 0.0f && mask[t]) ? w : ref[t];
            float d = mask[t] ? w - r : 0.0f;
            ref[t] = r;
            count[t] += (float)mask[t];
            sum_d[t] += d;
            sum_d2[t] += d * d;
        }
    }
}

/* Per position, in double from the float sums (see the top of the file): sum = count * ref + sum_d (the sum of w),
 * coef[t] = alpha2 * count / (sum + eps) rounded once to float (the affine pass uses that float), b = coef * sum,
 * sum_sq = (count * ref + 2 * sum_d) * ref + sum_d2 (the sum of w^2).
 * moments = (sum_t count, sum_t b, sum_t coef^2 * sum_sq): numbers of tokens, sum and sum of squares of the bonus. */
MULTIVERSION
static void coefficients_and_moments(TypeSums s, int64_t T, float alpha2, float eps, float *restrict coef,
                                     double moments[3]) {
    const float *restrict count = s.count, *restrict ref = s.ref, *restrict sum_d = s.sum_d,
                *restrict sum_d2 = s.sum_d2;
    double total_count = 0.0, total_bonus = 0.0, total_bonus_sq = 0.0;
    for (int64_t t = 0; t < T; t++) {
        /* count 0: ref, sum_d and sum_d2 are 0 (memset), so coef, b and the sum of w^2 are 0. */
        double n = (double)count[t], r = (double)ref[t], d = (double)sum_d[t];
        double sum = n * r + d;
        double sum_sq = (n * r + 2.0 * d) * r + (double)sum_d2[t];
        float c = (float)((double)alpha2 * n / (sum + (double)eps));
        double c64 = (double)c;
        coef[t] = c;
        total_count += n;
        total_bonus += c64 * sum;
        total_bonus_sq += c64 * c64 * sum_sq;
    }
    moments[0] = total_count;
    moments[1] = total_bonus;
    moments[2] = total_bonus_sq;
}

static void shaping_moments(const float *entropy, const uint8_t *mask, const uint8_t *failed, int64_t N, int64_t G,
                            int64_t T, float low, float high, float eps, float alpha2, float *coef_N2T,
                            double *moments_N32, float *scratch_42T) {
    TypeSums sums[2];
    for (int64_t k = 0; k < 2; k++) {
        sums[k].count = scratch_42T + (0 + k) * T;
        sums[k].ref = scratch_42T + (2 + k) * T;
        sums[k].sum_d = scratch_42T + (4 + k) * T;
        sums[k].sum_d2 = scratch_42T + (6 + k) * T;
    }
    for (int64_t n = 0; n < N; n++) {
        memset(scratch_42T, 0, sizeof(float) * 8 * T);
        for (int64_t g = 0; g < G; g++) {
            int64_t row = n * G + g, k = failed[row] ? 1 : 0;
            accumulate_row(entropy + row * T, mask + row * T, T, (int)k, low, high, eps, sums[k].count,
                           sums[k].ref, sums[k].sum_d, sums[k].sum_d2);
        }
        for (int64_t k = 0; k < 2; k++) {
            double moments[3];
            coefficients_and_moments(sums[k], T, alpha2, eps, coef_N2T + (n * 2 + k) * T, moments);
            for (int m = 0; m < 3; m++) moments_N32[(n * 3 + m) * 2 + k] = moments[m];
        }
    }
}

/* out[t] = valid ? (w[t] * coef[t]) * slope + intercept : 0, w as in accumulate_row. */
MULTIVERSION
static void affine_row(const float *restrict entropy, const uint8_t *restrict mask, int64_t T, int failed,
                       float low, float high, float eps, const float *restrict coef, float slope, float intercept,
                       float *restrict out) {
    if (!failed) {
        for (int64_t t = 0; t < T; t++) {
            float v = (clamp_keeping_nan(entropy[t], low, high) * coef[t]) * slope + intercept;
            out[t] = mask[t] ? v : 0.0f;
        }
    } else {
        for (int64_t t = 0; t < T; t++) {
            float inverse = 1.0f / (clamp_keeping_nan(entropy[t], low, high) + eps);
            float v = (inverse * coef[t]) * slope + intercept;
            out[t] = mask[t] ? v : 0.0f;
        }
    }
}

static void apply_affine(const float *entropy, const uint8_t *mask, const uint8_t *failed, int64_t N, int64_t G,
                         int64_t T, float low, float high, float eps, const float *coef_N2T, const float *slope_N2,
                         const float *intercept_N2, float *out) {
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < G; g++) {
            int64_t row = n * G + g, k = failed[row] ? 1 : 0;
            affine_row(entropy + row * T, mask + row * T, T, (int)k, low, high, eps, coef_N2T + (n * 2 + k) * T,
                       slope_N2[n * 2 + k], intercept_N2[n * 2 + k], out + row * T);
        }
    }
}

/* Per row: number of valid tokens and the sum of their clamped entropies. */
MULTIVERSION
static void row_sums(const float *entropy, const uint8_t *mask, int64_t R, int64_t T, float low, float high,
                     float *length_R, float *sum_R) {
    for (int64_t r = 0; r < R; r++) {
        const float *restrict e = entropy + r * T;
        const uint8_t *restrict m = mask + r * T;
        double length = 0.0, sum = 0.0;
        for (int64_t t = 0; t < T; t++) {
            float h = clamp_keeping_nan(e[t], low, high);
            length += (double)m[t];
            sum += (double)(m[t] ? h : 0.0f);
        }
        length_R[r] = (float)length;
        sum_R[r] = (float)sum;
    }
}

/* ------------------------------------------------------------------------------------------- Python bindings */

#define PTR(p) ((void *)(uintptr_t)(p))

static PyObject *py_shaping_moments(PyObject *self, PyObject *args) {
    unsigned long long entropy, mask, failed, coef, moments, scratch;
    long long N, G, T;
    float low, high, eps, alpha2;
    if (!PyArg_ParseTuple(args, "KKKLLLffffKKK", &entropy, &mask, &failed, &N, &G, &T, &low, &high, &eps, &alpha2,
                          &coef, &moments, &scratch))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    shaping_moments(PTR(entropy), PTR(mask), PTR(failed), N, G, T, low, high, eps, alpha2, PTR(coef), PTR(moments),
                    PTR(scratch)); /* scratch: 4 * 2 * T floats */
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_apply_affine(PyObject *self, PyObject *args) {
    unsigned long long entropy, mask, failed, coef, slope, intercept, out;
    long long N, G, T;
    float low, high, eps;
    if (!PyArg_ParseTuple(args, "KKKLLLfffKKKK", &entropy, &mask, &failed, &N, &G, &T, &low, &high, &eps, &coef,
                          &slope, &intercept, &out))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    apply_affine(PTR(entropy), PTR(mask), PTR(failed), N, G, T, low, high, eps, PTR(coef), PTR(slope),
                 PTR(intercept), PTR(out));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_row_sums(PyObject *self, PyObject *args) {
    unsigned long long entropy, mask, length, sum;
    long long R, T;
    float low, high;
    if (!PyArg_ParseTuple(args, "KKLLffKK", &entropy, &mask, &R, &T, &low, &high, &length, &sum))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    row_sums(PTR(entropy), PTR(mask), R, T, low, high, PTR(length), PTR(sum));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"shaping_moments", py_shaping_moments, METH_VARARGS, "See token_passes.shaping_moments."},
    {"apply_affine", py_apply_affine, METH_VARARGS, "See token_passes.apply_affine."},
    {"row_sums", py_row_sums, METH_VARARGS, "See token_passes.row_sums."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_token_passes_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__token_passes_native(void) { return PyModule_Create(&module); }
