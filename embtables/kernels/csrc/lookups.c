/* Pooled lookups of float32 tables, the split of ids by owning rank, and the finiteness scan. */
#include "embtables_native.h"

/* ------------------------------------------------------------------------------------------ */
/* Lookup: out[s] = sum_k coeffs[k] * W[ids[k]] over k in [offsets[s], offsets[s+1]).          */

/* One bag, one 64-column block: the accumulator lives in registers (4 AVX-512 / 8 AVX2 vectors).
 * pf_end > 0 also prefetches the row of id k + ET_LOOKUP_PF (k < pf_end), across bag boundaries.
 * Every id is range-checked against V before its row is read (prefetching a bad address is harmless);
 * a bad id sets *bad and is skipped. */
static inline void et_bag_block64(const float *W, int64_t D, int64_t V, const int64_t *ids, int64_t k0, int64_t k1,
                                  const float *coeffs, float *out, int64_t pf_end, int *bad) {
    float acc[64];
    for (int j = 0; j < 64; ++j) acc[j] = 0.0f;
    if (coeffs) {
        for (int64_t k = k0; k < k1; ++k) {
            if (k + ET_LOOKUP_PF < pf_end) et_prefetch_head(W + ids[k + ET_LOOKUP_PF] * D, D);
            const int64_t id = ids[k];
            if ((uint64_t)id >= (uint64_t)V) { *bad = 1; continue; }
            const float *restrict row = W + id * D;
            const float c = coeffs[k];
            for (int j = 0; j < 64; ++j) acc[j] += c * row[j];
        }
    } else {
        for (int64_t k = k0; k < k1; ++k) {
            if (k + ET_LOOKUP_PF < pf_end) et_prefetch_head(W + ids[k + ET_LOOKUP_PF] * D, D);
            const int64_t id = ids[k];
            if ((uint64_t)id >= (uint64_t)V) { *bad = 1; continue; }
            const float *restrict row = W + id * D;
            for (int j = 0; j < 64; ++j) acc[j] += row[j];
        }
    }
    memcpy(out, acc, sizeof acc);
}

/* One bag; a lane of *nonfinite is set for an output value that is not finite. */
static inline void et_bag(const float *W, int64_t D, int64_t V, const int64_t *ids, const int64_t *offsets, int64_t s,
                          int64_t total, const float *coeffs, float *out, int64_t ld, int *bad, et_u8v *nonfinite) {
    float *restrict o = out + s * ld;
    const int64_t k0 = offsets[s], k1 = offsets[s + 1];
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64)
        et_bag_block64(W + d0, D, V, ids, k0, k1, coeffs, o + d0, d0 == 0 ? total : 0, bad);
    if (d0 < D) { /* the columns past the last 64: the first good id writes 0 + c * row (o is not read), the rest add */
        int started = 0;
        for (int64_t k = k0; k < k1; ++k) {
            if (d0 == 0 && k + ET_LOOKUP_PF < total) et_prefetch_head(W + ids[k + ET_LOOKUP_PF] * D, D);
            const int64_t id = ids[k];
            if ((uint64_t)id >= (uint64_t)V) { *bad = 1; continue; }
            const float *restrict row = W + id * D;
            const float c = coeffs ? coeffs[k] : 1.0f; /* c * row with c == 1 is exact */
            if (started) {
                for (int64_t d = d0; d < D; ++d) o[d] += c * row[d];
            } else {
                for (int64_t d = d0; d < D; ++d) o[d] = 0.0f + c * row[d];
                started = 1;
            }
        }
        if (!started) /* an empty bag, or every id bad */
            for (int64_t d = d0; d < D; ++d) o[d] = 0.0f;
    }
    *nonfinite = et_nonfinite8(o, D, *nonfinite);
}

/* One bag of a float32 table, as the float32 lookups pool it: the half lookup's bags of float32 tables (a half
 * and float32 step's features in one call, half_tables.c). */
void et_bag_float32(const float *W, int64_t D, int64_t V, const int64_t *ids, const int64_t *offsets, int64_t s,
                    int64_t total, const float *coeffs, float *out, int64_t ld, int *bad, et_u8v *nonfinite) {
    et_bag(W, D, V, ids, offsets, s, total, coeffs, out, ld, bad, nonfinite);
}

/* 1 when every value of the F float32 buffers x[f] [n[f]] is finite (no NaN, no Inf), else 0. */
int et_all_finite(int64_t F, const float *const *x, const int64_t *n) {
    uint32_t m = 0;
    for (int64_t f = 0; f < F; ++f) m = et_maxbits(x[f], n[f], m);
    return m < ET_INF_BITS;
}

/* Owner of a valid global id (0 <= id < V) under "div" (spec §3: contiguous blocks, the first V % W ranks
 * hold q + 1 rows, the others q; V < W: rank i holds row i), from every rank's first row (first[0..W],
 * first[W] = V): the last rank r with first[r] <= id, by binary search, without a division. A rank
 * holding no row has first[r] == first[r + 1] and is never the answer. */
static inline int64_t et_first_row_owner(int64_t id, const int64_t *first, int64_t W) {
    int64_t lo = 0, hi = W; /* first[lo] <= id < first[hi] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) >> 1;
        if (first[mid] <= id) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* Owner of a valid id under strategy 0 "div" (from the first rows) or 1 "mod" (id modulo W; a mask when
 * W is a power of two). Writes the local row. */
static inline int64_t et_split_owner(int64_t id, int strategy, const int64_t *first, int64_t W, int64_t *local) {
    if (strategy == 1) {
        if ((W & (W - 1)) == 0) {
            *local = id >> __builtin_ctzll((unsigned long long)W);
            return id & (W - 1);
        }
        *local = id / W;
        return id % W;
    }
    const int64_t r = et_first_row_owner(id, first, W);
    *local = id - first[r];
    return r;
}

/* Split the bags of F features by the owner of each id (counting sort, stable): for feature f with ids
 * [N], offsets [S + 1] (offsets[0] == 0, offsets[S] == N) and coefficients [N] (NULL: all 1), write its
 * local rows and coefficients grouped by owner rank, in bag order within an owner (out_ids, out_coeffs
 * [N]; out_coeffs[f] NULL: not written), each owner's bag offsets (out_offsets [W, S + 1]) and each
 * owner's id count (out_counts [W]). Returns 0, or 1 when offsets are malformed or an id is outside
 * [0, V) (outputs then unusable). */
int et_split_by_owner(int64_t F, const int64_t *const *ids, const int64_t *N, const int64_t *const *offsets,
                      const int64_t *S, const float *const *coeffs, const int32_t *strategy, const int64_t *V,
                      int64_t W, int64_t *const *out_ids, float *const *out_coeffs, int64_t *const *out_offsets,
                      int64_t *const *out_counts) {
    if (W < 1) return 1;
    int64_t start[W], first[W + 1];
    for (int64_t f = 0; f < F; ++f) {
        const int64_t n = N[f], nb = S[f], v = V[f];
        const int64_t *off = offsets[f], *fid = ids[f];
        if (nb < 0 || !et_offsets_ok(off, nb, n) || off[0] != 0 || off[nb] != n || v < 1) return 1;
        if (strategy[f] != 0 && strategy[f] != 1) return 1;
        const int st = strategy[f];
        for (int64_t r = 0; r < W; ++r) { /* "div" (spec §3): the first V % W ranks hold one row more */
            const int64_t q = v / W, e = v % W;
            first[r] = r * q + (r < e ? r : e);
        }
        first[W] = v;
        int64_t *cnt = out_counts[f], *boff = out_offsets[f];
        memset(cnt, 0, sizeof(int64_t) * (size_t)W);
        memset(boff, 0, sizeof(int64_t) * (size_t)(W * (nb + 1)));
        for (int64_t s = 0; s < nb; ++s) {
            for (int64_t k = off[s]; k < off[s + 1]; ++k) {
                const int64_t id = fid[k];
                if ((uint64_t)id >= (uint64_t)v) return 1;
                int64_t local;
                const int64_t r = et_split_owner(id, st, first, W, &local);
                cnt[r]++;
                boff[r * (nb + 1) + s + 1]++;
            }
        }
        int64_t acc = 0;
        for (int64_t r = 0; r < W; ++r) {
            start[r] = acc;
            acc += cnt[r];
            int64_t *o = boff + r * (nb + 1);
            for (int64_t s = 0; s < nb; ++s) o[s + 1] += o[s];
        }
        const float *c = coeffs[f];
        int64_t *oid = out_ids[f];
        float *oc = out_coeffs[f];
        for (int64_t k = 0; k < n; ++k) {
            int64_t local;
            const int64_t r = et_split_owner(fid[k], st, first, W, &local);
            const int64_t pos = start[r]++;
            oid[pos] = local;
            if (oc) oc[pos] = c ? c[k] : 1.0f;
        }
    }
    return 0;
}

/* Output row s of every feature of one shared output (et_lookup_many): each feature's bag s, et_bag inlined here
 * (flatten: about 6% of a batch-512 concatenated lookup), not in et_bag_of (there it made the lookup per feature
 * slower). */
static inline __attribute__((flatten)) void et_bag_row(int64_t F, const float *const *W, const int64_t *D,
                                                       const int64_t *V, const int64_t *const *ids,
                                                       const int64_t *const *offsets, const int64_t *S,
                                                       const float *const *coeffs, float *const *out,
                                                       const int64_t *ld, int64_t s, int *bad,
                                                       et_u8v *nonfinite) {
    for (int64_t f = 0; f < F; ++f)
        et_bag(W[f], D[f], V[f], ids[f], offsets[f], s, offsets[f][S[f]], coeffs[f], out[f], ld[f], bad, nonfinite);
}

/* Output row s of every feature of one shared output when every bag holds one id and none has a coefficient
 * (et_one_id_bags): feature f's id s from ids[f] (at its first id), its block at out[f] + s * ld[f]. */
static inline void et_one_id_shared_row(int64_t F, const float *const *W, const int64_t *D, const int64_t *V,
                                        const int64_t *const *ids, int64_t S, float *const *out, const int64_t *ld,
                                        int64_t s, int *bad, et_u8v *nonfinite) {
    for (int64_t f = 0; f < F; ++f)
        et_one_id_bag(W[f], D[f], V[f], ids[f], s, S, out[f] + s * ld[f], bad, nonfinite);
}

/* Output row s of one shared output: et_one_id_shared_row when every bag holds one id (one_id), else et_bag_row. */
static inline __attribute__((always_inline)) void et_shared_row(int one_id, int64_t F, const float *const *W,
                                                                const int64_t *D, const int64_t *V,
                                                                const int64_t *const *ids,
                                                                const int64_t *const *first_id,
                                                                const int64_t *const *offsets, const int64_t *S,
                                                                const float *const *coeffs, float *const *out,
                                                                const int64_t *ld, int64_t s, int *bad,
                                                                et_u8v *nonfinite) {
    if (one_id)
        et_one_id_shared_row(F, W, D, V, first_id, S[0], out, ld, s, bad, nonfinite);
    else
        et_bag_row(F, W, D, V, ids, offsets, S, coeffs, out, ld, s, bad, nonfinite);
}

/* Bag i of the index space of every feature's bags (first[f]: feature f's first), *f its feature found from the
 * one before: et_one_id_bag when every bag of every feature holds one id (one_id; first_id[f] feature f's first
 * id), else et_bag. */
static inline void et_bag_of(int one_id, const float *const *W, const int64_t *D, const int64_t *V,
                             const int64_t *const *ids, const int64_t *const *first_id, const int64_t *const *offsets,
                             const int64_t *S, const float *const *coeffs, float *const *out, const int64_t *ld,
                             const int64_t *first, int64_t i, int64_t *f, int *bad, et_u8v *nonfinite) {
    const int64_t g = *f = et_feature_of(first, i, *f), s = i - first[g];
    if (one_id)
        et_one_id_bag(W[g], D[g], V[g], first_id[g], s, S[g], out[g] + s * ld[g], bad, nonfinite);
    else
        et_bag(W[g], D[g], V[g], ids[g], offsets[g], s, offsets[g][S[g]], coeffs[g], out[g], ld[g], bad, nonfinite);
}

/* The rows of each feature's first ET_LOOKUP_PF ids, prefetched before the bags reach them (each bag prefetches
 * ET_LOOKUP_PF ids ahead within its feature: at batch 64 with one id a bag, a quarter of the rows were read cold
 * one by one). A bad id's address is only prefetched (harmless); et_bag checks every id before reading. */
static inline __attribute__((always_inline)) void et_first_ids(int64_t F, const float *const *W, const int64_t *D,
                                                                const int64_t *const *ids, const int64_t *N) {
    for (int64_t f = 0; f < F; ++f)
        for (int64_t k = 0; k < N[f] && k < ET_LOOKUP_PF; ++k) et_prefetch_head(W[f] + ids[f][k] * D[f], D[f]);
}

/* The lookups of F features in one parallel region (none for one thread): feature f reads table W[f] [V[f],
 * D[f]] through ids[f] [N[f]] and writes out[f] [S[f], D[f]], rows ld[f] >= D[f] floats apart (ld[f] > D[f]: a
 * column block of one wider output, the concatenated activations). Bags of all features form one index space split
 * over the threads. When every bag of every feature holds one id and none has coefficients (et_one_id_features),
 * each bag is et_one_id_bag: the same bits without the bag loop. Returns 0 ok, 1 bad offsets, an id outside
 * [0, V) (outputs are then garbage and must be discarded) or a shape or stride that does not fit (et_shapes_ok:
 * nothing written), 2 a non-finite activation. */
int et_lookup_many(int64_t F, const float *const *W, const int64_t *D, const int64_t *V, const int64_t *const *ids,
                   const int64_t *N, const int64_t *const *offsets, const int64_t *S, const float *const *coeffs,
                   float *const *out, const int64_t *ld, int nthreads) {
    ET_FLUSH_SUBNORMALS;
    if (!et_shapes_ok(F, D, V, ld)) return 1;
    int64_t first[F + 1];
    if (!et_bag_index(F, offsets, S, N, first)) return 1;
    const int64_t all = first[F];
    int bad = 0, nonfinite = 0;
    et_u8v lanes = {0, 0, 0, 0, 0, 0, 0, 0}; /* one thread's non-finite lanes */
    /* Column blocks of one shared output (every feature S bags, rows ld > D apart): bag by bag, every feature's
     * block of an output row while the row is in cache (feature by feature, each of the row's cache lines was
     * fetched again for every feature once the output outgrew L2). The same sums, in another order of bags. */
    int shared = F > 1;
    for (int64_t f = 0; f < F && shared; ++f) shared = S[f] == S[0] && ld[f] > D[f];
    if (nthreads <= 1) et_first_ids(F, W, D, ids, N);
    const int64_t *first_id[F > 0 ? F : 1];
    const int one_id = et_one_id_features(F, ids, offsets, S, coeffs, first_id);
    if (shared) {
        const int64_t rows = S[0];
        if (nthreads <= 1) { /* one thread: no parallel region (entering one costs a system call or two) */
            for (int64_t s = 0; s < rows; ++s)
                et_shared_row(one_id, F, W, D, V, ids, first_id, offsets, S, coeffs, out, ld, s, &bad, &lanes);
            return bad ? 1 : (et_any_lane(lanes) ? 2 : 0);
        }
#pragma omp parallel num_threads(nthreads) reduction(| : bad, nonfinite)
        {
            ET_FLUSH_SUBNORMALS;
            et_u8v mine = lanes;
#pragma omp for schedule(static, 64)
            for (int64_t s = 0; s < rows; ++s)
                et_shared_row(one_id, F, W, D, V, ids, first_id, offsets, S, coeffs, out, ld, s, &bad, &mine);
            nonfinite |= et_any_lane(mine);
        }
        return bad ? 1 : (nonfinite ? 2 : 0);
    }
    if (nthreads <= 1) {
        int64_t f = 0;
        for (int64_t i = 0; i < all; ++i)
            et_bag_of(one_id, W, D, V, ids, first_id, offsets, S, coeffs, out, ld, first, i, &f, &bad, &lanes);
        return bad ? 1 : (et_any_lane(lanes) ? 2 : 0);
    }
#pragma omp parallel num_threads(nthreads) reduction(| : bad, nonfinite)
    {
        ET_FLUSH_SUBNORMALS;
        int64_t f = 0;
        et_u8v mine = lanes;
#pragma omp for schedule(static, 256)
        for (int64_t i = 0; i < all; ++i)
            et_bag_of(one_id, W, D, V, ids, first_id, offsets, S, coeffs, out, ld, first, i, &f, &bad, &mine);
        nonfinite |= et_any_lane(mine);
    }
    return bad ? 1 : (nonfinite ? 2 : 0);
}
