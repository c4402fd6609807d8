/* What the native kernels' sources share (embtables_native.c, half_tables.c): the optimizer parameters, the
 * prepared update, the CPU's subnormal modes, and small helpers on float bits and bags. */
#ifndef EMBTABLES_NATIVE_H
#define EMBTABLES_NATIVE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Subnormals (docs/spec.md §1.5): every kernel that computes with float32 values runs with the CPU's
 * flush-to-zero and denormals-are-zero modes on, as TF's CPU kernels and TPUs do: a subnormal operand reads as
 * zero and a subnormal result is written as zero, in every operation (and no operation takes the slow microcode
 * path subnormals take on many x86 CPUs). ET_FLUSH_SUBNORMALS turns both modes on in the calling thread until the
 * end of the enclosing block, then puts the thread's own modes back: it opens every exported function that
 * computes and every OpenMP parallel region (each thread of a team has its own control register), and leaves
 * nothing set for the Python and torch code that shares the threads. ET_CAN_FLUSH (et_flushes_subnormals()) says
 * whether this build can (x86-64 and AArch64 can; Python refuses to load a build that cannot). */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int et_fp_mode;
static inline et_fp_mode et_flush_on(void) {
    const et_fp_mode saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u); /* FTZ (bit 15) | DAZ (bit 6) */
    return saved;
}
static inline void et_flush_restore(const et_fp_mode *saved) { _mm_setcsr(*saved); }
#define ET_CAN_FLUSH 1
#elif defined(__aarch64__)
typedef uint64_t et_fp_mode;
static inline et_fp_mode et_flush_on(void) {
    et_fp_mode saved;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved | ((et_fp_mode)1 << 24)) : "memory"); /* FZ: inputs and results */
    return saved;
}
static inline void et_flush_restore(const et_fp_mode *saved) {
    __asm__ __volatile__("msr fpcr, %0" : : "r"(*saved) : "memory");
}
#define ET_CAN_FLUSH 1
#else
typedef int et_fp_mode;
static inline et_fp_mode et_flush_on(void) { return 0; }
static inline void et_flush_restore(const et_fp_mode *saved) { (void)saved; }
#define ET_CAN_FLUSH 0
#endif
#define ET_FLUSH_SUBNORMALS                                                                                            \
    const et_fp_mode et_saved_fp_mode __attribute__((cleanup(et_flush_restore), unused)) = et_flush_on()

enum {
    ET_SGD = 0,
    ET_ADAGRAD = 1,
    ET_ADAGRAD_MOMENTUM = 2,
    ET_ADAM = 3,
    ET_FTRL = 4,
    ET_PROXIMAL_ADAGRAD = 5,
    ET_MOMENTUM = 6,
    ET_RMSPROP = 7,
    ET_CENTERED_RMSPROP = 8,
    ET_ADADELTA = 9,
    ET_PROXIMAL_YOGI = 10,
    ET_FREQUENCY_ESTIMATOR = 11
};

/* Each optimizer's named flags and float32 constants (its kernel record in embtables/kernels/<name>.py
 * derives them; tests/numerics/test_kernel_records.py checks these members against the records). */
typedef union {
    int32_t raw[2];
    struct { int32_t use_nesterov, beta2_is_one; } adagrad_momentum;
    struct { int32_t sum_inside_sqrt; } adam;
    struct { int32_t multiply_linear_by_learning_rate, allow_zero_accumulator; } ftrl;
    struct { int32_t use_nesterov; } momentum;
} et_flags;

typedef union {
    float raw[8];
    struct { float momentum, neg_inv_exponent, beta2, one_minus_beta2, epsilon; } adagrad_momentum;
    struct { float beta_1, one_minus_beta_1, beta_2, one_minus_beta_2, epsilon_squared, epsilon; } adam;
    struct { float power, l1, beta, two_l2; } ftrl;
    struct { float l1, l2; } proximal_adagrad;
    struct { float momentum; } momentum;
    struct { float rho, one_minus_rho, momentum, epsilon; } rmsprop;
    struct { float rho, one_minus_rho, epsilon; } adadelta;
    struct { float beta_1, one_minus_beta_1, one_minus_beta_2, epsilon, l1, l2; } proximal_yogi;
    struct { float max_delta, outlier_threshold, one_minus_tau, tau; } frequency_estimator;
} et_constants;

/* Mirrors embtables.kernels.native._OptParams (ctypes.Structure); keep the field order in sync. */
typedef struct {
    int32_t kind;
    et_flags f;
    float lr, decay, glo, ghi, wlo, whi; /* absent clip bounds are -inf / +inf */
    et_constants k;
} et_opt;

/* |x| as its IEEE bit pattern: for non-negative floats the integer order is the float order, so an integer
 * max (which vectorises without -ffast-math, unlike a float max) gives the largest magnitude, and a value
 * is finite iff its bits are below ET_INF_BITS (NaN sorts above inf). */
#define ET_INF_BITS 0x7f800000u
static inline uint32_t et_absbits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7fffffffu;
}
static inline float et_bits_float(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}
static inline uint32_t et_maxbits(const float *x, int64_t D, uint32_t m) {
    for (int64_t d = 0; d < D; ++d) {
        const uint32_t a = et_absbits(x[d]);
        m = a > m ? a : m;
    }
    return m;
}

/* Rows an update takes through its optimizer in one call (the half update, the checked small update): a power
 * of two up to 16, at most 256 values a block (or one row of a wider table). A block's reads end before its
 * arithmetic starts, so a larger block leaves the memory idle longer (1024 values: the standard bfloat16 step,
 * width 64, slower than with 256). */
static inline int64_t et_block_rows(int64_t D) {
    int64_t R = 16;
    while (R > 1 && R * D > 256) R /= 2;
    return R;
}

#define ET_PF 8 /* rows of look-ahead: enough misses in flight to cover DRAM latency */
#define ET_LOOKUP_PF 16 /* ids of look-ahead in the lookup and in phase 1's sums: one row prefetched per id processed */

/* 8 uint32, int32 and float32 lanes (GCC / Clang vector extensions, unaligned loads) */
typedef uint32_t et_u8v __attribute__((vector_size(32), aligned(4)));
typedef int32_t et_i8v __attribute__((vector_size(32), aligned(4)));
typedef float et_f8v __attribute__((vector_size(32), aligned(4)));

/* Whether any lane of a vector of masks is set. */
static inline int et_any_lane(et_u8v m) {
    uint64_t q[4];
    memcpy(q, &m, sizeof q);
    return (q[0] | q[1] | q[2] | q[3]) != 0;
}

/* ``bad`` with a lane set for every value of x [D] that is not finite (NaN or infinite), 8 values a step: a
 * loop of many rows reduces the lanes once (et_any_lane), not once a row. */
static inline et_u8v et_nonfinite8(const float *x, int64_t D, et_u8v bad) {
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        et_u8v v;
        memcpy(&v, x + d, sizeof v);
        bad |= (et_u8v)((v & 0x7fffffffu) >= ET_INF_BITS);
    }
    for (; d < D; ++d) bad[0] |= et_absbits(x[d]) >= ET_INF_BITS;
    return bad;
}

/* An optimizer's fused row update, and the one for a kind (NULL: a kind the kernels do not know); defined in
 * embtables_native.c, not exported from the library. */
typedef void (*et_row_fn)(const et_opt *, float *, float *, float *, float *, const float *, int64_t);
__attribute__((visibility("hidden"))) et_row_fn et_row_function(int kind);

/* A table's prepared update (phase 1's result, phase 2's input) and its scratch. */
typedef struct {
    int64_t U, D, mask;
    int64_t *rows;  /* [U] unique row ids, in order of first occurrence */
    float *G;       /* [U, D] summed gradients */
    int32_t *hvals; /* a bucket's unique index (-1 = empty): its key is rows[index] */
    int finite;
    float gmax;     /* max |G| after phase 1 (for the finiteness guard) */
    /* scratch, reused across steps (capacities in elements) */
    int32_t *inv;
    int64_t *start, *occ;
    const float **occ_g;
    float *occ_c;
    float *scratch; /* [U, <= 4 x D]: the rows a checked small update overwrites, kept until it is checked */
    int64_t cap_n, cap_h, cap_g, cap_s;
    /* Small tables dedup through a direct map instead of the hash: dmap [cap_d], id -> unique index, -1 where
     * absent; rows[0 .. dmap_n) are set in it (cleared again before rows is next written). */
    int32_t *dmap;
    int64_t cap_d, dmap_n;
    int direct; /* the current unique rows are in dmap (else in the hash) */
} et_workspace;

/* The prepared rows must lie in [0, V) of a [V, D] table: re-checked in each call that writes through them. */
static inline int et_prepared_ok(const et_workspace *h, int64_t V, int64_t D) {
    if (h->D != D) return 0;
    for (int64_t u = 0; u < h->U; ++u)
        if ((uint64_t)h->rows[u] >= (uint64_t)V) return 0;
    return 1;
}

/* offsets [S+1] (S >= 0) must start at >= 0, never decrease and end at <= N: checked in the call that reads them. */
static inline int et_offsets_ok(const int64_t *offsets, int64_t S, int64_t N) {
    if (S < 0 || offsets[0] < 0 || offsets[S] > N) return 0;
    for (int64_t s = 0; s < S; ++s)
        if (offsets[s + 1] < offsets[s]) return 0;
    return 1;
}

/* F >= 0 features, feature f a table of V[f] >= 0 rows of width D[f] >= 0 and rows ld[f] >= D[f] floats apart (an
 * output's or a gradient's): checked in the call that reads or writes through them, so no id test lets a row past
 * the table through and no row starts before its buffer or overlaps the next. */
static inline int et_shapes_ok(int64_t F, const int64_t *D, const int64_t *V, const int64_t *ld) {
    if (F < 0) return 0;
    for (int64_t f = 0; f < F; ++f)
        if (D[f] < 0 || V[f] < 0 || ld[f] < D[f]) return 0;
    return 1;
}

/* The bags of F features as one index space: first[f] [F + 1] is feature f's first bag (first[F] all of them),
 * every feature's offsets checked (et_offsets_ok). Returns 0 when one is bad. */
static inline int et_bag_index(int64_t F, const int64_t *const *offsets, const int64_t *S, const int64_t *N, int64_t *first) {
    first[0] = 0;
    for (int64_t f = 0; f < F; ++f) {
        if (!et_offsets_ok(offsets[f], S[f], N[f])) return 0;
        first[f + 1] = first[f] + S[f];
    }
    return 1;
}

/* The feature of bag i of that index space, from the feature f of a nearby bag (a thread walks its bags in
 * order: a step or two at most). */
static inline int64_t et_feature_of(const int64_t *first, int64_t i, int64_t f) {
    while (i >= first[f + 1]) ++f;
    while (i < first[f]) --f;
    return f;
}

/* ------------------------------------------------------------------ shared by the sources' parts */
/* Prefetch the head of a row (its first two 64-byte lines) into all cache levels: the hardware's
 * adjacent-line and stream prefetchers bring the rest, and fewer prefetch instructions matter when hot
 * (Zipf) rows are already cached. Measured: 7.6 -> 5.9 ms for the standard lookup. */
static inline __attribute__((always_inline)) void et_prefetch_head(const float *row, int64_t D) {
    __builtin_prefetch(row, 0, 3);
    if (D > 16) __builtin_prefetch(row + 16, 0, 3);
}

/* Whether every bag of a feature holds exactly one id: offsets [S + 1] are offsets[0], offsets[0] + 1, ...,
 * offsets[0] + S (checked in the call that reads through them; et_offsets_ok's rules then hold too). */
static inline int et_one_id_bags(const int64_t *offsets, int64_t S) {
    const int64_t base = offsets[0];
    if (offsets[S] != base + S) return 0; /* pooled bags: no pass */
    int64_t off = 0;
    for (int64_t s = 0; s <= S; ++s) off |= offsets[s] ^ (base + s);
    return off == 0;
}

/* 1 when every bag of F features holds one id and none has coefficients (et_one_id_bags), first_id[f] [F] then
 * feature f's first id: the lookups read each feature's ids from there, without their offsets. */
static inline int et_one_id_features(int64_t F, const int64_t *const *ids, const int64_t *const *offsets,
                                     const int64_t *S, const float *const *coeffs, const int64_t **first_id) {
    for (int64_t f = 0; f < F; ++f) {
        if (coeffs[f] || !et_one_id_bags(offsets[f], S[f])) return 0;
        first_id[f] = ids[f] + offsets[f][0];
    }
    return 1;
}

/* The row of bag s of a feature whose bags hold one id each (et_one_id_bags; ids at the feature's first id, S
 * bags) in a table of rows ``bytes`` apart, the row of bag s + ET_LOOKUP_PF prefetched (its first two 64-byte
 * lines, as et_prefetch_head); NULL, with o [D] zeroed and *bad set, for an id outside [0, V). */
static inline __attribute__((always_inline)) const char *et_one_id_row(const char *W, int64_t bytes, int64_t V,
                                                                       const int64_t *ids, int64_t s, int64_t S,
                                                                       float *o, int64_t D, int *bad) {
    if (s + ET_LOOKUP_PF < S) {
        const char *ahead = W + ids[s + ET_LOOKUP_PF] * bytes;
        __builtin_prefetch(ahead, 0, 3);
        if (bytes > 64) __builtin_prefetch(ahead + 64, 0, 3);
    }
    const int64_t id = ids[s];
    if ((uint64_t)id >= (uint64_t)V) {
        *bad = 1;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
        return NULL;
    }
    return W + id * bytes;
}

/* Bag s of such a feature of a float32 table: o [D] = 0 + its row, the sum et_bag makes of one id, and a lane of
 * *nonfinite set for a value that is not finite, from the registers stored (the output is not read back). */
static inline __attribute__((always_inline)) void et_one_id_bag(const float *W, int64_t D, int64_t V,
                                                                const int64_t *ids, int64_t s, int64_t S,
                                                                float *restrict o, int *bad, et_u8v *nonfinite) {
    const float *restrict row = (const float *)et_one_id_row((const char *)W, 4 * D, V, ids, s, S, o, D, bad);
    if (!row) return;
    et_u8v lanes = *nonfinite;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        const et_f8v v = 0.0f + *(const et_f8v *)(row + d);
        *(et_f8v *)(o + d) = v;
        lanes |= (et_u8v)(((et_u8v)v & 0x7fffffffu) >= ET_INF_BITS);
    }
    for (; d < D; ++d) {
        o[d] = 0.0f + row[d];
        lanes[0] |= et_absbits(o[d]) >= ET_INF_BITS;
    }
    *nonfinite = lanes;
}

/* Prefetch a whole row (every 64-byte line), for writing. */
static inline __attribute__((always_inline)) void et_prefetch_row(const float *row, int64_t D, int rw) {
    for (int64_t off = 0; off < D; off += 16) {
        if (rw) __builtin_prefetch(row + off, 1, 0);
        else __builtin_prefetch(row + off, 0, 0);
    }
}

/* Phase 1's hash over a workspace's rows (embtables_native.c); the updates find rows with it too. */
static inline uint64_t et_hash(int64_t id) { return (uint64_t)id * 0x9E3779B97F4A7C15ull; }

static inline int64_t et_find(const et_workspace *h, int64_t id, int shift) {
    if (h->direct) return (uint64_t)id < (uint64_t)h->cap_d ? h->dmap[id] : -1;
    uint64_t b = et_hash(id) >> shift;
    for (int32_t v; (v = h->hvals[b]) != -1; b = (b + 1) & (uint64_t)h->mask) {
        if (h->rows[v] == id) return v;
    }
    return -1;
}

static inline int et_shift(int64_t mask) {
    int bits = 0;
    while ((1ll << bits) <= mask) ++bits;
    return 64 - bits;
}

/* Whether a lazy update of the prepared rows goes through them in row order (the direct map, scanned): when
 * they are at least a quarter of the table, the table's rows then stream in order, which the hardware
 * prefetches, instead of being fetched at random; each row's update is the same either way. */
static inline int et_in_row_order(const et_workspace *h, int64_t V) { return h->direct && h->cap_d >= V && V <= 4 * h->U; }

/* Phase 1's allocation helpers (embtables_native.c), used by the updates' scratch. */
__attribute__((visibility("hidden"))) int et_reserve(void **p, int64_t *cap, int64_t n, size_t sz);
__attribute__((visibility("hidden"))) void et_shrink(void **p, int64_t *cap, int64_t need, size_t sz);
/* Bounds over the rows an update touches, and the proof that it is finite (finite_bounds.c). */
__attribute__((visibility("hidden"))) int et_touched_bounds_of(const et_workspace *h, const float *W,
                                                             const float *S0, const float *S1, const float *S2,
                                                             int64_t V, int64_t D, int dense, int nthreads,
                                                             double *hi, double *lo);
int et_prove_update(const et_opt *p, double gmax, const double *hi, const double *lo, double *out);
/* One bag of a float32 table into out + s * ld [D] (lookups.c), for the half lookup's float32 features. */
__attribute__((visibility("hidden"))) void et_bag_float32(const float *W, int64_t D, int64_t V, const int64_t *ids,
                                                        const int64_t *offsets, int64_t s, int64_t total,
                                                        const float *coeffs, float *out, int64_t ld, int *bad,
                                                        et_u8v *nonfinite);
/* Phase 2 of float32 tables, all or nothing (float32_updates.c): the half update's float32 tables. */
void et_apply_many(int64_t T, void *const *handles, float *const *W, float *const *S0, float *const *S1,
                   float *const *S2, const int64_t *V, const int64_t *D, const et_opt *const *p, const int32_t *dense,
                   const int32_t *measure, const int32_t *check, int nthreads, float *maxabs, int32_t *status,
                   int64_t *bad, double *hi, double *lo, int32_t *proven);
/* How many tensors (weights and slots) et_prove_update bounds for an optimizer kind: 0 where it proves nothing. */
static inline int et_proof_tensors(int kind) {
    return kind == ET_SGD ? 1 : kind == ET_ADAGRAD ? 2 : kind == ET_ADAM ? 3 : 0;
}

#endif
