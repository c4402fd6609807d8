/* The bounds that prove an update finite without computing it: the touched rows' largest |value| and smallest
 * value, and the proof of kernels/finite_guard.py, in double. */
#include "embtables_native.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

/* Lane-wise signed max and min of 8 int32 lanes (et_i8v; the plain loops were not vectorised): one instruction
 * each with AVX2, a compare and a select otherwise. */
static inline et_i8v et_max8(et_i8v a, et_i8v b) {
#ifdef __AVX2__
    return (et_i8v)_mm256_max_epi32((__m256i)a, (__m256i)b);
#else
    const et_i8v up = (et_i8v)(a > b);
    return (a & up) | (b & ~up);
#endif
}
static inline et_i8v et_min8(et_i8v a, et_i8v b) {
#ifdef __AVX2__
    return (et_i8v)_mm256_min_epi32((__m256i)a, (__m256i)b);
#else
    const et_i8v down = (et_i8v)(a < b);
    return (a & down) | (b & ~down);
#endif
}

/* One slot row's first D8 floats (a multiple of 8) into 8-lane running maxima / minima of et_float_key. Inlined
 * on the caller's locals, so the lanes stay in registers across rows. */
static inline __attribute__((always_inline)) void et_fold_keys(const float *row, int64_t D8, et_i8v *up,
                                                                et_i8v *down) {
    et_i8v u = *up, m = *down;
    for (int64_t d = 0; d < D8; d += 8) {
        const et_i8v v = *(const et_i8v *)(row + d);
        const et_i8v key = v ^ ((v >> 31) & 0x7fffffff);
        u = et_max8(u, key);
        m = et_min8(m, key);
    }
    *up = u;
    *down = m;
}

/* Prefetch row q of every tensor present. Always inlined, so its prefetches stay in the loop (float32_updates.c,
 * et_prefetch_state, says why). */
static inline __attribute__((always_inline)) void et_bounds_prefetch(const float *const *src, int64_t D, int64_t q) {
    for (int i = 0; i < 4; ++i)
        if (src[i])
            for (int64_t off = 0; off < D; off += 16) __builtin_prefetch(src[i] + q * D + off, 0, 3);
}

/* The first 16 of the update's rows [k0, k1), prefetched before the loop reaches them (the loop prefetches 16
 * rows ahead: a small update's first rows, a quarter of 64, were read cold one by one). */
static inline __attribute__((always_inline)) void et_bounds_first_rows(const et_workspace *h, const float *const *src,
                                                                        int64_t D, int dense, int64_t k0,
                                                                        int64_t k1) {
    if (dense) return;
    for (int64_t k = k0; k < k1 && k < k0 + 16; ++k) et_bounds_prefetch(src, D, h->rows[k]);
}

/* The row the bounds pass folds k-th (k itself when dense), after prefetching every tensor's row of the update's
 * row 16 further on (before k1). */
static inline __attribute__((always_inline)) int64_t et_bounds_row(const et_workspace *h, const float *const *src,
                                                                  int64_t D, int dense, int64_t k, int64_t k1) {
    if (dense) return k;
    if (k + 16 < k1) et_bounds_prefetch(src, D, h->rows[k + 16]);
    return h->rows[k];
}

/* Fold rows [k0, k1) of the update (rows k0..k1-1 of [V, D] when dense) into 8-lane running bounds, every tensor
 * of a row together, 16 rows prefetched ahead: the weights' largest |value| (as bits, up[0..7]); each slot's
 * largest and smallest et_float_key (up[8i..8i+7], down[8i..8i+7], i = 1..3), from which et_touched_bounds_of
 * takes its largest |value| and smallest value. No proof reads the weights' smallest value, so it is not
 * measured. The pass is bound by these operations as much as by its reads: the lanes are locals, in registers
 * for the whole range (kept in memory, each 8 floats waited on the store of the 8 before), read from and written
 * to up / down once; columns past the last multiple of 8 fold into lane 0. A noinline function of its own:
 * inside the OpenMP region's outlined function the same loop ran several times slower. */
static __attribute__((noinline)) void et_fold_rows(const et_workspace *h, const float *W, const float *S0,
                                                   const float *S1, const float *S2, int64_t D, int dense,
                                                   int64_t k0, int64_t k1, int32_t *up, int32_t *down) {
    const float *const src[4] = {W, S0, S1, S2};
    const int64_t D8 = D & ~(int64_t)7;
    et_i8v u0, u1, u2, u3, m1, m2, m3;
    memcpy(&u0, up, sizeof u0);
    memcpy(&u1, up + 8, sizeof u1);
    memcpy(&u2, up + 16, sizeof u2);
    memcpy(&u3, up + 24, sizeof u3);
    memcpy(&m1, down + 8, sizeof m1);
    memcpy(&m2, down + 16, sizeof m2);
    memcpy(&m3, down + 24, sizeof m3);
    int32_t tu[4], tm[4];
    for (int i = 0; i < 4; ++i) {
        tu[i] = up[8 * i];
        tm[i] = down[8 * i];
    }
    et_bounds_first_rows(h, src, D, dense, k0, k1);
    for (int64_t k = k0; k < k1; ++k) {
        const int64_t o = et_bounds_row(h, src, D, dense, k, k1) * D;
        for (int64_t d = 0; d < D8; d += 8) u0 = et_max8(u0, *(const et_i8v *)(W + o + d) & 0x7fffffff);
        if (S0) et_fold_keys(S0 + o, D8, &u1, &m1);
        if (S1) et_fold_keys(S1 + o, D8, &u2, &m2);
        if (S2) et_fold_keys(S2 + o, D8, &u3, &m3);
        if (D8 < D) { /* the columns past the lanes */
            for (int64_t d = D8; d < D; ++d) {
                const int32_t a = (int32_t)et_absbits(W[o + d]);
                tu[0] = a > tu[0] ? a : tu[0];
            }
            for (int i = 1; i < 4; ++i)
                for (int64_t d = D8; src[i] && d < D; ++d) {
                    const int32_t key = et_float_key(src[i][o + d]);
                    tu[i] = key > tu[i] ? key : tu[i];
                    tm[i] = key < tm[i] ? key : tm[i];
                }
        }
    }
    memcpy(up, &u0, sizeof u0);
    memcpy(up + 8, &u1, sizeof u1);
    memcpy(up + 16, &u2, sizeof u2);
    memcpy(up + 24, &u3, sizeof u3);
    memcpy(down + 8, &m1, sizeof m1);
    memcpy(down + 16, &m2, sizeof m2);
    memcpy(down + 24, &m3, sizeof m3);
    for (int i = 0; i < 4; ++i) {
        up[8 * i] = tu[i] > up[8 * i] ? tu[i] : up[8 * i];
        down[8 * i] = tm[i] < down[8 * i] ? tm[i] : down[8 * i];
    }
}

#ifdef __AVX512F__
#define ET_WIDE_BOUNDS 1
/* The weights' |value| bits of one row's columns [0, D16) and, when tail is not 0, the tail's columns past them
 * (a masked read: the lanes past the row read 0, which no |value| is below) into 16 running lanes. */
static inline __attribute__((always_inline)) __m512i et_abs_fold16(const float *row, int64_t D16, __mmask16 tail,
                                                                    __m512i a) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    for (int64_t d = 0; d < D16; d += 16)
        a = _mm512_max_epi32(a, _mm512_and_si512(_mm512_loadu_si512(row + d), magnitude));
    if (tail) a = _mm512_max_epi32(a, _mm512_and_si512(_mm512_maskz_loadu_epi32(tail, row + D16), magnitude));
    return a;
}

/* et_float_key of 16 floats' bits. */
static inline __m512i et_key16(__m512i v) {
    return _mm512_xor_si512(v, _mm512_and_si512(_mm512_srai_epi32(v, 31), _mm512_set1_epi32(0x7fffffff)));
}

/* A slot row's et_float_key maxima and minima, as et_abs_fold16 reads it; the masked tail updates only its own
 * lanes. */
static inline __attribute__((always_inline)) void et_key_fold16(const float *row, int64_t D16, __mmask16 tail,
                                                                 __m512i *up, __m512i *down) {
    __m512i u = *up, m = *down;
    for (int64_t d = 0; d < D16; d += 16) {
        const __m512i key = et_key16(_mm512_loadu_si512(row + d));
        u = _mm512_max_epi32(u, key);
        m = _mm512_min_epi32(m, key);
    }
    if (tail) {
        const __m512i key = et_key16(_mm512_maskz_loadu_epi32(tail, row + D16));
        u = _mm512_mask_max_epi32(u, tail, u, key);
        m = _mm512_mask_min_epi32(m, tail, m, key);
    }
    *up = u;
    *down = m;
}

/* et_fold_rows on 16 lanes (AVX-512): the same bounds in half the instructions, and the columns past the last
 * multiple of 16 read with a mask instead of one at a time. The pass waits on its reads with a window of
 * instructions in flight; fewer instructions a row keep more rows' reads in flight (8 x 1M x 64 tables, 205k
 * touched rows: 4.96-5.10 -> 4.30-4.52 ms in a C driver, where a plain read of the rows takes 3.3-3.7). up /
 * down hold 16 lanes a tensor (up[16i..16i+15]). */
static __attribute__((noinline)) void et_fold_rows16(const et_workspace *h, const float *W, const float *S0,
                                                     const float *S1, const float *S2, int64_t D, int dense,
                                                     int64_t k0, int64_t k1, int32_t *up, int32_t *down) {
    const float *const src[4] = {W, S0, S1, S2};
    const int64_t D16 = D & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (D - D16)) - 1u);
    __m512i u0 = _mm512_loadu_si512(up), u1 = _mm512_loadu_si512(up + 16), u2 = _mm512_loadu_si512(up + 32);
    __m512i u3 = _mm512_loadu_si512(up + 48), m1 = _mm512_loadu_si512(down + 16);
    __m512i m2 = _mm512_loadu_si512(down + 32), m3 = _mm512_loadu_si512(down + 48);
    et_bounds_first_rows(h, src, D, dense, k0, k1);
    for (int64_t k = k0; k < k1; ++k) {
        const int64_t o = et_bounds_row(h, src, D, dense, k, k1) * D;
        u0 = et_abs_fold16(W + o, D16, tail, u0);
        if (S0) et_key_fold16(S0 + o, D16, tail, &u1, &m1);
        if (S1) et_key_fold16(S1 + o, D16, tail, &u2, &m2);
        if (S2) et_key_fold16(S2 + o, D16, tail, &u3, &m3);
    }
    _mm512_storeu_si512(up, u0);
    _mm512_storeu_si512(up + 16, u1);
    _mm512_storeu_si512(up + 32, u2);
    _mm512_storeu_si512(up + 48, u3);
    _mm512_storeu_si512(down + 16, m1);
    _mm512_storeu_si512(down + 32, m2);
    _mm512_storeu_si512(down + 48, m3);
}
#else
#define ET_WIDE_BOUNDS 0
#endif

/* The lanes of the bounds pass: 16 (et_fold_rows16) where the library is built with AVX-512, else 8
 * (et_fold_rows); chosen when the library loads. Both give the same bounds; et_bounds_path lets a test force
 * each. */
static int et_bounds_lanes = ET_WIDE_BOUNDS ? 16 : 8;

/* Set the bounds pass's lanes (16 where built with AVX-512, 8; any other value leaves them); returns the lanes
 * before. */
int32_t et_bounds_path(int32_t lanes) {
    const int32_t before = et_bounds_lanes;
    if (lanes == 8 || (lanes == 16 && ET_WIDE_BOUNDS)) et_bounds_lanes = lanes;
    return before;
}

/* Rows [k0, k1) folded on the pass's lanes L (16: et_fold_rows16, 8: et_fold_rows). */
static void et_fold_range(int L, const et_workspace *h, const float *W, const float *S0, const float *S1,
                          const float *S2, int64_t D, int dense, int64_t k0, int64_t k1, int32_t *up, int32_t *down) {
#if ET_WIDE_BOUNDS
    if (L == 16) {
        et_fold_rows16(h, W, S0, S1, S2, D, dense, k0, k1, up, down);
        return;
    }
#endif
    (void)L;
    et_fold_rows(h, W, S0, S1, S2, D, dense, k0, k1, up, down);
}

/* Bounds on the values an update reads, measured now over exactly the rows it touches (every row of [V, D] when
 * dense): hi[i] the largest |value| (inf when any is NaN or inf) of the weights (i = 0) and slots 0-2 (i = 1-3),
 * lo[i] the smallest value of each slot (a NaN or -inf when one is, -inf for the weights: not measured, no proof
 * reads it); both 0 for a slot not present or an update of no rows. Measured in the call that proves the update,
 * so no write made since an earlier step (through torch, .data, a NumPy view or other native code) can make a
 * proof unsound. Returns 0, or -2 for a workspace that does not fit the table. */
int et_touched_bounds_of(const et_workspace *h, const float *W, const float *S0, const float *S1,
                                const float *S2, int64_t V, int64_t D, int dense, int nthreads, double *hi,
                                double *lo) {
    if (!et_prepared_ok(h, V, D)) return -2;
    const float *const src[4] = {W, S0, S1, S2};
    const int64_t n = dense ? V : h->U;
    const int threads = n * D > 65536 && nthreads > 1 ? (nthreads < 64 ? nthreads : 64) : 1;
    const int L = et_bounds_lanes; /* lanes a tensor: up[t][L * i + j], lane j of tensor i */
    int32_t up[64][64];
    int32_t down[64][64];
    for (int t = 0; t < threads; ++t)
        for (int j = 0; j < 4 * L; ++j) {
            up[t][j] = j < L ? 0 : INT32_MIN; /* |x| bits of the weights; keys of the slots */
            down[t][j] = INT32_MAX;
        }
    if (threads == 1) { /* no parallel region: entering one, even of one thread, costs a system call or two */
        et_fold_range(L, h, W, S0, S1, S2, D, dense, 0, n, up[0], down[0]);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; ++t)
            et_fold_range(L, h, W, S0, S1, S2, D, dense, n * t / threads, n * (t + 1) / threads, up[t], down[t]);
    }
    const int32_t pos_inf = et_float_key(INFINITY), neg_inf = et_float_key(-INFINITY);
    for (int i = 0; i < 4; ++i) {
        int32_t u = i ? INT32_MIN : 0, m = INT32_MAX;
        for (int t = 0; t < threads; ++t)
            for (int j = L * i; j < L * i + L; ++j) {
                u = up[t][j] > u ? up[t][j] : u;
                m = down[t][j] < m ? down[t][j] : m;
            }
        if (!src[i] || n == 0) {
            hi[i] = lo[i] = 0.0;
        } else if (i == 0) {
            hi[0] = (uint32_t)u >= ET_INF_BITS ? INFINITY : (double)et_bits_float((uint32_t)u);
            lo[0] = -INFINITY;
        } else {
            const double most = fabs((double)et_key_float(u)), least = fabs((double)et_key_float(m));
            hi[i] = u >= pos_inf || m <= neg_inf ? INFINITY : (most > least ? most : least);
            lo[i] = (double)et_key_float(m);
        }
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
