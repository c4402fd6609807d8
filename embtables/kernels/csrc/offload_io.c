/* The row I/O of an offloaded table's row cache (embtables/tables/offload_files.py), compiled into the same
 * library as embtables_native.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#if defined(__NR_io_uring_setup) && defined(__NR_io_uring_enter)
#define ET_URING 1
#endif
#endif
#endif

/* The row I/O of an offloaded table's row cache: rows of one file by row index, one call for a batch of rows.
 *
 * op 0: read row rows[i] of the file into buf + i * row_bytes (pread); op 1: write it from there (pwrite); op 2:
 *       read as op 0, then on Linux drop the pages read from the page cache (POSIX_FADV_DONTNEED: no second copy
 *       there, and the next read of the row comes from the disk). A run of consecutive rows
 *       (rows[i + 1] == rows[i] + 1) goes in one system call. With depth > 1, when the first runs are slow (the
 *       disk answers them, not the page cache), up to depth threads each take the next run (many requests in
 *       flight: the disk's queue is kept full), or with the io_uring engine (et_offload_io_engine(1)) the
 *       calling thread keeps up to depth reads or writes in flight in one io_uring; else one after another in
 *       the calling thread.
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

/* The engine for requests in flight: 0 threads each with one pread/pwrite, 1 one io_uring in the calling thread;
 * and whether requests go in flight from the first run, without the probe (et_always: a test's or a benchmark's
 * choice). Set once by et_offload_io_engine, read by every call. */
static int et_engine = 0, et_always = 0;

#ifdef ET_URING
typedef struct {
    int fd;
    unsigned entries;
    unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_len, cq_len, sqe_len;
} et_ring;

static void et_ring_close(et_ring *r) {
    if (r->sqes != MAP_FAILED && r->sqes != 0) munmap(r->sqes, r->sqe_len);
    if (r->cq_ptr != r->sq_ptr && r->cq_ptr != MAP_FAILED && r->cq_ptr != 0) munmap(r->cq_ptr, r->cq_len);
    if (r->sq_ptr != MAP_FAILED && r->sq_ptr != 0) munmap(r->sq_ptr, r->sq_len);
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
}

/* 0: a ring of at least `entries` submissions; -1: none (the kernel or its policy refuses io_uring). */
static int et_ring_open(et_ring *r, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    memset(r, 0, sizeof *r);
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0) return -1;
    const int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (single && r->cq_len > r->sq_len) r->sq_len = r->cq_len;
    r->sq_ptr = mmap(0, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    r->cq_ptr = single ? r->sq_ptr
                       : mmap(0, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                              IORING_OFF_CQ_RING);
    r->sqe_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = (struct io_uring_sqe *)(r->sq_ptr == MAP_FAILED || r->cq_ptr == MAP_FAILED
                                          ? MAP_FAILED
                                          : mmap(0, r->sqe_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                                                 r->fd, IORING_OFF_SQES));
    if (r->sq_ptr == MAP_FAILED || r->cq_ptr == MAP_FAILED || r->sqes == MAP_FAILED) {
        et_ring_close(r);
        return -1;
    }
    char *sq = (char *)r->sq_ptr, *cq = (char *)r->cq_ptr;
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    r->entries = p.sq_entries;
    return 0;
}

typedef struct {
    int64_t i, j, done; /* the run's row indices [i, j) and the bytes of it done */
    int busy;
} et_uring_req;

/* Queue the rest of request `slot` (its submission entry has the same index). */
static void et_uring_queue(et_ring *r, et_row_io *io, et_uring_req *q, unsigned slot) {
    const int64_t off = io->rows[q->i] * io->row_bytes + q->done, len = (q->j - q->i) * io->row_bytes - q->done;
    struct io_uring_sqe *sqe = &r->sqes[slot];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = io->op == 1 ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = io->fd;
    sqe->off = (uint64_t)off;
    sqe->addr = (uint64_t)(uintptr_t)(io->base + q->i * io->row_bytes + q->done);
    sqe->len = (unsigned)(len > (1 << 30) ? (1 << 30) : len);
    sqe->user_data = slot;
    const unsigned tail = *r->sq_tail;
    r->sq_array[tail & *r->sq_mask] = slot;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* Take every run left with up to `depth` requests in flight in ring `r`, in the calling thread; a failure is
 * recorded as the threads record it (io->failed, err0, err1), and the requests in flight are waited for. */
static void et_uring_take(et_row_io *io, et_ring *r, int depth) {
    et_uring_req req[ET_MAX_DEPTH];
    memset(req, 0, sizeof req);
    int inflight = 0;
    unsigned queued = 0;
    double refused_at = -1.0; /* when the ring refused a submission */
    if (depth > (int)r->entries) depth = (int)r->entries;
    for (;;) {
        for (int s = 0; s < depth && !io->failed && io->next < io->n; s++) {
            if (req[s].busy) continue;
            const int64_t i = io->next;
            int64_t j = i + 1;
            while (j < io->n && io->rows[j] == io->rows[j - 1] + 1) j++;
            io->next = j;
            req[s] = (et_uring_req){i, j, 0, 1};
            et_uring_queue(r, io, &req[s], (unsigned)s);
            queued++;
            inflight++;
        }
        if (inflight == 0) return;
        const long got = syscall(__NR_io_uring_enter, r->fd, queued, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (got < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
            /* the ring refuses submissions: record the failure, queue nothing more, and keep reaping (below) until
             * the requests already in flight have completed, so none writes into the buffer after the return */
            if (!io->failed) {
                io->failed = 1;
                io->err0 = errno;
                io->err1 = 0;
            }
            queued = 0;
            if (refused_at < 0) refused_at = et_now();
            if (et_now() - refused_at > 10.0) return; /* requests never submitted never complete */
            const struct timespec pause = {0, 1000000};
            nanosleep(&pause, NULL); /* a system call: the kernel posts finished requests on the way out */
        }
        if (got > 0) queued -= (unsigned)got > queued ? queued : (unsigned)got;
        unsigned head = *r->cq_head;
        const unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            const struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
            const unsigned s = (unsigned)c->user_data;
            const int res = c->res;
            if (s >= (unsigned)depth || !req[s].busy) continue;
            et_uring_req *q = &req[s];
            const int64_t len = (q->j - q->i) * io->row_bytes;
            if (res == -EINTR || res == -EAGAIN) {
                et_uring_queue(r, io, q, s);
                queued++;
                continue;
            }
            if (res <= 0) { /* an error, or a read that ends before its row (0: EIO) */
                if (!io->failed) {
                    io->failed = 1;
                    io->err0 = res < 0 ? -res : EIO;
                    io->err1 = (int32_t)(q->i < INT32_MAX ? q->i : INT32_MAX);
                }
                q->busy = 0;
                inflight--;
                continue;
            }
            q->done += res;
            if (q->done < len) { /* a short read or write: the rest goes again */
                et_uring_queue(r, io, q, s);
                queued++;
                continue;
            }
            if (io->op == 2) {
                const int64_t off = io->rows[q->i] * io->row_bytes, page = 4096;
                const int64_t first = off / page * page, last = (off + len + page - 1) / page * page;
                (void)posix_fadvise(io->fd, first, last - first, POSIX_FADV_DONTNEED);
            }
            q->busy = 0;
            inflight--;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
}
#endif

/* Choose the engine for requests in flight, once (want bit 0: io_uring, else threads; bit 1: in flight from the
 * first run, without the probe); returns the choice in use: bit 0 set only when a ring opens here (the kernel and
 * its policy allow io_uring). */
int32_t et_offload_io_engine(int32_t want) {
    et_engine = 0;
    et_always = (want & 2) != 0;
#ifdef ET_URING
    if (want & 1) {
        et_ring r;
        if (et_ring_open(&r, 4) == 0) { /* and one request goes through it: a policy may refuse only submissions */
            struct io_uring_sqe *sqe = &r.sqes[0];
            memset(sqe, 0, sizeof *sqe);
            sqe->opcode = IORING_OP_NOP;
            const unsigned tail = *r.sq_tail;
            r.sq_array[tail & *r.sq_mask] = 0;
            __atomic_store_n(r.sq_tail, tail + 1, __ATOMIC_RELEASE);
            long got;
            do got = syscall(__NR_io_uring_enter, r.fd, 1, 1, IORING_ENTER_GETEVENTS, NULL, 0);
            while (got < 0 && errno == EINTR);
            const unsigned head = *r.cq_head;
            if (got == 1 && head != __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE) && r.cqes[head & *r.cq_mask].res == 0)
                et_engine = 1;
            et_ring_close(&r);
        }
    }
#endif
    return et_engine | (et_always ? 2 : 0);
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
    int64_t done = et_always ? ET_PROBE_RUNS : et_row_take(&io, ET_PROBE_RUNS);
    pthread_t ids[ET_MAX_DEPTH];
    int started = 0;
    const int slow = done == ET_PROBE_RUNS && depth > 1 && (et_always || (et_now() - start) / done > ET_DISK_RUN_S);
#ifdef ET_URING
    if (slow && et_engine == 1 && !io.failed) {
        et_ring ring;
        if (et_ring_open(&ring, ET_MAX_DEPTH) == 0) {
            et_uring_take(&io, &ring, depth > ET_MAX_DEPTH ? ET_MAX_DEPTH : depth);
            et_ring_close(&ring);
            done = -1; /* every run was taken (or the work stopped at a failure) */
        }
    }
#endif
    if (slow && done >= 0) {
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
