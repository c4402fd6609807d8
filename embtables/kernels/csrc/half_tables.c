/* Half-precision tables (docs/spec.md §12): stochastic rounding to bfloat16 / float16, and the lookups and lazy
 * updates of tables whose rows (and slots) are stored in a half type, computed in float32. */
#include "embtables_native.h"

/* ------------------------------------------------------------------ stochastic rounding to half types */
/* spec §12: 32 random bits per written element from (seed, step, table, row, column) through the
 * lowbias32 hash, and the rounding rules of kernels/stochastic_rounding.py, bit for bit. */
static inline uint32_t et_lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* The hash state after (seed, step, table): every row of the table at that step continues from it. */
static inline uint32_t et_round_prefix(uint64_t seed, uint64_t step, uint32_t table) {
    uint32_t h = 0x243f6a88u;
    h = et_lowbias32(h ^ (uint32_t)seed);
    h = et_lowbias32(h ^ (uint32_t)(seed >> 32));
    h = et_lowbias32(h ^ (uint32_t)step);
    h = et_lowbias32(h ^ (uint32_t)(step >> 32));
    return et_lowbias32(h ^ table);
}

static inline uint32_t et_round_row(uint32_t prefix, int64_t row) {
    const uint64_t r = (uint64_t)row;
    return et_lowbias32(et_lowbias32(prefix ^ (uint32_t)r) ^ (uint32_t)(r >> 32));
}

/* The rounding loops' path, fixed when the library loads (it is compiled for this CPU with -march=native, so
 * the vector loops use its widest integer vectors, AVX2 or AVX-512): 1 the vector loops, 8 values at a time,
 * 0 the scalar loops. Both give the same bits; et_round_path lets a test force each. */
static int et_vector_rounding = 1;

/* Set the rounding path (vector: 1 the vector loops, 0 the scalar ones, < 0 leave it); returns the one before. */
int32_t et_round_path(int32_t vector) {
    const int32_t before = et_vector_rounding;
    if (vector >= 0) et_vector_rounding = vector != 0;
    return before;
}

/* bfloat16 is float32's upper half: 16 random bits added below it carry into it with probability
 * (the dropped bits) / 2^16. A NaN stays a (quiet) NaN, an infinity an infinity. */
static inline uint16_t et_sr_bfloat16(float x, uint32_t r) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    if ((b & 0x7fffffffu) > ET_INF_BITS) return (uint16_t)((b >> 16) | 0x0040u);
    if ((b & 0x7fffffffu) == ET_INF_BITS) return (uint16_t)(b >> 16);
    return (uint16_t)((b + (r >> 16)) >> 16);
}

/* float16: away from zero when r / 2^32 * gap < |x| - |toward zero|; above 65504 in magnitude an infinity. */
static inline uint16_t et_sr_float16(float x, uint32_t r) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    const uint32_t sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
    if (a > ET_INF_BITS) return (uint16_t)(sign | 0x7e00u);
    if (a > 0x477fe000u) return (uint16_t)(sign | 0x7c00u); /* |x| > 65504, or an infinity */
    uint32_t low;
    int up;
    if (a >= 0x38800000u) { /* |x| >= 2^-14: a float16 normal, 13 bits dropped */
        low = (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3ffu);
        up = (uint64_t)r < ((uint64_t)(a & 0x1fffu) << 19);
    } else { /* a float16 subnormal or zero: multiples of 2^-24 */
        const float scaled = et_bits_float(a) * 16777216.0f; /* exact: a power of two */
        low = (uint32_t)scaled;
        up = (double)r < ((double)scaled - (double)low) * 4294967296.0;
    }
    return (uint16_t)(sign | (low + (uint32_t)up));
}

/* ------------------------------------------------------------------ half-precision tables */
/* spec §12: rows (and slots) stored as bfloat16 (kind 0), float16 (kind 1) or float32 (kind 2), read into
 * float32, updated by the optimizer's float32 row function, and rounded back as they are written:
 * stochastically with the bits of (seed, step, table, global row, column) (column c < D: the weights'; (k+1)
 * D + c: slot k's), or to nearest, ties to even (the types' own conversion). */
typedef uint16_t et_h8v __attribute__((vector_size(16), aligned(2))); /* 8 half patterns */
typedef uint16_t et_h16v __attribute__((vector_size(32), aligned(2))); /* 16 half patterns */
typedef uint32_t et_u16v __attribute__((vector_size(64), aligned(4))); /* 16 uint32 lanes */

static inline float et_half_float(uint16_t h, int kind) {
    if (kind == 0) return et_bits_float((uint32_t)h << 16);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 31) return et_bits_float(sign | 0x7f800000u | (m << 13));           /* inf, NaN */
    if (e == 0) return (sign ? -1.0f : 1.0f) * (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
    return et_bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

/* 8 float16 patterns (in uint32 lanes) as float32: et_half_float's values, bit for bit (NaN payloads included),
 * without branches. The exponent and mantissa move to float32's places and the exponent is rebased by 112 (by 224
 * for an infinity or NaN); a subnormal or zero m x 2^-24 is 2^-14 (1 + m / 1024) - 2^-14, an exact subtraction of
 * normal floats whose result is normal (or +0), so the subnormal modes do not touch it. */
static inline et_f8v et_f16_widen8(et_u8v h) {
    const et_u8v sign = (h & 0x8000u) << 16, mag = (h & 0x7fffu) << 13, e = mag & 0x0f800000u;
    const et_u8v o = mag + (112u << 23) + ((et_u8v)(e == 0x0f800000u) & (112u << 23));
    const et_u8v sub = (et_u8v)(e == 0);
    const et_u8v small = (et_u8v)((et_f8v)(o + (1u << 23)) - 6.103515625e-05f); /* 2^-14 */
    return (et_f8v)(((small & sub) | (o & ~sub)) | sign);
}

/* to nearest, ties to even */
static inline uint16_t et_rn_half(float x, int kind) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    const uint32_t a = b & 0x7fffffffu;
    if (kind == 0) {
        if (a > ET_INF_BITS) return (uint16_t)((b >> 16) | 0x0040u);
        return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16); /* an infinity stays one */
    }
    const uint32_t sign = (b >> 16) & 0x8000u;
    if (a > ET_INF_BITS) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u); /* >= 65536, or an infinity */
    uint32_t low;
    int up;
    if (a >= 0x38800000u) {
        low = (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3ffu);
        const uint32_t d = a & 0x1fffu;
        up = d > 0x1000u || (d == 0x1000u && (low & 1u)); /* a carry past 65504 gives the infinity */
    } else {
        const float scaled = et_bits_float(a) * 16777216.0f;
        low = (uint32_t)scaled;
        const float frac = scaled - (float)low; /* exact */
        up = frac > 0.5f || (frac == 0.5f && (low & 1u));
    }
    return (uint16_t)(sign | (low + (uint32_t)up));
}

/* Row r of a table of ``kind`` into D floats (a loop per kind, so each vectorises). */
static inline void et_load_row(const void *T, int kind, int64_t r, int64_t D, float *restrict dst) {
    if (kind == 2) {
        memcpy(dst, (const float *)T + r * D, sizeof(float) * (size_t)D);
    } else if (kind == 0) {
        const uint16_t *restrict src = (const uint16_t *)T + r * D;
        uint32_t *restrict u = (uint32_t *)dst;
        int64_t d = 0;
        /* 16 at a time first: the row functions read dst 64 bytes at a time, and a read that spans two narrower
         * stores still in flight waits for them (no store-to-load forwarding) */
        for (; d + 16 <= D; d += 16) {
            et_h16v h;
            memcpy(&h, src + d, sizeof h);
            const et_u16v w = __builtin_convertvector(h, et_u16v) << 16;
            memcpy(u + d, &w, sizeof w);
        }
        for (; d + 8 <= D; d += 8) {
            et_h8v h;
            memcpy(&h, src + d, sizeof h);
            const et_u8v w = __builtin_convertvector(h, et_u8v) << 16;
            memcpy(u + d, &w, sizeof w);
        }
        for (; d < D; ++d) u[d] = (uint32_t)src[d] << 16;
    } else {
        const uint16_t *restrict src = (const uint16_t *)T + r * D;
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            et_h8v h;
            memcpy(&h, src + d, sizeof h);
            const et_f8v f = et_f16_widen8(__builtin_convertvector(h, et_u8v));
            memcpy(dst + d, &f, sizeof f);
        }
        for (; d < D; ++d) dst[d] = et_half_float(src[d], 1);
    }
}

/* lowbias32(h ^ c) for 8 columns c below 2^16, given h1 = h ^ (h >> 16), but for its last round (x ^= x >> 16,
 * which leaves the upper 16 bits as they are: all that the bfloat16 rounding adds). h ^ c keeps h's upper 16
 * bits, so the first round's x >> 16 is h >> 16 for every column and h1 ^ c is that round's result. */
static inline et_u8v et_hash_cols(uint32_t h1, et_u8v col) {
    et_u8v x = h1 ^ col;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x;
}

/* bfloat16 rounding of D floats, stochastic (bits of row hash h, columns col0 + d) or to nearest: the rules of
 * et_sr_bfloat16 and et_rn_half on 8 values at a time without branches (GCC vector extensions: the same bits,
 * whole vectors) for columns below 2^16 (et_hash_cols), the rest of the row through them; returns badv with a lane
 * set for a result that is not finite (a loop of rows reduces the lanes once, et_any_lane, not once a row). With a
 * the value's |bits| and add at most 0xffff, a + add is the result's magnitude before the shift: an infinity (a
 * carry past the largest bfloat16, or an infinity kept) exactly when it reaches ET_INF_BITS, which a NaN's |bits|
 * already exceed; a NaN alone does not take the shifted sum (its result is the quiet NaN of its upper half). */
static inline et_u8v et_round_bf16(const float *restrict x, int64_t D, uint32_t h, uint32_t col0, int stochastic,
                                   uint16_t *restrict out, et_u8v badv) {
    const uint32_t *restrict b = (const uint32_t *)x;
    const uint32_t h1 = h ^ (h >> 16); /* the hash's first round for every column below 2^16 (et_hash_cols) */
    et_u8v col = (et_u8v){0, 1, 2, 3, 4, 5, 6, 7} + col0;
    int64_t d0 = 0;
    for (; et_vector_rounding && col0 + D <= 65536 && d0 + 8 <= D; d0 += 8, col += 8u) {
        et_u8v v;
        memcpy(&v, b + d0, sizeof v);
        const et_u8v a = v & 0x7fffffffu;
        et_u8v add;
        if (stochastic) {
            add = et_hash_cols(h1, col) >> 16;
        } else {
            add = 0x7fffu + ((v >> 16) & 1u);
        }
        /* |bits| fit int32: signed comparisons (one instruction each; a NaN's a + add may wrap, its own lane
         * flags it) */
        const et_u8v nan = (et_u8v)((et_i8v)a > (int32_t)ET_INF_BITS);
        const et_u8v o = ((v + (add & ~nan)) >> 16) | (nan & 0x0040u);
        badv |= nan | (et_u8v)((et_i8v)(a + add) >= (int32_t)ET_INF_BITS);
        const et_h8v o16 = __builtin_convertvector(o, et_h8v);
        memcpy(out + d0, &o16, sizeof o16);
    }
    for (int64_t d = d0; d < D; ++d) {
        const uint16_t o = stochastic ? et_sr_bfloat16(x[d], et_lowbias32(h ^ (col0 + (uint32_t)d)))
                                      : et_rn_half(x[d], 0);
        out[d] = o;
        badv[0] |= (uint32_t)((o & 0x7f80u) == 0x7f80u);
    }
    return badv;
}

typedef double et_d8v __attribute__((vector_size(64), aligned(8))); /* 8 doubles */
typedef int64_t et_l8v __attribute__((vector_size(64), aligned(8))); /* 8 int64 lanes: a comparison of et_d8v */

/* The float16 patterns (without sign) of 8 values whose lanes in ``tiny`` lie in float16's subnormal range
 * (0 < |x| < 2^-14), merged into m (the other lanes' patterns): et_sr_float16's and et_rn_half's subnormal rules on
 * 8 lanes. |x| 2^24 is exact (a power of two; a float32 subnormal reads as zero in both, under the same modes), its
 * integer part is the pattern toward zero and its fraction exact; the stochastic comparison r < fraction 2^32 is
 * made in double, as the scalar rule makes it. */
static inline __attribute__((always_inline)) et_u8v et_f16_subnormals8(et_u8v a, et_u8v r, int stochastic,
                                                                       et_u8v tiny, et_u8v m) {
    const et_f8v scaled = (et_f8v)a * 16777216.0f;
    const et_u8v low = __builtin_convertvector(scaled, et_u8v);
    const et_f8v frac = scaled - __builtin_convertvector(low, et_f8v);
    et_u8v up;
    if (stochastic) {
        const et_l8v below = __builtin_convertvector(r, et_d8v) < __builtin_convertvector(frac, et_d8v) * 4294967296.0;
        up = __builtin_convertvector(below, et_u8v);
    } else {
        up = (et_u8v)(frac > 0.5f) | ((et_u8v)(frac == 0.5f) & -(low & 1u));
    }
    return ((low + (up & 1u)) & tiny) | (m & ~tiny);
}

/* float16 rounding of D floats, stochastic or to nearest: the rules of et_sr_float16 and et_rn_half on 8 values
 * at a time (columns below 2^16): zeros, normals, overflows, infinities and NaNs without branches, and a vector
 * holding a value in float16's subnormal range through et_f16_subnormals8 as well (the same bits); returns badv
 * with a lane set for a result that is not finite (as et_round_bf16). */
static inline et_u8v et_round_f16(const float *restrict x, int64_t D, uint32_t h, uint32_t col0, int stochastic,
                                  uint16_t *restrict out, et_u8v badv) {
    const uint32_t *restrict b = (const uint32_t *)x;
    const uint32_t h1 = h ^ (h >> 16); /* the hash's first round for every column below 2^16 (et_hash_cols) */
    et_u8v col = (et_u8v){0, 1, 2, 3, 4, 5, 6, 7} + col0;
    int64_t d0 = 0;
    for (; et_vector_rounding && col0 + D <= 65536 && d0 + 8 <= D; d0 += 8, col += 8u) {
        et_u8v v;
        memcpy(&v, b + d0, sizeof v);
        const et_u8v a = v & 0x7fffffffu;
        const et_u8v tiny = (et_u8v)(a - 1u < 0x387fffffu); /* 0 < |x| < 2^-14: a float16 subnormal */
        const et_u8v sign = (v >> 16) & 0x8000u;
        /* |x| >= 2^-14 in the lanes this holds for: float16's exponent field is float32's less 112 (rebased in
         * place by a subtraction), its mantissa float32's upper 10 bits */
        const et_u8v low = (a >> 13) - (112u << 10);
        const et_u8v dropped = a & 0x1fffu;
        et_u8v up, r = {0, 0, 0, 0, 0, 0, 0, 0};
        if (stochastic) {
            r = et_hash_cols(h1, col);
            r ^= r >> 16;
            /* r < dropped << 19 on 32 bits, unsigned: dropped << 19 is even, so halving both keeps the order and
             * fits int32 */
            up = (et_u8v)((et_i8v)(r >> 1) < (et_i8v)(dropped << 18)) & 1u;
        } else {
            up = ((et_u8v)(dropped > 0x1000u) | ((et_u8v)(dropped == 0x1000u) & -(low & 1u))) & 1u;
        }
        const et_i8v sa = (et_i8v)a; /* |bits| fit int32: signed comparisons, one instruction each */
        const et_u8v zero = (et_u8v)(a == 0), nan = (et_u8v)(sa > (int32_t)ET_INF_BITS);
        const et_u8v over = stochastic ? (et_u8v)(sa > 0x477fe000) : (et_u8v)(sa >= 0x47800000);
        et_u8v m = (low + up) & ~zero;
        if (et_any_lane(tiny)) m = et_f16_subnormals8(a, r, stochastic, tiny, m);
        m = (0x7c00u & over) | (m & ~over);
        m = (0x7e00u & nan) | (m & ~nan);
        badv |= (et_u8v)((et_i8v)m >= 0x7c00); /* an infinity or the NaN */
        const et_h8v o16 = __builtin_convertvector(sign | m, et_h8v);
        memcpy(out + d0, &o16, sizeof o16);
    }
    for (int64_t d = d0; d < D; ++d) {
        const uint16_t v = stochastic ? et_sr_float16(x[d], et_lowbias32(h ^ (col0 + (uint32_t)d)))
                                      : et_rn_half(x[d], 1);
        out[d] = v;
        badv[0] |= (uint32_t)((v & 0x7c00u) == 0x7c00u);
    }
    return badv;
}

static inline et_u8v et_round_into(const float *x, int kind, int64_t D, uint32_t h, int64_t col0, int stochastic,
                                   uint16_t *out, et_u8v badv) {
    return kind == 0 ? et_round_bf16(x, D, h, (uint32_t)col0, stochastic, out, badv)
                     : et_round_f16(x, D, h, (uint32_t)col0, stochastic, out, badv);
}

/* Whether n values of storage kind (0 bfloat16, 1 float16: 2-byte patterns; 2 float32) at x hold one that is not
 * finite. */
static inline int et_stored_nonfinite(const void *x, int kind, int64_t n) {
    if (kind == 2) return et_maxbits((const float *)x, n, 0) >= ET_INF_BITS;
    const uint16_t *v = (const uint16_t *)x, e = kind == 0 ? 0x7f80u : 0x7c00u;
    for (int64_t i = 0; i < n; ++i)
        if ((v[i] & e) == e) return 1;
    return 0;
}

/* x [U, D] float32 rounded to bfloat16 (kind 0) or float16 (kind 1) into out [U, D] (the half patterns):
 * stochastically, row u's random bits from (seed, step, table, rows[u], column), or to nearest (stochastic 0);
 * the loops the tables write with, on the path et_round_path chose. */
void et_round_rows(const float *x, int64_t U, int64_t D, const int64_t *rows, int64_t seed, int64_t step,
                   int64_t table, int32_t kind, int32_t stochastic, uint16_t *out) {
    ET_FLUSH_SUBNORMALS;
    const uint32_t prefix = et_round_prefix((uint64_t)seed, (uint64_t)step, (uint32_t)table);
    for (int64_t u = 0; u < U; ++u)
        (void)et_round_into(x + u * D, kind, D, et_round_row(prefix, rows[u]), 0, stochastic != 0, out + u * D,
                            (et_u8v){0, 0, 0, 0, 0, 0, 0, 0});
}

static inline __attribute__((always_inline)) void et_prefetch_half(const uint16_t *row, int64_t D) {
    __builtin_prefetch(row, 0, 3);
    if (D > 32) __builtin_prefetch(row + 32, 0, 3);
}

/* One bag, one 64-column block of a bfloat16 table: the accumulator in registers, as et_bag_block64. */
static inline void et_bag_bf16_block64(const uint16_t *W, int64_t D, int64_t V, const int64_t *ids, int64_t k0,
                                       int64_t k1, const float *coeffs, float *out, int64_t pf_end, int *bad) {
    float acc[64];
    for (int j = 0; j < 64; ++j) acc[j] = 0.0f;
    for (int64_t k = k0; k < k1; ++k) {
        if (k + ET_LOOKUP_PF < pf_end) et_prefetch_half(W + ids[k + ET_LOOKUP_PF] * D, D);
        const int64_t id = ids[k];
        if ((uint64_t)id >= (uint64_t)V) {
            *bad = 1;
            continue;
        }
        const uint16_t *restrict row = W + id * D;
        const float c = coeffs ? coeffs[k] : 1.0f;
        for (int j = 0; j < 64; ++j) {
            const uint32_t u = (uint32_t)row[j] << 16;
            float f;
            memcpy(&f, &u, sizeof f);
            acc[j] += c * f;
        }
    }
    memcpy(out, acc, sizeof acc);
}

/* One bag of a half table into o [D] float32: the float32 lookup's sums (0 + c * row, in id order). */
static inline void et_bag_half(const uint16_t *W, int kind, int64_t D, int64_t V, const int64_t *ids, int64_t k0,
                               int64_t k1, int64_t total, const float *coeffs, float *restrict o, int *bad) {
    if (kind == 0 && D % 64 == 0) {
        for (int64_t d0 = 0; d0 < D; d0 += 64)
            et_bag_bf16_block64(W + d0, D, V, ids, k0, k1, coeffs, o + d0, d0 == 0 ? total : 0, bad);
        return;
    }
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t k = k0; k < k1; ++k) {
        if (k + ET_LOOKUP_PF < total) {
            const int64_t ahead = ids[k + ET_LOOKUP_PF];
            if ((uint64_t)ahead < (uint64_t)V) et_prefetch_half(W + ahead * D, D);
        }
        const int64_t id = ids[k];
        if ((uint64_t)id >= (uint64_t)V) {
            *bad = 1;
            continue;
        }
        const uint16_t *restrict row = W + id * D;
        const float c = coeffs ? coeffs[k] : 1.0f;
        if (kind == 0) {
            for (int64_t d = 0; d < D; ++d) {
                const uint32_t u = (uint32_t)row[d] << 16;
                float f;
                memcpy(&f, &u, sizeof f);
                o[d] += c * f;
            }
        } else {
            int64_t d = 0;
            for (; d + 8 <= D; d += 8) {
                et_h8v h;
                et_f8v acc;
                memcpy(&h, row + d, sizeof h);
                memcpy(&acc, o + d, sizeof acc);
                acc += c * et_f16_widen8(__builtin_convertvector(h, et_u8v));
                memcpy(o + d, &acc, sizeof acc);
            }
            for (; d < D; ++d) o[d] += c * et_half_float(row[d], 1);
        }
    }
}

/* One bag of a bfloat16 table with D a multiple of 8, 8 columns at a time: each block's sums in a register,
 * 0 + c * row in id order (the float32 lookup's sums; no fused multiply-add: -ffp-contract=off). */
static inline void et_bag_bf16_v8(const uint16_t *W, int64_t D, int64_t V, const int64_t *ids, int64_t k0,
                                  int64_t k1, int64_t total, const float *coeffs, float *restrict o, int *bad) {
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
        et_f8v acc = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t k = k0; k < k1; ++k) {
            if (d0 == 0 && k + ET_LOOKUP_PF < total) et_prefetch_half(W + ids[k + ET_LOOKUP_PF] * D, D);
            const int64_t id = ids[k];
            if ((uint64_t)id >= (uint64_t)V) {
                *bad = 1;
                continue;
            }
            et_h8v h;
            memcpy(&h, W + id * D + d0, sizeof h);
            const et_u8v bits = __builtin_convertvector(h, et_u8v) << 16;
            et_f8v f;
            memcpy(&f, &bits, sizeof f);
            acc += (coeffs ? coeffs[k] : 1.0f) * f;
        }
        memcpy(o + d0, &acc, sizeof acc);
    }
}

/* Bag s of a feature of a half table (kind 0 bfloat16, 1 float16) or (kind 2) a float32 one whose bags hold one
 * id each and no coefficient (et_one_id_bags; ids at the feature's first id, S bags): o [D] = 0 + the row read as
 * float32, the sum et_bag_half and et_bag_bf16_v8 make of one id, with et_one_id_bag's non-finite lanes and
 * bad ids. */
static inline __attribute__((always_inline)) void et_one_id_half_bag(const uint16_t *W, int kind, int64_t D,
                                                                     int64_t V, const int64_t *ids, int64_t s,
                                                                     int64_t S, float *restrict o, int *bad,
                                                                     et_u8v *nonfinite) {
    if (kind == 2) {
        et_one_id_bag((const float *)W, D, V, ids, s, S, o, bad, nonfinite);
        return;
    }
    const uint16_t *restrict row = (const uint16_t *)et_one_id_row((const char *)W, 2 * D, V, ids, s, S, o, D, bad);
    if (!row) return;
    et_u8v lanes = *nonfinite;
    int64_t d = 0;
    for (; kind == 0 && d + 8 <= D; d += 8) {
        et_h8v h;
        memcpy(&h, row + d, sizeof h);
        const et_f8v v = 0.0f + (et_f8v)(__builtin_convertvector(h, et_u8v) << 16);
        *(et_f8v *)(o + d) = v;
        lanes |= (et_u8v)(((et_u8v)v & 0x7fffffffu) >= ET_INF_BITS);
    }
    for (; kind == 1 && d + 8 <= D; d += 8) {
        et_h8v h;
        memcpy(&h, row + d, sizeof h);
        const et_f8v v = 0.0f + et_f16_widen8(__builtin_convertvector(h, et_u8v));
        *(et_f8v *)(o + d) = v;
        lanes |= (et_u8v)(((et_u8v)v & 0x7fffffffu) >= ET_INF_BITS);
    }
    for (; d < D; ++d) {
        o[d] = 0.0f + et_half_float(row[d], kind);
        lanes[0] |= et_absbits(o[d]) >= ET_INF_BITS;
    }
    *nonfinite = lanes;
}

/* Bag i of the index space of every feature's bags (first[f]: feature f's first), *f its feature found from the
 * one before, from a half table or (kind 2) a float32 one (et_one_id_half_bag when every bag of every feature
 * holds one id: one_id, first_id[f] feature f's first id); a lane of *nonfinite is set for an activation value
 * that is not finite. Always inlined: a call per bag cost the lookup. */
static inline __attribute__((always_inline)) void et_half_bag_of(int one_id, const uint16_t *const *W,
                                                                  const int32_t *kind, const int64_t *D,
                                                                  const int64_t *V, const int64_t *const *ids,
                                                                  const int64_t *const *first_id,
                                                                  const int64_t *const *offsets, const int64_t *S,
                                                                  const float *const *coeffs, float *const *out,
                                                                  const int64_t *ld, const int64_t *first, int64_t i,
                                                                  int64_t *f, int *bad, et_u8v *nonfinite) {
    const int64_t g = *f = et_feature_of(first, i, *f);
    const int64_t s = i - first[g], d = D[g];
    if (one_id) {
        et_one_id_half_bag(W[g], kind[g], d, V[g], first_id[g], s, S[g], out[g] + s * ld[g], bad, nonfinite);
        return;
    }
    if (kind[g] == 2) { /* a float32 table: the float32 lookup's bag */
        et_bag_float32((const float *)W[g], d, V[g], ids[g], offsets[g], s, offsets[g][S[g]], coeffs[g], out[g],
                       ld[g], bad, nonfinite);
        return;
    }
    float *restrict o = out[g] + s * ld[g];
    if (kind[g] == 0 && d % 8 == 0 && d % 64 != 0) /* 64-column blocks: et_bag_half's registers */
        et_bag_bf16_v8(W[g], d, V[g], ids[g], offsets[g][s], offsets[g][s + 1], offsets[g][S[g]], coeffs[g], o, bad);
    else
        et_bag_half(W[g], kind[g], d, V[g], ids[g], offsets[g][s], offsets[g][s + 1], offsets[g][S[g]], coeffs[g], o,
                    bad);
    *nonfinite = et_nonfinite8(o, d, *nonfinite);
}

/* Lookups of F features from half tables, one parallel region over every feature's bags (none for one thread):
 * feature f reads W[f] [V[f], D[f]] of kind[f] (0 bfloat16, 1 float16; 2 float32, pooled as et_lookup_many pools
 * it: a step of half and float32 tables in one call) and writes out[f] [S[f], D[f]] float32,
 * rows ld[f] >= D[f] floats apart (ld[f] > D[f]: a column block of one wider output, the concatenated
 * activations): each row read as float32 and the bags summed in float32 in the float32 lookup's order (bags of one
 * id each and no coefficients, every feature's: et_one_id_half_bag). Returns 0, 1 bad offsets, an id outside
 * [0, V) (the outputs are then garbage), a kind outside 0-2 or a shape or stride that does not fit (et_shapes_ok:
 * nothing written), 2 a non-finite activation. */
int et_lookup_half_many(int64_t F, const uint16_t *const *W, const int32_t *kind, const int64_t *D,
                        const int64_t *V, const int64_t *const *ids, const int64_t *N,
                        const int64_t *const *offsets, const int64_t *S, const float *const *coeffs,
                        float *const *out, const int64_t *ld, int nthreads) {
    ET_FLUSH_SUBNORMALS;
    for (int64_t f = 0; f < F; ++f)
        if (kind[f] < 0 || kind[f] > 2) return 1;
    if (!et_shapes_ok(F, D, V, ld)) return 1;
    int64_t first[F + 1];
    if (!et_bag_index(F, offsets, S, N, first)) return 1;
    const int64_t all = first[F];
    int bad = 0, nonfinite = 0;
    const int64_t *first_id[F > 0 ? F : 1];
    const int one_id = et_one_id_features(F, ids, offsets, S, coeffs, first_id);
    if (one_id && nthreads <= 1) { /* feature by feature: each feature's table, kind and width read once */
        et_u8v lanes = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t f = 0; f < F; ++f)
            for (int64_t s = 0; s < S[f]; ++s)
                et_one_id_half_bag(W[f], kind[f], D[f], V[f], first_id[f], s, S[f], out[f] + s * ld[f], &bad, &lanes);
        return bad ? 1 : (et_any_lane(lanes) ? 2 : 0);
    }
    if (nthreads <= 1) { /* one thread: no parallel region (entering one costs a system call or two) */
        int64_t f = 0;
        et_u8v lanes = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < all; ++i)
            et_half_bag_of(one_id, W, kind, D, V, ids, first_id, offsets, S, coeffs, out, ld, first, i, &f, &bad,
                           &lanes);
        return bad ? 1 : (et_any_lane(lanes) ? 2 : 0);
    }
#pragma omp parallel num_threads(nthreads) reduction(| : bad, nonfinite)
    {
        ET_FLUSH_SUBNORMALS;
        int64_t f = 0;
        et_u8v lanes = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma omp for schedule(static, 256)
        for (int64_t i = 0; i < all; ++i)
            et_half_bag_of(one_id, W, kind, D, V, ids, first_id, offsets, S, coeffs, out, ld, first, i, &f, &bad,
                           &lanes);
        nonfinite |= et_any_lane(lanes);
    }
    return bad ? 1 : (nonfinite ? 2 : 0);
}

/* The body of et_apply_half_rows, always inlined so that a caller passing constants (kinds, slots, mode) gets a
 * loop without their branches. */
static inline __attribute__((always_inline)) int64_t et_half_rows(const et_workspace *h, void *W, void *const *S,
                                                                   int K, int32_t wkind, int32_t skind, int64_t D,
                                                                   const et_opt *p, et_row_fn fn,
                                                                   const int64_t *grows, int affine, int64_t first,
                                                                   int64_t stride, uint32_t prefix,
                                                                   int32_t stochastic, int32_t mode, uint16_t *out,
                                                                   float *sout, int64_t wide, float *buf) {
    const int64_t U = h->U, sb = skind == 2 ? 4 : 2; /* bytes of one slot value */
    const int64_t R = et_block_rows(D), blocks = (U + R - 1) / R;
    et_u8v lanes = {0, 0, 0, 0, 0, 0, 0, 0}; /* a lane set: some row written here is not finite */
    float *c[4] = {buf, buf + R * D, buf + 2 * R * D, buf + 3 * R * D}; /* R rows of weights, of each slot */
    /* 256 / R blocks a chunk: each thread gets the rows schedule(static, 256) over rows gives it */
#pragma omp for schedule(static, 256 / R) nowait
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t u0 = blk * R, n = U - u0 < R ? U - u0 : R;
        for (int64_t i = 0; i < n; ++i) { /* the block's rows read into float32 */
            const int64_t u = u0 + i;
            if (u + ET_PF < U) { /* every 64-byte line of the row ET_PF ahead, weights and slots */
                const int64_t ahead = h->rows[u + ET_PF];
                const int64_t wbytes = 2 * D, sbytes = sb * D;
                const char *w = (const char *)W + ahead * wbytes;
                for (int64_t b = 0; b < wbytes; b += 64) __builtin_prefetch(w + b, 0, 3);
                for (int k = 0; k < K; ++k) {
                    const char *sr = (const char *)S[k] + ahead * sbytes;
                    for (int64_t b = 0; b < sbytes; b += 64) __builtin_prefetch(sr + b, 0, 3);
                }
            }
            const int64_t r = h->rows[u];
            uint16_t *o = out + u * wide;
            if (mode == 2) { /* the stored row first, to put back (mode 3) */
                memcpy(o, (const uint16_t *)W + r * D, sizeof(uint16_t) * (size_t)D);
                for (int k = 0; k < K; ++k) {
                    char *to = skind == 2 ? (char *)(sout + (u * K + k) * D) : (char *)(o + (k + 1) * D);
                    memcpy(to, (const char *)S[k] + r * D * sb, (size_t)(D * sb));
                }
            }
            et_load_row(W, wkind, r, D, c[0] + i * D);
            for (int k = 0; k < K; ++k) et_load_row(S[k], skind, r, D, c[k + 1] + i * D);
        }
        /* the optimizer over the block as one row of n x D values: its row functions are elementwise, and the
         * block's gradient rows are consecutive in G */
        fn(p, c[0], K > 0 ? c[1] : NULL, K > 1 ? c[2] : NULL, K > 2 ? c[3] : NULL, h->G + u0 * D, n * D);
        for (int64_t i = 0; i < n; ++i) {
            const int64_t u = u0 + i, r = h->rows[u];
            uint16_t *o = out + u * wide;
            const uint32_t hr = et_round_row(prefix, affine ? first + stride * r : grows ? grows[r] : r);
            /* mode 0: the rounded row into out / sout; mode 2: into the table, in place */
            lanes = et_round_into(c[0] + i * D, wkind, D, hr, 0, stochastic, mode == 2 ? (uint16_t *)W + r * D : o,
                                  lanes);
            for (int k = 0; k < K; ++k) {
                const float *x = c[k + 1] + i * D;
                if (skind == 2) {
                    float *to = mode == 2 ? (float *)S[k] + r * D : sout + (u * K + k) * D;
                    memcpy(to, x, sizeof(float) * (size_t)D);
                    lanes = et_nonfinite8(x, D, lanes);
                } else {
                    uint16_t *to = mode == 2 ? (uint16_t *)S[k] + r * D : o + (k + 1) * D;
                    lanes = et_round_into(x, skind, D, hr, (k + 1) * D, stochastic, to, lanes);
                }
            }
        }
    }
    if (!et_any_lane(lanes)) return -1;
    /* Some value written is not finite: the largest such row, read back from what was written, over the same rows
     * (a static schedule of the same loop gives this thread the same rows). */
    int64_t bad = -1;
#pragma omp for schedule(static, 256) nowait
    for (int64_t u = 0; u < U; ++u) {
        const int64_t r = h->rows[u];
        const uint16_t *o = out + u * wide;
        int nonfinite = et_stored_nonfinite(mode == 2 ? (const uint16_t *)W + r * D : o, wkind, D);
        for (int k = 0; k < K && !nonfinite; ++k) {
            const void *at = mode == 2     ? (const char *)S[k] + r * D * sb
                             : skind == 2 ? (const void *)(sout + (u * K + k) * D)
                                          : (const void *)(o + (k + 1) * D);
            nonfinite = et_stored_nonfinite(at, skind, D);
        }
        if (nonfinite && r > bad) bad = r;
    }
    return bad;
}

/* The rows of et_apply_half's modes 0 and 2, shared by the calling team's threads (a worksharing loop; called
 * outside a parallel region, by one thread, it runs every row), buf this thread's 4 x R x D floats
 * (R = et_block_rows(D)). Returns the largest row whose update is not finite, -1 when none. A bfloat16
 * table with one bfloat16 slot (Adagrad's), rounded stochastically in place, gets a loop of its own. Not inlined:
 * the prefetch test finds its loop by name. */
static __attribute__((noinline)) int64_t et_apply_half_rows(const et_workspace *h, void *W, void *const *S, int K,
                                                           int32_t wkind, int32_t skind, int64_t D, const et_opt *p,
                                                           et_row_fn fn, const int64_t *grows, int affine,
                                                           int64_t first, int64_t stride, uint32_t prefix,
                                                           int32_t stochastic, int32_t mode, uint16_t *out,
                                                           float *sout, int64_t wide, float *buf) {
    if (wkind == 0 && skind == 0 && K == 1 && stochastic && mode == 2)
        return et_half_rows(h, W, S, 1, 0, 0, D, p, fn, grows, affine, first, stride, prefix, 1, 2, out, sout, wide,
                            buf);
    if (wkind == 1 && skind == 1 && K == 1 && stochastic && mode == 2)
        return et_half_rows(h, W, S, 1, 1, 1, D, p, fn, grows, affine, first, stride, prefix, 1, 2, out, sout, wide,
                            buf);
    return et_half_rows(h, W, S, K, wkind, skind, D, p, fn, grows, affine, first, stride, prefix, stochastic, mode,
                        out, sout, wide, buf);
}

/* Phase 2 of a lazy update of a half table from its prepared workspace. Every prepared row's update is computed
 * in float32 from its stored values (weights of kind wkind, 0 or 1; slots of kind skind, 0, 1 or 2: float32)
 * and rounded, row u's random bits from (seed, step, table, grows[rows[u]]) (grows NULL: the rows are global;
 * nglobal -1: grows is the pair {first, stride} and local row r is global row first + stride * r; else
 * [nglobal], one per local row). The scratch is out [U, (1 + K) x D] (2-byte patterns; with K float32
 * slots out holds the weights [U, D] and sout [U, K x D] floats). mode 0: the rounded rows into the scratch,
 * nothing in the table changes; mode 1: the scratch of a mode-0 call written into the rows (returns -1);
 * mode 2: the rows updated in place, each row's stored values kept in the scratch first; mode 3: the rows a
 * mode-2 call changed put back from the scratch (returns -1). Modes 0 and 2 return -1 when every rounded value
 * is finite, else the largest row whose update is not (after mode 2 the caller must then put the rows back).
 * -2: a workspace, row map or scratch that does not fit; -3 out of memory (nothing written); -4 an unknown optimizer
 * or kind. */
int64_t et_apply_half(const void *handle, void *W, void *S0, void *S1, void *S2, int32_t wkind, int32_t skind,
                      int64_t V, int64_t D, const et_opt *p, const int64_t *grows, int64_t nglobal, int64_t seed,
                      int64_t step, int64_t table, int32_t stochastic, int32_t mode, uint16_t *out, float *sout,
                      int64_t scratch_rows, int nthreads) {
    ET_FLUSH_SUBNORMALS;
    const et_workspace *h = (const et_workspace *)handle;
    if (!et_prepared_ok(h, V, D)) return -2;
    const int affine = grows != NULL && nglobal == -1;
    if (grows && !affine && nglobal < V) return -2;
    if (affine && (grows[0] < 0 || grows[1] < 1)) return -2;
    const int64_t first = affine ? grows[0] : 0, stride = affine ? grows[1] : 1;
    if ((wkind != 0 && wkind != 1) || skind < 0 || skind > 2 || mode < 0 || mode > 3) return -4;
    const et_row_fn fn = et_row_function(p->kind);
    if (!fn) return -4;
    void *S[3] = {S0, S1, S2};
    const int K = (S0 != NULL) + (S1 != NULL) + (S2 != NULL);
    if ((S0 == NULL && K > 0) || (S1 == NULL && S2 != NULL)) return -2;
    const int64_t U = h->U, wide = skind == 2 ? D : (1 + K) * D; /* 2-byte values per row of out */
    if (scratch_rows < U || (skind == 2 && K > 0 && sout == NULL)) return -2;
    const int64_t sb = skind == 2 ? 4 : 2; /* bytes of one slot value */
    if (mode == 1 || mode == 3) { /* out / sout into the rows: a mode-0 call's update, or a mode-2 call's copies */
#pragma omp parallel num_threads(nthreads)
        {
            ET_FLUSH_SUBNORMALS;
#pragma omp for schedule(static, 256)
            for (int64_t u = 0; u < U; ++u) {
                const int64_t r = h->rows[u];
                memcpy((uint16_t *)W + r * D, out + u * wide, sizeof(uint16_t) * (size_t)D);
                for (int k = 0; k < K; ++k) {
                    const char *from = skind == 2 ? (const char *)(sout + (u * K + k) * D)
                                                  : (const char *)(out + u * wide + (k + 1) * D);
                    memcpy((char *)S[k] + r * D * sb, from, (size_t)(D * sb));
                }
            }
        }
        return -1;
    }
    const uint32_t prefix = et_round_prefix((uint64_t)seed, (uint64_t)step, (uint32_t)table);
    /* every thread's row buffer before any row is touched: out of memory here changes nothing */
    const int nt = nthreads > 0 ? nthreads : 1;
    const int64_t per_thread = 4 * et_block_rows(D) * D; /* floats: R rows of weights and 3 slots */
    float *bufs = (float *)malloc(sizeof(float) * (size_t)per_thread * (size_t)nt);
    if (!bufs) return -3;
    int64_t bad = -1;
    if (nt == 1) { /* one thread: no parallel region (entering one costs a system call or two) */
        bad = et_apply_half_rows(h, W, S, K, wkind, skind, D, p, fn, grows, affine, first, stride, prefix,
                                 stochastic, mode, out, sout, wide, bufs);
    } else {
#pragma omp parallel num_threads(nt) reduction(max : bad)
        {
            ET_FLUSH_SUBNORMALS;
            const int64_t b = et_apply_half_rows(h, W, S, K, wkind, skind, D, p, fn, grows, affine, first, stride,
                                                 prefix, stochastic, mode, out, sout, wide,
                                                 bufs + (size_t)omp_get_thread_num() * (size_t)per_thread);
            bad = b > bad ? b : bad;
        }
    }
    free(bufs);
    return bad;
}

/* The half tables among tables [0, last] (wkind 0 or 1) put back after a mode-2 call (mode 3), last first. */
static void et_put_back_half(int64_t last, void *const *handles, void *const *W, void *const *S0, void *const *S1,
                             void *const *S2, const int32_t *wkind, const int32_t *skind, const int64_t *V,
                             const int64_t *D, const et_opt *const *p, const int64_t *const *grows,
                             const int64_t *nglobal, const int64_t *seed, int64_t step, const int64_t *table,
                             const int32_t *stochastic, uint16_t *const *out, float *const *sout,
                             const int64_t *scratch_rows, int nthreads) {
    for (int64_t k = last; k >= 0; --k)
        if (wkind[k] != 2)
            et_apply_half(handles[k], W[k], S0[k], S1[k], S2[k], wkind[k], skind[k], V[k], D[k], p[k], grows[k],
                          nglobal[k], seed[k], step, table[k], stochastic[k], 3, out[k], sout[k], scratch_rows[k],
                          nthreads);
}

/* The float32 tables (wkind 2) among T tables written by et_apply_many, all or nothing, each checked (proven
 * finite from bounds on the rows it touches, or checked as it is written). Returns 0 (all written), 1 (one not
 * finite: bad[t] one such row of it; nothing written) or the first status below -1 (nothing written). */
static int64_t et_apply_float32_of(int64_t T, void *const *handles, void *const *W, void *const *S0,
                                   void *const *S1, void *const *S2, const int32_t *wkind, const int64_t *V,
                                   const int64_t *D, const et_opt *const *p, int nthreads, int64_t *bad) {
    const int64_t n = T > 0 ? T : 1;
    void *h[n];
    float *w[n], *s0[n], *s1[n], *s2[n], maxabs[4 * n];
    const et_opt *q[n];
    int64_t v[n], d[n], b[n], at[n], m = 0;
    int32_t zeros[n], ones[n], status[n], proven[n];
    double hi[4 * n], lo[4 * n];
    for (int64_t t = 0; t < T; ++t) {
        if (wkind[t] != 2) continue;
        h[m] = handles[t], w[m] = (float *)W[t], s0[m] = (float *)S0[t], s1[m] = (float *)S1[t];
        s2[m] = (float *)S2[t], q[m] = p[t], v[m] = V[t], d[m] = D[t], zeros[m] = 0, ones[m] = 1, at[m++] = t;
    }
    if (m == 0) return 0;
    et_apply_many(m, h, w, s0, s1, s2, v, d, q, zeros, zeros, ones, nthreads, maxabs, status, b, hi, lo, proven);
    for (int64_t i = 0; i < m; ++i) {
        if (status[i] == 1) {
            bad[at[i]] = b[i];
            return 1;
        }
        if (status[i] != 0) return status[i];
    }
    return 0;
}

/* T tables' lazy updates in one call, all or nothing: the half-precision tables (wkind 0 or 1: et_apply_half,
 * argument t of each array for table t) each updated in place (mode 2), its stored rows kept in its scratch; then
 * the float32 tables (wkind 2, skind 2: float32 slots; rounding and scratch arguments unused) by et_apply_many,
 * each checked. When table t's update is not finite, bad[t] is its largest such row (a float32 table's: one such
 * row) and every half table written, t included, is put back (mode 3): nothing changes. Returns 0 (every table
 * written, bad all -1), 1 (one not finite, nothing written) or the first status below -1 of et_apply_half or
 * et_apply_many (nothing written: such a call writes nothing itself), -4 for a kind outside 0-2. */
int64_t et_apply_half_many(int64_t T, void *const *handles, void *const *W, void *const *S0, void *const *S1,
                           void *const *S2, const int32_t *wkind, const int32_t *skind, const int64_t *V,
                           const int64_t *D, const et_opt *const *p, const int64_t *const *grows,
                           const int64_t *nglobal, const int64_t *seed, int64_t step, const int64_t *table,
                           const int32_t *stochastic, uint16_t *const *out, float *const *sout,
                           const int64_t *scratch_rows, int nthreads, int64_t *bad) {
    for (int64_t t = 0; t < T; ++t) {
        bad[t] = -1;
        if (wkind[t] < 0 || wkind[t] > 2 || (wkind[t] == 2 && skind[t] != 2)) return -4;
    }
    for (int64_t t = 0; t < T; ++t) {
        if (wkind[t] == 2) continue;
        const int64_t r = et_apply_half(handles[t], W[t], S0[t], S1[t], S2[t], wkind[t], skind[t], V[t], D[t], p[t],
                                        grows[t], nglobal[t], seed[t], step, table[t], stochastic[t], 2, out[t],
                                        sout[t], scratch_rows[t], nthreads);
        if (r == -1) continue;
        /* the tables written, back to what they held */
        et_put_back_half(r >= 0 ? t : t - 1, handles, W, S0, S1, S2, wkind, skind, V, D, p, grows, nglobal, seed,
                         step, table, stochastic, out, sout, scratch_rows, nthreads);
        if (r >= 0) {
            bad[t] = r;
            return 1;
        }
        return r;
    }
    const int64_t r = et_apply_float32_of(T, handles, W, S0, S1, S2, wkind, V, D, p, nthreads, bad);
    if (r != 0) /* nothing of the float32 tables written: the half tables back too */
        et_put_back_half(T - 1, handles, W, S0, S1, S2, wkind, skind, V, D, p, grows, nglobal, seed, step, table,
                         stochastic, out, sout, scratch_rows, nthreads);
    return r;
}
