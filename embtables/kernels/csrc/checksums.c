/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of TensorFlow's checkpoint bundles
 * (embtables/checkpoint/tf_bundle.py). The SSE 4.2 crc32 instruction where the compiler targets it, else one
 * table lookup a byte; both give the same value. Compiled into the same library as embtables_native.c. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE4_2__
#include <nmmintrin.h>
#endif

#ifndef __SSE4_2__
#include <pthread.h>
static uint32_t et_crc_table[256];
static pthread_once_t et_crc_once = PTHREAD_ONCE_INIT;

static void et_crc_init(void) { /* once per process (pthread_once), before any call reads the table */
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        et_crc_table[i] = c;
    }
}
#endif

/* The CRC-32C of n bytes at data, continuing crc (0 to start; the value a previous call returned to extend
 * it). n <= 0 returns crc unchanged; data is read only when n > 0. */
uint32_t et_crc32c(const uint8_t *data, int64_t n, uint32_t crc) {
    if (n <= 0 || data == NULL) return crc;
    uint32_t c = ~crc;
#ifdef __SSE4_2__
    uint64_t c64 = c;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t word;
        memcpy(&word, data + i, sizeof word);
        c64 = _mm_crc32_u64(c64, word);
    }
    c = (uint32_t)c64;
    for (; i < n; ++i) c = _mm_crc32_u8(c, data[i]);
#else
    pthread_once(&et_crc_once, et_crc_init);
    for (int64_t i = 0; i < n; ++i) c = et_crc_table[(c ^ data[i]) & 0xFFu] ^ (c >> 8);
#endif
    return ~c;
}
