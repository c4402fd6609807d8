/* Phase 2 of float32 tables: the checked, lazy, dense and sequential updates from a prepared workspace, all or
 * nothing across tables (et_apply_many), and the rows each marks changed. */
#include "embtables_native.h"

/* maxabs[i] from the largest |value| bits m[i] written into the weights and slots 0-2 (a NaN written, bits
 * above inf, reads back as inf: the engine's bound then forces the exact check). */
static inline void et_store_maxabs(float *maxabs, const uint32_t *m) {
    for (int i = 0; i < 4; ++i) maxabs[i] = m[i] >= ET_INF_BITS ? INFINITY : et_bits_float(m[i]);
}

/* Prefetch row q / D of the weights and each slot present (rw: for writing). Always inlined: a function of
 * prefetches alone has no effect GCC must keep, so GCC 12 marked it const and deleted every call to it (the
 * fused update and the dry run ran without prefetching; the standard update took about 1.6x as long). */
static inline __attribute__((always_inline)) void et_prefetch_state(const float *W, const float *S0,
                                                                    const float *S1, const float *S2, int64_t q,
                                                                    int64_t D, int rw) {
    et_prefetch_row(W + q, D, rw);
    if (S0) et_prefetch_row(S0 + q, D, rw);
    if (S1) et_prefetch_row(S1 + q, D, rw);
    if (S2) et_prefetch_row(S2 + q, D, rw);
}

/* Copy one row of D floats as 8-float vectors (GCC / Clang vector extensions, unaligned): inlined moves where a
 * libc memcpy call per row of a few dozen floats, twice per tensor per row, cost a checked small update more
 * than its arithmetic. */
static inline void et_copy_row(float *dst, const float *src, int64_t D) {
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) *(et_f8v *)(dst + d) = *(const et_f8v *)(src + d);
    for (; d < D; ++d) dst[d] = src[d];
}

/* One row's update on a copy: the weights and slots present are copied to buf (4 blocks of D floats: weights,
 * then slots 0, 1, 2) and updated there; the table is not touched. */
static inline void et_row_on_copy(et_row_fn fn, const et_opt *p, const float *w, const float *s0, const float *s1,
                                  const float *s2, const float *g, int64_t D, float *buf) {
    float *cw = buf, *c0 = buf + D, *c1 = buf + 2 * D, *c2 = buf + 3 * D;
    et_copy_row(cw, w, D);
    if (s0) et_copy_row(c0, s0, D);
    if (s1) et_copy_row(c1, s1, D);
    if (s2) et_copy_row(c2, s2, D);
    fn(p, cw, s0 ? c0 : NULL, s1 ? c1 : NULL, s2 ? c2 : NULL, g, D);
}

/* The row function applied to copies of a row and its slots; returns 1 when every new value is finite.
 * buf holds 4 * D floats. Nothing in W/S changes. */
static inline int et_row_finite(et_row_fn fn, const et_opt *p, const float *w, const float *s0, const float *s1,
                                const float *s2, const float *g, int64_t D, float *buf) {
    et_row_on_copy(fn, p, w, s0, s1, s2, g, D, buf);
    const float *cw = buf, *c0 = buf + D, *c1 = buf + 2 * D, *c2 = buf + 3 * D;
    uint32_t m = et_maxbits(cw, D, 0);
    if (s0) m = et_maxbits(c0, D, m);
    if (s1) m = et_maxbits(c1, D, m);
    if (s2) m = et_maxbits(c2, D, m);
    return m < ET_INF_BITS;
}

/* Phase 2 dry run: would the update of the prepared rows (every row of [V, D] when dense) write only finite
 * values? Computes each row on a copy and writes nothing. Returns -1 when all are finite, else a row id whose
 * update is not finite; -2 for a workspace that does not fit the table; -3 out of memory. */
int64_t et_check(const void *handle, const float *W, const float *S0, const float *S1, const float *S2, int64_t V,
                 int64_t D,
                 const et_opt *p, int dense, int nthreads) {
    ET_FLUSH_SUBNORMALS;
    const et_workspace *h = (const et_workspace *)handle;
    if (!et_prepared_ok(h, V, D)) return -2;
    const int64_t U = h->U, n = dense ? V : U;
    const et_row_fn fn = et_row_function(p->kind);
    if (!fn) return -4;
    const int shift = dense ? et_shift(h->mask) : 0;
    int64_t bad = -1;
    int oom = 0;
#pragma omp parallel num_threads(nthreads) reduction(max : bad) reduction(| : oom)
    {
        ET_FLUSH_SUBNORMALS;
        float *buf = (float *)malloc(sizeof(float) * (size_t)(4 * D));
        if (!buf) {
            oom = 1;
        } else {
#pragma omp for schedule(static, 256)
            for (int64_t i = 0; i < n; ++i) {
                int64_t r, u;
                if (dense) {
                    r = i;
                    u = U ? et_find(h, r, shift) : -1;
                } else {
                    r = h->rows[i];
                    u = i;
                    if (i + ET_PF < n) et_prefetch_state(W, S0, S1, S2, h->rows[i + ET_PF] * D, D, 0);
                }
                const int64_t o = r * D;
                if (!et_row_finite(fn, p, W + o, S0 ? S0 + o : NULL, S1 ? S1 + o : NULL, S2 ? S2 + o : NULL,
                                   u >= 0 ? h->G + u * D : NULL, D, buf) &&
                    r > bad)
                    bad = r;
            }
            free(buf);
        }
    }
    return oom ? -3 : bad;
}

/* The fused pass's rows, shared by the threads of the calling team (a worksharing loop; called outside a
 * parallel region, by one thread, it runs every row): in row order over most of a small table (in_order, the
 * table's direct map), else the prepared rows in their order, ET_PF rows prefetched ahead. A parallel region,
 * even of one thread, costs a system call or two on entry: at batch 64 one a table was a tenth of the update.
 * Not inlined: the prefetch test finds its loop by this name. */
static __attribute__((noinline)) void et_apply_rows(const et_workspace *h, float *W, float *S0, float *S1,
                                                    float *S2, int64_t V, int64_t D, et_row_fn fn, const et_opt *p,
                                                    int in_order) {
    if (in_order) {
#pragma omp for schedule(static, 256) nowait
        for (int64_t r = 0; r < V; ++r) {
            const int32_t u = h->dmap[r];
            if (u < 0) continue;
            const int64_t o = r * D;
            fn(p, W + o, S0 ? S0 + o : NULL, S1 ? S1 + o : NULL, S2 ? S2 + o : NULL, h->G + (int64_t)u * D, D);
        }
        return;
    }
    const int64_t U = h->U;
#pragma omp for schedule(static, 256) nowait
    for (int64_t u = 0; u < U; ++u) {
        if (u + ET_PF < U) et_prefetch_state(W, S0, S1, S2, h->rows[u + ET_PF] * D, D, 1);
        const int64_t r = h->rows[u] * D;
        fn(p, W + r, S0 ? S0 + r : NULL, S1 ? S1 + r : NULL, S2 ? S2 + r : NULL, h->G + u * D, D);
    }
}

/* Phase 2: one fused pass per updated row. dense != 0 updates every row of [V, D] (non-lazy Adam).
 * maxabs != NULL receives the largest |value| written into W, S0, S1 and S2 (each row is scanned right after
 * its update; this costs ~15% of the pass, so the engine asks for it only where its bounds need it).
 * Returns 0, or -2 (nothing written) for a workspace that does not fit the table. */
int et_apply(const void *handle, float *W, float *S0, float *S1, float *S2, int64_t V, int64_t D, const et_opt *p,
             int dense, int nthreads, float *maxabs) {
    ET_FLUSH_SUBNORMALS;
    const et_workspace *h = (const et_workspace *)handle;
    if (!et_prepared_ok(h, V, D)) return -2;
    const int64_t U = h->U;
    const et_row_fn fn = et_row_function(p->kind);
    if (!fn) return -4;
    const int measure = maxabs != NULL;
    uint32_t mw = 0, m0 = 0, m1 = 0, m2 = 0;
    if (!dense && !measure) { /* the hot paths; one thread runs them without a parallel region */
        const int in_order = et_in_row_order(h, V);
        if (nthreads <= 1) {
            et_apply_rows(h, W, S0, S1, S2, V, D, fn, p, in_order);
        } else {
#pragma omp parallel num_threads(nthreads)
            {
                ET_FLUSH_SUBNORMALS;
                et_apply_rows(h, W, S0, S1, S2, V, D, fn, p, in_order);
            }
        }
    } else if (!dense) {
#pragma omp parallel num_threads(nthreads) reduction(max : mw, m0, m1, m2)
        {
            ET_FLUSH_SUBNORMALS;
#pragma omp for schedule(static, 256)
            for (int64_t u = 0; u < U; ++u) {
                if (u + ET_PF < U) et_prefetch_state(W, S0, S1, S2, h->rows[u + ET_PF] * D, D, 1);
                const int64_t r = h->rows[u] * D;
                fn(p, W + r, S0 ? S0 + r : NULL, S1 ? S1 + r : NULL, S2 ? S2 + r : NULL, h->G + u * D, D);
                if (measure) {
                    mw = et_maxbits(W + r, D, mw);
                    if (S0) m0 = et_maxbits(S0 + r, D, m0);
                    if (S1) m1 = et_maxbits(S1 + r, D, m1);
                    if (S2) m2 = et_maxbits(S2 + r, D, m2);
                }
            }
        }
    } else {
        const int shift = et_shift(h->mask);
#pragma omp parallel num_threads(nthreads) reduction(max : mw, m0, m1, m2)
        {
            ET_FLUSH_SUBNORMALS;
#pragma omp for schedule(static, 1024)
            for (int64_t r = 0; r < V; ++r) {
                const int64_t u = U ? et_find(h, r, shift) : -1;
                fn(p, W + r * D, S0 ? S0 + r * D : NULL, S1 ? S1 + r * D : NULL, S2 ? S2 + r * D : NULL,
                   u >= 0 ? h->G + u * D : NULL, D);
                if (measure) {
                    mw = et_maxbits(W + r * D, D, mw);
                    if (S0) m0 = et_maxbits(S0 + r * D, D, m0);
                    if (S1) m1 = et_maxbits(S1 + r * D, D, m1);
                    if (S2) m2 = et_maxbits(S2 + r * D, D, m2);
                }
            }
        }
    }
    if (measure) {
        const uint32_t m[4] = {mw, m0, m1, m2};
        et_store_maxabs(maxabs, m);
    }
    return 0;
}

/* No accumulation (spec §10.2): occurrences applied one at a time in the given order. Rows are split */
/* across threads by id, so every row still sees its occurrences in order. Returns 0, or 3 (nothing  */
/* written) when a row is outside [0, V).                                                             */
int et_apply_sequential(const int64_t *rows, const float *G, int64_t N, float *W, float *S0, float *S1, float *S2,
                        int64_t V, int64_t D, const et_opt *p, int nthreads) {
    ET_FLUSH_SUBNORMALS;
    for (int64_t k = 0; k < N; ++k)
        if ((uint64_t)rows[k] >= (uint64_t)V) return 3;
    const et_row_fn fn = et_row_function(p->kind);
    if (!fn) return 4;
#pragma omp parallel num_threads(nthreads)
    {
        ET_FLUSH_SUBNORMALS;
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        T = omp_get_num_threads();
#endif
        for (int64_t k = 0; k < N; ++k) {
            const int64_t r = rows[k];
            if ((int)(et_hash(r) >> 59) % T != t) continue;
            fn(p, W + r * D, S0 ? S0 + r * D : NULL, S1 ? S1 + r * D : NULL, S2 ? S2 + r * D : NULL, G + k * D, D);
        }
    }
    return 0;
}

/* Rows x D values at most for which a checked update is computed once, in scratch (see et_apply_many). */
#define ET_STAGED_MAX (1 << 16)

/* A checked small update, in place with a backup: a block of rows at a time (et_block_rows), each row's weights
 * and slots are copied into the workspace's scratch ([U, tensors x D], the backup) and into a block of the scratch
 * past it, the optimizer runs once over the block as one row of its values (its row functions are elementwise:
 * the same values as row by row), and the block is checked and written into the rows. Returns -1 when every
 * value written is finite, -3 when out of memory (nothing written), else the first row whose new values are not
 * finite. *written counts the rows written (and backed up): all U unless out of memory; et_restore_update puts
 * them back. With m, the largest |value| written per tensor (as float bits). */
static int64_t et_update_backed_up(et_workspace *h, float *W, float *S0, float *S1, float *S2, int64_t D,
                                   et_row_fn fn, const et_opt *p, int64_t *written, uint32_t *m) {
    const int64_t U = h->U, R = et_block_rows(D);
    const int64_t backup = 4 * (U ? U : 1) * D; /* in the workspace: no fresh pages per step */
    *written = 0;
    et_shrink((void **)&h->scratch, &h->cap_s, backup + 4 * R * D, sizeof(float));
    if (!et_reserve((void **)&h->scratch, &h->cap_s, backup + 4 * R * D, sizeof(float))) return -3;
    float *const dst[4] = {W, S0, S1, S2};
    float *const block = h->scratch + backup; /* [4, R x D]: tensor i's rows at block + i R D */
    uint32_t most[4] = {0, 0, 0, 0};          /* the largest |value| written per tensor, as float bits */
    const int64_t width = (1 + (S0 != NULL) + (S1 != NULL) + (S2 != NULL)) * D; /* backed-up floats per row */
    for (int64_t u0 = 0; u0 < U; u0 += R) {
        const int64_t n = U - u0 < R ? U - u0 : R;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t u = u0 + j;
            /* the rows are random: keep several in flight, as the fused pass does */
            if (u + ET_PF < U) et_prefetch_state(W, S0, S1, S2, h->rows[u + ET_PF] * D, D, 1);
            const int64_t r = h->rows[u] * D;
            float *keep = h->scratch + u * width;
            for (int i = 0, k = 0; i < 4; ++i)
                if (dst[i]) {
                    et_copy_row(keep + D * k++, dst[i] + r, D);
                    et_copy_row(block + (i * R + j) * D, dst[i] + r, D);
                }
        }
        fn(p, block, S0 ? block + R * D : NULL, S1 ? block + 2 * R * D : NULL, S2 ? block + 3 * R * D : NULL,
           h->G + u0 * D, n * D);
        for (int i = 0; i < 4; ++i) {
            if (!dst[i]) continue;
            most[i] = et_maxbits(block + i * R * D, n * D, most[i]);
            for (int64_t j = 0; j < n; ++j) et_copy_row(dst[i] + h->rows[u0 + j] * D, block + (i * R + j) * D, D);
        }
        *written = u0 + n;
    }
    uint32_t bits = 0;
    for (int i = 0; i < 4; ++i) {
        if (m) m[i] = most[i] > m[i] ? most[i] : m[i];
        bits = most[i] > bits ? most[i] : bits;
    }
    if (bits < ET_INF_BITS) return -1;
    for (int64_t u = 0; u < U; ++u) { /* rare: find the first row written with a value that is not finite */
        const int64_t r = h->rows[u] * D;
        uint32_t b = 0;
        for (int i = 0; i < 4; ++i)
            if (dst[i]) b = et_maxbits(dst[i] + r, D, b);
        if (b >= ET_INF_BITS) return h->rows[u];
    }
    return -1; /* not reached: some written value was not finite */
}

/* Put back the first `written` rows et_update_backed_up changed (rows are distinct: any order). */
static void et_restore_update(const et_workspace *h, float *W, float *S0, float *S1, float *S2, int64_t D,
                              int64_t written) {
    float *const dst[4] = {W, S0, S1, S2};
    const int64_t width = (1 + (S0 != NULL) + (S1 != NULL) + (S2 != NULL)) * D;
    for (int64_t u = 0; u < written; ++u) {
        const int64_t r = h->rows[u] * D;
        const float *keep = h->scratch + u * width;
        for (int i = 0, k = 0; i < 4; ++i)
            if (dst[i]) et_copy_row(dst[i] + r, keep + D * k++, D);
    }
}

/* Phase 2 for T tables, all or nothing: every table's workspace is checked to fit it, and each table with
 * check[t] set is checked exactly: a small lazy update (at most ET_STAGED_MAX values) is written in place with a
 * backup of its rows and checked as it goes (et_update_backed_up), any other gets the dry run first (et_check).
 * When any check fails, the tables written so far are put back and nothing else is written.
 * status[t]: 0 written, -4 unknown optimizer kind, -2 a workspace that does not fit its table, -3 out of
 * memory in a check, 1 the update would write a non-finite value (bad[t] = one such row); any non-zero
 * status means nothing was written. maxabs as in et_apply (4 floats per table, when measure[t]).
 * hi / lo (4 doubles per table, or NULL): scratch for the bounds of the rows each update touches, measured here
 * (et_touched_bounds_of). A lazy, unmeasured SGD, Adagrad or Adam table with check[t] set whose update
 * et_prove_update proves finite from them is written without a backup (proven[t] = 1); proven[t] = 0 for every
 * other table, and for all when nothing was written. */
void et_apply_many(int64_t T, void *const *handles, float *const *W, float *const *S0, float *const *S1,
                   float *const *S2, const int64_t *V, const int64_t *D, const et_opt *const *p, const int32_t *dense,
                   const int32_t *measure, const int32_t *check, int nthreads, float *maxabs, int32_t *status,
                   int64_t *bad, double *hi, double *lo, int32_t *proven) {
    ET_FLUSH_SUBNORMALS;
    int ok = 1;
    int64_t written[T > 0 ? T : 1]; /* rows written with a backup, per table (-1: not written that way) */
    double next[T > 0 ? T : 1][4];  /* a proven table's bounds after its update */
    for (int64_t t = 0; t < T; ++t) {
        status[t] = !et_row_function(p[t]->kind) ? -4 : !et_prepared_ok(handles[t], V[t], D[t]) ? -2 : 0;
        bad[t] = -1;
        written[t] = -1;
        ok = ok && status[t] == 0;
    }
    if (!ok) return;
    for (int64_t t = 0; t < T && ok; ++t) {
        if (proven) proven[t] = 0;
        if (!check[t]) continue;
        et_workspace *h = (et_workspace *)handles[t];
        int64_t r;
        if (proven && hi && lo && !dense[t] && !measure[t] && et_proof_tensors(p[t]->kind) &&
            et_touched_bounds_of(h, W[t], S0[t], S1[t], S2[t], V[t], D[t], 0, 1, hi + 4 * t, lo + 4 * t) == 0 &&
            et_prove_update(p[t], (double)h->gmax, hi + 4 * t, lo + 4 * t, next[t])) {
            proven[t] = 1; /* written below without a check: its bounds prove every value finite */
            continue;
        }
        if (!dense[t] && h->U * D[t] <= ET_STAGED_MAX) {
            uint32_t m[4] = {0, 0, 0, 0};
            r = et_update_backed_up(h, W[t], S0[t], S1[t], S2[t], D[t], et_row_function(p[t]->kind), p[t],
                                    &written[t], m);
            if (r == -1 && measure[t]) et_store_maxabs(maxabs + 4 * t, m);
        } else {
            r = et_check(handles[t], W[t], S0[t], S1[t], S2[t], V[t], D[t], p[t], dense[t], nthreads);
        }
        if (r >= 0) {
            status[t] = 1;
            bad[t] = r;
        } else if (r != -1) {
            status[t] = (int32_t)r;
        }
        ok = ok && status[t] == 0;
    }
    for (int64_t t = 0; t < T; ++t) {
        if (!ok) {
            if (written[t] > 0) et_restore_update(handles[t], W[t], S0[t], S1[t], S2[t], D[t], written[t]);
        } else if (written[t] < 0) {
            status[t] = et_apply(handles[t], W[t], S0[t], S1[t], S2[t], V[t], D[t], p[t], dense[t], nthreads,
                                 measure[t] ? maxabs + 4 * t : NULL);
        }
    }
    if (!ok && proven)
        for (int64_t t = 0; t < T; ++t) proven[t] = 0; /* nothing was written */
}

/* ------------------------------------------------------------------ rows changed since the last save */
/* Mark every row r the prepared update of workspace t wrote (every row of a dense one: V[t]), a byte a row
 * (changed[t][r] = 1); the rows are the workspace's own, checked inside [0, V[t]) here too. mode[t] bit 0: dense. */
void et_mark_changed(int64_t T, void *const *handles, uint8_t *const *changed, const int64_t *V,
                     const int32_t *mode) {
    for (int64_t t = 0; t < T; ++t) {
        if (mode[t] & 1) {
            memset(changed[t], 1, (size_t)V[t]);
            continue;
        }
        const et_workspace *h = (const et_workspace *)handles[t];
        for (int64_t u = 0; u < h->U; ++u) {
            const int64_t r = h->rows[u];
            if (r >= 0 && r < V[t]) changed[t][r] = 1;
        }
    }
}
