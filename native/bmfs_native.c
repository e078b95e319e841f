/* bmfs._native: the data path's CPU-heavy loops in C, run without the GIL.
 *
 * Caveats first: this module is optional. bmfs/data/codec.py and bmfs/format/fragment.py
 * fall back to pyeclib and the crc32c package when it is missing (not built, or
 * BMFS_NATIVE=0), and tests/test_t0_native.py checks that both paths produce the same
 * bytes. It links ISA-L (Debian libisal-dev), the library pyeclib's isa_l_rs_vand
 * backend runs on.
 *
 * crc32c_blocks(parts, block) -> bytes
 *     The crc32c of each `block`-byte block of the concatenation of the buffers in
 *     `parts` (the last block may be short), as little-endian uint32s: one call for a
 *     fragment's whole checksum table instead of one Python call per 4 KiB.
 *
 * rs_encode(k, m, parts, payload, headers) -> list of k+m bytes
 *     Fragments of an ISA-L Reed-Solomon (Vandermonde) stripe, byte for byte what
 *     pyeclib's isa_l_rs_vand encode returns: fragment i is headers[i*80:(i+1)*80] (the
 *     80-byte liberasurecode header, which depends only on the lengths, so the caller
 *     takes it from pyeclib once per length) followed by `payload` bytes; data fragment
 *     i holds bytes [i*payload, (i+1)*payload) of the stripe, zero-padded; the m parity
 *     payloads are computed with gf_gen_rs_matrix + ec_encode_data, as liberasurecode
 *     does. The stripe is `parts`: one buffer, or a sequence of buffers taken as their
 *     concatenation (the write buffer's pieces: the caller need not join them, a 4 MiB
 *     copy on the event loop's thread per stripe). The copy and the encode run with
 *     the GIL released, so the event loop keeps serving FUSE requests meanwhile.
 *
 * rs_rebuild(k, m, payload, survivors, missing) -> list of bytes
 *     Degraded reads: the payloads of missing data fragments from any k others (below).
 *
 * pread_batch(jobs, threads) -> list
 *     A direct client's batch of fragment reads on local devices (below), done by up
 *     to `threads` threads at once with the GIL released: each job opens a file,
 *     reads its ranges and closes it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <isa-l/crc.h>
#include <isa-l/erasure_code.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define LIB_HEADER 80
#define MAX_FRAGS 32

static inline void put_le32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* crc32_iscsi keeps the state un-inverted: crc32c(x) = ~crc32_iscsi(x, ~0). */
static void crc_table(Py_buffer *bufs, Py_ssize_t nbufs, Py_ssize_t block, unsigned char *out)
{
    uint32_t state = 0xFFFFFFFFu;
    Py_ssize_t left = block, nout = 0;
    for (Py_ssize_t b = 0; b < nbufs; b++) {
        unsigned char *p = bufs[b].buf;
        Py_ssize_t n = bufs[b].len;
        while (n > 0) {
            Py_ssize_t take = n < left ? n : left;
            while (take > 0) {  /* crc32_iscsi takes an int length */
                int chunk = take > (1 << 30) ? (1 << 30) : (int)take;
                state = crc32_iscsi(p, chunk, state);
                p += chunk;
                n -= chunk;
                left -= chunk;
                take -= chunk;
            }
            if (left == 0) {
                put_le32(out + 4 * nout++, ~state);
                state = 0xFFFFFFFFu;
                left = block;
            }
        }
    }
    if (left != block)
        put_le32(out + 4 * nout, ~state);
}

/* The buffers of `parts` (one buffer, or a sequence of them) into *bufs (PyMem, for
 * release_parts); their count, or -1 with an exception set. */
static Py_ssize_t get_parts(PyObject *parts, Py_buffer **bufs, Py_ssize_t *total)
{
    PyObject *seq;
    Py_ssize_t n, got = 0;
    *total = 0;
    if (PyObject_CheckBuffer(parts)) {
        *bufs = PyMem_Calloc(1, sizeof(Py_buffer));
        if (*bufs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (PyObject_GetBuffer(parts, *bufs, PyBUF_SIMPLE) < 0) {
            PyMem_Free(*bufs);
            return -1;
        }
        *total = (*bufs)->len;
        return 1;
    }
    seq = PySequence_Fast(parts, "parts must be a buffer or a sequence of buffers");
    if (seq == NULL)
        return -1;
    n = PySequence_Fast_GET_SIZE(seq);
    *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (*bufs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &(*bufs)[got],
                               PyBUF_SIMPLE) < 0) {
            while (got > 0)
                PyBuffer_Release(&(*bufs)[--got]);
            PyMem_Free(*bufs);
            Py_DECREF(seq);
            return -1;
        }
        *total += (*bufs)[got].len;
    }
    Py_DECREF(seq);
    return n;
}

static void release_parts(Py_buffer *bufs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
}

static PyObject *crc32c_blocks(PyObject *self, PyObject *args)
{
    PyObject *parts, *result;
    Py_ssize_t block, nbufs, total;
    Py_buffer *bufs;
    if (!PyArg_ParseTuple(args, "On", &parts, &block))
        return NULL;
    if (block <= 0) {
        PyErr_SetString(PyExc_ValueError, "block size must be positive");
        return NULL;
    }
    nbufs = get_parts(parts, &bufs, &total);
    if (nbufs < 0)
        return NULL;
    result = PyBytes_FromStringAndSize(NULL, 4 * ((total + block - 1) / block));
    if (result != NULL) {
        Py_BEGIN_ALLOW_THREADS
        crc_table(bufs, nbufs, block, (unsigned char *)PyBytes_AS_STRING(result));
        Py_END_ALLOW_THREADS
    }
    release_parts(bufs, nbufs);
    return result;
}

/* Encode tables of one (k, m), made once: gf_gen_rs_matrix's parity rows. */
typedef struct {
    int k, m;
    unsigned char *tables;
} coder_t;

static coder_t coders[8];
static int ncoders;
static PyThread_type_lock coders_lock;

static unsigned char *tables_for(int k, int m)
{
    unsigned char *found = NULL, *matrix;
    PyThread_acquire_lock(coders_lock, WAIT_LOCK);
    for (int i = 0; i < ncoders; i++)
        if (coders[i].k == k && coders[i].m == m)
            found = coders[i].tables;
    if (found == NULL && ncoders < (int)(sizeof(coders) / sizeof(coders[0]))) {
        matrix = PyMem_RawMalloc((size_t)(k + m) * k);
        found = PyMem_RawMalloc((size_t)32 * k * m);
        if (matrix && found) {
            gf_gen_rs_matrix(matrix, k + m, k);
            ec_init_tables(k, m, matrix + k * k, found);
            coders[ncoders].k = k;
            coders[ncoders].m = m;
            coders[ncoders++].tables = found;
        } else {
            PyMem_RawFree(found);
            found = NULL;
        }
        PyMem_RawFree(matrix);
    }
    PyThread_release_lock(coders_lock);
    return found;
}

static PyObject *rs_encode(PyObject *self, PyObject *args)
{
    int k, m;
    Py_ssize_t payload, nparts, total;
    PyObject *parts, *list = NULL;
    Py_buffer *data, headers;
    unsigned char *tables, *frag[MAX_FRAGS];
    if (!PyArg_ParseTuple(args, "iiOny*", &k, &m, &parts, &payload, &headers))
        return NULL;
    nparts = get_parts(parts, &data, &total);
    if (nparts < 0) {
        PyBuffer_Release(&headers);
        return NULL;
    }
    if (k < 1 || m < 1 || k + m > MAX_FRAGS || payload < 1 || payload > INT_MAX ||
        total > (Py_ssize_t)k * payload || headers.len != (Py_ssize_t)(k + m) * LIB_HEADER) {
        PyErr_SetString(PyExc_ValueError, "rs_encode: inconsistent k, m, lengths or headers");
        goto fail;
    }
    tables = tables_for(k, m);
    if (tables == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    list = PyList_New(k + m);
    if (list == NULL)
        goto fail;
    for (int i = 0; i < k + m; i++) {
        PyObject *b = PyBytes_FromStringAndSize(NULL, LIB_HEADER + payload);
        if (b == NULL)
            goto fail;
        PyList_SET_ITEM(list, i, b);
        frag[i] = (unsigned char *)PyBytes_AS_STRING(b);
    }
    Py_BEGIN_ALLOW_THREADS
    unsigned char *dptr[MAX_FRAGS], *pptr[MAX_FRAGS];
    Py_ssize_t part = 0, used = 0;  /* the next byte to copy: data[part].buf + used */
    for (int i = 0; i < k + m; i++) {
        memcpy(frag[i], (const unsigned char *)headers.buf + i * LIB_HEADER, LIB_HEADER);
        if (i < k) {
            unsigned char *dst = frag[i] + LIB_HEADER, *end = dst + payload;
            while (dst < end && part < nparts) {
                Py_ssize_t n = data[part].len - used;
                if (n > end - dst)
                    n = end - dst;
                memcpy(dst, (const unsigned char *)data[part].buf + used, n);
                dst += n;
                used += n;
                if (used == data[part].len) {
                    part++;
                    used = 0;
                }
            }
            memset(dst, 0, end - dst);
            dptr[i] = frag[i] + LIB_HEADER;
        } else {
            pptr[i - k] = frag[i] + LIB_HEADER;
        }
    }
    ec_encode_data((int)payload, k, m, tables, dptr, pptr);
    Py_END_ALLOW_THREADS
    release_parts(data, nparts);
    PyBuffer_Release(&headers);
    return list;
fail:
    Py_XDECREF(list);
    release_parts(data, nparts);
    PyBuffer_Release(&headers);
    return NULL;
}

/* rs_rebuild(k, m, payload, survivors, missing) -> list of bytes
 *     The payloads of the data fragments `missing` (indexes < k) of a stripe encoded as
 *     above, from `survivors`: a list of k (index, buffer) pairs, each buffer a whole
 *     fragment (its 80-byte header first). The k survivors' rows of the encode matrix
 *     are inverted (gf_invert_matrix) and the missing rows of the inverse applied with
 *     ec_encode_data: what liberasurecode's isa_l_rs_vand reconstruct computes, without
 *     the GIL and without building whole fragments. ValueError for a singular choice
 *     (possible with m > 4: the caller picks survivors that determine the data) or an
 *     index out of range, TypeError for arguments of the wrong type.
 */

/* The index `o` (an int below `limit`), or -1 with TypeError (not an int) or
 * ValueError (out of range: checked on the whole value, which a cast to int would
 * wrap) set. */
static int index_arg(PyObject *o, int limit, const char *what)
{
    int overflow;
    long v;
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "rs_rebuild: %s index must be an int", what);
        return -1;
    }
    v = PyLong_AsLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < 0 || v >= limit) {
        PyErr_Format(PyExc_ValueError, "rs_rebuild: %s index out of range", what);
        return -1;
    }
    return (int)v;
}
static PyObject *rs_rebuild(PyObject *self, PyObject *args)
{
    int k, m, nmiss, idx[MAX_FRAGS], miss[MAX_FRAGS], singular;
    Py_ssize_t payload, got = 0;
    PyObject *survivors, *missing, *sseq = NULL, *mseq = NULL, *list = NULL;
    Py_buffer bufs[MAX_FRAGS];
    unsigned char *src[MAX_FRAGS], *dst[MAX_FRAGS], *matrix = NULL, *rows, *inv, *dec, *tbl;
    if (!PyArg_ParseTuple(args, "iinOO", &k, &m, &payload, &survivors, &missing))
        return NULL;
    if (k < 1 || m < 1 || k + m > MAX_FRAGS || payload < 1 || payload > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "rs_rebuild: bad k, m or payload");
        return NULL;
    }
    sseq = PySequence_Fast(survivors, "survivors must be a sequence of (index, buffer)");
    mseq = PySequence_Fast(missing, "missing must be a sequence of indexes");
    if (sseq == NULL || mseq == NULL)
        goto done;
    nmiss = (int)PySequence_Fast_GET_SIZE(mseq);
    if (PySequence_Fast_GET_SIZE(sseq) != k || nmiss < 1 || nmiss > k) {
        PyErr_SetString(PyExc_ValueError, "rs_rebuild: need k survivors and 1..k missing");
        goto done;
    }
    for (int j = 0; j < nmiss; j++) {
        miss[j] = index_arg(PySequence_Fast_GET_ITEM(mseq, j), k, "a missing (data fragment)");
        if (miss[j] < 0)
            goto done;
    }
    for (; got < k; got++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(sseq, got);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "rs_rebuild: survivors must be (index, buffer) tuples");
            goto done;
        }
        idx[got] = index_arg(PyTuple_GET_ITEM(pair, 0), k + m, "a survivor");
        if (idx[got] < 0)
            goto done;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 1), &bufs[got], PyBUF_SIMPLE) < 0)
            goto done;
        if (bufs[got].len < LIB_HEADER + payload) {
            PyBuffer_Release(&bufs[got]);
            PyErr_SetString(PyExc_ValueError, "rs_rebuild: a survivor is shorter than its payload");
            goto done;
        }
        src[got] = (unsigned char *)bufs[got].buf + LIB_HEADER;
    }
    list = PyList_New(nmiss);
    if (list == NULL)
        goto done;
    for (int j = 0; j < nmiss; j++) {
        PyObject *b = PyBytes_FromStringAndSize(NULL, payload);
        if (b == NULL) {
            Py_CLEAR(list);
            goto done;
        }
        PyList_SET_ITEM(list, j, b);
        dst[j] = (unsigned char *)PyBytes_AS_STRING(b);
    }
    matrix = PyMem_RawMalloc((size_t)(k + m) * k + 3 * (size_t)k * k + (size_t)32 * k * nmiss);
    if (matrix == NULL) {
        Py_CLEAR(list);
        PyErr_NoMemory();
        goto done;
    }
    rows = matrix + (size_t)(k + m) * k;
    inv = rows + (size_t)k * k;
    dec = inv + (size_t)k * k;
    tbl = dec + (size_t)k * k;
    Py_BEGIN_ALLOW_THREADS
    gf_gen_rs_matrix(matrix, k + m, k);
    for (int r = 0; r < k; r++)
        memcpy(rows + r * k, matrix + idx[r] * k, k);
    singular = gf_invert_matrix(rows, inv, k);  /* (overwrites rows) */
    if (!singular) {
        for (int j = 0; j < nmiss; j++)
            memcpy(dec + j * k, inv + miss[j] * k, k);
        ec_init_tables(k, nmiss, dec, tbl);
        ec_encode_data((int)payload, k, nmiss, tbl, src, dst);
    }
    Py_END_ALLOW_THREADS
    if (singular) {
        Py_CLEAR(list);
        PyErr_SetString(PyExc_ValueError, "rs_rebuild: these survivors do not determine the data");
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_RawFree(matrix);
    Py_XDECREF(sseq);
    Py_XDECREF(mseq);
    return list;
}

/* pread_batch(jobs, threads) -> list
 *
 * jobs: a sequence of (path, ranges, into): `path` bytes, `ranges` a sequence of
 * (offset, length), `into` None or a writable contiguous buffer of the last range's
 * length that range is read into. Each job opens `path` (O_RDONLY | O_NOFOLLOW |
 * O_CLOEXEC), preads its ranges (each up to the file's end: a part is shorter there)
 * and closes it. The jobs are shared out among min(threads, len(jobs)) threads, the
 * caller's one of them, all without the GIL; every buffer is made (and every `into`
 * taken) before it is released. Returns, job by job, its list of parts (bytes; the
 * last one `into` itself when given, or a view of its first bytes if the file ended
 * sooner), or the OSError the job failed with (errno and path). A thread that cannot
 * be started leaves its share to the others.
 */
typedef struct {
    off_t off;
    Py_ssize_t len, got;
    char *dst;
} prange;

typedef struct {
    const char *path;
    Py_ssize_t first, count;  /* its ranges in the batch's table */
    int err;
} pjob;

typedef struct {
    pjob *jobs;
    prange *ranges;
    Py_ssize_t n, next;
} pbatch;

static void pread_job(pjob *j, prange *ranges)
{
    int fd = open(j->path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        j->err = errno;
        return;
    }
    for (Py_ssize_t r = j->first; r < j->first + j->count; r++) {
        prange *p = &ranges[r];
        while (p->got < p->len) {
            ssize_t k = pread(fd, p->dst + p->got, (size_t)(p->len - p->got), p->off + p->got);
            if (k < 0 && errno == EINTR)
                continue;
            if (k < 0) {
                j->err = errno;
                close(fd);
                return;
            }
            if (k == 0)
                break;  /* the file's end */
            p->got += k;
        }
    }
    close(fd);
}

static void *pread_worker(void *arg)
{
    pbatch *b = arg;
    Py_ssize_t i;
    while ((i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED)) < b->n)
        pread_job(&b->jobs[i], b->ranges);
    return NULL;
}

static PyObject *pread_batch(PyObject *self, PyObject *args)
{
    PyObject *jobs_arg, *seq = NULL, *out = NULL, **objs = NULL, **paths = NULL;
    int threads;
    Py_buffer *intos = NULL;
    pjob *jobs = NULL;
    prange *ranges = NULL;
    Py_ssize_t n = 0, nr = 0, nobjs = 0;
    if (!PyArg_ParseTuple(args, "Oi", &jobs_arg, &threads))
        return NULL;
    seq = PySequence_Fast(jobs_arg, "pread_batch: jobs must be a sequence");
    if (seq == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {  /* (count the ranges) */
        PyObject *job = PySequence_Fast_GET_ITEM(seq, i), *rs;
        if (!PyTuple_Check(job) || PyTuple_GET_SIZE(job) != 3) {
            PyErr_SetString(PyExc_TypeError, "pread_batch: a job is (path, ranges, into)");
            goto done;
        }
        rs = PyTuple_GET_ITEM(job, 1);
        Py_ssize_t k = PySequence_Size(rs);
        if (k < 0)
            goto done;
        nr += k;
    }
    jobs = PyMem_Calloc(n ? n : 1, sizeof(pjob));
    ranges = PyMem_Calloc(nr ? nr : 1, sizeof(prange));
    objs = PyMem_Calloc(nr ? nr : 1, sizeof(PyObject *));  /* each range's part */
    paths = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    intos = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (!jobs || !ranges || !objs || !paths || !intos) {
        PyErr_NoMemory();
        goto done;
    }
    nobjs = nr;
    Py_ssize_t r = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *job = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *path = PyTuple_GET_ITEM(job, 0), *into = PyTuple_GET_ITEM(job, 2);
        PyObject *rs = PySequence_Fast(PyTuple_GET_ITEM(job, 1), "pread_batch: ranges");
        if (rs == NULL)
            goto done;
        if (!PyBytes_Check(path)) {
            Py_DECREF(rs);
            PyErr_SetString(PyExc_TypeError, "pread_batch: a path is bytes");
            goto done;
        }
        Py_INCREF(path);
        paths[i] = path;
        jobs[i].path = PyBytes_AS_STRING(path);
        jobs[i].first = r;
        jobs[i].count = PySequence_Fast_GET_SIZE(rs);
        for (Py_ssize_t q = 0; q < jobs[i].count; q++, r++) {
            long long off, len;
            PyObject *range = PySequence_Fast_GET_ITEM(rs, q);
            if (!PyTuple_Check(range)) {
                Py_DECREF(rs);
                PyErr_SetString(PyExc_TypeError, "pread_batch: a range is (offset, length)");
                goto done;
            }
            if (!PyArg_ParseTuple(range, "LL", &off, &len) || off < 0 || len < 0) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "pread_batch: a negative range");
                Py_DECREF(rs);
                goto done;
            }
            ranges[r].off = (off_t)off;
            ranges[r].len = (Py_ssize_t)len;
            if (q == jobs[i].count - 1 && into != Py_None) {
                if (PyObject_GetBuffer(into, &intos[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
                    Py_DECREF(rs);
                    goto done;
                }
                if (intos[i].len != len) {
                    Py_DECREF(rs);
                    PyErr_SetString(PyExc_ValueError, "pread_batch: into is not its range's length");
                    goto done;
                }
                ranges[r].dst = intos[i].buf;
                Py_INCREF(into);
                objs[r] = into;
            } else {
                objs[r] = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
                if (objs[r] == NULL) {
                    Py_DECREF(rs);
                    goto done;
                }
                ranges[r].dst = PyBytes_AS_STRING(objs[r]);
            }
        }
        Py_DECREF(rs);
    }
    pbatch b = {jobs, ranges, n, 0};
    int want = threads < 1 ? 1 : threads;
    if (want > n)
        want = (int)n;
    pthread_t tids[64];
    int started = 0;
    if (want > 64)
        want = 64;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < want; t++)
        if (pthread_create(&tids[started], NULL, pread_worker, &b) == 0)
            started++;
    pread_worker(&b);
    for (int t = 0; t < started; t++)
        pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item;
        if (jobs[i].err) {
            errno = jobs[i].err;
            item = PyObject_CallFunction(PyExc_OSError, "isO", jobs[i].err,
                                         strerror(jobs[i].err), paths[i]);
        } else {
            item = PyList_New(jobs[i].count);
            for (Py_ssize_t q = 0; item != NULL && q < jobs[i].count; q++) {
                Py_ssize_t at = jobs[i].first + q;
                PyObject *part = objs[at];
                if (ranges[at].got < ranges[at].len) {
                    if (PyBytes_Check(part)) {
                        objs[at] = NULL;
                        if (_PyBytes_Resize(&part, ranges[at].got) < 0) {
                            Py_CLEAR(item);
                            break;
                        }
                    } else {
                        PyObject *mv = PyMemoryView_FromObject(part);
                        part = mv ? PySequence_GetSlice(mv, 0, ranges[at].got) : NULL;
                        Py_XDECREF(mv);
                        if (part == NULL) {
                            Py_CLEAR(item);
                            break;
                        }
                    }
                } else {
                    Py_INCREF(part);
                }
                PyList_SET_ITEM(item, q, part);
            }
        }
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
    }
done:
    for (Py_ssize_t i = 0; intos && i < n; i++)
        if (intos[i].obj != NULL)
            PyBuffer_Release(&intos[i]);
    for (Py_ssize_t i = 0; objs && i < nobjs; i++)
        Py_XDECREF(objs[i]);
    for (Py_ssize_t i = 0; paths && i < n; i++)
        Py_XDECREF(paths[i]);
    PyMem_Free(jobs);
    PyMem_Free(ranges);
    PyMem_Free(objs);
    PyMem_Free(paths);
    PyMem_Free(intos);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"crc32c_blocks", crc32c_blocks, METH_VARARGS,
     "crc32c_blocks(parts, block) -> bytes: crc32c of each block of the parts' "
     "concatenation, little-endian uint32s"},
    {"rs_encode", rs_encode, METH_VARARGS,
     "rs_encode(k, m, parts, payload, headers) -> list of k+m fragments (pyeclib "
     "isa_l_rs_vand layout) of the stripe `parts` (a buffer or a sequence of them)"},
    {"rs_rebuild", rs_rebuild, METH_VARARGS,
     "rs_rebuild(k, m, payload, survivors, missing) -> payloads of the missing data "
     "fragments, from k (index, whole fragment) survivors"},
    {"pread_batch", pread_batch, METH_VARARGS,
     "pread_batch(jobs, threads) -> list: each job (path, ranges, into) opened, its "
     "ranges read and closed, by up to `threads` threads without the GIL; per job its "
     "parts or the OSError it failed with"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "bmfs.data._native",
    "The data path's CPU-heavy loops in C, without the GIL (native/bmfs_native.c).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    coders_lock = PyThread_allocate_lock();
    if (coders_lock == NULL)
        return PyErr_NoMemory();
    return PyModule_Create(&module);
}
