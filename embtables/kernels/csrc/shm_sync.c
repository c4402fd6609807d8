/* Waiting and waking between processes of one host, for the shared-memory exchange of
 * embtables/sharding/shm_channel.py. Compiled into the same library as embtables_native.c.
 *
 * A sequence word is a 32-bit counter in a shared mapping that only its writer advances. A writer
 * publishes with et_shm_post (a release store, then a futex wake of every waiter); a reader waits
 * with et_shm_wait until the word has reached a target (an acquire load, so everything written
 * before the post is visible after the wait). Counters wrap: "reached" compares the signed
 * difference, so a counter may run through 2^31 posts between two waits.
 *
 * Linux only (futex). The caller, shm_channel.py, checks every address: each word lies inside a
 * mapping it holds for the whole call.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <sys/file.h>
#include <time.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

static int shm_reached(const uint32_t *word, uint32_t target) {
    return (int32_t)(__atomic_load_n(word, __ATOMIC_ACQUIRE) - target) >= 0;
}

static double shm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 1 when the process holding a shared flock on peer_fd's file is gone: the lock is released when a
 * process exits, killed or not, before it is reaped. */
static int shm_peer_gone(int peer_fd) {
    if (peer_fd < 0) return 0;
    if (flock(peer_fd, LOCK_EX | LOCK_NB) == 0) {
        flock(peer_fd, LOCK_UN);
        return 1;
    }
    return 0;
}

/* Publish: *word = value (release), then wake every process waiting on it. */
void et_shm_post(uint32_t *word, uint32_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#endif
}

/* Wait until *word has reached target. Returns 0 when it has, 1 after timeout_s seconds without it,
 * 2 when the peer (the holder of peer_fd's lock; -1: none) is gone and the word has not reached it.
 * Spins briefly (a peer that is about to post costs no sleep), then sleeps on the futex in slices of
 * 20 ms, checking the peer between slices. The GIL is released by ctypes for the whole call. */
int32_t et_shm_wait(uint32_t *word, uint32_t target, double timeout_s, int32_t peer_fd) {
    for (int i = 0; i < 4000; i++) {
        if (shm_reached(word, target)) return 0;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    double start = shm_now();
    for (;;) {
        uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if ((int32_t)(seen - target) >= 0) return 0;
#ifdef __linux__
        struct timespec slice = {0, 20 * 1000 * 1000};
        syscall(SYS_futex, word, FUTEX_WAIT, seen, &slice, NULL, 0);
#else
        struct timespec slice = {0, 200 * 1000};
        nanosleep(&slice, NULL);
#endif
        if (shm_reached(word, target)) return 0;
        if (shm_peer_gone(peer_fd)) return shm_reached(word, target) ? 0 : 2;
        if (shm_now() - start > timeout_s) return 1;
    }
}
