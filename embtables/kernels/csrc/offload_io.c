/* The row I/O of an offloaded table's row cache (embtables/tables/offload_files.py), compiled into the same
 * library as embtables_native.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

/* The row I/O of an offloaded table's row cache: rows of one file by row index, one call for a batch of rows.
 *
 * op 0: read row rows[i] of the file into buf + i * row_bytes (pread); op 1: write it from there (pwrite); op 2:
 *       read as op 0, then on Linux drop the pages read from the page cache (POSIX_FADV_DONTNEED: no second copy
 *       there, and the next read of the row comes from the disk). A run of consecutive rows
 *       (rows[i + 1] == rows[i] + 1) goes in one system call. With depth > 1, when the first runs are slow (the
 *       disk answers them, not the page cache), up to depth threads each take the next run (many requests in
 *       flight: the disk's queue is kept full); else one after another in the calling thread.
 *
 * Nothing is trusted: fd >= 0, row_bytes > 0, n >= 0, buf and rows given when n > 0, and every row inside the
 * file's recorded size (0 <= rows[i], (rows[i] + 1) * row_bytes <= size, no overflow), else nothing is done and
 * 2 ("sizes") is returned. A failing system call stops the work: 1 is returned with err[0] = errno (a read
 * that ends before its row: EIO; a full disk: ENOSPC) and err[1] = the row's index (the first failure seen). 0:
 * done. A thread that cannot be started leaves its share to the others.
 */
#define ET_MAX_DEPTH 64
#define ET_PROBE_RUNS 32      /* runs the calling thread does alone before deciding whether to start more */
#define ET_DISK_RUN_S 20e-6   /* a run slower than this on average came from the disk: start the others */

typedef struct {
    int32_t fd, op;
    char *base;
    int64_t row_bytes, n;
    const int64_t *rows;
    int64_t next; /* the next row index to take (a run starts there), under lock */
    int32_t failed, err0, err1;
    pthread_mutex_t lock;
} et_row_io;

static int et_row_run(et_row_io *io, int64_t i, int64_t j) {
    const int64_t off = io->rows[i] * io->row_bytes, len = (j - i) * io->row_bytes;
    char *at = io->base + i * io->row_bytes;
    for (int64_t done = 0; done < len;) {
        const ssize_t got = io->op != 1 ? pread(io->fd, at + done, (size_t)(len - done), (off_t)(off + done))
                                        : pwrite(io->fd, at + done, (size_t)(len - done), (off_t)(off + done));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return got < 0 ? errno : EIO; /* 0: the file ends before its recorded size */
        done += got;
    }
#ifdef __linux__
    if (io->op == 2) { /* the rows are in the cache now: their pages leave the page cache (no second copy) */
        const int64_t page = 4096, first = off / page * page, last = (off + len + page - 1) / page * page;
        (void)posix_fadvise(io->fd, first, last - first, POSIX_FADV_DONTNEED);
    }
#endif
    return 0;
}

/* Take runs until none is left; returns the runs done (-1 after a failure). */
static int64_t et_row_take(et_row_io *io, int64_t most) {
    int64_t done = 0;
    while (done < most) {
        pthread_mutex_lock(&io->lock);
        int64_t i = io->next, j = i;
        if (!io->failed && i < io->n) {
            j = i + 1;
            while (j < io->n && io->rows[j] == io->rows[j - 1] + 1) j++;
            io->next = j;
        }
        pthread_mutex_unlock(&io->lock);
        if (j == i) return done;
        const int rc = et_row_run(io, i, j);
        if (rc != 0) {
            pthread_mutex_lock(&io->lock);
            if (!io->failed) {
                io->failed = 1;
                io->err0 = rc;
                io->err1 = (int32_t)(i < INT32_MAX ? i : INT32_MAX);
            }
            pthread_mutex_unlock(&io->lock);
            return -1;
        }
        done++;
    }
    return done;
}

static void *et_row_worker(void *arg) {
    et_row_take((et_row_io *)arg, INT64_MAX);
    return NULL;
}

static double et_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int32_t et_offload_rows(int32_t fd, int64_t size, void *buf, int64_t row_bytes, const int64_t *rows, int64_t n,
                        int32_t op, int32_t depth, int32_t *err) {
    if (fd < 0 || size < 0 || row_bytes <= 0 || n < 0 || err == 0 || op < 0 || op > 2 ||
        (n > 0 && (buf == 0 || rows == 0)))
        return 2;
    const int64_t max_rows = size / row_bytes;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= max_rows) return 2;
    et_row_io io = {fd, op, (char *)buf, row_bytes, n, rows, 0, 0, 0, 0, PTHREAD_MUTEX_INITIALIZER};
    /* The calling thread starts alone; when its runs take longer than a page-cache copy (the disk answers them),
     * up to depth - 1 more threads join, so that many requests are in flight. Page-cache hits stay on one thread:
     * threads would only add their start and the lock. */
    const double start = et_now();
    int64_t done = et_row_take(&io, ET_PROBE_RUNS);
    pthread_t ids[ET_MAX_DEPTH];
    int started = 0;
    if (done == ET_PROBE_RUNS && depth > 1 && (et_now() - start) / (double)done > ET_DISK_RUN_S) {
        const int want = depth > ET_MAX_DEPTH ? ET_MAX_DEPTH : depth;
        for (int t = 1; t < want; t++)
            if (pthread_create(&ids[started], NULL, et_row_worker, &io) == 0) started++;
    }
    if (done >= 0) et_row_take(&io, INT64_MAX);
    for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
    if (io.failed) {
        err[0] = io.err0;
        err[1] = io.err1;
        return 1;
    }
    return 0;
}
