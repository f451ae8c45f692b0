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

/* Entropy weights of one response row, accumulated into its type's per-position sums:
 * count[t] += valid, sum[t] += w, sum_sq[t] += w * w, with w = H (successful) or 1 / (H + eps) (failed), 0 at
 * padding. */
MULTIVERSION
static void accumulate_row(const float *restrict entropy, const uint8_t *restrict mask, int64_t T, int failed,
                           float low, float high, float eps, float *restrict count, float *restrict sum,
                           float *restrict sum_sq) {
    if (!failed) {
        for (int64_t t = 0; t < T; t++) {
            float h = clamp_keeping_nan(entropy[t], low, high);
            float w = mask[t] ? h : 0.0f;
            count[t] += (float)mask[t];
            sum[t] += w;
            sum_sq[t] += w * w;
        }
    } else {
        for (int64_t t = 0; t < T; t++) {
            float inverse = 1.0f / (clamp_keeping_nan(entropy[t], low, high) + eps);
            float w = mask[t] ? inverse : 0.0f;
            count[t] += (float)mask[t];
            sum[t] += w;
            sum_sq[t] += w * w;
        }
    }
}

/* coef[t] = alpha2 * count[t] / (sum[t] + eps); moments = (sum count, sum coef * sum, sum coef^2 * sum_sq). */
MULTIVERSION
static void coefficients_and_moments(const float *restrict count, const float *restrict sum,
                                     const float *restrict sum_sq, int64_t T, float alpha2, float eps,
                                     float *restrict coef, double moments[3]) {
    double total_count = 0.0, total_bonus = 0.0, total_bonus_sq = 0.0;
    for (int64_t t = 0; t < T; t++) {
        float c = alpha2 * count[t] / (sum[t] + eps);
        coef[t] = c;
        total_count += (double)count[t];
        total_bonus += (double)(c * sum[t]);
        total_bonus_sq += (double)(c * c * sum_sq[t]);
    }
    moments[0] = total_count;
    moments[1] = total_bonus;
    moments[2] = total_bonus_sq;
}

static void shaping_moments(const float *entropy, const uint8_t *mask, const uint8_t *failed, int64_t N, int64_t G,
                            int64_t T, float low, float high, float eps, float alpha2, float *coef_N2T,
                            double *moments_N32, float *scratch_32T) {
    float *count_2T = scratch_32T, *sum_2T = scratch_32T + 2 * T, *sum_sq_2T = scratch_32T + 4 * T;
    for (int64_t n = 0; n < N; n++) {
        memset(scratch_32T, 0, sizeof(float) * 6 * T);
        for (int64_t g = 0; g < G; g++) {
            int64_t row = n * G + g, k = failed[row] ? 1 : 0;
            accumulate_row(entropy + row * T, mask + row * T, T, (int)k, low, high, eps, count_2T + k * T,
                           sum_2T + k * T, sum_sq_2T + k * T);
        }
        for (int64_t k = 0; k < 2; k++) {
            double moments[3];
            coefficients_and_moments(count_2T + k * T, sum_2T + k * T, sum_sq_2T + k * T, T, alpha2, eps,
                                     coef_N2T + (n * 2 + k) * T, moments);
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
                    PTR(scratch));
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
