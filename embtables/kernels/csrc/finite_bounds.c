/* The bounds that prove an update finite without computing it: the touched rows' largest |value| and smallest
 * value, and the proof of kernels/finite_guard.py, in double. */
#include "embtables_native.h"

/* A float's bits as an int32 whose signed order is the float order (NaN aside): integer min / max vectorise
 * without -ffast-math, float ones do not. et_key_float undoes it. */
static inline int32_t et_float_key(float x) {
    int32_t k;
    memcpy(&k, &x, sizeof k);
    return k ^ ((k >> 31) & 0x7fffffff);
}
static inline float et_key_float(int32_t k) {
    const int32_t b = k ^ ((k >> 31) & 0x7fffffff);
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* 8-lane running maxima of |x| (as bits) and minima of x (as et_float_key), with GCC / Clang vector extensions
 * (unaligned loads): the plain loops were not vectorised. */
typedef int32_t et_i8v __attribute__((vector_size(32), aligned(4)));

/* Fold rows [k0, k1) of the update (rows k0..k1-1 of [V, D] when dense) into mb / mn (4 x 8 lanes: weights,
 * slots 0-2), every tensor of a row together, 16 rows prefetched ahead. The lanes are the function's own locals
 * for the whole range, read from and written to mb / mn once (through mb / mn every row, which the compiler must
 * assume may alias the rows, the standard step's pass took 18% longer); columns past the last multiple of 8 fold
 * into lane 0. A noinline function of its own: inside the OpenMP region's outlined function the same loop ran
 * several times slower. */
static __attribute__((noinline)) void et_fold_rows(const et_workspace *h, const float *W, const float *S0,
                                                   const float *S1, const float *S2, int64_t D, int dense,
                                                   int64_t k0, int64_t k1, uint32_t *mb, int32_t *mn) {
    const float *const src[4] = {W, S0, S1, S2};
    const int64_t D8 = D & ~(int64_t)7;
    et_u8v b[4];
    et_i8v m[4];
    uint32_t tb[4] = {0, 0, 0, 0};
    int32_t tm[4] = {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX};
    for (int i = 0; i < 4; ++i) {
        memcpy(&b[i], mb + 8 * i, sizeof b[i]);
        memcpy(&m[i], mn + 8 * i, sizeof m[i]);
    }
    for (int64_t k = k0; k < k1; ++k) {
        int64_t r = k;
        if (!dense) {
            if (k + 16 < k1) {
                const int64_t ahead = h->rows[k + 16] * D;
                for (int i = 0; i < 4; ++i)
                    if (src[i])
                        for (int64_t off = 0; off < D; off += 16) __builtin_prefetch(src[i] + ahead + off, 0, 3);
            }
            r = h->rows[k];
        }
        for (int i = 0; i < 4; ++i) {
            if (!src[i]) continue;
            const float *row = src[i] + r * D;
            for (int64_t d = 0; d < D8; d += 8) {
                const et_i8v v = *(const et_i8v *)(row + d);
                const et_u8v a = (et_u8v)v & 0x7fffffffu;
                const et_i8v key = v ^ ((v >> 31) & 0x7fffffff);
                const et_u8v up = (et_u8v)(a > b[i]);
                b[i] = (a & up) | (b[i] & ~up);
                const et_i8v down = (et_i8v)(key < m[i]);
                m[i] = (key & down) | (m[i] & ~down);
            }
            for (int64_t d = D8; d < D; ++d) {
                const uint32_t a = et_absbits(row[d]);
                const int32_t key = et_float_key(row[d]);
                tb[i] = a > tb[i] ? a : tb[i];
                tm[i] = key < tm[i] ? key : tm[i];
            }
        }
    }
    for (int i = 0; i < 4; ++i) {
        memcpy(mb + 8 * i, &b[i], sizeof b[i]);
        memcpy(mn + 8 * i, &m[i], sizeof m[i]);
        mb[8 * i] = tb[i] > mb[8 * i] ? tb[i] : mb[8 * i];
        mn[8 * i] = tm[i] < mn[8 * i] ? tm[i] : mn[8 * i];
    }
}

/* Bounds on the values an update reads, measured now over exactly the rows it touches (every row of [V, D] when
 * dense): hi[i] the largest |value| (inf when any is NaN or inf) and lo[i] the smallest value of the weights (i = 0)
 * and slots 0-2 (i = 1-3; 0 for a slot not present). Measured in the call that proves the update, so no write made
 * since an earlier step (through torch, .data, a NumPy view or other native code) can make a proof unsound.
 * Returns 0, or -2 for a workspace that does not fit the table. */
int et_touched_bounds_of(const et_workspace *h, const float *W, const float *S0, const float *S1,
                                const float *S2, int64_t V, int64_t D, int dense, int nthreads, double *hi,
                                double *lo) {
    if (!et_prepared_ok(h, V, D)) return -2;
    const float *const src[4] = {W, S0, S1, S2};
    const int64_t n = dense ? V : h->U;
    const int threads = n * D > 65536 && nthreads > 1 ? (nthreads < 64 ? nthreads : 64) : 1;
    uint32_t mb[64][32];
    int32_t mn[64][32];
    for (int t = 0; t < threads; ++t)
        for (int j = 0; j < 32; ++j) {
            mb[t][j] = 0;
            mn[t][j] = INT32_MAX;
        }
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; ++t)
        et_fold_rows(h, W, S0, S1, S2, D, dense, n * t / threads, n * (t + 1) / threads, mb[t], mn[t]);
    for (int i = 0; i < 4; ++i) {
        uint32_t m = 0;
        int32_t k = INT32_MAX;
        for (int t = 0; t < threads; ++t)
            for (int j = 0; j < 8; ++j) {
                m = mb[t][8 * i + j] > m ? mb[t][8 * i + j] : m;
                k = mn[t][8 * i + j] < k ? mn[t][8 * i + j] : k;
            }
        hi[i] = m >= ET_INF_BITS ? INFINITY : (double)et_bits_float(m);
        lo[i] = (src[i] && n > 0) ? (double)et_key_float(k) : 0.0;
    }
    return 0;
}

int et_touched_bounds(const void *handle, const float *W, const float *S0, const float *S1, const float *S2,
                      int64_t V, int64_t D, int dense, int nthreads, double *hi, double *lo) {
    return et_touched_bounds_of((const et_workspace *)handle, W, S0, S1, S2, V, D, dense, nthreads, hi, lo);
}

/* Every bounded intermediate stays below this (as kernels/record.py's SAFE: far below float32's 3.4e38). */
#define ET_SAFE 1e30

static int et_bounded(double v) { return v > -ET_SAFE && v < ET_SAFE; } /* NaN fails */


/* The finiteness proof of kernels/finite_guard.py for SGD, Adagrad and Adam, in double as there: 1 when the update of a
 * table with optimizer p, largest |summed gradient| gmax and bounds hi (max |value|) / lo (min value) of its
 * (weights, *slots) provably writes only finite values; then out holds bounds on every value it writes (and on the
 * table after it: they include hi). 0 otherwise, or for any other optimizer (not proven, never "not finite"). */
int et_prove_update(const et_opt *p, double gmax, const double *hi, const double *lo, double *out) {
    const int slots = et_proof_tensors(p->kind) - 1;
    if (slots < 0) return 0;
    const double lr = p->lr, decay = p->decay;
    if (!et_bounded(lr) || !et_bounded(decay) || !et_bounded(gmax)) return 0;
    for (int i = 0; i <= slots; ++i)
        if (!et_bounded(hi[i])) return 0;
    double g = gmax;
    const double cap = fmax(fabs((double)p->glo), fabs((double)p->ghi)); /* an open side: +inf, no cap */
    if (cap < g) g = cap;
    const double w_dec = hi[0] * (1.0 + fabs(decay));
    if (!et_bounded(w_dec) || !et_bounded(g * g)) return 0;
    if (p->kind == ET_SGD) {
        out[0] = w_dec + fabs(lr) * g;
    } else if (p->kind == ET_ADAM) { /* kernels/adam.py: |m| <= max(|m|, g), v <= v + g^2 (+ eps^2), eps below */
        const double eps = p->k.adam.epsilon;
        const double den_min = !p->f.adam.sum_inside_sqrt ? eps : sqrt(fmax(eps * eps * (1 - 1e-6), 0.0));
        if (!(lo[2] >= 0 && den_min >= 1.1754944e-38)) return 0;
        const double m_new = fmax(hi[1], g);
        out[0] = w_dec + fabs(lr) * m_new / den_min;
        out[1] = m_new;
        out[2] = hi[2] + g * g + eps * eps;
    } else {
        /* the update divides by sqrt(accumulator); a subnormal accumulator reads as zero (ET_FLUSH_SUBNORMALS) */
        if (!(lo[1] >= 1.1754944e-38)) return 0;
        const double ratio = fmax(1.001, 2e-19 / sqrt(lo[1])); /* |g| / sqrt(a + g^2), adagrad.step_ratio_bound */
        out[0] = w_dec + fabs(lr) * ratio;
        out[1] = hi[1] + g * g;
    }
    /* a weight clamp can move a value to its bound: the table's bound must cover it */
    if (isfinite(p->wlo)) out[0] = fmax(out[0], fabs((double)p->wlo));
    if (isfinite(p->whi)) out[0] = fmax(out[0], fabs((double)p->whi));
    for (int i = 0; i <= slots; ++i)
        if (!et_bounded(out[i])) return 0;
    return 1;
}
