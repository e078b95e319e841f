/* bmfs.node._client: a mount's small READs to storage nodes (a lone one, or the k of
 * a degraded read), sent and their replies waited for and taken in C, without the
 * GIL and without the event loop.
 *
 * Caveats first: this module is optional. bmfs/transport/tcp.py does the same in
 * Python when it is missing (not built, or BMFS_NATIVE=0), and uses it only where
 * the Python path would spin for the reply anyway (small READs, nothing else under
 * way: Connection._spin_loop). The request frame built here is the one the Python
 * path builds, byte for byte (tests/test_t2_tcp.py compares them); of the replies
 * it takes only the plain ones (the request's id, no error, one length per range,
 * nothing else), and leaves any other frame in the buffer for bmfs/node/protocol.py
 * to parse as always. While it spins, the event loop does not run: the spin is
 * bounded (BMFS_SPIN_US, 500 us by default) and ends early when the watched
 * descriptor (the FUSE device: another request came in) is readable.
 *
 * read_all(requests, spin_ns, watch_fd) -> [(status, end, payload_start, lengths,
 *                                             unsent, seconds), ...]
 *     Each of `requests` (at most 16) is (fd, buf, start, end, id, device, name,
 *     ranges): a READ request (`id`, `device`, fragment `name` as bytes, `ranges` a
 *     sequence of at most 8 (offset, length) pairs) to send on the non-blocking
 *     socket `fd`, and the bytearray `buf` its reply is received into, whose bytes
 *     [start, end) are received and not yet consumed. Every request is sent first;
 *     then the sockets are received from, without sleeping, until each has a whole
 *     frame (u32 header length, u32 payload length, header, payload: the framing of
 *     bmfs/node/protocol.py) from its `start`, for at most `spin_ns` nanoseconds in
 *     all. For each: its status, the new end of its received bytes, and:
 *       REPLY   the frame is the plain reply to the request: its payload at
 *               buf[payload_start:], the ranges' `lengths` (a tuple); `seconds` from
 *               the first send to its arrival;
 *       FRAME   another whole frame is there (an error reply, another id), or one
 *               whose prefix the Python parser refuses;
 *       SPUN    the time is up, or the frame would not fit in `buf`;
 *       WANTED  `watch_fd` (if not -1) became readable;
 *       CLOSED  the send failed, or the peer closed the connection or it failed
 *               (the caller drops the connection);
 *     `unsent`: None, or the end of the request that the socket did not take (its
 *     send buffer was full; the status is SPUN): the caller sends it, then waits.
 *
 * read_batch(conns, wait_ns) -> [(status, end, taken, replies), ...]
 *     A batch's READs pipelined: each of `conns` is (fd, buf, start, end, requests),
 *     `requests` a list of (id, device, name, ranges) as above (any number). Each
 *     connection's requests go out in one send (the rest as the socket takes it),
 *     and their replies, which a node sends in order, are received into `buf` after
 *     `end` and taken in turn, for all the connections at once, sleeping in poll(2)
 *     between receives, for at most `wait_ns` nanoseconds in all. For each
 *     connection: `replies`, [(payload_start, lengths), ...] of the plain replies
 *     taken, in request order (a prefix of its requests); `taken`, where the bytes
 *     after the last of them start; `end`, the new end of its received bytes; and its
 *     status: REPLY (every request's reply taken), FRAME (the next frame is not the
 *     next request's plain reply, or it would not fit in `buf`), SPUN (the time is
 *     up) or CLOSED (a send failed, or the peer closed the connection). Past the
 *     replies taken, the connection is out of step: the caller closes it.
 *
 * read_frame(id, device, name, ranges) -> bytes
 *     The request frame read_all() sends (for the tests).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "wire.h"

enum { REPLY = 0, FRAME = 1, SPUN = 2, WANTED = 3, CLOSED = 4 };
enum { PREFIX = 8, WATCH_EVERY = 8,  /* poll the watched descriptor every 8 tries */
       OP_READ = 2, MAX_RANGES = 8, MAX_NAME = 64, MAX_REQUESTS = 16,
       MAX_FRAME = PREFIX + 32 + MAX_NAME + MAX_RANGES * 24 };
#define MAX_HEADER (64u << 10)
#define MAX_PAYLOAD (64u << 20)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
           (uint32_t)p[3] << 24;
}

/* FRAME if [start, end) holds a whole frame (or a prefix the parser refuses), SPUN
 * if the frame cannot fit in `cap` bytes from `start`, else -1 (more to receive). */
static int frame_state(const unsigned char *buf, size_t start, size_t end, size_t cap)
{
    if (end - start < PREFIX)
        return -1;
    uint32_t hlen = le32(buf + start), plen = le32(buf + start + 4);
    if (hlen > MAX_HEADER || plen > MAX_PAYLOAD)
        return FRAME;
    size_t need = PREFIX + (size_t)hlen + plen;
    if (end - start >= need)
        return FRAME;
    return start + need > cap ? SPUN : -1;
}

static int send_some(int fd, const unsigned char *p, size_t n, size_t *sent)
{
    *sent = 0;
    while (*sent < n) {
        ssize_t k = send(fd, p + *sent, n - *sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
        }
        *sent += (size_t)k;
    }
    return 0;
}

typedef struct {
    uint64_t id, device;
    int nranges;
    uint64_t off[MAX_RANGES], len[MAX_RANGES];
    const char *name;
    size_t name_len;
} read_req;

/* The frame of `r` into out (MAX_FRAME bytes): protobuf's encoding of a Request as
 * the Python path serializes it (fields in order, proto3: zeros left out). */
static size_t build_frame(const read_req *r, unsigned char *out)
{
    unsigned char *h = out + PREFIX;
    if (r->id) {
        *h++ = 0x08;
        h = put_varint(h, r->id);
    }
    *h++ = 0x10;
    *h++ = OP_READ;
    if (r->device) {
        *h++ = 0x18;
        h = put_varint(h, r->device);
    }
    if (r->name_len) {
        *h++ = 0x22;
        h = put_varint(h, r->name_len);
        memcpy(h, r->name, r->name_len);
        h += r->name_len;
    }
    for (int i = 0; i < r->nranges; i++) {
        size_t n = (r->off[i] ? 1 + varint_size(r->off[i]) : 0) +
                   (r->len[i] ? 1 + varint_size(r->len[i]) : 0);
        *h++ = 0x2a;
        h = put_varint(h, n);
        if (r->off[i]) {
            *h++ = 0x08;
            h = put_varint(h, r->off[i]);
        }
        if (r->len[i]) {
            *h++ = 0x10;
            h = put_varint(h, r->len[i]);
        }
    }
    uint32_t hlen = (uint32_t)(h - out - PREFIX), plen = 0;
    memcpy(out, &hlen, 4);  /* little-endian hosts (x86-64, aarch64) */
    memcpy(out + 4, &plen, 4);
    return (size_t)(h - out);
}

/* Whether [p, end) is a Response with id `id`, no error and exactly `n` lengths
 * (packed or not), nothing else; the lengths into len. */
static int plain_reply(const unsigned char *p, const unsigned char *end, uint64_t id,
                       int n, uint64_t *len)
{
    uint64_t got_id = 0, v;
    int count = 0;
    while (p < end) {
        uint64_t key;
        if (!varint(&p, end, &key))
            return 0;
        if (key == 0x08) {  /* id */
            if (!varint(&p, end, &got_id))
                return 0;
        } else if (key == 0x20) {  /* one length, unpacked */
            if (count == n || !varint(&p, end, &len[count++]))
                return 0;
        } else if (key == 0x22) {  /* lengths, packed */
            uint64_t size;
            if (!varint(&p, end, &size) || size > (uint64_t)(end - p))
                return 0;
            const unsigned char *q = p, *qend = p + size;
            while (q < qend)
                if (count == n || !varint(&q, qend, &len[count++]))
                    return 0;
            p = qend;
        } else if (key == 0x10) {  /* errno: only 0 is plain */
            if (!varint(&p, end, &v) || v != 0)
                return 0;
        } else {
            return 0;  /* an error text, names, info: the Python parser's */
        }
    }
    return got_id == id && count == n;
}

/* `ranges` (a sequence of (offset, length)) into r; -1 with an exception set. */
static int take_ranges(PyObject *ranges, read_req *r)
{
    PyObject *seq = PySequence_Fast(ranges, "read: ranges must be a sequence of pairs");
    if (seq == NULL)
        return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_RANGES) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "read: more than 8 ranges");
        return -1;
    }
    r->nranges = (int)count;
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned long long off, len;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KK", &off, &len)) {
            Py_DECREF(seq);
            return -1;
        }
        r->off[i] = off;
        r->len[i] = len;
    }
    Py_DECREF(seq);
    return 0;
}

static int take_name(const Py_buffer *name, read_req *r)
{
    if (name->len > MAX_NAME) {
        PyErr_SetString(PyExc_ValueError, "read: fragment name too long");
        return -1;
    }
    r->name = name->buf;
    r->name_len = (size_t)name->len;
    return 0;
}

static PyObject *read_frame(PyObject *self, PyObject *args)
{
    read_req r;
    Py_buffer name;
    PyObject *ranges, *out = NULL;
    unsigned long long id, device;
    unsigned char frame[MAX_FRAME];
    (void)self;
    if (!PyArg_ParseTuple(args, "KKy*O", &id, &device, &name, &ranges))
        return NULL;
    r.id = id;
    r.device = device;
    if (take_name(&name, &r) == 0 && take_ranges(ranges, &r) == 0)
        out = PyBytes_FromStringAndSize((const char *)frame,
                                        (Py_ssize_t)build_frame(&r, frame));
    PyBuffer_Release(&name);
    return out;
}

/* One request of read_all: its socket, buffer and request in, what came of it out. */
typedef struct {
    int fd, status, pending;
    Py_buffer buf, name;
    size_t start, end, poff, flen, sent;
    uint64_t len[MAX_RANGES], done_ns;
    read_req r;
    unsigned char frame[MAX_FRAME];
} slot_t;

/* A slot's receive: -1 while its frame is still coming, else its status. */
static int slot_recv(slot_t *s)
{
    unsigned char *b = s->buf.buf;
    size_t cap = (size_t)s->buf.len;
    if (s->end == cap)
        return SPUN;  /* (the caller's buffer is full: its parser makes room) */
    ssize_t k = recv(s->fd, b + s->end, cap - s->end, MSG_DONTWAIT);
    if (k > 0) {
        s->end += (size_t)k;
        return frame_state(b, s->start, s->end, cap);
    }
    if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        return CLOSED;
    return -1;
}

/* Send every slot's request, then receive their replies for up to spin_ns (see the
 * top of the file); a whole frame that is a plain reply becomes REPLY. */
static void exchange(slot_t *slots, int n, uint64_t spin_ns, int watch_fd)
{
    uint64_t t0 = now_ns(), until = t0 + spin_ns;
    int pending = 0;
    for (int i = 0; i < n; i++) {
        slot_t *s = &slots[i];
        s->flen = build_frame(&s->r, s->frame);
        s->pending = 0;
        if (send_some(s->fd, s->frame, s->flen, &s->sent) < 0)
            s->status = CLOSED;
        else if (s->sent < s->flen)
            s->status = SPUN;  /* the caller sends the rest, then waits */
        else if ((s->status = frame_state(s->buf.buf, s->start, s->end,
                                          (size_t)s->buf.len)) < 0)
            s->pending = 1, pending++;
    }
    for (unsigned tries = 1; pending; tries++) {
        for (int i = 0; i < n; i++) {
            slot_t *s = &slots[i];
            if (s->pending && (s->status = slot_recv(s)) >= 0) {
                s->pending = 0;
                s->done_ns = now_ns() - t0;
                pending--;
            }
        }
        int stop = -1;
        if (pending && now_ns() >= until)
            stop = SPUN;
        else if (pending && watch_fd >= 0 && tries % WATCH_EVERY == 0) {
            struct pollfd p = {.fd = watch_fd, .events = POLLIN};
            if (poll(&p, 1, 0) > 0)
                stop = WANTED;
        }
        for (int i = 0; stop >= 0 && i < n; i++)
            if (slots[i].pending)
                slots[i].status = stop, slots[i].pending = 0, pending--;
    }
    for (int i = 0; i < n; i++) {
        slot_t *s = &slots[i];
        if (s->status != FRAME)
            continue;
        unsigned char *b = s->buf.buf;
        uint32_t hlen = le32(b + s->start), plen = le32(b + s->start + 4);
        const unsigned char *h = b + s->start + PREFIX;
        uint64_t total = 0;
        if (hlen > MAX_HEADER || plen > MAX_PAYLOAD ||
            !plain_reply(h, h + hlen, s->r.id, s->r.nranges, s->len))
            continue;
        int fits = 1;
        for (int j = 0; fits && j < s->r.nranges; j++) {
            fits = s->len[j] <= plen - total;  /* (no sum past the payload, no wrap) */
            total += s->len[j];
        }
        if (fits && total == plen) {
            s->status = REPLY;
            s->poff = s->start + PREFIX + hlen;
        }
    }
}

/* A slot from (fd, buf, start, end, id, device, name, ranges); -1 with an exception
 * set (its buffers released). */
static int take_slot(PyObject *item, slot_t *s)
{
    PyObject *ranges;
    Py_ssize_t start, end;
    unsigned long long id, device;
    if (!PyTuple_Check(item) ||
        !PyArg_ParseTuple(item, "iw*nnKKy*O", &s->fd, &s->buf, &start, &end, &id, &device,
                          &s->name, &ranges)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "read_all: requests must be tuples");
        return -1;
    }
    s->r.id = id;
    s->r.device = device;
    int bad = take_name(&s->name, &s->r) < 0 || take_ranges(ranges, &s->r) < 0;
    if (!bad && (start < 0 || start > end || end > s->buf.len)) {
        PyErr_SetString(PyExc_ValueError, "read_all: bad buffer bounds");
        bad = 1;
    }
    if (bad) {
        PyBuffer_Release(&s->buf);
        PyBuffer_Release(&s->name);
        return -1;
    }
    s->start = (size_t)start;
    s->end = (size_t)end;
    return 0;
}

static PyObject *slot_result(const slot_t *s)
{
    PyObject *lengths = Py_None, *unsent = Py_None;
    if (s->status == REPLY) {
        lengths = PyTuple_New(s->r.nranges);
        for (int i = 0; lengths != NULL && i < s->r.nranges; i++) {
            PyObject *n = PyLong_FromUnsignedLongLong(s->len[i]);
            if (n == NULL)
                Py_CLEAR(lengths);
            else
                PyTuple_SET_ITEM(lengths, i, n);
        }
    } else {
        Py_INCREF(lengths);
    }
    if (s->status != CLOSED && s->sent < s->flen) {
        unsent = PyBytes_FromStringAndSize((const char *)s->frame + s->sent,
                                           (Py_ssize_t)(s->flen - s->sent));
    } else {
        Py_INCREF(unsent);
    }
    if (lengths == NULL || unsent == NULL) {
        Py_XDECREF(lengths);
        Py_XDECREF(unsent);
        return NULL;
    }
    return Py_BuildValue("innNNd", s->status, (Py_ssize_t)s->end, (Py_ssize_t)s->poff,
                         lengths, unsent, s->done_ns / 1e9);
}

static PyObject *read_all(PyObject *self, PyObject *args)
{
    PyObject *requests, *out = NULL;
    unsigned long long spin_ns;
    int watch_fd, n = 0;
    slot_t slots[MAX_REQUESTS];
    (void)self;
    if (!PyArg_ParseTuple(args, "OKi", &requests, &spin_ns, &watch_fd))
        return NULL;
    PyObject *seq = PySequence_Fast(requests, "read_all: requests must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_REQUESTS) {
        PyErr_SetString(PyExc_ValueError, "read_all: more than 16 requests");
        goto done;
    }
    for (; n < count; n++) {
        memset(&slots[n].r, 0, sizeof(slots[n].r));
        slots[n].done_ns = 0;
        slots[n].poff = 0;
        if (take_slot(PySequence_Fast_GET_ITEM(seq, n), &slots[n]) < 0)
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    exchange(slots, n, spin_ns, watch_fd);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (int i = 0; out != NULL && i < n; i++) {
        PyObject *r = slot_result(&slots[i]);
        if (r == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, r);
    }
done:
    for (int i = 0; i < n; i++) {
        PyBuffer_Release(&slots[i].buf);
        PyBuffer_Release(&slots[i].name);
    }
    Py_DECREF(seq);
    return out;
}

/* One connection of read_batch: its socket, buffer and requests in, what came of
 * them out. */
typedef struct {
    int fd, status, n, taken;  /* status -1: still under way */
    Py_buffer buf;
    size_t end, cur, flen, sent;  /* cur: where the next reply starts */
    read_req *reqs;
    Py_buffer *names;
    size_t *poff;
    uint64_t (*len)[MAX_RANGES];
    unsigned char *frames;
} bconn_t;

/* Take the whole frames at b->cur while each is the next request's plain reply. */
static void bconn_take(bconn_t *b)
{
    unsigned char *p = b->buf.buf;
    size_t cap = (size_t)b->buf.len;
    while (b->taken < b->n) {
        int st = frame_state(p, b->cur, b->end, cap);
        if (st < 0)
            return;
        read_req *r = &b->reqs[b->taken];
        uint64_t *len = b->len[b->taken];
        uint32_t hlen = le32(p + b->cur), plen = le32(p + b->cur + 4);
        const unsigned char *h = p + b->cur + PREFIX;
        uint64_t total = 0;
        int fits = st == FRAME && hlen <= MAX_HEADER && plen <= MAX_PAYLOAD &&
                   plain_reply(h, h + hlen, r->id, r->nranges, len);
        for (int j = 0; fits && j < r->nranges; j++) {
            fits = len[j] <= plen - total;
            total += len[j];
        }
        if (!fits || total != plen) {
            b->status = FRAME;
            return;
        }
        b->poff[b->taken++] = b->cur + PREFIX + hlen;
        b->cur += PREFIX + (size_t)hlen + plen;
    }
    b->status = REPLY;
}

/* Send what the socket takes of b's frames, then receive what has come. */
static void bconn_step(bconn_t *b, short revents)
{
    if (b->sent < b->flen) {
        size_t k;
        if (send_some(b->fd, b->frames + b->sent, b->flen - b->sent, &k) < 0) {
            b->status = CLOSED;
            return;
        }
        b->sent += k;
    }
    if (!(revents & (POLLIN | POLLERR | POLLHUP)))
        return;
    size_t cap = (size_t)b->buf.len;
    if (b->end == cap) {
        b->status = FRAME;  /* (no room: the caller's parser makes some) */
        return;
    }
    ssize_t k = recv(b->fd, (unsigned char *)b->buf.buf + b->end, cap - b->end,
                     MSG_DONTWAIT);
    if (k > 0) {
        b->end += (size_t)k;
        bconn_take(b);
    } else if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        b->status = CLOSED;
    }
}

static void batch_exchange(bconn_t *conns, int n, uint64_t wait_ns)
{
    uint64_t until = now_ns() + wait_ns;
    struct pollfd *fds = malloc(sizeof(*fds) * (size_t)(n ? n : 1));
    int *which = malloc(sizeof(int) * (size_t)(n ? n : 1));
    if (fds == NULL || which == NULL) {
        for (int i = 0; i < n; i++)
            conns[i].status = CLOSED;
        free(fds);
        free(which);
        return;
    }
    for (int i = 0; i < n; i++) {
        bconn_t *b = &conns[i];
        b->status = -1;
        size_t off = 0;
        for (int j = 0; j < b->n; j++)
            off += build_frame(&b->reqs[j], b->frames + off);
        b->flen = off;
        bconn_step(b, 0);
        if (b->status < 0)
            bconn_take(b);  /* (replies received before, if any) */
        if (b->status < 0 && b->n == 0)
            b->status = REPLY;
    }
    for (;;) {
        int m = 0;
        for (int i = 0; i < n; i++) {
            if (conns[i].status >= 0)
                continue;
            fds[m].fd = conns[i].fd;
            fds[m].events = POLLIN | (conns[i].sent < conns[i].flen ? POLLOUT : 0);
            fds[m].revents = 0;
            which[m++] = i;
        }
        if (m == 0)
            break;
        uint64_t now = now_ns();
        if (now >= until) {
            for (int i = 0; i < m; i++)
                conns[which[i]].status = SPUN;
            break;
        }
        struct timespec left = {(time_t)((until - now) / 1000000000u),
                                (long)((until - now) % 1000000000u)};
        int got = ppoll(fds, (nfds_t)m, &left, NULL);
        if (got < 0 && errno != EINTR) {
            for (int i = 0; i < m; i++)
                conns[which[i]].status = CLOSED;
            break;
        }
        for (int i = 0; got > 0 && i < m; i++)
            if (fds[i].revents)
                bconn_step(&conns[which[i]], fds[i].revents);
    }
    free(fds);
    free(which);
}

static void bconn_release(bconn_t *b)
{
    PyBuffer_Release(&b->buf);
    for (int j = 0; j < b->n; j++)
        PyBuffer_Release(&b->names[j]);
    PyMem_Free(b->reqs);
    PyMem_Free(b->names);
    PyMem_Free(b->poff);
    PyMem_Free(b->len);
    PyMem_Free(b->frames);
}

/* A connection of read_batch from (fd, buf, start, end, requests); -1 with an
 * exception set (what it took released). */
static int take_bconn(PyObject *item, bconn_t *b)
{
    PyObject *requests, *seq;
    Py_ssize_t start, end;
    memset(b, 0, sizeof(*b));
    if (!PyTuple_Check(item) ||
        !PyArg_ParseTuple(item, "iw*nnO", &b->fd, &b->buf, &start, &end, &requests)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "read_batch: connections must be tuples");
        return -1;
    }
    if (start < 0 || start > end || end > b->buf.len) {
        PyErr_SetString(PyExc_ValueError, "read_batch: bad buffer bounds");
        PyBuffer_Release(&b->buf);
        return -1;
    }
    b->end = b->cur = (size_t)end;
    (void)start;
    seq = PySequence_Fast(requests, "read_batch: requests must be a sequence");
    if (seq == NULL) {
        PyBuffer_Release(&b->buf);
        return -1;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), k = count ? count : 1;
    b->reqs = PyMem_Calloc((size_t)k, sizeof(*b->reqs));
    b->names = PyMem_Calloc((size_t)k, sizeof(*b->names));
    b->poff = PyMem_Calloc((size_t)k, sizeof(*b->poff));
    b->len = PyMem_Calloc((size_t)k, sizeof(*b->len));
    b->frames = PyMem_Malloc((size_t)k * MAX_FRAME);
    int bad = b->reqs == NULL || b->names == NULL || b->poff == NULL || b->len == NULL ||
              b->frames == NULL;
    if (bad)
        PyErr_NoMemory();
    for (Py_ssize_t j = 0; !bad && j < count; j++) {
        PyObject *ranges;
        unsigned long long id, device;
        read_req *r = &b->reqs[j];
        PyObject *req = PySequence_Fast_GET_ITEM(seq, j);
        if (!PyTuple_Check(req) ||
            !PyArg_ParseTuple(req, "KKy*O", &id, &device, &b->names[j], &ranges)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "read_batch: requests must be tuples");
            bad = 1;
            break;
        }
        b->n = (int)j + 1;
        r->id = id;
        r->device = device;
        bad = take_name(&b->names[j], r) < 0 || take_ranges(ranges, r) < 0;
    }
    Py_DECREF(seq);
    if (bad) {
        bconn_release(b);
        return -1;
    }
    return 0;
}

static PyObject *bconn_result(const bconn_t *b)
{
    PyObject *replies = PyList_New(b->taken);
    for (int j = 0; replies != NULL && j < b->taken; j++) {
        const read_req *r = &b->reqs[j];
        PyObject *lengths = PyTuple_New(r->nranges);
        for (int i = 0; lengths != NULL && i < r->nranges; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(b->len[j][i]);
            if (v == NULL)
                Py_CLEAR(lengths);
            else
                PyTuple_SET_ITEM(lengths, i, v);
        }
        PyObject *one = lengths == NULL ? NULL :
            Py_BuildValue("nN", (Py_ssize_t)b->poff[j], lengths);
        if (one == NULL)
            Py_CLEAR(replies);
        else
            PyList_SET_ITEM(replies, j, one);
    }
    if (replies == NULL)
        return NULL;
    return Py_BuildValue("innN", b->status, (Py_ssize_t)b->end, (Py_ssize_t)b->cur,
                         replies);
}

static PyObject *read_batch(PyObject *self, PyObject *args)
{
    PyObject *conns, *out = NULL;
    unsigned long long wait_ns;
    int n = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OK", &conns, &wait_ns))
        return NULL;
    PyObject *seq = PySequence_Fast(conns, "read_batch: connections must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    bconn_t *bc = PyMem_Calloc((size_t)(count ? count : 1), sizeof(*bc));
    if (bc == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (; n < count; n++)
        if (take_bconn(PySequence_Fast_GET_ITEM(seq, n), &bc[n]) < 0)
            goto done;
    Py_BEGIN_ALLOW_THREADS
    batch_exchange(bc, n, wait_ns);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (int i = 0; out != NULL && i < n; i++) {
        PyObject *r = bconn_result(&bc[i]);
        if (r == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, r);
    }
done:
    for (int i = 0; i < n; i++)
        bconn_release(&bc[i]);
    PyMem_Free(bc);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"read_batch", read_batch, METH_VARARGS,
     "read_batch([(fd, buf, start, end, [(id, device, name, ranges), ...]), ...], wait_ns)"
     " -> [(status, end, taken, [(payload_start, lengths), ...]), ...]"},
    {"read_all", read_all, METH_VARARGS,
     "read_all([(fd, buf, start, end, id, device, name, ranges), ...], spin_ns, watch_fd)"
     " -> [(status, end, payload_start, lengths, unsent, seconds), ...]"},
    {"read_frame", read_frame, METH_VARARGS,
     "read_frame(id, device, name, ranges) -> the request frame read_all() sends"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "bmfs.node._client",
    "Small READs to storage nodes sent and their replies taken in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__client(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "REPLY", REPLY) < 0 ||
        PyModule_AddIntConstant(m, "FRAME", FRAME) < 0 ||
        PyModule_AddIntConstant(m, "SPUN", SPUN) < 0 ||
        PyModule_AddIntConstant(m, "WANTED", WANTED) < 0 ||
        PyModule_AddIntConstant(m, "CLOSED", CLOSED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
