/* Protobuf varints, as the node protocol's hand-built frames need them (shared by
 * native/node_reads.c and native/client_reads.c; static: each module has its copy). */
#ifndef BMFS_WIRE_H
#define BMFS_WIRE_H

#include <stddef.h>
#include <stdint.h>

/* A varint at *p (before end); 0 if malformed. */
static int varint(const unsigned char **p, const unsigned char *end, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        unsigned char b = *(*p)++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 1;
        }
    }
    return 0;
}

static unsigned char *put_varint(unsigned char *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    *p++ = (unsigned char)v;
    return p;
}

static size_t varint_size(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

#endif
