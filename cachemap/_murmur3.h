/* MurmurHash3_x64_128 (Austin Appleby, public domain), as the mmh3 package computes it
   (`mmh3.mmh3_x64_128_digest`: h1 then h2, little-endian). Blocks are read with memcpy (any
   alignment); the digest is written little-endian whatever the host's byte order. */
#ifndef KVGATE_MURMUR3_H
#define KVGATE_MURMUR3_H

#include <stdint.h>
#include <string.h>

static inline uint64_t kvg_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t kvg_fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static inline uint64_t kvg_load64(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
#endif
}

static inline void kvg_store64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* the 16-byte digest of `data` (len bytes), seed 0, into `out` */
static void kvg_murmur3_128(const uint8_t *data, size_t len, uint8_t *out) {
    const size_t nblocks = len / 16;
    uint64_t h1 = 0, h2 = 0;
    const uint64_t c1 = 0x87c37b91114253d5ULL;
    const uint64_t c2 = 0x4cf5ad432745937fULL;
    for (size_t i = 0; i < nblocks; i++) {
        uint64_t k1 = kvg_load64(data + 16 * i);
        uint64_t k2 = kvg_load64(data + 16 * i + 8);
        k1 *= c1; k1 = kvg_rotl64(k1, 31); k1 *= c2; h1 ^= k1;
        h1 = kvg_rotl64(h1, 27); h1 += h2; h1 = h1 * 5 + 0x52dce729;
        k2 *= c2; k2 = kvg_rotl64(k2, 33); k2 *= c1; h2 ^= k2;
        h2 = kvg_rotl64(h2, 31); h2 += h1; h2 = h2 * 5 + 0x38495ab5;
    }
    const uint8_t *tail = data + nblocks * 16;
    uint64_t k1 = 0, k2 = 0;
    switch (len & 15) {
    case 15: k2 ^= ((uint64_t)tail[14]) << 48; /* fall through */
    case 14: k2 ^= ((uint64_t)tail[13]) << 40; /* fall through */
    case 13: k2 ^= ((uint64_t)tail[12]) << 32; /* fall through */
    case 12: k2 ^= ((uint64_t)tail[11]) << 24; /* fall through */
    case 11: k2 ^= ((uint64_t)tail[10]) << 16; /* fall through */
    case 10: k2 ^= ((uint64_t)tail[9]) << 8; /* fall through */
    case 9:
        k2 ^= ((uint64_t)tail[8]);
        k2 *= c2; k2 = kvg_rotl64(k2, 33); k2 *= c1; h2 ^= k2;
        /* fall through */
    case 8: k1 ^= ((uint64_t)tail[7]) << 56; /* fall through */
    case 7: k1 ^= ((uint64_t)tail[6]) << 48; /* fall through */
    case 6: k1 ^= ((uint64_t)tail[5]) << 40; /* fall through */
    case 5: k1 ^= ((uint64_t)tail[4]) << 32; /* fall through */
    case 4: k1 ^= ((uint64_t)tail[3]) << 24; /* fall through */
    case 3: k1 ^= ((uint64_t)tail[2]) << 16; /* fall through */
    case 2: k1 ^= ((uint64_t)tail[1]) << 8; /* fall through */
    case 1:
        k1 ^= ((uint64_t)tail[0]);
        k1 *= c1; k1 = kvg_rotl64(k1, 31); k1 *= c2; h1 ^= k1;
    }
    h1 ^= (uint64_t)len;
    h2 ^= (uint64_t)len;
    h1 += h2;
    h2 += h1;
    h1 = kvg_fmix64(h1);
    h2 = kvg_fmix64(h2);
    h1 += h2;
    h2 += h1;
    kvg_store64(out, h1);
    kvg_store64(out + 8, h2);
}

#endif
