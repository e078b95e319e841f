/* bmfs.node._native: a storage node's small READs served in C, without the GIL.
 *
 * Caveats first: this module is optional. bmfs/node/server.py serves every request in
 * Python when it is missing (not built, or BMFS_NATIVE=0), and hands this module only
 * what it can do exactly as the Python path would; anything else (another request,
 * a frame this parser does not take, a fragment that is being written or cannot be
 * opened, a read past `max_read`) is left in the receive buffer untouched for the
 * Python path, which then answers it (or the error) itself. tests/test_t2_tcp.py sends
 * the same frames to a node with and without it and compares the replies byte for
 * byte; the cluster tests fuzz it (test_protocol_robustness).
 *
 * state(tracked, hot_reads, hot_window, hot_rate, fragment_guess) -> capsule
 *     A node's state for the calls below: the READs served here, a fault flag, the
 *     fragment writes under way, and the table of fragments with recent small READs
 *     (`tracked` slots; a fragment's `hot_reads`-th small READ within `hot_window`
 *     seconds makes it hot, at most `hot_rate` bytes a second of them counted as
 *     `fragment_guess` bytes each: NodeServer._note_small_read says why).
 *
 * serve_reads(fd, buf, start, end, roots, read_ahead, max_read, state)
 *         -> (status, start, end, device, name)
 *     Serves the connection on socket `fd` (blocking) for as long as its frames are
 *     small READs, received into the bytearray `buf`, whose bytes [start, end) are
 *     received and not yet consumed (the framing of bmfs/node/protocol.py: u32 header
 *     length, u32 payload length, a Request header, no payload). A READ of a device in
 *     `roots` (a tuple of (device, directory) pairs: the fragment file of name N is
 *     directory + N[14:16] + "/" + N) for at most `max_read` bytes is answered here: the
 *     ranges are read (pread, short at the end of the file) and the reply (a Response
 *     with the request's id and the lengths read, then the bytes) sent. Returns with
 *     status HOT after serving a READ that made its fragment hot (device and name
 *     given: the caller reads it whole), PYTHON when the next frame is for the Python
 *     path (left at `start`, whole or in part), END when the peer closed the
 *     connection. `read_ahead` bounds how far past a frame a receive reads (as the
 *     Python path's BlockingConnection._fill). A socket error raises OSError.
 *
 * served(state) -> int; set_delayed(state, flag); puts(state, delta) -> int;
 * note(state, device, name) -> bool
 *     The READs served here; while `flag` is set (the node's fault delay), READs go to
 *     the Python path; fragment writes under way (the node's PUTs add 1 before and
 *     subtract 1 after: meanwhile READs go to the Python path, which waits for a write
 *     of the same fragment); a small READ served by the Python path, counted in the
 *     same table (True: the fragment became hot).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "wire.h"

enum { HOT = 0, PYTHON = 1, END = 2 };
enum { OP_READ = 2, MAX_RANGES = 64, MAX_ROOTS = 16, PREFIX = 8 };
#define MAX_HEADER (64u << 10)
#define MAX_PAYLOAD (64u << 20)
#define NAME_MAX_LEN 24          /* 16 hex digits, a dot, the fragment index */
#define REPLY_HEAD_ROOM 1024     /* prefix + the largest Response header built here */

typedef struct {
    uint64_t device;
    double first;  /* CLOCK_MONOTONIC seconds of the first counted READ */
    int count;     /* 0: a free slot */
    char name[NAME_MAX_LEN + 1];
} hot_slot;

typedef struct {
    uint64_t served;    /* READs answered here */
    long puts;          /* fragment writes under way */
    int delayed;        /* the fault delay is set: READs to the Python path */
    pthread_mutex_t lock;
    int hot_reads;
    double hot_window, hot_rate, guess, tokens, at;
    size_t nslots;
    hot_slot slots[];   /* direct-mapped by (device, name): a collision replaces */
} node_state;

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.monotonic()'s clock */
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Count a small READ of (device, name); 1 if it made the fragment hot. */
static int note_read(node_state *st, uint64_t device, const char *name)
{
    uint64_t h = 1469598103934665603ull ^ device;  /* FNV-1a */
    for (const char *c = name; *c; c++)
        h = (h ^ (unsigned char)*c) * 1099511628211ull;
    double now = now_seconds();
    int hot = 0;
    pthread_mutex_lock(&st->lock);
    hot_slot *e = &st->slots[h % st->nslots];
    if (!(e->count && e->device == device && strcmp(e->name, name) == 0 &&
          now - e->first <= st->hot_window)) {
        e->device = device;
        e->first = now;
        e->count = 0;
        snprintf(e->name, sizeof(e->name), "%s", name);
    }
    if (++e->count >= st->hot_reads) {
        e->count = 0;
        /* a token bucket of hot_rate bytes a second, one second deep */
        st->tokens += (now - st->at) * st->hot_rate;
        if (st->tokens > st->hot_rate)
            st->tokens = st->hot_rate;
        st->at = now;
        if (st->tokens >= st->guess) {
            st->tokens -= st->guess;
            hot = 1;
        }
    }
    pthread_mutex_unlock(&st->lock);
    return hot;
}

typedef struct {
    uint64_t id, device;
    int op, nranges;
    uint64_t off[MAX_RANGES], len[MAX_RANGES];
    char name[NAME_MAX_LEN + 1];
} read_req;

static int parse_range(const unsigned char *p, const unsigned char *end, read_req *r)
{
    uint64_t key, v, off = 0, len = 0;
    if (r->nranges == MAX_RANGES)
        return 0;
    while (p < end) {
        if (!varint(&p, end, &key) || (key & 7) != 0 || !varint(&p, end, &v))
            return 0;
        if (key >> 3 == 1)
            off = v;
        else if (key >> 3 == 2)
            len = v;
        else
            return 0;
    }
    r->off[r->nranges] = off;
    r->len[r->nranges++] = len;
    return 1;
}

/* The name rule of bmfs/node/server.py's _NAME: 16 lowercase hex digits, a dot, digits. */
static int valid_name(const unsigned char *s, uint64_t n)
{
    if (n < 18 || n > NAME_MAX_LEN || s[16] != '.')
        return 0;
    for (int i = 0; i < 16; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    for (uint64_t i = 17; i < n; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

/* A Request header this path serves: 1 if parsed, 0 if it is for the Python path
 * (another field, wire type or value than those of a plain READ). */
static int parse_request(const unsigned char *p, const unsigned char *end, read_req *r)
{
    uint64_t key, v;
    memset(r, 0, offsetof(read_req, off));
    r->name[0] = 0;
    while (p < end) {
        if (!varint(&p, end, &key))
            return 0;
        int field = (int)(key >> 3), wire = (int)(key & 7);
        if (wire == 0) {
            if (!varint(&p, end, &v))
                return 0;
            if (field == 1)
                r->id = v;
            else if (field == 2)
                r->op = v > 100 ? -1 : (int)v;
            else if (field == 3)
                r->device = v;
            else if (field == 6) {
                if (v)
                    return 0;  /* durable: a PUT's */
            } else
                return 0;
        } else if (wire == 2) {
            if (!varint(&p, end, &v) || v > (uint64_t)(end - p))
                return 0;
            if (field == 4) {
                if (!valid_name(p, v))
                    return 0;
                memcpy(r->name, p, v);
                r->name[v] = 0;
            } else if (field == 5) {
                if (!parse_range(p, p + v, r))
                    return 0;
            } else
                return 0;
            p += v;
        } else
            return 0;
    }
    return r->op == OP_READ && r->name[0] && r->device <= 0xFFFFFFFFu;
}

static int send_all(int fd, const unsigned char *p, size_t n, int flags)
{
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL | flags);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Read the request's ranges from `path` and send the reply; 1 if sent, 0 if the
 * Python path should answer (the file did not open, a read failed), -1 on a socket
 * error (errno set). */
static int answer(int fd, const read_req *r, const char *path, uint64_t total,
                  uint64_t *served, int more)
{
    uint64_t got[MAX_RANGES];
    unsigned char *out = malloc(REPLY_HEAD_ROOM + total + 1);
    if (out == NULL)
        return 0;
    int file = open(path, O_RDONLY | O_CLOEXEC);
    if (file < 0) {
        free(out);
        return 0;
    }
    unsigned char *data = out + REPLY_HEAD_ROOM, *w = data;
    for (int i = 0; i < r->nranges; i++) {
        uint64_t want = r->len[i], have = 0;
        while (have < want) {
            ssize_t k = pread(file, w + have, want - have, (off_t)(r->off[i] + have));
            if (k < 0 && errno == EINTR)
                continue;
            if (k < 0) {
                close(file);
                free(out);
                return 0;
            }
            if (k == 0)
                break;  /* the end of the file: short, as os.pread */
            have += (uint64_t)k;
        }
        got[i] = have;
        w += have;
    }
    close(file);
    /* Response: id = 1 (varint), lengths = 4 (packed varints) */
    size_t packed = 0;
    for (int i = 0; i < r->nranges; i++)
        packed += varint_size(got[i]);
    size_t hlen = (r->id ? 1 + varint_size(r->id) : 0) +
                  (r->nranges ? 1 + varint_size(packed) + packed : 0);
    unsigned char *start = data - hlen - PREFIX, *h = start + PREFIX;
    uint32_t plen = (uint32_t)(w - data), hl = (uint32_t)hlen;
    memcpy(start, &hl, 4);  /* little-endian hosts (x86-64, aarch64) */
    memcpy(start + 4, &plen, 4);
    if (r->id) {
        *h++ = 0x08;
        h = put_varint(h, r->id);
    }
    if (r->nranges) {
        *h++ = 0x22;
        h = put_varint(h, packed);
        for (int i = 0; i < r->nranges; i++)
            h = put_varint(h, got[i]);
    }
    __atomic_add_fetch(served, 1, __ATOMIC_RELAXED);
    int rc = send_all(fd, start, (size_t)(w - start), more ? MSG_MORE : 0);
    free(out);
    return rc < 0 ? -1 : 1;
}

typedef struct {
    uint64_t device;
    char dir[PATH_MAX - NAME_MAX_LEN - 8];
} root_t;

static int take_roots(PyObject *roots, root_t *out, int *n)
{
    PyObject *seq = PySequence_Fast(roots, "roots must be a sequence of (device, directory)");
    if (seq == NULL)
        return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_ROOTS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many devices");
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned long long dev;
        const char *dir;
        Py_ssize_t dlen;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Ky#", &dev, &dir, &dlen)) {
            Py_DECREF(seq);
            return -1;
        }
        if ((size_t)dlen >= sizeof(out[i].dir)) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "device directory too long");
            return -1;
        }
        out[i].device = dev;
        memcpy(out[i].dir, dir, (size_t)dlen);
        out[i].dir[dlen] = 0;
    }
    *n = (int)count;
    Py_DECREF(seq);
    return 0;
}

static void free_state(PyObject *capsule)
{
    node_state *st = PyCapsule_GetPointer(capsule, "bmfs.node_state");
    if (st != NULL) {
        pthread_mutex_destroy(&st->lock);
        free(st);
    }
}

static PyObject *new_state(PyObject *self, PyObject *args)
{
    Py_ssize_t tracked;
    int hot_reads;
    double window, rate, guess;
    (void)self;
    if (!PyArg_ParseTuple(args, "niddd", &tracked, &hot_reads, &window, &rate, &guess))
        return NULL;
    if (tracked < 1 || tracked > (1 << 24) || hot_reads < 1) {
        PyErr_SetString(PyExc_ValueError, "bad hot-fragment settings");
        return NULL;
    }
    node_state *st = calloc(1, sizeof(node_state) + (size_t)tracked * sizeof(hot_slot));
    if (st == NULL)
        return PyErr_NoMemory();
    pthread_mutex_init(&st->lock, NULL);
    st->hot_reads = hot_reads;
    st->hot_window = window;
    st->hot_rate = st->tokens = rate;
    st->guess = guess;
    st->at = now_seconds();
    st->nslots = (size_t)tracked;
    PyObject *capsule = PyCapsule_New(st, "bmfs.node_state", free_state);
    if (capsule == NULL) {
        pthread_mutex_destroy(&st->lock);
        free(st);
    }
    return capsule;
}

static node_state *get_state(PyObject *capsule)
{
    return PyCapsule_GetPointer(capsule, "bmfs.node_state");
}

static PyObject *serve_reads(PyObject *self, PyObject *args)
{
    int fd, nroots = 0, status = PYTHON, err = 0, behind = 0;
    Py_ssize_t start, end, read_ahead, max_read;
    PyObject *bufobj, *roots, *capsule;
    Py_buffer view;
    root_t rt[MAX_ROOTS];
    read_req r;
    char path[PATH_MAX];
    (void)self;
    if (!PyArg_ParseTuple(args, "iOnnOnnO", &fd, &bufobj, &start, &end, &roots,
                          &read_ahead, &max_read, &capsule))
        return NULL;
    node_state *st = get_state(capsule);
    if (st == NULL || take_roots(roots, rt, &nroots) < 0)
        return NULL;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    unsigned char *b = view.buf;
    Py_ssize_t size = view.len;
    if (start < 0 || end < start || end > size || read_ahead < 1) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "bad buffer bounds");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        Py_ssize_t have = end - start, need = PREFIX;
        uint32_t hlen = 0, plen = 0;
        if (have >= PREFIX) {
            memcpy(&hlen, b + start, 4);  /* little-endian hosts (x86-64, aarch64) */
            memcpy(&plen, b + start + 4, 4);
            if (hlen > MAX_HEADER || plen > MAX_PAYLOAD || plen != 0)
                break;  /* PYTHON: its error, or a PUT */
            need = PREFIX + (Py_ssize_t)hlen;
        }
        if (have >= need && have >= PREFIX) {
            if (!parse_request(b + start + PREFIX, b + start + need, &r))
                break;
            const root_t *root = NULL;
            for (int i = 0; i < nroots; i++)
                if (rt[i].device == r.device)
                    root = &rt[i];
            uint64_t total = 0;
            int ok = root != NULL;
            for (int i = 0; ok && i < r.nranges; i++) {
                ok = r.off[i] <= (uint64_t)INT64_MAX / 2 && r.len[i] <= (uint64_t)max_read;
                total += r.len[i];
            }
            if (!ok || total > (uint64_t)max_read ||
                __atomic_load_n(&st->delayed, __ATOMIC_ACQUIRE) ||
                __atomic_load_n(&st->puts, __ATOMIC_ACQUIRE) != 0)
                break;
            snprintf(path, sizeof(path), "%s%c%c/%s", root->dir, r.name[14], r.name[15],
                     r.name);
            /* another whole READ frame received already: this reply may wait for
             * its (MSG_MORE), the pipelined replies leave in fewer segments; the
             * last one (or one the Python path answers next) sends them */
            Py_ssize_t left = have - need;
            uint32_t h2 = 0, p2 = 1;
            if (left >= PREFIX) {
                memcpy(&h2, b + start + need, 4);
                memcpy(&p2, b + start + need + 4, 4);
            }
            int more = left >= PREFIX && p2 == 0 && h2 <= MAX_HEADER &&
                       left >= PREFIX + (Py_ssize_t)h2;
            int rc = answer(fd, &r, path, total, &st->served, more);
            if (rc < 0) {
                err = errno;
                break;
            }
            if (rc == 0)
                break;  /* PYTHON: it answers with the error */
            start += need;
            /* a READ pipelined with others (a direct client's batch: a frame behind
             * it, or it was behind one) does not count toward its fragment's heat:
             * that reader keeps its own reads in flight, which a whole-fragment read
             * would compete with for the device */
            int pipelined = more || behind;
            behind = more;
            if (r.nranges && !pipelined && note_read(st, r.device, r.name)) {
                status = HOT;
                break;
            }
            continue;
        }
        /* receive more: room for the frame at the front, at most read_ahead past it */
        if (need > size)
            break;  /* a header larger than the buffer: the Python path grows it */
        if (start + need > size || have == 0) {
            memmove(b, b + start, (size_t)have);
            start = 0;
            end = have;
        }
        Py_ssize_t want = need - have > read_ahead ? need - have : read_ahead;
        if (want > size - end)
            want = size - end;
        ssize_t k = recv(fd, b + end, (size_t)want, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0) {
            err = errno;
            break;
        }
        if (k == 0) {
            status = END;
            break;
        }
        end += k;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (status == HOT)
        return Py_BuildValue("(innKs)", status, start, end, (unsigned long long)r.device,
                             r.name);
    return Py_BuildValue("(innOO)", status, start, end, Py_None, Py_None);
}

static PyObject *served(PyObject *self, PyObject *capsule)
{
    (void)self;
    node_state *st = get_state(capsule);
    return st ? PyLong_FromUnsignedLongLong(__atomic_load_n(&st->served, __ATOMIC_RELAXED))
              : NULL;
}

static PyObject *set_delayed(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    int flag;
    (void)self;
    if (!PyArg_ParseTuple(args, "Op", &capsule, &flag))
        return NULL;
    node_state *st = get_state(capsule);
    if (st == NULL)
        return NULL;
    __atomic_store_n(&st->delayed, flag, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *count_puts(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    long delta;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ol", &capsule, &delta))
        return NULL;
    node_state *st = get_state(capsule);
    return st ? PyLong_FromLong(__atomic_add_fetch(&st->puts, delta, __ATOMIC_ACQ_REL))
              : NULL;
}

static PyObject *note(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    unsigned long long device;
    const char *name;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "OKs#", &capsule, &device, &name, &n))
        return NULL;
    node_state *st = get_state(capsule);
    if (st == NULL)
        return NULL;
    if (n > NAME_MAX_LEN)  /* no such fragment is written: not counted */
        Py_RETURN_FALSE;
    return PyBool_FromLong(note_read(st, device, name));
}

static PyMethodDef methods[] = {
    {"state", new_state, METH_VARARGS,
     "state(tracked, hot_reads, hot_window, hot_rate, fragment_guess) -> a node's state"},
    {"serve_reads", serve_reads, METH_VARARGS,
     "serve_reads(fd, buf, start, end, roots, read_ahead, max_read, state) -> (status, "
     "start, end, device, name): serve small READs until a fragment gets hot (HOT), a "
     "frame is for the Python path (PYTHON) or the peer is gone (END)"},
    {"served", served, METH_O, "served(state) -> READs answered by serve_reads"},
    {"set_delayed", set_delayed, METH_VARARGS,
     "set_delayed(state, flag): while set, READs are left to the Python path"},
    {"puts", count_puts, METH_VARARGS,
     "puts(state, delta) -> int: fragment writes under way, after adding delta"},
    {"note", note, METH_VARARGS,
     "note(state, device, name) -> bool: count a small READ; True if the fragment got hot"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "bmfs.node._native",
    "A storage node's small READs served in C, without the GIL (native/node_reads.c).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "HOT", HOT) < 0 ||
        PyModule_AddIntConstant(m, "PYTHON", PYTHON) < 0 ||
        PyModule_AddIntConstant(m, "END", END) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
