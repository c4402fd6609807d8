/* Native CPU kernels for embtables, compiled at first use by kernels/native_library.py (gcc -O3 -fopenmp
 * -ffp-contract=off -fno-trapping-math: FP exception flags are never read, so selects may be if-converted; values
 * unchanged) and called through ctypes on buffers kernels/native.py checked. Float32 arithmetic in the same
 * operation order as the torch reference path (kernels/<optimizer>.py); no fused multiply-add, so gradient sums
 * are bit-identical to the reference's index_add_. The sources, sharing embtables_native.h:
 *
 *   embtables_native.c  phase 1 of an update (this file): a table's ids deduplicated into a workspace and each
 *                       row's gradient summed; the workspace loaded from rows; the inputs staged and checked
 *   lookups.c           pooled lookups, the split of ids by owning rank, the finiteness scan
 *   optimizer_rows.c    one row's update per optimizer
 *   float32_updates.c   phase 2 of float32 tables: checked, lazy, dense and sequential updates
 *   finite_bounds.c     the bounds that prove an update finite
 *   half_tables.c       stochastic rounding, half-precision tables' lookups and updates
 *
 * Shapes: W, S0, S1, S2 are [V, D] row-major; ids [N] int64; offsets [S+1] int64; coeffs [N] float32
 * (NULL = all 1); grads [S, D] float32 (NULL = zero gradient).
 */
#include "embtables_native.h"

int et_flushes_subnormals(void) { return ET_CAN_FLUSH; }

/* The same over ``rows`` rows of D floats, ld floats apart: the running maxima stay in 8 lanes across
 * rows (one horizontal reduction at the end, not one per row). */
static inline uint32_t et_maxbits_rows(const float *x, int64_t rows, int64_t D, int64_t ld, uint32_t m) {
    uint32_t lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t D8 = D & ~(int64_t)7;
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * ld;
        for (int64_t d = 0; d < D8; d += 8)
            for (int j = 0; j < 8; ++j) {
                const uint32_t a = et_absbits(row[d + j]);
                lane[j] = a > lane[j] ? a : lane[j];
            }
        m = et_maxbits(row + D8, D - D8, m);
    }
    for (int j = 0; j < 8; ++j) m = lane[j] > m ? lane[j] : m;
    return m;
}

/* ------------------------------------------------------------------------------------------ */
/* Phase 1: dedup the ids of one table (all its features) with an open-addressing hash, and sum */
/* each unique row's gradient, in occurrence order, into G [U, D]. Nothing in W/S changes.      */

void *et_workspace_new(void) { return calloc(1, sizeof(et_workspace)); }

void et_workspace_free(void *handle) {
    et_workspace *h = (et_workspace *)handle;
    if (!h) return;
    free(h->rows);
    free(h->G);
    free(h->hvals);
    free(h->inv);
    free(h->start);
    free(h->occ);
    free(h->occ_g);
    free(h->occ_c);
    free(h->scratch);
    free(h->dmap);
    free(h);
}

/* Grow *p to hold n elements of size sz (never shrinks: steady-state steps allocate nothing). */
int et_reserve(void **p, int64_t *cap, int64_t n, size_t sz) {
    if (n <= *cap && *p) return 1;
    int64_t want = n + n / 4 + 16;
    void *q = realloc(*p, (size_t)want * sz);
    if (!q) return 0;
    *p = q;
    *cap = want;
    return 1;
}

/* Free a buffer whose capacity is over 4x what this step needs (and over 1 MiB), so that one huge step
 * does not pin its scratch memory for the life of the module; the next et_reserve sizes it again. */
void et_shrink(void **p, int64_t *cap, int64_t need, size_t sz) {
    if (*p && *cap > 4 * (need + 16) && (size_t)*cap * sz > ((size_t)1 << 20)) {
        free(*p);
        *p = NULL;
        *cap = 0;
    }
}

/* Phase 1 for one table [V, D] into workspace h. Every offset and id is checked here, in the call that
 * reads them. status: 0 ok, 1 non-finite gradient, 2 out of memory, 3 bad offsets or an id outside [0, V). */
/* Phase 1, step 1: every buffer sized for N occurrences (one shared capacity) and, with ``hash``, a hash table
 * of 2N..4N buckets, emptied (the direct map needs none); 0 when out of memory (the workspace stays
 * consistent). */
static int et_reserve_workspace(et_workspace *h, int64_t N, int hash) {
    int64_t H = 16;
    while (hash && H < 2 * N) H <<= 1;
    if (h->cap_n > 4 * (N + 16) && h->cap_n * 40 > (1 << 20)) {
        /* every N-sized buffer shares one capacity: drop them together */
        free(h->inv); free(h->rows); free(h->start); free(h->occ); free(h->occ_g); free(h->occ_c);
        h->inv = NULL; h->rows = NULL; h->start = NULL; h->occ = NULL; h->occ_g = NULL; h->occ_c = NULL;
        h->cap_n = 0;
    }
    int64_t cap_h0 = h->cap_h;
    et_shrink((void **)&h->hvals, &cap_h0, H, sizeof(int32_t));
    if (!h->hvals) h->cap_h = 0;
    int64_t cap_n = h->cap_n, cap_h = h->cap_h;
    int ok = 1;
    /* every N-sized buffer shares one capacity: reserve them all against the old one */
    int64_t c;
    c = h->cap_n; ok &= et_reserve((void **)&h->inv, &c, N + 1, sizeof(int32_t));
    c = h->cap_n; ok &= et_reserve((void **)&h->rows, &c, N + 1, sizeof(int64_t));
    c = h->cap_n; ok &= et_reserve((void **)&h->start, &c, N + 2, sizeof(int64_t));
    c = h->cap_n; ok &= et_reserve((void **)&h->occ, &c, N + 1, sizeof(int64_t));
    c = h->cap_n; ok &= et_reserve((void **)&h->occ_g, &c, N + 1, sizeof(float *));
    c = h->cap_n; ok &= et_reserve((void **)&h->occ_c, &c, N + 1, sizeof(float));
    cap_n = c;
    c = h->cap_h; ok &= et_reserve((void **)&h->hvals, &c, H, sizeof(int32_t));
    cap_h = c;
    if (!ok) return 0;
    h->cap_n = cap_n;
    h->cap_h = cap_h;
    h->mask = H - 1;
    if (hash) memset(h->hvals, 0xff, sizeof(int32_t) * H); /* every bucket empty (-1) */
    return 1;
}

/* Tables of at most this many rows (or 4 x the step's ids, when more) dedup through the direct map. */
#define ET_DIRECT_V (1 << 16)

static int et_dedup_mode = 0; /* 0: by size (et_use_direct), 1: always the hash, 2: the direct map up to 2^22 rows */

/* For tests: the same steps through either dedup (they must give the same bits). Not thread-safe: set it
 * between steps. */
void et_set_dedup_mode(int mode) { et_dedup_mode = mode; }

static int et_use_direct(int64_t V, int64_t N) {
    if (et_dedup_mode) return et_dedup_mode == 2 && V <= (1 << 22);
    return V <= ET_DIRECT_V || (V <= 4 * N && V <= (1 << 22));
}

/* Forget the unique rows of the previous phase 1 in the direct map (all -1 again): before rows is rewritten. */
static void et_clear_direct(et_workspace *h) {
    for (int64_t u = 0; u < h->dmap_n; ++u) h->dmap[h->rows[u]] = -1;
    h->dmap_n = 0;
    h->direct = 0;
}

/* The direct map sized for ids in [0, V) (its new entries -1; the old ones are -1 after et_clear_direct). */
static int et_reserve_direct(et_workspace *h, int64_t V) {
    if (h->cap_d >= V) return 1;
    int32_t *m = (int32_t *)realloc(h->dmap, sizeof(int32_t) * (size_t)(V > 0 ? V : 1));
    if (!m) return 0;
    memset(m + h->cap_d, 0xff, sizeof(int32_t) * (size_t)(V - h->cap_d));
    h->dmap = m;
    h->cap_d = V;
    return 1;
}

/* et_dedup through the direct map: the same rows and inv (first-occurrence order), no hashing or probing. */
static int et_dedup_direct(et_workspace *h, int64_t nfeat, const int64_t *const *ids, const int64_t *const *offsets,
                           const int64_t *nbags, int64_t V, int64_t *U_out) {
    int32_t *inv = h->inv, *map = h->dmap;
    int64_t *rows = h->rows;
    int64_t U = 0, kg = 0;
    h->direct = 1;
    for (int64_t f = 0; f < nfeat; ++f) {
        const int64_t *fid = ids[f];
        const int64_t kend = offsets[f][nbags[f]];
        for (int64_t k = offsets[f][0]; k < kend; ++k, ++kg) {
            const int64_t id = fid[k];
            if ((uint64_t)id >= (uint64_t)V) {
                h->dmap_n = U;
                return 0;
            }
            int32_t u = map[id];
            if (u < 0) {
                u = (int32_t)U;
                map[id] = u;
                rows[U++] = id;
            }
            inv[kg] = u;
        }
    }
    h->dmap_n = U;
    *U_out = U;
    return 1;
}

/* Phase 1, step 2: dedup in first-occurrence order: rows[u] (the U unique ids) and inv[k] (the unique
 * index of occurrence k, over all features); 0 when an id is outside [0, V). */
static int et_dedup(et_workspace *h, int64_t nfeat, const int64_t *const *ids, const int64_t *const *offsets,
                    const int64_t *nbags, int64_t V, int64_t *U_out) {
    const int shift = et_shift(h->mask);
    int32_t *inv = h->inv;
    int64_t U = 0, kg = 0;
    for (int64_t f = 0; f < nfeat; ++f) {
        const int64_t *fid = ids[f];
        const int64_t kend = offsets[f][nbags[f]];
        for (int64_t k = offsets[f][0]; k < kend; ++k, ++kg) {
            if (k + 16 < kend) { /* the probes are random: keep several bucket misses in flight */
                const uint64_t ahead = et_hash(fid[k + 16]) >> shift;
                __builtin_prefetch(h->hvals + ahead, 1, 0);
            }
            const int64_t id = fid[k];
            if ((uint64_t)id >= (uint64_t)V) return 0;
            uint64_t b = et_hash(id) >> shift;
            int32_t v;
            while ((v = h->hvals[b]) != -1 && h->rows[v] != id) b = (b + 1) & (uint64_t)h->mask;
            if (v == -1) { /* a new unique row: its bucket holds its index, rows[index] its id */
                v = (int32_t)U;
                h->hvals[b] = v;
                h->rows[U++] = id;
            }
            inv[kg] = v;
        }
    }
    *U_out = U;
    return 1;
}

/* Phase 1, step 3: the occurrences of each unique row in occurrence order (CSR: start [U + 1], each
 * with its incoming gradient row, NULL for a zero gradient, and its coefficient); returns the most
 * occurrences any one row has. */
static int64_t et_group_occurrences(et_workspace *h, int64_t nfeat, const int64_t *const *offsets,
                                    const int64_t *nbags, const float *const *coeffs, const float *const *grads,
                                    const int64_t *ld, int64_t N) {
    const int64_t U = h->U;
    const int32_t *inv = h->inv;
    int64_t *start = h->start, *occ = h->occ;
    memset(start, 0, sizeof(int64_t) * (size_t)(U + 1));
    for (int64_t i = 0; i < N; ++i) start[inv[i] + 1]++;
    int64_t maxcount = 0;
    for (int64_t u = 0; u < U; ++u) {
        const int64_t c = start[u + 1];
        maxcount = c > maxcount ? c : maxcount;
        start[u + 1] += start[u];
    }
    memcpy(occ, start, sizeof(int64_t) * (size_t)U);
    int64_t kg = 0;
    for (int64_t f = 0; f < nfeat; ++f) {
        const int64_t *off = offsets[f];
        for (int64_t s = 0; s < nbags[f]; ++s) {
            const float *grow = grads[f] ? grads[f] + s * ld[f] : NULL;
            for (int64_t k = off[s]; k < off[s + 1]; ++k, ++kg) {
                const int64_t pos = occ[inv[kg]]++;
                h->occ_g[pos] = grow;
                h->occ_c[pos] = coeffs[f] ? coeffs[f][k] : 1.0f;
            }
        }
    }
    return maxcount;
}

/* |summed gradient| <= maxcount * max|coeff| * max|incoming gradient|: bounded from the S x D
 * gradients (and N coefficients) instead of scanning the U x D sums afterwards (INFINITY when an
 * input is not finite). */
static double et_sum_bound(int64_t nfeat, const int64_t *const *offsets, const int64_t *nbags,
                           const float *const *coeffs, const float *const *grads, const int64_t *ld, int64_t D,
                           int64_t maxcount) {
    uint32_t in_bits = 0, c_bits = 0x3f800000u; /* |1.0f|: absent coefficients are 1 */
    for (int64_t f = 0; f < nfeat; ++f) {
        if (grads[f] && ld[f] == D) {
            in_bits = et_maxbits(grads[f], nbags[f] * D, in_bits);
        } else if (grads[f]) { /* rows ld[f] apart (columns of a wider gradient) */
            in_bits = et_maxbits_rows(grads[f], nbags[f], D, ld[f], in_bits);
        }
        if (coeffs[f]) c_bits = et_maxbits(coeffs[f] + offsets[f][0], offsets[f][nbags[f]] - offsets[f][0], c_bits);
    }
    if (in_bits >= ET_INF_BITS || c_bits >= ET_INF_BITS) return INFINITY;
    return (double)maxcount * (double)et_bits_float(c_bits) * (double)et_bits_float(in_bits);
}

/* Phase 1, step 4: G [U, D], the float32 sums of each row's occurrences in occurrence order (in
 * parallel over rows); with ``scan``, returns the largest |sum| as float bits (else 0). */
static uint32_t et_sum_rows(et_workspace *h, int64_t D, int scan, int nthreads) {
    const int64_t U = h->U;
    const int64_t *start = h->start;
    const float *const *occ_g = (const float *const *)h->occ_g;
    const float *occ_c = h->occ_c;
    uint32_t gbits = 0;
#pragma omp parallel num_threads(nthreads) reduction(max : gbits)
    {
        ET_FLUSH_SUBNORMALS;
#pragma omp for schedule(static, 256)
        for (int64_t u = 0; u < U; ++u) {
            float *restrict acc = h->G + u * D;
            for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
            for (int64_t i = start[u]; i < start[u + 1]; ++i) {
                const float *restrict g = occ_g[i];
                if (!g) {
                    for (int64_t d = 0; d < D; ++d) acc[d] += 0.0f;
                    continue;
                }
                const float cf = occ_c[i];
                if (cf == 1.0f) {
                    for (int64_t d = 0; d < D; ++d) acc[d] += g[d];
                } else {
                    for (int64_t d = 0; d < D; ++d) acc[d] += g[d] * cf;
                }
            }
            if (scan) {
                const uint32_t m = et_maxbits(acc, D, 0);
                gbits = m > gbits ? m : gbits;
            }
        }
    }
    return gbits;
}

/* Sums of at most this many floats (256 KiB) stay in L2 while they are scattered: cleared first, not prefetched. */
#define ET_SUMS_IN_CACHE 65536

/* Phase 1, steps 3-4 on one thread: G [U, D] summed by scattering the occurrences in occurrence order
 * (the gradient rows are read in order, no grouping pass). Each row gets the same float32 additions in the
 * same order as et_sum_rows gives it (from +0, zero gradients adding +0): the same bits. N: the occurrences
 * (inv [N]). Sums past ET_SUMS_IN_CACHE (``large``) are random reads past L2: each is prefetched ET_LOOKUP_PF
 * occurrences ahead and set to +0 at its row's first occurrence (rows are numbered in that order) rather than
 * by a pass clearing all of G first, and each row's occurrences are counted (in h->start, which the one-thread
 * path does not otherwise use); on sums in L2 that bookkeeping costs more than it saves. Returns the most
 * occurrences any one row has when ``large``, else 0. */
static int64_t et_scatter_sums(et_workspace *h, int64_t nfeat, const int64_t *const *offsets, const int64_t *nbags,
                               const float *const *coeffs, const float *const *grads, const int64_t *ld, int64_t D,
                               int64_t N, int large) {
    float *G = h->G;
    const int32_t *inv = h->inv;
    int64_t *count = h->start;
    int64_t kg = 0, seen = 0, maxcount = 0;
    if (!large) memset(G, 0, sizeof(float) * (size_t)(h->U * D)); /* all-zero bits: +0.0f */
    for (int64_t f = 0; f < nfeat; ++f) {
        const int64_t *off = offsets[f];
        for (int64_t s = 0; s < nbags[f]; ++s) {
            const float *restrict grow = grads[f] ? grads[f] + s * ld[f] : NULL;
            for (int64_t k = off[s]; k < off[s + 1]; ++k, ++kg) {
                const int64_t u = inv[kg];
                float *restrict acc = G + u * D;
                if (large) {
                    if (kg + ET_LOOKUP_PF < N) et_prefetch_row(G + (int64_t)inv[kg + ET_LOOKUP_PF] * D, D, 1);
                    if (u == seen) {
                        ++seen;
                        count[u] = 0;
                        for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
                    }
                    const int64_t c = ++count[u];
                    maxcount = c > maxcount ? c : maxcount;
                }
                if (!grow) {
                    for (int64_t d = 0; d < D; ++d) acc[d] += 0.0f;
                    continue;
                }
                const float cf = coeffs[f] ? coeffs[f][k] : 1.0f;
                if (cf == 1.0f) {
                    for (int64_t d = 0; d < D; ++d) acc[d] += grow[d];
                } else {
                    for (int64_t d = 0; d < D; ++d) acc[d] += grow[d] * cf;
                }
            }
        }
    }
    return maxcount;
}

/* Phase 1 for one table: check the offsets, size the workspace, dedup, group, sum. ``status``: 0 done,
 * 1 a sum is not finite, 2 out of memory, 3 bad offsets, an id outside [0, V) or a shape that does not fit (D < 0,
 * V < 0, a gradient's rows ld[f] < D apart). */
static void et_prepare_one(et_workspace *h, int64_t nfeat, const int64_t *const *ids, const int64_t *nids,
                           const int64_t *const *offsets, const int64_t *nbags, const float *const *coeffs,
                           const float *const *grads, const int64_t *ld, int64_t D, int64_t V, int nthreads,
                           int *status) {
    int64_t N = 0, U = 0;
    et_clear_direct(h);
    h->U = 0;
    h->D = D;
    *status = 3;
    if (D < 0 || V < 0 || nfeat < 0) return;
    for (int64_t f = 0; f < nfeat; ++f) {
        if (!et_offsets_ok(offsets[f], nbags[f], nids[f]) || (grads[f] && ld[f] < D)) return;
        N += offsets[f][nbags[f]] - offsets[f][0];
    }
    *status = 2;
    const int direct = et_use_direct(V, N);
    if (!et_reserve_workspace(h, N, !direct) || (direct && !et_reserve_direct(h, V))) return;
    const int deduped = direct ? et_dedup_direct(h, nfeat, ids, offsets, nbags, V, &U)
                               : et_dedup(h, nfeat, ids, offsets, nbags, V, &U);
    if (!deduped) {
        *status = 3;
        return;
    }
    et_shrink((void **)&h->G, &h->cap_g, (U ? U : 1) * D, sizeof(float));
    if (!et_reserve((void **)&h->G, &h->cap_g, (U ? U : 1) * D, sizeof(float))) return;
    h->U = U;
    const int in_cache = nthreads <= 1 && U * D <= ET_SUMS_IN_CACHE; /* one thread, sums in L2 */
    const int64_t maxcount = nthreads <= 1 /* one thread: scatter in occurrence order, no grouping pass */
                                 ? et_scatter_sums(h, nfeat, offsets, nbags, coeffs, grads, ld, D, N, !in_cache)
                                 : et_group_occurrences(h, nfeat, offsets, nbags, coeffs, grads, ld, N);
    /* Below 1e37 no sum of maxcount float32 terms can overflow (float32 max is 3.4e38), so the sums need no
     * scan (past L2 it would read them all again); above it each row is scanned exactly. Sums in L2 are always
     * scanned: cheaper than the bound there, and exact. */
    const double bound = in_cache ? INFINITY : et_sum_bound(nfeat, offsets, nbags, coeffs, grads, ld, D, maxcount);
    const int scan = !(bound < 1e37);
    const uint32_t gbits = nthreads <= 1 ? (scan ? et_maxbits(h->G, U * D, 0) : 0) : et_sum_rows(h, D, scan, nthreads);
    const int finite = gbits < ET_INF_BITS;
    h->finite = finite;
    h->gmax = !finite ? INFINITY : (scan ? et_bits_float(gbits) : (float)(bound * 1.0001));
    *status = finite ? 0 : 1;
}

/* Phase 1 for T tables at once. With at least as many tables as threads, tables run in parallel,
 * each on one thread (the dedup is serial, so this is where the second core pays); otherwise each
 * table uses every thread. Table t [V[t], dims[t]] has features features[first[t] .. first[t+1]) (first[0] >= 0,
 * never decreasing: else every status is 3 and nothing is prepared); the gradient rows of feature f are
 * ld[f] >= dims[t] floats apart (a column block of a wider gradient). */
void et_prepare_many(int64_t T, const int64_t *first, const int64_t *const *ids, const int64_t *nids,
                     const int64_t *const *offsets, const int64_t *nbags, const float *const *coeffs,
                     const float *const *grads, const int64_t *ld, const int64_t *dims, const int64_t *V,
                     int nthreads, void **workspaces, int *statuses) {
    ET_FLUSH_SUBNORMALS;
    int ranges_ok = T <= 0 || first[0] >= 0; /* feature ranges neither before the arrays nor overlapping */
    for (int64_t t = 0; t < T && ranges_ok; ++t) ranges_ok = first[t + 1] >= first[t];
    if (!ranges_ok) {
        for (int64_t t = 0; t < T; ++t) { /* every workspace emptied, as a status of 3 leaves it */
            et_clear_direct((et_workspace *)workspaces[t]);
            ((et_workspace *)workspaces[t])->U = 0;
            statuses[t] = 3;
        }
        return;
    }
    if (T >= nthreads && nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        {
            ET_FLUSH_SUBNORMALS;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < T; ++t) {
                const int64_t f0 = first[t], nf = first[t + 1] - first[t];
                et_prepare_one((et_workspace *)workspaces[t], nf, ids + f0, nids + f0, offsets + f0, nbags + f0,
                               coeffs + f0, grads + f0, ld + f0, dims[t], V[t], 1, statuses + t);
            }
        }
        return;
    }
    for (int64_t t = 0; t < T; ++t) {
        const int64_t f0 = first[t], nf = first[t + 1] - first[t];
        et_prepare_one((et_workspace *)workspaces[t], nf, ids + f0, nids + f0, offsets + f0, nbags + f0, coeffs + f0,
                       grads + f0, ld + f0, dims[t], V[t], nthreads, statuses + t);
    }
}

int64_t et_prepared_size(const void *handle) { return ((const et_workspace *)handle)->U; }

/* The largest prepared update (unique rows x D[t] values) of T workspaces: one call for every table. */
int64_t et_prepared_values_max(int64_t T, void *const *handles, const int64_t *D) {
    int64_t most = 0;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t values = ((const et_workspace *)handles[t])->U * D[t];
        most = values > most ? values : most;
    }
    return most;
}

float et_prepared_gmax(const void *handle) { return ((const et_workspace *)handle)->gmax; }

/* Bytes of scratch memory the workspace holds now. */
int64_t et_workspace_bytes(const void *handle) {
    const et_workspace *h = (const et_workspace *)handle;
    const int64_t per_n = sizeof(int32_t) + sizeof(int64_t) * 3 + sizeof(float *) + sizeof(float);
    return h->cap_n * per_n + h->cap_h * (int64_t)(sizeof(int64_t) + sizeof(int32_t)) +
           (h->cap_g + h->cap_s) * (int64_t)sizeof(float);
}

/* Copy the unique rows [U] and summed gradients [U, D] out (for tests and the torch fallback). */
void et_prepared_copy(const void *handle, int64_t *rows, float *G) {
    const et_workspace *h = (const et_workspace *)handle;
    memcpy(rows, h->rows, sizeof(int64_t) * h->U);
    memcpy(G, h->G, sizeof(float) * h->U * h->D);
}

/* Fill workspace h with U distinct rows [U] in [0, V) and their summed gradients G [U, D], as phase 1 would
 * (used to apply an update that was copied or unpickled). Returns 0, 2 out of memory, 3 a row outside
 * [0, V) or a repeated row (the workspace is then empty). */
int et_workspace_load(void *handle, const int64_t *rows, const float *G, int64_t U, int64_t D, int64_t V) {
    et_workspace *h = (et_workspace *)handle;
    et_clear_direct(h);
    h->U = 0;
    h->D = D;
    int64_t H = 16;
    while (H < 2 * U) H <<= 1;
    int ok = 1;
    int64_t c = h->cap_n;
    ok &= et_reserve((void **)&h->rows, &c, U + 1, sizeof(int64_t));
    if (c != h->cap_n) { /* keep the shared N-capacity of the other N-sized buffers consistent */
        c = h->cap_n; ok &= et_reserve((void **)&h->inv, &c, U + 1, sizeof(int32_t));
        c = h->cap_n; ok &= et_reserve((void **)&h->start, &c, U + 2, sizeof(int64_t));
        c = h->cap_n; ok &= et_reserve((void **)&h->occ, &c, U + 1, sizeof(int64_t));
        c = h->cap_n; ok &= et_reserve((void **)&h->occ_g, &c, U + 1, sizeof(float *));
        c = h->cap_n; ok &= et_reserve((void **)&h->occ_c, &c, U + 1, sizeof(float));
        if (ok) h->cap_n = c;
    }
    int64_t ch = h->cap_h;
    ok &= et_reserve((void **)&h->hvals, &ch, H, sizeof(int32_t));
    if (ok) h->cap_h = ch;
    ok = ok && et_reserve((void **)&h->G, &h->cap_g, (U ? U : 1) * D, sizeof(float));
    if (!ok) return 2;
    h->mask = H - 1;
    memset(h->hvals, 0xff, sizeof(int32_t) * H);
    const int shift = et_shift(h->mask);
    for (int64_t u = 0; u < U; ++u) {
        const int64_t id = rows[u];
        if ((uint64_t)id >= (uint64_t)V) return 3;
        uint64_t b = et_hash(id) >> shift;
        int32_t v;
        while ((v = h->hvals[b]) != -1 && h->rows[v] != id) b = (b + 1) & (uint64_t)h->mask;
        if (v != -1) return 3;
        h->rows[u] = id; /* before its bucket names it: a later probe reads rows[u] */
        h->hvals[b] = (int32_t)u;
    }
    memcpy(h->G, G, sizeof(float) * (size_t)(U * D));
    const uint32_t gbits = et_maxbits(G, U * D, 0);
    h->gmax = gbits >= ET_INF_BITS ? INFINITY : et_bits_float(gbits);
    h->U = U;
    return 0;
}

/* Stage F features' inputs into one owned arena dst [cap] and check them there (so what was checked is
 * what the engine keeps, whatever the caller writes later). Feature f takes N[f] ids then its offsets:
 * S[f] + 1 copied row splits, or, when S[f] < 0 (dense ids, one id per bag), N[f] + 1 offsets 0..N[f].
 * status[f] = 0 when every id is in [0, V[f]) and the splits start at 0, never decrease and end at N[f];
 * 1 otherwise (that feature's region is then unusable); single[f] = 1 when every bag holds exactly one id.
 * A row-split feature whose combiner[f] is 1 (mean) or 2 (sqrtn) takes N[f] floats of coef [coef_cap] in
 * feature order: each id's coefficient, written when the feature is good and not single (0: sum, none).
 * Returns the int64 count written, or -1 (nothing written) when a size is negative or the regions do not
 * fit in cap. */
int64_t et_stage_inputs_many(int64_t F, const int64_t *const *ids, const int64_t *N, const int64_t *const *splits,
                             const int64_t *S, const int64_t *V, int64_t *dst, int64_t cap, int32_t *status,
                             int32_t *single, const int32_t *combiner, float *coef, int64_t coef_cap) {
    ET_FLUSH_SUBNORMALS;
    int64_t need = 0, coef_need = 0;
    for (int64_t f = 0; f < F; ++f) {
        if (N[f] < 0 || V[f] < 0 || (S[f] >= 0 && !splits[f]) || combiner[f] < 0 || combiner[f] > 2) return -1;
        const int64_t len = N[f] + 1 + (S[f] >= 0 ? S[f] : N[f]);
        if (len > cap - need) return -1;
        need += len;
        if (combiner[f] != 0 && S[f] >= 0) {
            if (N[f] > coef_cap - coef_need) return -1;
            coef_need += N[f];
        }
    }
    int64_t at = 0, coef_at = 0;
    for (int64_t f = 0; f < F; ++f) {
        int64_t *x = dst + at;
        const uint64_t v = (uint64_t)V[f];
        if (N[f] > 0) memcpy(x, ids[f], (size_t)N[f] * sizeof(int64_t));
        int bad = 0;
        if (v) /* V = 0: a dynamic table's keys, every int64 is one */
            for (int64_t k = 0; k < N[f]; ++k) bad |= (uint64_t)x[k] >= v; /* negative ids wrap above V */
        int64_t *o = x + N[f];
        if (S[f] >= 0) {
            memcpy(o, splits[f], (size_t)(S[f] + 1) * sizeof(int64_t));
            bad = bad || o[0] != 0 || o[S[f]] != N[f];
            int one = S[f] == N[f];
            for (int64_t b = 0; b < S[f] && !bad; ++b) {
                bad = o[b + 1] < o[b];
                one = one && o[b + 1] - o[b] == 1;
            }
            single[f] = one && !bad;
            if (combiner[f] != 0) {
                /* every id of a bag of c ids: 1/c (mean) or 1/sqrt(c) (sqrtn), in float32 exactly as the
                 * torch path computes them (c as float32, sqrtf, one correctly rounded division) */
                if (!bad && !one)
                    for (int64_t b = 0; b < S[f]; ++b) {
                        const int64_t c = o[b + 1] - o[b];
                        float den = (float)c;
                        if (combiner[f] == 2) den = sqrtf(den);
                        const float scale = den != 0.0f ? 1.0f / den : 0.0f;
                        for (int64_t k = o[b]; k < o[b + 1]; ++k) coef[coef_at + k] = scale;
                    }
                coef_at += N[f];
            }
            at += N[f] + S[f] + 1;
        } else {
            for (int64_t k = 0; k <= N[f]; ++k) o[k] = k;
            single[f] = 1;
            at += 2 * N[f] + 1;
        }
        status[f] = bad;
    }
    return at;
}
