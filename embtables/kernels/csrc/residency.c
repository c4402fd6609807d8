/* The offloaded row cache's residency arrays (embtables/tables/offload_residency.py, docs/offload.md): the
 * passes that keep them sorted in place, and the choice of the rows to evict. Compiled into the same library
 * as embtables_native.c; driven by Residency, which hands it its own arrays (int32 units, slots and last
 * uses, float32 use counts, each of the cache's capacity) and checks them before it calls.
 *
 * Each function validates what it is given before it writes anything: a bad status (2, "sizes") leaves
 * every array as it was.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Remove the entries at positions pos[0..e) (strictly ascending, in [0, n)) of the aligned arrays units,
 * slots, last and uses (n entries), keeping the order of the others, in one pass; each removed entry's slot is
 * appended to free_slots[nfree..] (cap entries in all). Returns 0, or 2 when a position or a size is not
 * as described. */
int32_t et_res_remove(int32_t *units, int32_t *slots, int32_t *last, float *uses, int64_t n, const int64_t *pos,
                      int64_t e, int32_t *free_slots, int64_t nfree, int64_t cap) {
    if (n < 0 || e < 0 || e > n || nfree < 0 || nfree + e > cap || n > cap) return 2;
    for (int64_t i = 0; i < e; i++) {
        if (pos[i] < 0 || pos[i] >= n || (i > 0 && pos[i] <= pos[i - 1])) return 2;
    }
    if (e == 0) return 0;
    int64_t w = pos[0], j = 0;
    for (int64_t r = pos[0]; r < n; r++) {
        if (j < e && pos[j] == r) {
            free_slots[nfree + j] = slots[r];
            j++;
            continue;
        }
        units[w] = units[r];
        slots[w] = slots[r];
        last[w] = last[r];
        uses[w] = uses[r];
        w++;
    }
    return 0;
}

/* Merge k new units new_units[0..k) (strictly ascending, none of them among the n) into the n ascending units
 * of the aligned arrays (cap entries each), in place, from the end: each new unit takes its slot from
 * new_slots, the last use `never` and no uses. Returns 0, or 2 when a size, the order or a duplicate is not as
 * described (checked in a read-only pass first). */
int32_t et_res_insert(int32_t *units, int32_t *slots, int32_t *last, float *uses, int64_t n, int64_t cap,
                      const int32_t *new_units, const int32_t *new_slots, int64_t k, int32_t never) {
    if (n < 0 || k < 0 || n + k > cap) return 2;
    for (int64_t i = 1; i < k; i++) {
        if (new_units[i] <= new_units[i - 1]) return 2;
    }
    for (int64_t i = 0, j = 0; i < n && j < k;) { /* a new unit already resident */
        if (units[i] < new_units[j]) {
            i++;
        } else if (units[i] > new_units[j]) {
            j++;
        } else {
            return 2;
        }
    }
    int64_t r = n - 1, j = k - 1, w = n + k - 1;
    while (j >= 0) {
        if (r >= 0 && units[r] > new_units[j]) {
            units[w] = units[r];
            slots[w] = slots[r];
            last[w] = last[r];
            uses[w] = uses[r];
            r--;
        } else {
            units[w] = new_units[j];
            slots[w] = new_slots[j];
            last[w] = never;
            uses[w] = 0.0f;
            j--;
        }
        w--;
    }
    return 0;
}

#define RES_AGES 4096 /* ages whose decay is tabled once a call */
#define RES_NONE UINT32_MAX /* the key of an entry that may not leave (above every finite float's bits) */

/* The `over` least used of the n resident entries that may leave, their positions ascending into out[0..over):
 * an entry may leave when its last use is before pin_from and its position is not among asked[0..na) (strictly
 * ascending: the resident units a lookup asks for). An entry's use at `step` is uses * decay ** age, age =
 * max(0, step - last), in float32; of equal uses the lower positions leave first. Returns the number of entries
 * that may leave (out is written only when it is at least over), -1 for a size or an order not as described,
 * -2 when out of memory.
 *
 * A use is >= 0, so its float32 bits order as it does: the over-th least (key, position) is found by a count
 * of the keys' high 16 bits, then of the low 16 bits within the one high value it falls in, and the entries
 * at or below it are written in one pass in position order (three passes over the n, no sort). */
int64_t et_res_victims(const int32_t *last, const float *uses, int64_t n, const int64_t *asked, int64_t na,
                       int32_t pin_from, int32_t step, float decay, int64_t over, int64_t *out) {
    if (n < 0 || na < 0 || na > n || over < 1) return -1;
    for (int64_t i = 0; i < na; i++) {
        if (asked[i] < 0 || asked[i] >= n || (i > 0 && asked[i] <= asked[i - 1])) return -1;
    }
    uint32_t *key = (uint32_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(uint32_t));
    int64_t *count = (int64_t *)calloc(65536, sizeof(int64_t));
    if (key == NULL || count == NULL) {
        free(key);
        free(count);
        return -2;
    }
    float decayed[RES_AGES]; /* decay ** age for the recent ages, the same powf as for the others */
    for (int i = 0; i < RES_AGES; i++) decayed[i] = powf(decay, (float)i);
    int64_t m = 0, a = 0;
    for (int64_t i = 0; i < n; i++) {
        key[i] = RES_NONE;
        if (a < na && asked[a] == i) {
            a++;
            continue;
        }
        if (last[i] >= pin_from) continue;
        int64_t age = (int64_t)step - (int64_t)last[i];
        if (age < 0) age = 0;
        float f = uses[i] * (age < RES_AGES ? decayed[age] : powf(decay, (float)age));
        if (!(f >= 0.0f) || f > 3.4e38f) f = 3.4e38f; /* never NaN or Inf: a use is finite and >= 0 */
        f += 0.0f; /* -0 as +0 */
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        key[i] = bits;
        count[bits >> 16]++;
        m++;
    }
    if (m >= over) {
        int64_t below = 0, hi = 0;
        while (below + count[hi] < over) below += count[hi++];
        memset(count, 0, 65536 * sizeof(int64_t));
        for (int64_t i = 0; i < n; i++) {
            if (key[i] != RES_NONE && (key[i] >> 16) == (uint32_t)hi) count[key[i] & 0xFFFF]++;
        }
        int64_t lo = 0;
        while (below + count[lo] < over) below += count[lo++];
        uint32_t edge = ((uint32_t)hi << 16) | (uint32_t)lo; /* the over-th least key */
        int64_t at_edge = over - below, w = 0;              /* how many of the entries with that key leave */
        for (int64_t i = 0; i < n && w < over; i++) {
            if (key[i] < edge || (key[i] == edge && at_edge-- > 0)) out[w++] = i;
        }
    }
    free(key);
    free(count);
    return m;
}
