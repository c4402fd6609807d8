/* Dynamic vocabularies (spec §12): one open-addressing hash map per table from any 64-bit key to one of
 * the table's V rows, with admission, eviction and expiry. Compiled into the same library as
 * embtables_native.c; driven by embtables/kernels/key_map.py, which checks every buffer before it calls.
 *
 * State per row r: key[r], count[r] (lookups of its key, 0 = free row), last[r] (the step of its last
 * lookup) and order[r] (a global touch sequence: unique, increasing with time). Keys not yet admitted are
 * "pending": a slot of the hash map pointing into a pool of (count, last step).
 *
 * One training lookup at step s (et_km_train) does, in this order:
 *   1. expiry: with ttl, every row with s - last > ttl is freed (oldest first);
 *   2. every key of the batch in the order given (sample-major), each distinct key once:
 *      a live key is touched (count += 1, last = s, order = next);
 *      another key's count goes up by one (restarting at 1 after ttl steps unseen); once it reaches
 *      admit_after the key takes a row: the lowest-numbered free row, else (eviction) the row of the
 *      least recently looked-up key (lru: smallest order) or the least frequently looked-up one (lfu:
 *      smallest (count, order)), never a row looked up at a pinned step (>= pin_from). With no row to
 *      take the key stays pending ("rejected") and is admitted at a later lookup once a row is free.
 * Everything depends only on the sequence of calls, so results are deterministic.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define KM_EMPTY INT64_MIN
#define KM_LIMIT ((int64_t)1 << 62) /* the largest count, order and age a loaded state may hold */

typedef struct { int64_t key, val; } km_slot; /* val: row >= 0, -(p + 1) for pending pool entry p, KM_EMPTY */
typedef struct { int64_t count, order, row; } km_entry;

enum { KM_ADMITTED, KM_EVICTED, KM_EXPIRED, KM_REJECTED, KM_UNTRACKED, KM_NSTATS };

typedef struct {
    int64_t V, admit_after, ttl, pending_limit;
    int eviction; /* 0 none, 1 lru, 2 lfu */
    km_slot *slots;
    int64_t mask;
    int64_t *key, *count, *last, *order;
    int64_t live, seq, step;
    int64_t *free_heap, nfree; /* min-heap of free rows */
    int64_t *pcount, *plast, *pfree, npfree; /* pending pool and its free stack */
    int64_t *q_row, *q_ord, q_head, q_end, q_cap; /* lru queue, increasing order (lazy: stale entries skipped) */
    km_entry *heap, *aside;
    int64_t hn, hcap, naside; /* lfu heap (lazy) and the pinned entries set aside during one call */
    int64_t stats[KM_NSTATS];
    /* the step whose full pending pool was last swept: every pending key left was seen at that step, so another
     * sweep in the same step frees nothing (sweeping again for each new key made a batch quadratic) */
    int64_t swept_at;
} et_keymap;

static inline uint64_t km_mix(int64_t k) {
    uint64_t z = (uint64_t)k + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The slot holding key k, or the empty slot where it would go. */
static inline int64_t km_slot_of(const et_keymap *m, int64_t k) {
    int64_t i = (int64_t)(km_mix(k) & (uint64_t)m->mask);
    while (m->slots[i].val != KM_EMPTY && m->slots[i].key != k) i = (i + 1) & m->mask;
    return i;
}

/* Remove slot i (linear probing, backward shift: no tombstones). */
static void km_delete_slot(et_keymap *m, int64_t i) {
    int64_t j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        if (m->slots[j].val == KM_EMPTY) break;
        int64_t home = (int64_t)(km_mix(m->slots[j].key) & (uint64_t)m->mask);
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        m->slots[i] = m->slots[j];
        i = j;
    }
    m->slots[i].val = KM_EMPTY;
}

static void km_free_push(et_keymap *m, int64_t r) {
    int64_t i = m->nfree++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (m->free_heap[parent] <= r) break;
        m->free_heap[i] = m->free_heap[parent];
        i = parent;
    }
    m->free_heap[i] = r;
}

static int64_t km_free_pop(et_keymap *m) {
    int64_t top = m->free_heap[0], x = m->free_heap[--m->nfree], i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= m->nfree) break;
        if (c + 1 < m->nfree && m->free_heap[c + 1] < m->free_heap[c]) ++c;
        if (m->free_heap[c] >= x) break;
        m->free_heap[i] = m->free_heap[c];
        i = c;
    }
    if (m->nfree > 0) m->free_heap[i] = x;
    return top;
}

static inline int km_less(km_entry a, km_entry b) {
    return a.count < b.count || (a.count == b.count && a.order < b.order);
}

static void km_heap_sift_down(km_entry *h, int64_t n, int64_t i) {
    km_entry x = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && km_less(h[c + 1], h[c])) ++c;
        if (!km_less(h[c], x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

static inline int km_row_current(const et_keymap *m, int64_t r, int64_t order) {
    return m->count[r] > 0 && m->order[r] == order;
}

/* Drop stale entries of the lfu heap and rebuild it (it holds at most V current entries). */
static void km_heap_compact(et_keymap *m) {
    int64_t n = 0;
    for (int64_t i = 0; i < m->hn; ++i) {
        km_entry e = m->heap[i];
        if (km_row_current(m, e.row, e.order) && m->count[e.row] == e.count) m->heap[n++] = e;
    }
    m->hn = n;
    for (int64_t i = n / 2 - 1; i >= 0; --i) km_heap_sift_down(m->heap, n, i);
}

static void km_heap_push(et_keymap *m, km_entry e) {
    if (m->hn == m->hcap) km_heap_compact(m);
    int64_t i = m->hn++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!km_less(e, m->heap[parent])) break;
        m->heap[i] = m->heap[parent];
        i = parent;
    }
    m->heap[i] = e;
}

static km_entry km_heap_pop(et_keymap *m) {
    km_entry top = m->heap[0];
    m->heap[0] = m->heap[--m->hn];
    if (m->hn > 0) km_heap_sift_down(m->heap, m->hn, 0);
    return top;
}

static void km_queue_push(et_keymap *m, int64_t r, int64_t order) {
    if (m->q_end == m->q_cap) { /* keep the current entries (at most V, in order) at the front */
        int64_t n = 0;
        for (int64_t i = m->q_head; i < m->q_end; ++i)
            if (km_row_current(m, m->q_row[i], m->q_ord[i])) {
                m->q_row[n] = m->q_row[i];
                m->q_ord[n++] = m->q_ord[i];
            }
        m->q_head = 0;
        m->q_end = n;
    }
    m->q_row[m->q_end] = r;
    m->q_ord[m->q_end++] = order;
}

static inline int km_tracks_order(const et_keymap *m) { return m->eviction == 1 || m->ttl >= 0; }

/* Record a lookup of live row r at step s. */
static void km_touch(et_keymap *m, int64_t r, int64_t s) {
    m->count[r] += 1;
    m->last[r] = s;
    m->order[r] = m->seq++;
    if (km_tracks_order(m)) km_queue_push(m, r, m->order[r]);
    if (m->eviction == 2) km_heap_push(m, (km_entry){m->count[r], m->order[r], r});
}

/* Free live row r (its key leaves the map). */
static void km_release(et_keymap *m, int64_t r) {
    km_delete_slot(m, km_slot_of(m, m->key[r]));
    m->count[r] = 0;
    m->live -= 1;
}

/* The oldest current entry of the lru queue (row, or -1 when empty), without removing it. */
static int64_t km_queue_front(et_keymap *m) {
    while (m->q_head < m->q_end && !km_row_current(m, m->q_row[m->q_head], m->q_ord[m->q_head])) ++m->q_head;
    return m->q_head < m->q_end ? m->q_row[m->q_head] : -1;
}

/* A row for a new key: the lowest free row, else an evicted one that no pinned step looked up; -1 if none. */
static int64_t km_take_row(et_keymap *m, int64_t pin_from) {
    if (m->nfree > 0) return km_free_pop(m);
    int64_t r = -1;
    if (m->eviction == 1) {
        r = km_queue_front(m);
        if (r >= 0 && m->last[r] >= pin_from) r = -1; /* every other row is newer still */
        if (r >= 0) ++m->q_head;
    } else if (m->eviction == 2) {
        while (m->hn > 0) {
            km_entry e = km_heap_pop(m);
            if (!km_row_current(m, e.row, e.order) || m->count[e.row] != e.count) continue;
            if (m->last[e.row] >= pin_from) {
                /* a row has at most two current-looking entries here (one from before this call, one from
                 * its touch in it), so the hcap = 2V + 16 slots never fill; stop rather than overflow */
                if (m->naside == m->hcap) { km_heap_push(m, e); break; }
                m->aside[m->naside++] = e;
                continue;
            }
            r = e.row;
            break;
        }
    }
    if (r >= 0) {
        km_release(m, r);
        m->stats[KM_EVICTED] += 1;
    }
    return r;
}

/* Forget every pending key not seen at step s (the pool is full); 0 when out of memory. */
static int km_forget_pending(et_keymap *m, int64_t s) {
    int64_t H = m->mask + 1, n = 0;
    km_slot *keep = (km_slot *)malloc(sizeof(km_slot) * (size_t)(m->live + m->pending_limit + 1));
    if (!keep) return 0;
    for (int64_t i = 0; i < H; ++i) {
        km_slot x = m->slots[i];
        if (x.val == KM_EMPTY) continue;
        if (x.val < 0 && m->plast[-x.val - 1] < s) {
            m->pfree[m->npfree++] = -x.val - 1;
            continue;
        }
        keep[n++] = x;
    }
    for (int64_t i = 0; i < H; ++i) m->slots[i].val = KM_EMPTY;
    for (int64_t i = 0; i < n; ++i) m->slots[km_slot_of(m, keep[i].key)] = keep[i];
    free(keep);
    return 1;
}

static int64_t km_pending_count(const et_keymap *m) { return m->pending_limit - m->npfree; }

/* Key k (not live) seen with count c at step s; p its pending entry or -1. Returns its row or -1. */
static int64_t km_admit_or_pend(et_keymap *m, int64_t k, int64_t c, int64_t p, int64_t s, int64_t pin_from,
                                int64_t *reset, int64_t *nreset) {
    if (c >= m->admit_after) {
        int64_t r = km_take_row(m, pin_from);
        if (r >= 0) {
            int64_t i = km_slot_of(m, k); /* again: an eviction may have moved k's slot */
            if (p >= 0) m->pfree[m->npfree++] = p;
            m->slots[i].key = k;
            m->slots[i].val = r;
            m->key[r] = k;
            m->count[r] = c - 1;
            m->live += 1;
            km_touch(m, r, s);
            m->stats[KM_ADMITTED] += 1;
            reset[(*nreset)++] = r;
            return r;
        }
        m->stats[KM_REJECTED] += 1;
    }
    if (p < 0) {
        if (km_pending_count(m) == m->pending_limit && m->swept_at != s) {
            if (!km_forget_pending(m, s)) return -2;
            m->swept_at = s;
        }
        if (km_pending_count(m) == m->pending_limit) {
            m->stats[KM_UNTRACKED] += 1;
            return -1;
        }
        p = m->pfree[--m->npfree];
        int64_t i = km_slot_of(m, k);
        m->slots[i].key = k;
        m->slots[i].val = -(p + 1);
    }
    m->pcount[p] = c;
    m->plast[p] = s;
    return -1;
}

void et_km_free(void *handle) {
    et_keymap *m = (et_keymap *)handle;
    if (!m) return;
    free(m->slots); free(m->key); free(m->count); free(m->last); free(m->order); free(m->free_heap);
    free(m->pcount); free(m->plast); free(m->pfree); free(m->q_row); free(m->q_ord); free(m->heap); free(m->aside);
    free(m);
}

/* An empty map of V rows; NULL when out of memory or an argument is out of range. */
void *et_km_new(int64_t V, int64_t admit_after, int eviction, int64_t ttl) {
    if (V < 1 || V > ((int64_t)1 << 40) || admit_after < 1 || eviction < 0 || eviction > 2 || ttl < -1 || ttl == 0)
        return NULL;
    et_keymap *m = (et_keymap *)calloc(1, sizeof(et_keymap));
    if (!m) return NULL;
    m->V = V;
    m->admit_after = admit_after;
    m->eviction = eviction;
    m->ttl = ttl;
    m->pending_limit = V;
    int64_t H = 16;
    while (H < 2 * (V + m->pending_limit)) H <<= 1;
    m->mask = H - 1;
    m->q_cap = 2 * V + 16;
    m->hcap = eviction == 2 ? 2 * V + 16 : 0;
    m->slots = (km_slot *)malloc(sizeof(km_slot) * (size_t)H);
    m->key = (int64_t *)calloc((size_t)V, sizeof(int64_t));
    m->count = (int64_t *)calloc((size_t)V, sizeof(int64_t));
    m->last = (int64_t *)calloc((size_t)V, sizeof(int64_t));
    m->order = (int64_t *)calloc((size_t)V, sizeof(int64_t));
    m->free_heap = (int64_t *)malloc(sizeof(int64_t) * (size_t)V);
    m->pcount = (int64_t *)malloc(sizeof(int64_t) * (size_t)m->pending_limit);
    m->plast = (int64_t *)malloc(sizeof(int64_t) * (size_t)m->pending_limit);
    m->pfree = (int64_t *)malloc(sizeof(int64_t) * (size_t)m->pending_limit);
    if (km_tracks_order(m)) {
        m->q_row = (int64_t *)malloc(sizeof(int64_t) * (size_t)m->q_cap);
        m->q_ord = (int64_t *)malloc(sizeof(int64_t) * (size_t)m->q_cap);
    }
    if (eviction == 2) {
        m->heap = (km_entry *)malloc(sizeof(km_entry) * (size_t)m->hcap);
        m->aside = (km_entry *)malloc(sizeof(km_entry) * (size_t)m->hcap);
    }
    if (!m->slots || !m->key || !m->count || !m->last || !m->order || !m->free_heap || !m->pcount || !m->plast ||
        !m->pfree || (km_tracks_order(m) && (!m->q_row || !m->q_ord)) || (eviction == 2 && (!m->heap || !m->aside))) {
        et_km_free(m);
        return NULL;
    }
    for (int64_t i = 0; i < H; ++i) m->slots[i].val = KM_EMPTY;
    for (int64_t r = 0; r < V; ++r) m->free_heap[r] = r; /* sorted: a valid min-heap */
    m->nfree = V;
    for (int64_t p = 0; p < m->pending_limit; ++p) m->pfree[p] = m->pending_limit - 1 - p;
    m->npfree = m->pending_limit;
    m->swept_at = -1;
    return m;
}

/* One training lookup at step s of keys[n]: rows[n] gets each key's row or -1 (not admitted); reset[]
 * (room for n) gets the rows given to new keys this call, in order. Rows last looked up at a step >= pin_from
 * are never evicted (pin_from <= s). Returns the number of reset rows; -1 when s is below the map's step or
 * pin_from above s (nothing changed); -2 when out of memory (the map stays consistent; keys after that point
 * get -1). */
int64_t et_km_train(void *handle, const int64_t *keys, int64_t n, int64_t s, int64_t pin_from, int64_t *rows,
                    int64_t *reset) {
    et_keymap *m = (et_keymap *)handle;
    if (!m || n < 0 || s < m->step || pin_from > s) return -1;
    m->step = s;
    if (m->ttl >= 0) {
        for (;;) {
            int64_t r = km_queue_front(m);
            if (r < 0 || s - m->last[r] <= m->ttl || m->last[r] >= pin_from) break;
            ++m->q_head;
            km_release(m, r);
            km_free_push(m, r);
            m->stats[KM_EXPIRED] += 1;
        }
    }
    int64_t nreset = 0, status = 0;
    m->naside = 0;
    for (int64_t j = 0; j < n; ++j) {
        int64_t k = keys[j];
        if (status) { rows[j] = -1; continue; }
        int64_t i = km_slot_of(m, k), v = m->slots[i].val;
        if (v >= 0) {
            if (m->last[v] != s) km_touch(m, v, s);
            rows[j] = v;
        } else if (v == KM_EMPTY) {
            int64_t r = km_admit_or_pend(m, k, 1, -1, s, pin_from, reset, &nreset);
            if (r == -2) { status = -2; r = -1; }
            rows[j] = r;
        } else {
            int64_t p = -v - 1;
            if (m->plast[p] == s) { rows[j] = -1; continue; } /* counted once per lookup */
            int64_t c = (m->ttl >= 0 && s - m->plast[p] > m->ttl) ? 1 : m->pcount[p] + 1;
            rows[j] = km_admit_or_pend(m, k, c, p, s, pin_from, reset, &nreset);
        }
    }
    for (int64_t a = 0; a < m->naside; ++a) km_heap_push(m, m->aside[a]);
    m->naside = 0;
    return status ? status : nreset;
}

/* Read-only: rows[j] = the row of keys[j], or -1 when it has none (evaluation lookups). */
void et_km_find(const void *handle, const int64_t *keys, int64_t n, int64_t *rows) {
    const et_keymap *m = (const et_keymap *)handle;
    for (int64_t j = 0; j < n; ++j) {
        int64_t v = m->slots[km_slot_of(m, keys[j])].val;
        rows[j] = v >= 0 ? v : -1;
    }
}

/* out[0..9]: step, live rows, pending keys, next order, admitted, evicted, expired, rejected, untracked, V. */
void et_km_stats(const void *handle, int64_t *out) {
    const et_keymap *m = (const et_keymap *)handle;
    out[0] = m->step;
    out[1] = m->live;
    out[2] = km_pending_count(m);
    out[3] = m->seq;
    for (int i = 0; i < KM_NSTATS; ++i) out[4 + i] = m->stats[i];
    out[9] = m->V;
}

/* The row arrays [V] each: key, count (0 = free), last step, order. */
void et_km_export(const void *handle, int64_t *key, int64_t *count, int64_t *last, int64_t *order) {
    const et_keymap *m = (const et_keymap *)handle;
    size_t b = sizeof(int64_t) * (size_t)m->V;
    memcpy(key, m->key, b);
    memcpy(count, m->count, b);
    memcpy(last, m->last, b);
    memcpy(order, m->order, b);
}

/* The pending keys (seen, not admitted), in slot order: key, count, last step; room for out[2] entries. */
void et_km_export_pending(const void *handle, int64_t *key, int64_t *count, int64_t *last) {
    const et_keymap *m = (const et_keymap *)handle;
    int64_t H = m->mask + 1, n = 0;
    for (int64_t i = 0; i < H; ++i) {
        km_slot x = m->slots[i];
        if (x.val == KM_EMPTY || x.val >= 0) continue;
        key[n] = x.key;
        count[n] = m->pcount[-x.val - 1];
        last[n++] = m->plast[-x.val - 1];
    }
}

static int km_order_less(const et_keymap *m, int64_t a, int64_t b) { return m->order[a] < m->order[b]; }

/* Heap sort of rows[n] by order (no recursion, no allocation). */
static void km_sort_rows_by_order(const et_keymap *m, int64_t *rows, int64_t n) {
    for (int64_t start = n / 2 - 1, end = n; end > 1;) {
        int64_t root;
        if (start >= 0) root = start--;
        else { int64_t t = rows[0]; rows[0] = rows[--end]; rows[end] = t; root = 0; }
        int64_t x = rows[root];
        for (;;) {
            int64_t c = 2 * root + 1;
            if (c >= end) break;
            if (c + 1 < end && km_order_less(m, rows[c], rows[c + 1])) ++c;
            if (!km_order_less(m, x, rows[c])) break;
            rows[root] = rows[c];
            root = c;
        }
        rows[root] = x;
    }
}

static void km_clear(et_keymap *m, int64_t s) {
    int64_t H = m->mask + 1;
    for (int64_t i = 0; i < H; ++i) m->slots[i].val = KM_EMPTY;
    memset(m->count, 0, sizeof(int64_t) * (size_t)m->V);
    m->nfree = 0;
    m->live = 0;
    m->seq = 0;
    m->step = s;
    m->q_head = m->q_end = 0;
    m->hn = 0;
    m->npfree = m->pending_limit;
    for (int64_t p = 0; p < m->pending_limit; ++p) m->pfree[p] = m->pending_limit - 1 - p;
    memset(m->stats, 0, sizeof(m->stats));
    m->swept_at = -1;
}

/* Replace the map with rows key/count/last/order [V] and np pending keys pkey/pcount/plast at step s
 * (counters start at 0). Returns 0, or 1 when the data break a rule (a negative count, a last step after s,
 * a key twice, two live rows with one order, more pending keys than the pool holds, a pending count < 1):
 * the map is then empty. */
int et_km_import(void *handle, const int64_t *key, const int64_t *count, const int64_t *last, const int64_t *order,
                 const int64_t *pkey, const int64_t *pcount, const int64_t *plast, int64_t np, int64_t s) {
    et_keymap *m = (et_keymap *)handle;
    int64_t V = m->V;
    km_clear(m, s);
    int bad = np < 0 || np > m->pending_limit || s < 0 || s > KM_LIMIT;
    int64_t nlive = 0;
    for (int64_t r = 0; r < V && !bad; ++r) {
        m->key[r] = key[r];
        m->count[r] = count[r];
        m->last[r] = last[r];
        m->order[r] = order[r];
        /* bounded so that no later step arithmetic (s - last, order + 1, count + 1) can overflow */
        if (count[r] < 0 || count[r] > KM_LIMIT ||
            (count[r] > 0 && (last[r] > s || last[r] < s - KM_LIMIT || order[r] < 0 || order[r] > KM_LIMIT)))
            bad = 1;
        if (count[r] <= 0) { m->count[r] = 0; km_free_push(m, r); continue; }
        int64_t i = km_slot_of(m, key[r]);
        if (m->slots[i].val != KM_EMPTY) bad = 1;
        m->slots[i].key = key[r];
        m->slots[i].val = r;
        m->free_heap[V - 1 - nlive++] = r; /* the live rows, collected at the far end of the (unused) heap space */
        if (order[r] >= m->seq) m->seq = order[r] + 1;
    }
    for (int64_t j = 0; j < np && !bad; ++j) {
        int64_t i = km_slot_of(m, pkey[j]);
        if (m->slots[i].val != KM_EMPTY || pcount[j] < 1 || pcount[j] > KM_LIMIT || plast[j] > s ||
            plast[j] < s - KM_LIMIT) { bad = 1; break; }
        int64_t p = m->pfree[--m->npfree];
        m->pcount[p] = pcount[j];
        m->plast[p] = plast[j];
        m->slots[i].key = pkey[j];
        m->slots[i].val = -(p + 1);
    }
    int64_t *live_rows = m->free_heap + (V - nlive);
    if (!bad) {
        km_sort_rows_by_order(m, live_rows, nlive);
        for (int64_t a = 1; a < nlive; ++a)
            if (m->order[live_rows[a]] == m->order[live_rows[a - 1]]) bad = 1;
    }
    if (bad) {
        km_clear(m, s);
        for (int64_t r = 0; r < V; ++r) m->free_heap[r] = r;
        m->nfree = V;
        return 1;
    }
    m->live = nlive;
    for (int64_t a = 0; a < nlive; ++a) {
        int64_t r = live_rows[a];
        if (km_tracks_order(m)) km_queue_push(m, r, m->order[r]);
        if (m->eviction == 2) km_heap_push(m, (km_entry){m->count[r], m->order[r], r});
    }
    return 0;
}

/* et_km_train for T maps at once, in parallel over the maps (each map is touched by one thread only):
 * out[t] gets map t's return value. One map or one thread: no parallel region (an `if` clause still enters one,
 * which costs a system call or two once the runtime has idle threads). */
void et_km_train_many(int64_t T, void *const *handles, const int64_t *const *keys, const int64_t *n, int64_t s,
                      int64_t pin_from, int64_t *const *rows, int64_t *const *reset, int64_t *out, int nthreads) {
    if (T <= 1 || nthreads <= 1) {
        for (int64_t t = 0; t < T; ++t)
            out[t] = et_km_train(handles[t], keys[t], n[t], s, pin_from, rows[t], reset[t]);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
#endif
    for (int64_t t = 0; t < T; ++t) out[t] = et_km_train(handles[t], keys[t], n[t], s, pin_from, rows[t], reset[t]);
}
