# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled forms of per-block loops of the request path and the event ingest (optional; see
cachemap.native).

- `chain`: `cachemap.keys.chain_hashes` without extras, in one call a prompt.
- `Lru`: one replica's epoch of `cachemap.memory.MemoryIndex` (`cachemap.memory.OrderedLru`'s
  methods), an open-addressing table of 16-byte key prefixes inline with a log of touches for
  its order, instead of an OrderedDict (three dict probes and a linked node a move).
- `DomainTable`: `cachemap.events.DomainMaps`, a domain's held masks, parents and held-children
  counts in one record a key of an open-addressing table (broken: a record with children and
  no tier) and its engine hashes in a second, its stores and removals one loop over the
  event's blocks.
- `WordTable`: a mirror of the precise word cache's young pieces, first and later
  (`gateway.events.words`), that looks a text's words up from its characters, no `str` made a
  word (`words._tail`'s form).
- `common_prefix`: the longest common prefix of two texts (`gateway.events.texts`), compared 8
  bytes a step, no slice made.
- `unpack_u32`: a KV event's token ids from their msgpack bytes into an `array("I")`, no int
  object made a token (`gateway.events.decode.unpack_u32`).

The pure-Python forms are the definitions; tests hold these to them.
"""

import array

from cpython cimport array
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject, PyObject_Hash
from cpython.long cimport PyLong_Check, PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

cdef extern from "_murmur3.h":
    void kvg_murmur3_128(const uint8_t *data, size_t len, uint8_t *out) nogil
    uint64_t kvg_fmix64(uint64_t k) nogil
    uint64_t kvg_rotl64(uint64_t x, int r) nogil

cdef enum:
    TAG = 6


def chain(data, bytes root, Py_ssize_t block_bytes, object parent):
    """`chain_hashes(data, root, block_bytes, parent=parent)`: `parent` None or 16 bytes,
    `block_bytes` positive."""
    cdef bytes src = data if type(data) is bytes else bytes(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(src)
    cdef Py_ssize_t nblocks = n // block_bytes
    cdef const uint8_t *p = <const uint8_t *>PyBytes_AS_STRING(src)
    cdef list out = []
    cdef Py_ssize_t i = 0
    cdef Py_ssize_t rlen = PyBytes_GET_SIZE(root)
    cdef uint8_t digest[16]
    cdef uint8_t key[16]
    cdef uint8_t *buf
    if nblocks == 0:
        return out
    buf = <uint8_t *>malloc((rlen if rlen > 16 else 16) + block_bytes)
    if buf == NULL:
        raise MemoryError()
    try:
        if parent is None:
            memcpy(buf, PyBytes_AS_STRING(root), rlen)
            memcpy(buf + rlen, p, block_bytes)
            kvg_murmur3_128(buf, rlen + block_bytes, key)
            out.append(PyBytes_FromStringAndSize(<char *>key, 16))
            i = 1
        else:
            if not PyBytes_Check(parent) or PyBytes_GET_SIZE(parent) != 16:
                raise ValueError("parent must be 16 bytes")
            memcpy(key, PyBytes_AS_STRING(parent), 16)
        while i < nblocks:
            memcpy(buf, key, 16)
            memcpy(buf + 16, p + i * block_bytes, block_bytes)
            kvg_murmur3_128(buf, 16 + block_bytes, digest)
            memcpy(key + TAG, digest + TAG, 16 - TAG)
            out.append(PyBytes_FromStringAndSize(<char *>key, 16))
            i += 1
    finally:
        free(buf)
    return out


cdef struct Slot:
    uint64_t k0  # the key's first 16 bytes, zero padded
    uint64_t k1
    double used
    PyObject *key  # NULL: never used; &GONE: emptied; else a reference held
    uint64_t meta  # stamp << 5 | the key's length (17: longer than 16)


cdef char GONE_MARK = 0
cdef PyObject *GONE = <PyObject *>&GONE_MARK


cdef struct Touch:
    Py_ssize_t slot
    uint64_t stamp


cdef enum:
    SIZE_BITS = 5
    SIZE_MASK = 31
    LONG = 17


cdef inline uint64_t _hash(uint64_t k0, uint64_t k1, uint64_t size, object key) except? 0:
    if size == LONG:
        return kvg_fmix64(k0 ^ kvg_rotl64(k1, 32) ^ <uint64_t>PyObject_Hash(key))
    return kvg_fmix64(k0 ^ kvg_rotl64(k1, 32) ^ (size * 0x9E3779B97F4A7C15ULL))


# a key's first 16 bytes (zero padded), its size (LONG past 16) and its hash: the LRU's and the
# domain table's slots both match a key by these
cdef inline int _parse_key(object key, uint64_t *k0, uint64_t *k1, uint64_t *size,
                           uint64_t *h) except -1:
    cdef uint8_t pad[16]
    cdef Py_ssize_t n
    if not PyBytes_Check(key):
        raise TypeError(f"keys are bytes, got {type(key).__name__}")
    n = PyBytes_GET_SIZE(key)
    if n >= 16:
        memcpy(pad, PyBytes_AS_STRING(key), 16)
    else:
        memset(pad, 0, 16)
        memcpy(pad, PyBytes_AS_STRING(key), n)
    memcpy(k0, pad, 8)
    memcpy(k1, pad + 8, 8)
    size[0] = <uint64_t>n if n <= 16 else LONG
    h[0] = _hash(k0[0], k1[0], size[0], key)
    return 0


cdef inline bint live(Slot *s):
    return s.key != NULL and s.key != GONE


cdef inline uint64_t stamp_of(Slot *s):
    return s.meta >> SIZE_BITS


cdef class Lru:
    """Keys (bytes) -> last use (float), oldest first: the subset of an OrderedDict that
    `cachemap.memory.OrderedLru` uses, with its methods.

    A table of 40-byte slots, linear probing, at most 3/4 full counting the emptied slots
    (rebuilt without them to at most half full): a key of up to 16 bytes is compared in its
    slot, without reading the key object. The order is a log of touches (`Touch`: a slot and
    the stamp it was given); a slot's place is the entry whose stamp it holds, the others are
    skipped where the log is read and dropped when it is compacted."""

    cdef Slot *slots
    cdef Py_ssize_t mask  # len(slots) - 1, a power of two minus one
    cdef Py_ssize_t live
    cdef Py_ssize_t filled  # slots live or emptied
    cdef Touch *log
    cdef Py_ssize_t log_cap
    cdef Py_ssize_t head  # the oldest entry of the log that may be current
    cdef Py_ssize_t tail  # one past the newest
    cdef uint64_t next_stamp

    def __cinit__(self):
        self.slots = <Slot *>malloc(8 * sizeof(Slot))
        self.log = <Touch *>malloc(16 * sizeof(Touch))
        if self.slots == NULL or self.log == NULL:
            raise MemoryError()
        memset(self.slots, 0, 8 * sizeof(Slot))
        self.mask = 7
        self.log_cap = 16
        self.next_stamp = 1

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.slots != NULL:
            for i in range(self.mask + 1):
                if live(&self.slots[i]):
                    Py_DECREF(<object>self.slots[i].key)
            free(self.slots)
        free(self.log)

    def __len__(self):
        return self.live

    # -- the table -------------------------------------------------------------------------

    cdef inline bint _same(self, Slot *s, uint64_t k0, uint64_t k1, uint64_t size, object key):
        return (s.k0 == k0 and s.k1 == k1 and (s.meta & SIZE_MASK) == size
                and (size != LONG or (
                    PyBytes_GET_SIZE(<object>s.key) == PyBytes_GET_SIZE(key)
                    and memcmp(PyBytes_AS_STRING(<object>s.key), PyBytes_AS_STRING(key),
                               PyBytes_GET_SIZE(key)) == 0)))

    cdef inline Py_ssize_t _find(self, object key) except -2:
        """The slot holding `key`, or -1."""
        cdef uint64_t k0, k1, size, h
        cdef Py_ssize_t i
        cdef Slot *s
        _parse_key(key, &k0, &k1, &size, &h)
        i = <Py_ssize_t>(h & <uint64_t>self.mask)
        while True:
            s = &self.slots[i]
            if s.key == NULL:
                return -1
            if s.key != GONE and self._same(s, k0, k1, size, key):
                return i
            i = (i + 1) & self.mask

    cdef int _touch(self, object key, double used) except -1:
        """`key` used at `used`, at the newest end."""
        cdef uint64_t k0, k1, size, h
        cdef Py_ssize_t i, spot = -1
        cdef Slot *s
        _parse_key(key, &k0, &k1, &size, &h)
        i = <Py_ssize_t>(h & <uint64_t>self.mask)
        while True:
            s = &self.slots[i]
            if s.key == NULL:
                break
            if s.key == GONE:
                if spot < 0:
                    spot = i
            elif self._same(s, k0, k1, size, key):
                s.used = used
                self._append(i)
                return 0
            i = (i + 1) & self.mask
        if spot < 0:
            if (self.filled + 1) * 4 > (self.mask + 1) * 3:
                self._rebuild(self.live + 1)
                return self._touch(key, used)
            spot = i
            self.filled += 1
        s = &self.slots[spot]
        Py_INCREF(key)
        s.key = <PyObject *>key
        s.k0 = k0
        s.k1 = k1
        s.used = used
        s.meta = size
        self.live += 1
        self._append(spot)
        return 0

    cdef inline void _remove(self, Py_ssize_t i):
        cdef Slot *s = &self.slots[i]
        cdef PyObject *key = s.key
        s.key = GONE
        self.live -= 1
        Py_DECREF(<object>key)

    # -- the order -------------------------------------------------------------------------

    cdef inline bint _current(self, Py_ssize_t at):
        cdef Touch *t = &self.log[at]
        cdef Slot *s = &self.slots[t.slot]
        return live(s) and stamp_of(s) == t.stamp

    cdef int _append(self, Py_ssize_t slot) except -1:
        cdef Slot *s = &self.slots[slot]
        if self.tail == self.log_cap:
            self._compact()
        s.meta = (self.next_stamp << SIZE_BITS) | (s.meta & SIZE_MASK)
        self.log[self.tail].slot = slot
        self.log[self.tail].stamp = self.next_stamp
        self.next_stamp += 1
        self.tail += 1
        return 0

    cdef int _compact(self) except -1:
        """The log's current entries to its start, in order; doubled when still half full."""
        cdef Py_ssize_t at, kept = 0
        cdef Touch *grown
        for at in range(self.head, self.tail):
            if self._current(at):
                self.log[kept] = self.log[at]
                kept += 1
        self.head = 0
        self.tail = kept
        if kept * 2 > self.log_cap:
            grown = <Touch *>realloc(self.log, 2 * self.log_cap * sizeof(Touch))
            if grown == NULL:
                raise MemoryError()
            self.log = grown
            self.log_cap *= 2
        return 0

    cdef int _rebuild(self, Py_ssize_t need) except -1:
        """A table for `need` keys at most half full, without the emptied slots: the live
        keys placed again in order of the log (their stamps kept), the log compacted to them."""
        cdef Py_ssize_t size = 8, at, i, kept = 0
        cdef Slot *old = self.slots
        cdef Slot *fresh
        cdef Slot *s
        while size < need * 2:
            size *= 2
        fresh = <Slot *>malloc(size * sizeof(Slot))
        if fresh == NULL:
            raise MemoryError()
        memset(fresh, 0, size * sizeof(Slot))
        for at in range(self.head, self.tail):
            if not self._current(at):
                continue
            s = &old[self.log[at].slot]
            i = <Py_ssize_t>(_hash(s.k0, s.k1, s.meta & SIZE_MASK, <object>s.key)
                             & <uint64_t>(size - 1))
            while fresh[i].key != NULL:
                i = (i + 1) & (size - 1)
            fresh[i] = s[0]
            self.log[kept].slot = i
            self.log[kept].stamp = stamp_of(s)
            kept += 1
        self.slots = fresh
        self.mask = size - 1
        self.filled = kept
        self.head = 0
        self.tail = kept
        free(old)
        return 0

    cdef inline Py_ssize_t _oldest(self):
        """The log position of the least recent key (self.live > 0), stale entries passed."""
        while not self._current(self.head):
            self.head += 1
        return self.head

    # -- OrderedLru's methods --------------------------------------------------------------

    def get(self, key, default=None):
        cdef Py_ssize_t i = self._find(key)
        return default if i < 0 else self.slots[i].used

    def touch_chain(self, hashes, double now):
        """Every block used `now`, moved to the newest end tail first."""
        cdef Py_ssize_t i
        cdef list blocks = hashes if type(hashes) is list else list(hashes)
        for i in range(len(blocks) - 1, -1, -1):
            self._touch(blocks[i], now)

    def walk(self, hashes, double expired_before, double first_used):
        """The leading depth of `hashes` held and live, and the last use of the deepest."""
        cdef Py_ssize_t i, n, depth = 0, at
        cdef double last = first_used
        cdef list blocks = hashes if type(hashes) is list else list(hashes)
        n = len(blocks)
        for i in range(n):
            at = self._find(blocks[i])
            if at < 0 or self.slots[at].used <= expired_before:
                break
            depth += 1
            last = self.slots[at].used
        return depth, last

    def bisect(self, hashes, double expired_before, double first_used):
        """`cachemap.memory.OrderedLru.bisect`."""
        cdef list blocks = hashes if type(hashes) is list else list(hashes)
        cdef Py_ssize_t end = len(blocks), held = 1, missing, mid, at
        cdef double last = first_used
        at = self._find(blocks[end - 1])
        if at >= 0 and self.slots[at].used > expired_before:
            return end, self.slots[at].used
        missing = end - 1
        while held < missing:
            mid = (held + missing) // 2
            at = self._find(blocks[mid])
            if at >= 0 and self.slots[at].used > expired_before:
                held = mid + 1
                last = self.slots[at].used
            else:
                missing = mid
        return held, last

    def trim(self, Py_ssize_t capacity, double expired_before):
        """Drop the least recent entries while more than `capacity` are held or the least
        recent was used at or before `expired_before`."""
        cdef Py_ssize_t at
        while self.live:
            at = self._oldest()
            if self.live <= capacity and self.slots[self.log[at].slot].used > expired_before:
                break
            self._remove(self.log[at].slot)
            self.head += 1

    def discard_all(self, hashes):
        cdef Py_ssize_t at
        for key in hashes:
            at = self._find(key)
            if at >= 0:
                self._remove(at)

    def release(self, Py_ssize_t budget):
        """Drop up to `budget` entries, newest first; how many were dropped."""
        cdef Py_ssize_t done = 0
        while self.live and done < budget:
            self.tail -= 1
            if self._current(self.tail):
                self._remove(self.log[self.tail].slot)
                done += 1
        return done

    def newest_first(self, since_s=None):
        """(key, last use) newest first; with `since_s`, those used at or after it."""
        cdef Py_ssize_t at
        cdef Slot *s
        cdef double since = float("-inf") if since_s is None else since_s
        cdef list out = []
        for at in range(self.tail - 1, self.head - 1, -1):
            if not self._current(at):
                continue
            s = &self.slots[self.log[at].slot]
            if s.used < since:
                break
            out.append((<object>s.key, s.used))
        return out


cdef struct Rec:
    uint64_t k0  # the key's first 16 bytes, zero padded
    uint64_t k1
    PyObject *key  # NULL: never used; GONE: emptied; else a reference held
    PyObject *parent  # NULL: none (a chain's first, or not held); else a reference held
    uint32_t mask  # the tiers holding the key; 0: not held (broken when it has children)
    uint32_t size  # the key's length (LONG: longer than 16)
    Py_ssize_t children  # held children of the key on the domain


cdef inline bint _rec_is(Rec *r, uint64_t k0, uint64_t k1, uint64_t size, object key):
    return (r.k0 == k0 and r.k1 == k1 and r.size == size
            and (size != LONG or (
                PyBytes_GET_SIZE(<object>r.key) == PyBytes_GET_SIZE(key)
                and memcmp(PyBytes_AS_STRING(<object>r.key), PyBytes_AS_STRING(key),
                           PyBytes_GET_SIZE(key)) == 0)))


cdef struct Parsed:
    uint64_t k0
    uint64_t k1
    uint64_t size
    uint64_t h


cdef struct Eng:
    uint64_t eh  # the engine hash's 64 bits (two's complement when negative)
    uint64_t k0  # the own key's first 16 bytes, zero padded
    uint64_t k1
    PyObject *long_key  # the own key when longer than 16 bytes (a reference held), else NULL
    uint8_t state  # EMPTY, LIVE or EMPTIED
    uint8_t neg  # the engine hash was negative (SGLang's signed hashes)
    uint8_t size  # the own key's length (LONG: longer than 16)


cdef enum:
    EMPTY = 0
    LIVE = 1
    EMPTIED = 2


cdef struct EngineInt:
    uint64_t eh
    uint8_t neg
    uint8_t is_int  # an int in [-2**63, 2**64): kept in the table, else in the dict


cdef extern from *:
    """
    #include <Python.h>
    #include <stdint.h>
    /* 1 when `o` is an int in [-2**63, 2**64): `*eh` its 64 bits (two's complement below 0),
       `*neg` whether it is below 0; else 0 (another type, or past 64 bits). The sign and the
       bit count are read in O(1) and the bits by the mask, where CPython exports them (3.11 to
       3.13: `PyLong_AsUnsignedLongLong` of a hash past 2**63 went through `_PyLong_AsByteArray`,
       ~200 instructions); else by the public calls, an overflow cleared. */
    static int kvg_engine_int(PyObject *o, uint64_t *eh, uint8_t *neg) {
        if (!PyLong_Check(o))
            return 0;
    #if PY_VERSION_HEX < 0x030E0000
        {
            int sign = _PyLong_Sign(o);
            size_t bits = _PyLong_NumBits(o);
            if (bits == (size_t)-1) {
                PyErr_Clear();
                return 0;
            }
            if (bits > 64)
                return 0;
            *eh = (uint64_t)PyLong_AsUnsignedLongLongMask(o);
            *neg = sign < 0;
            /* below 0 with 64 bits: only -2**63 fits */
            return sign >= 0 || bits < 64 || *eh == 0x8000000000000000ULL;
        }
    #else
        {
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
            unsigned long long u;
            if (overflow == 0) {
                *eh = (uint64_t)v;
                *neg = v < 0;
                return 1;
            }
            if (overflow < 0)
                return 0;
            u = PyLong_AsUnsignedLongLong(o);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            *eh = (uint64_t)u;
            *neg = 0;
            return 1;
        }
    #endif
    }
    """
    int kvg_engine_int(object o, uint64_t *eh, uint8_t *neg)


cdef inline int _engine_int(object o, EngineInt *out) except -1:
    """Whether `o` is an int the engine table keeps (in [-2**63, 2**64); bool as int, as a
    dict's key equals it), its 64 bits and sign in `out` (`kvg_engine_int`)."""
    out.is_int = <uint8_t>kvg_engine_int(o, &out.eh, &out.neg)
    return 0


cdef inline uint64_t _engine_hash(uint64_t eh, uint8_t neg) nogil:
    return kvg_fmix64(eh ^ (0x9E3779B97F4A7C15ULL if neg else 0))


cdef inline Py_ssize_t _rebuilt_size(Py_ssize_t filled, Py_ssize_t live, Py_ssize_t mask,
                                     Py_ssize_t extra):
    """The slots an open-addressed table of `mask + 1` (`filled` used, `live` of them still
    live) is rebuilt with to take `extra` more: 0 while they fit under 3/4, else the smallest
    power of two (from 8) that leaves it at most half full."""
    cdef Py_ssize_t size = 8
    if (filled + extra) * 4 <= (mask + 1) * 3:
        return 0
    while size < (live + extra) * 2:
        size *= 2
    return size


cdef void *_zeroed(size_t nbytes) except NULL:
    """`nbytes` of zeroed memory (the caller frees it)."""
    cdef void *p = malloc(nbytes)
    if p == NULL:
        raise MemoryError()
    memset(p, 0, nbytes)
    return p


cdef inline bint _broken(Rec *r):
    return r.mask == 0 and r.children > 0


cdef class DomainTable:
    """`cachemap.events.DomainMaps`: a domain's held masks, parents and held-children counts in
    one record a key (an open-addressing table, linear probing, at most 3/4 full counting the
    emptied records), and the engine hash -> own key map in a second table (`Eng`: an int
    hash's 64 bits beside the key's 16 bytes, no object a block; a hash that is no such int,
    bytes, in a dict). A key is broken when its record has held children and no tier, so no set
    is kept for it. A store or a removal is one loop over the event's blocks: a probe of each
    table a block (two for a removal's parent), its slots fetched ahead, against a dict
    operation a map a block (~5) on the pure form's five maps."""

    cdef Rec *recs
    cdef Py_ssize_t mask  # len(recs) - 1, a power of two minus one
    cdef Py_ssize_t live  # records in use (held, or broken)
    cdef Py_ssize_t filled  # records in use or emptied
    cdef Py_ssize_t nheld
    cdef Py_ssize_t nbroken
    cdef Eng *engs
    cdef Py_ssize_t eng_mask  # len(engs) - 1
    cdef Py_ssize_t eng_live
    cdef Py_ssize_t eng_filled  # live or emptied
    cdef dict other  # engine hashes the table does not keep (bytes, ints past 64 bits)

    def __cinit__(self):
        self.recs = <Rec *>malloc(8 * sizeof(Rec))
        self.engs = <Eng *>malloc(8 * sizeof(Eng))
        if self.recs == NULL or self.engs == NULL:
            raise MemoryError()
        memset(self.recs, 0, 8 * sizeof(Rec))
        memset(self.engs, 0, 8 * sizeof(Eng))
        self.mask = 7
        self.eng_mask = 7
        self.other = {}

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.recs != NULL:
            for i in range(self.mask + 1):
                self._release(&self.recs[i])
            free(self.recs)
        if self.engs != NULL:
            for i in range(self.eng_mask + 1):
                if self.engs[i].state == LIVE and self.engs[i].long_key != NULL:
                    Py_DECREF(<object>self.engs[i].long_key)
            free(self.engs)

    cdef inline void _release(self, Rec *r):
        """Let go of the record's references (it is being freed or emptied)."""
        if r.key != NULL and r.key != GONE:
            Py_DECREF(<object>r.key)
            if r.parent != NULL:
                Py_DECREF(<object>r.parent)
            r.parent = NULL

    def __len__(self):
        return self.nheld

    # -- the table -------------------------------------------------------------------------

    cdef Rec *_find(self, object key) except? NULL:
        """The record of `key`, or NULL."""
        cdef uint64_t k0, k1, size, h
        _parse_key(key, &k0, &k1, &size, &h)
        return self._find_parsed(key, k0, k1, size, h)

    cdef Rec *_find_parsed(self, object key, uint64_t k0, uint64_t k1, uint64_t size,
                           uint64_t h):
        """`_find` of a key `_parse_key` has read (`key` read only when LONG)."""
        cdef Py_ssize_t i = <Py_ssize_t>(h & <uint64_t>self.mask)
        cdef Rec *r
        while True:
            r = &self.recs[i]
            if r.key == NULL:
                return NULL
            if r.key != GONE and _rec_is(r, k0, k1, size, key):
                return r
            i = (i + 1) & self.mask

    cdef Rec *_get(self, object key) except NULL:
        """The record of `key`, made (no tier, no children) when it has none; room for it
        must have been reserved (`_reserve`)."""
        cdef uint64_t k0, k1, size, h
        _parse_key(key, &k0, &k1, &size, &h)
        return self._get_parsed(key, k0, k1, size, h)

    cdef Rec *_get_parsed(self, object key, uint64_t k0, uint64_t k1, uint64_t size,
                          uint64_t h) except NULL:
        """`_get` of a key `_parse_key` has read."""
        cdef Py_ssize_t i, spot = -1
        cdef Rec *r
        i = <Py_ssize_t>(h & <uint64_t>self.mask)
        while True:
            r = &self.recs[i]
            if r.key == NULL:
                break
            if r.key == GONE:
                if spot < 0:
                    spot = i
            elif _rec_is(r, k0, k1, size, key):
                return r
            i = (i + 1) & self.mask
        if spot < 0:
            spot = i
            self.filled += 1
        r = &self.recs[spot]
        Py_INCREF(key)
        r.key = <PyObject *>key
        r.parent = NULL
        r.k0 = k0
        r.k1 = k1
        r.size = <uint32_t>size
        r.mask = 0
        r.children = 0
        self.live += 1
        return r

    cdef inline void _drop(self, Rec *r):
        """Empty a record (no tier, no children left)."""
        self._release(r)
        r.key = GONE
        self.live -= 1

    cdef int _reserve(self, Py_ssize_t extra) except -1:
        """Room for `extra` more records without growing: rebuilt without the emptied records
        to at most half full when they would pass 3/4."""
        cdef Py_ssize_t size = _rebuilt_size(self.filled, self.live, self.mask, extra), i, j
        cdef Rec *old = self.recs
        cdef Rec *fresh
        cdef Rec *r
        if size == 0:
            return 0
        fresh = <Rec *>_zeroed(size * sizeof(Rec))
        for i in range(self.mask + 1):
            r = &old[i]
            if r.key == NULL or r.key == GONE:
                continue
            j = <Py_ssize_t>(_hash(r.k0, r.k1, r.size, <object>r.key) & <uint64_t>(size - 1))
            while fresh[j].key != NULL:
                j = (j + 1) & (size - 1)
            fresh[j] = r[0]
        free(old)
        self.recs = fresh
        self.mask = size - 1
        self.filled = self.live
        return 0

    cdef int _leave(self, Rec *r) except -1:
        """The domain no longer holds `r`'s key: its parent has a held child fewer (emptied
        when that leaves it neither held nor broken), and the key stays as broken while it has
        held children."""
        cdef PyObject *parent = r.parent
        cdef Rec *p
        r.mask = 0
        r.parent = NULL
        self.nheld -= 1
        if parent != NULL:
            p = self._find(<object>parent)
            Py_DECREF(<object>parent)
            if p != NULL:
                if _broken(p):
                    self.nbroken -= 1
                p.children -= 1
                if p.children <= 0:
                    p.children = 0
                    if p.mask == 0:
                        self._drop(p)
                elif _broken(p):
                    self.nbroken += 1
        if r.children > 0:
            self.nbroken += 1
        else:
            self._drop(r)
        return 0

    # -- the engine hashes -----------------------------------------------------------------

    cdef Eng *_eng_find(self, uint64_t eh, uint8_t neg) nogil:
        """The live slot of engine hash (eh, neg), or NULL."""
        cdef Py_ssize_t i = <Py_ssize_t>(_engine_hash(eh, neg) & <uint64_t>self.eng_mask)
        cdef Eng *e
        while True:
            e = &self.engs[i]
            if e.state == EMPTY:
                return NULL
            if e.state == LIVE and e.eh == eh and e.neg == neg:
                return e
            i = (i + 1) & self.eng_mask

    cdef inline void _eng_prefetch(self, uint64_t eh, uint8_t neg) nogil:
        KVG_PREFETCH(&self.engs[<Py_ssize_t>(_engine_hash(eh, neg) & <uint64_t>self.eng_mask)])

    cdef int _eng_reserve(self, Py_ssize_t extra) except -1:
        """Room for `extra` more hashes without growing: rebuilt without the emptied slots to
        at most half full when they would pass 3/4."""
        cdef Py_ssize_t size = _rebuilt_size(self.eng_filled, self.eng_live, self.eng_mask, extra)
        cdef Py_ssize_t i, j
        cdef Eng *old = self.engs
        cdef Eng *fresh
        if size == 0:
            return 0
        fresh = <Eng *>_zeroed(size * sizeof(Eng))
        for i in range(self.eng_mask + 1):
            if old[i].state != LIVE:
                continue
            j = <Py_ssize_t>(_engine_hash(old[i].eh, old[i].neg) & <uint64_t>(size - 1))
            while fresh[j].state != EMPTY:
                j = (j + 1) & (size - 1)
            fresh[j] = old[i]
        free(old)
        self.engs = fresh
        self.eng_mask = size - 1
        self.eng_filled = self.eng_live
        return 0

    cdef int _eng_put(self, uint64_t eh, uint8_t neg, Parsed *k, object key) except -1:
        """Engine hash (eh, neg) -> `key` (parsed as `k`); room reserved (`_eng_reserve`)."""
        cdef Py_ssize_t i = <Py_ssize_t>(_engine_hash(eh, neg) & <uint64_t>self.eng_mask)
        cdef Py_ssize_t spot = -1
        cdef Eng *e
        while True:
            e = &self.engs[i]
            if e.state == EMPTY:
                break
            if e.state == EMPTIED:
                if spot < 0:
                    spot = i
            elif e.eh == eh and e.neg == neg:
                if e.long_key != NULL:
                    Py_DECREF(<object>e.long_key)
                    e.long_key = NULL
                break
            i = (i + 1) & self.eng_mask
        if e.state != LIVE:
            if spot < 0:
                spot = i
                self.eng_filled += 1
            e = &self.engs[spot]
            e.state = LIVE
            e.eh = eh
            e.neg = neg
            e.long_key = NULL
            self.eng_live += 1
        e.k0 = k.k0
        e.k1 = k.k1
        e.size = <uint8_t>k.size
        if k.size == LONG:
            Py_INCREF(key)
            e.long_key = <PyObject *>key
        return 0

    cdef inline void _eng_drop(self, Eng *e):
        if e.long_key != NULL:
            Py_DECREF(<object>e.long_key)
            e.long_key = NULL
        e.state = EMPTIED
        self.eng_live -= 1

    cdef inline object _eng_key(self, Eng *e):
        """The own key of a live slot, as bytes."""
        cdef uint8_t pad[16]
        if e.size == LONG:
            return <object>e.long_key
        memcpy(pad, &e.k0, 8)
        memcpy(pad + 8, &e.k1, 8)
        return PyBytes_FromStringAndSize(<char *>pad, e.size)

    cdef inline Rec *_eng_rec(self, Eng *e):
        """The record of a live slot's key, or NULL."""
        cdef object key = <object>e.long_key if e.size == LONG else None
        return self._find_parsed(key, e.k0, e.k1, e.size, _hash(e.k0, e.k1, e.size, key))

    cdef object _engine_get(self, object engine_hash, bint pop):
        """The own key of `engine_hash` (None: unknown), its entry dropped when `pop`."""
        cdef EngineInt parsed
        cdef Eng *e
        _engine_int(engine_hash, &parsed)
        if not parsed.is_int:
            return self.other.pop(engine_hash, None) if pop else self.other.get(engine_hash)
        e = self._eng_find(parsed.eh, parsed.neg)
        if e == NULL:
            return None
        key = self._eng_key(e)
        if pop:
            self._eng_drop(e)
        return key

    # -- DomainMaps's methods --------------------------------------------------------------

    def mask_of(self, key):
        cdef Rec *r = self._find(key)
        return r.mask if r != NULL else 0

    cdef Parsed *_parse_all(self, list keys) except NULL:
        """Every key of `keys` read (`_parse_key`) and its record's slot fetched, into an array
        the caller frees: a chain's records are scattered over a table bigger than the caches,
        so a probe a key in turn waited for a miss a key (~0.2 us each, caches cold), where
        fetched ahead their misses overlap."""
        cdef Py_ssize_t n = len(keys), i
        cdef Parsed *parsed = <Parsed *>malloc((n if n else 1) * sizeof(Parsed))
        if parsed == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                _parse_key(keys[i], &parsed[i].k0, &parsed[i].k1, &parsed[i].size, &parsed[i].h)
                KVG_PREFETCH(&self.recs[<Py_ssize_t>(parsed[i].h & <uint64_t>self.mask)])
        except BaseException:
            free(parsed)
            raise
        return parsed

    def masks(self, keys):
        cdef list chain = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t i
        cdef list out = []
        cdef Rec *r
        cdef Parsed *parsed = self._parse_all(chain)
        try:
            for i in range(len(chain)):
                r = self._find_parsed(chain[i], parsed[i].k0, parsed[i].k1, parsed[i].size,
                                      parsed[i].h)
                out.append(r.mask if r != NULL else 0)
        finally:
            free(parsed)
        return out

    def holds(self, key):
        cdef Rec *r = self._find(key)
        return r != NULL and r.mask != 0

    def holds_any(self, keys):
        cdef list chain = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t i
        cdef Rec *r
        cdef Parsed *parsed = self._parse_all(chain)
        try:
            for i in range(len(chain)):
                r = self._find_parsed(chain[i], parsed[i].k0, parsed[i].k1, parsed[i].size,
                                      parsed[i].h)
                if r != NULL and r.mask != 0:
                    return True
        finally:
            free(parsed)
        return False

    def held_run(self, keys):
        cdef Py_ssize_t low = 0, high = len(keys), mid, i
        cdef Rec *r
        cdef list chain
        cdef Parsed *parsed
        if self.nbroken:
            chain = keys if type(keys) is list else list(keys)
            parsed = self._parse_all(chain)
            try:
                for i in range(len(chain)):
                    r = self._find_parsed(chain[i], parsed[i].k0, parsed[i].k1, parsed[i].size,
                                          parsed[i].h)
                    if r != NULL and _broken(r):
                        return None
            finally:
                free(parsed)
        while low < high:
            mid = (low + high) // 2
            r = self._find(keys[mid])
            if r != NULL and r.mask != 0:
                low = mid + 1
            else:
                high = mid
        return low

    def own_key(self, engine_hash):
        return self._engine_get(engine_hash, False)

    def hold(self, engine_hashes, list keys, uint32_t tier, object parent):
        """Each key i held on `tier` under engine hash i; a key newly held is a held child
        more of its parent (the first key's is `parent`). How many keys are new on `tier`."""
        cdef list hashes = engine_hashes if type(engine_hashes) is list else list(engine_hashes)
        cdef Py_ssize_t n = len(keys) if len(keys) < len(hashes) else len(hashes)
        cdef Py_ssize_t i, new = 0
        cdef Rec *r
        cdef Rec *prev = NULL
        cdef object key
        cdef object prev_key = parent
        cdef uint32_t m
        cdef Parsed *parsed
        cdef EngineInt *ehs
        self._reserve(n + 1)
        self._eng_reserve(n)
        if parent is not None and n:
            prev = self._find(parent)  # made only when a key is newly held under it
        # every key and engine hash read and their slots fetched first: the chain's slots are
        # scattered over tables bigger than the caches, so their misses overlap instead of
        # coming one a block
        parsed = <Parsed *>malloc((n if n else 1) * sizeof(Parsed))
        ehs = <EngineInt *>malloc((n if n else 1) * sizeof(EngineInt))
        if parsed == NULL or ehs == NULL:
            free(parsed)
            free(ehs)
            raise MemoryError()
        try:
            for i in range(n):
                _parse_key(keys[i], &parsed[i].k0, &parsed[i].k1, &parsed[i].size, &parsed[i].h)
                KVG_PREFETCH(&self.recs[<Py_ssize_t>(parsed[i].h & <uint64_t>self.mask)])
                _engine_int(hashes[i], &ehs[i])
                if ehs[i].is_int:
                    self._eng_prefetch(ehs[i].eh, ehs[i].neg)
            for i in range(n):
                key = keys[i]
                r = self._get_parsed(key, parsed[i].k0, parsed[i].k1, parsed[i].size,
                                     parsed[i].h)
                m = r.mask
                if not m & tier:
                    new += 1
                if m == 0:  # newly held by the domain
                    if r.children > 0:
                        self.nbroken -= 1
                    self.nheld += 1
                    if prev_key is not None:
                        if prev == NULL:
                            prev = self._get(prev_key)
                        Py_INCREF(prev_key)
                        r.parent = <PyObject *>prev_key
                        if _broken(prev):
                            self.nbroken -= 1
                        prev.children += 1
                        if _broken(prev):
                            self.nbroken += 1
                r.mask = m | tier
                prev = r
                prev_key = key
                if ehs[i].is_int:
                    self._eng_put(ehs[i].eh, ehs[i].neg, &parsed[i], key)
                else:
                    self.other[hashes[i]] = key
        finally:
            free(parsed)
            free(ehs)
        return new

    def remove_whole(self, engine_hashes):
        """Every block of `engine_hashes` leaves whatever its tiers: (the keys that left, in
        order; how many hashes were unknown or repeats)."""
        cdef list hashes = engine_hashes if type(engine_hashes) is list else list(engine_hashes)
        cdef Py_ssize_t n = len(hashes), i
        cdef list gone = []
        cdef Py_ssize_t unknown = 0
        cdef Rec *r
        cdef Eng *e
        cdef EngineInt *ehs = <EngineInt *>malloc((n if n else 1) * sizeof(EngineInt))
        if ehs == NULL:
            raise MemoryError()
        try:
            # the hashes' slots fetched, then their keys' records, then the keys (a reference
            # given up a block), then the work: passes whose misses overlap, where one pass
            # waited for three or four a block
            for i in range(n):
                _engine_int(hashes[i], &ehs[i])
                if ehs[i].is_int:
                    self._eng_prefetch(ehs[i].eh, ehs[i].neg)
            for i in range(n):
                if ehs[i].is_int:
                    e = self._eng_find(ehs[i].eh, ehs[i].neg)
                    if e != NULL and e.size != LONG:
                        KVG_PREFETCH(&self.recs[<Py_ssize_t>(
                            _hash(e.k0, e.k1, e.size, None) & <uint64_t>self.mask)])
            for i in range(n):
                if ehs[i].is_int:
                    e = self._eng_find(ehs[i].eh, ehs[i].neg)
                    if e != NULL and e.size != LONG:
                        r = self._eng_rec(e)
                        if r != NULL:
                            KVG_PREFETCH(r.key)
            for i in range(n):
                if ehs[i].is_int:
                    e = self._eng_find(ehs[i].eh, ehs[i].neg)
                    if e == NULL:
                        unknown += 1
                        continue
                    r = self._eng_rec(e)
                    key = <object>r.key if r != NULL and r.mask != 0 else None
                    self._eng_drop(e)
                else:
                    key = self.other.pop(hashes[i], None)
                    r = self._find(key) if key is not None else NULL
                if r == NULL or r.mask == 0:
                    unknown += 1
                    continue
                gone.append(key)
                self._leave(r)
        finally:
            free(ehs)
        return gone, unknown

    def remove_tier(self, engine_hashes, uint32_t tier):
        """Each block of `engine_hashes` held on `tier` leaves it (and the domain when that
        was its last tier): (the keys that left `tier`, in order; how many hashes were
        unknown there)."""
        cdef list removed = []
        cdef Py_ssize_t unknown = 0
        cdef Rec *r
        for engine_hash in engine_hashes:
            key = self._engine_get(engine_hash, False)
            r = self._find(key) if key is not None else NULL
            if r == NULL or not r.mask & tier:
                unknown += 1
                continue
            removed.append(key)
            if r.mask & ~tier:
                r.mask &= ~tier
                continue
            self._leave(r)
            self._engine_get(engine_hash, True)
        return removed, unknown

    # -- the maps, for the invariants' tests -----------------------------------------------

    def maps(self):
        """(held masks, parents, held-children counts, engine hashes, broken keys): the pure
        form's maps (`DomainMaps.maps`), as dicts and a set."""
        cdef Py_ssize_t i
        cdef Rec *r
        cdef dict held = {}, parents = {}, children = {}
        cdef dict engine = dict(self.other)
        cdef set broken = set()
        cdef Eng *e
        for i in range(self.mask + 1):
            r = &self.recs[i]
            if r.key == NULL or r.key == GONE:
                continue
            if r.mask:
                held[<object>r.key] = r.mask
            if r.parent != NULL:
                parents[<object>r.key] = <object>r.parent
            if r.children > 0:
                children[<object>r.key] = r.children
            if _broken(r):
                broken.add(<object>r.key)
        for i in range(self.eng_mask + 1):
            e = &self.engs[i]
            if e.state == LIVE:
                engine[PyLong_FromLongLong(<long long>e.eh) if e.neg
                       else PyLong_FromUnsignedLongLong(e.eh)] = self._eng_key(e)
        return held, parents, children, engine, broken


cdef extern from *:
    """
    #include <stdlib.h>
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ && defined(__GNUC__)
    #define KVG_SWAR 1
    #define KVG_CTZ64(x) __builtin_ctzll(x)
    #define KVG_PREFETCH(p) __builtin_prefetch(p)
    #else
    #define KVG_SWAR 0
    #define KVG_CTZ64(x) 0
    #define KVG_PREFETCH(p) ((void)(p))
    #endif
    /* 64-byte-aligned memory of `size` bytes (a multiple of 64), or NULL */
    static void *kvg_alloc64(size_t size) {
        void *p = NULL;
        return posix_memalign(&p, 64, size) == 0 ? p : NULL;
    }
    """
    bint KVG_SWAR
    int KVG_CTZ64(uint64_t x) nogil
    void KVG_PREFETCH(const void *p) nogil
    void *kvg_alloc64(size_t size) nogil


cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object o)
    void *PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    int PyUnicode_KIND(object o)
    Py_UCS4 PyUnicode_READ(int kind, const void *data, Py_ssize_t index) nogil


cdef struct WordSlot:
    uint64_t hash  # 0: empty (a key's hash has its low bit set)
    uint32_t ids[8]
    uint8_t klen  # the key's length, | FIRST for a first piece
    uint8_t nids  # NOT_KEPT: its ids are not kept here (a lookup misses)
    char key[22]


cdef enum:
    WORD_KEY_BYTES = 22
    WORD_IDS = 8
    NOT_KEPT = 255
    FIRST = 0x80  # a slot's `klen` bit: a first piece, not a later one of the same characters
    KLEN_MASK = 0x7F


cdef enum:
    WORD_SEED = 0x5bd1e995

cdef uint64_t ONES = 0x0101010101010101ULL
cdef uint64_t HIGHS = 0x8080808080808080ULL


cdef inline uint64_t _word_end(uint64_t h, uint64_t k, Py_ssize_t n) nogil:
    """A word's hash from its state after its last byte (`_word_hash`)."""
    return kvg_fmix64(h ^ k ^ (<uint64_t>n * 0x9E3779B97F4A7C15ULL)) | 1


cdef inline uint64_t _word_hash(const char *s, Py_ssize_t n) nogil:
    """A word's hash, its bytes taken 8 at a time little-end first: what `tail` computes as
    it scans the word for its end (no second pass over it, no `memcpy` of a variable size:
    a libc call a word)."""
    cdef uint64_t h = WORD_SEED
    cdef uint64_t k = 0
    cdef Py_ssize_t i
    cdef int shift = 0
    for i in range(n):
        k |= <uint64_t><uint8_t>s[i] << shift
        shift += 8
        if shift == 64:
            h = kvg_fmix64(h ^ k)
            k = 0
            shift = 0
    return _word_end(h, k, n)


cdef inline bint _same(const char *a, const char *b, Py_ssize_t n) nogil:
    """`memcmp(a, b, n) == 0` for a key of up to `WORD_KEY_BYTES`, by loads of a constant size
    (the last 8 or 4 overlapping the ones before), not a libc call."""
    cdef uint64_t x, y
    cdef uint32_t u, v
    cdef Py_ssize_t i = 0
    if n >= 8:
        while i + 8 <= n:
            memcpy(&x, a + i, 8)
            memcpy(&y, b + i, 8)
            if x != y:
                return False
            i += 8
        if i < n:
            memcpy(&x, a + n - 8, 8)
            memcpy(&y, b + n - 8, 8)
            return x == y
        return True
    if n >= 4:
        memcpy(&u, a, 4)
        memcpy(&v, b, 4)
        if u != v:
            return False
        memcpy(&u, a + n - 4, 4)
        memcpy(&v, b + n - 4, 4)
        return u == v
    for i in range(n):
        if a[i] != b[i]:
            return False
    return True


cdef class WordTable:
    """One salt's pieces of the word cache's young generation (`gateway.events.words`), its
    later pieces and its first ones apart: an ASCII piece of up to 22 bytes -> its ids (up to 8 native uint32s), inline in a 64-byte
    slot, so a text's pieces are looked up straight from its characters (`tail`), no `str`
    made, hashed and compared a word. A mirror of a dict, never the only copy: a piece it
    does not keep is a miss, and the caller reads the dict then."""

    cdef WordSlot *slots
    cdef Py_ssize_t mask
    cdef Py_ssize_t used

    def __cinit__(self):
        # 512 bytes to start: a table a salt, and a tenant may send few words; a slot a cache
        # line (malloc's 16-byte alignment put most slots across two: two misses a probe)
        self.slots = <WordSlot *>kvg_alloc64(8 * sizeof(WordSlot))
        if self.slots == NULL:
            raise MemoryError()
        memset(self.slots, 0, 8 * sizeof(WordSlot))
        self.mask = 7

    def __dealloc__(self):
        free(self.slots)

    def __len__(self):
        return self.used

    cdef WordSlot *_find(self, const char *key, Py_ssize_t n, uint64_t h) nogil:
        """The slot of `key` (`n`: its length, | FIRST for a first piece), or the empty slot
        where it would go."""
        cdef Py_ssize_t i = <Py_ssize_t>(h >> 7) & self.mask
        cdef WordSlot *s
        while True:
            s = &self.slots[i]
            if s.hash == 0 or (s.hash == h and s.klen == n and _same(s.key, key, n & KLEN_MASK)):
                return s
            i = (i + 1) & self.mask

    cdef int _grow(self) except -1:
        cdef Py_ssize_t old_size = self.mask + 1
        cdef WordSlot *old = self.slots
        cdef WordSlot *s
        cdef Py_ssize_t i
        self.slots = <WordSlot *>kvg_alloc64(2 * old_size * sizeof(WordSlot))
        if self.slots == NULL:
            self.slots = old
            raise MemoryError()
        memset(self.slots, 0, 2 * old_size * sizeof(WordSlot))
        self.mask = 2 * old_size - 1
        for i in range(old_size):
            if old[i].hash != 0:
                s = self._find(old[i].key, old[i].klen, old[i].hash)
                s[0] = old[i]
        free(old)
        return 0

    def put(self, str key, bytes ids, bint first=False):
        """Keep `key`'s ids (native uint32 bytes) where they fit, as a first piece or a later
        one (apart: the same characters may be both); a key kept before with ids that do not
        fit is kept as a miss."""
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(key)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(ids)
        cdef bint fits = size % 4 == 0 and size // 4 <= WORD_IDS
        cdef const char *k
        cdef uint64_t h
        cdef WordSlot *s
        if not PyUnicode_IS_ASCII(key) or n > WORD_KEY_BYTES:
            return
        k = <const char *>PyUnicode_DATA(key)
        h = _word_hash(k, n)
        s = self._find(k, n | (FIRST if first else 0), h)
        if s.hash == 0:
            if not fits:
                return
            if (self.used + 1) * 4 > (self.mask + 1) * 3:
                self._grow()
                s = self._find(k, n | (FIRST if first else 0), h)
            self.used += 1
            s.hash = h
            s.klen = <uint8_t>(n | (FIRST if first else 0))
            memcpy(s.key, k, n)
        if fits:
            s.nids = <uint8_t>(size // 4)
            memcpy(s.ids, PyBytes_AS_STRING(ids), size)
        else:
            s.nids = NOT_KEPT

    def get(self, str key, bint first=False):
        """`key`'s ids as kept here, as a first piece or a later one (None: not kept)."""
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(key)
        cdef const char *k
        cdef WordSlot *s
        if not PyUnicode_IS_ASCII(key) or n > WORD_KEY_BYTES:
            return None
        k = <const char *>PyUnicode_DATA(key)
        s = self._find(k, n | (FIRST if first else 0), _word_hash(k, n))
        if s.hash == 0 or s.nids == NOT_KEPT:
            return None
        return PyBytes_FromStringAndSize(<char *>s.ids, 4 * s.nids)

    cdef Py_ssize_t _take(self, const char *key, Py_ssize_t n, uint64_t h, uint32_t **out,
                          Py_ssize_t *cap, Py_ssize_t count) except -2:
        """`key`'s ids (`n`: its length, | FIRST for a first piece) appended at
        `out[0][count]` (grown as needed): the new count, or -1 when it is not kept here."""
        cdef WordSlot *s = self._find(key, n, h)
        if s.hash == 0 or s.nids == NOT_KEPT:
            return -1
        if count + WORD_IDS > cap[0]:
            cap[0] = 2 * cap[0] + WORD_IDS
            out[0] = <uint32_t *>realloc_or_free(out[0], cap[0] * sizeof(uint32_t))
            if out[0] == NULL:
                raise MemoryError()
        memcpy(out[0] + count, s.ids, 4 * WORD_IDS)  # a constant size: no libc call
        return count + s.nids

    def tail(self, str text):
        """For a text every space of which is a cut (`gateway.events.words._every_space_cuts`:
        printable ASCII, no two spaces in a row, none at its end) of two pieces or more, each
        later one kept here: (where its first piece ends, the later pieces' ids joined, its
        pieces), or (0, every piece's ids joined, its pieces) when its first piece is kept
        here too (as a first piece; as the later piece after its space when it opens with
        one); else None.

        One pass over the characters: each later piece's bytes are checked and hashed as its
        end is sought (a check of the whole text first, then a scan a word and a hash a word,
        read every byte three times: ~1/3 of keying bench point 2's prompts, py-spy)."""
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
        cdef const char *p
        cdef Py_ssize_t i, start, first_end
        cdef uint8_t c
        cdef uint64_t h, k, w, special
        cdef int shift, at
        cdef uint32_t *out
        cdef Py_ssize_t count = 0
        cdef Py_ssize_t pieces = 1
        cdef Py_ssize_t cap
        cdef Py_ssize_t last = 0
        cdef uint64_t last_h = 0
        cdef Py_ssize_t head_at, head_n
        cdef object result
        if n == 0 or not PyUnicode_IS_ASCII(text):
            return None
        p = <const char *>PyUnicode_DATA(text)
        if p[n - 1] == b' ':
            return None
        # the first piece: up to the first space, or the second when the text opens with one
        i = 0
        if p[0] == b' ':
            if n < 2 or p[1] == b' ':
                return None
            i = 1
        while i < n:
            c = <uint8_t>p[i]
            if c == 0x20:
                break
            if c < 0x20 or c > 0x7E:
                return None
            i += 1
        if i == n:
            return None
        first_end = i
        cap = n // 2 + 2 * WORD_IDS
        out = <uint32_t *>malloc(cap * sizeof(uint32_t))
        if out == NULL:
            raise MemoryError()
        try:
            # the first piece's ids first, where kept: " x" is the later piece "x"
            head_at = 1 if p[0] == b' ' else 0
            head_n = first_end - head_at
            if head_n <= WORD_KEY_BYTES:
                count = self._take(p + head_at, head_n | (0 if head_at else FIRST),
                                   _word_hash(p + head_at, head_n), &out, &cap, 0)
                if count < 0:
                    count = 0
                else:
                    first_end = 0
            while i < n:  # p[i] is a space, and a character follows it
                start = i + 1
                i = start
                h = WORD_SEED
                k = 0
                shift = 0
                while KVG_SWAR and i + 8 <= n:  # 8 bytes a step: a word's end found at once
                    memcpy(&w, p + i, 8)
                    # the lowest byte < 0x21 or == 0x7F (every byte is ASCII): a borrow or a
                    # carry only ever reaches bytes above a flagged one
                    special = ((w - ONES * 0x21) & ~w | (w + ONES)) & HIGHS
                    if special == 0:
                        h = kvg_fmix64(h ^ w)
                        i += 8
                        continue
                    at = KVG_CTZ64(special) >> 3
                    if at:
                        k = w & ((<uint64_t>1 << (8 * at)) - 1)
                        shift = 8 * at
                    i += at
                    if p[i] != b' ':
                        return None
                    break
                while i < n:
                    c = <uint8_t>p[i]
                    if c == 0x20:
                        break
                    if c < 0x20 or c > 0x7E:
                        return None
                    k |= <uint64_t>c << shift
                    shift += 8
                    if shift == 64:
                        h = kvg_fmix64(h ^ k)
                        k = 0
                        shift = 0
                    i += 1
                if i == start or i - start > WORD_KEY_BYTES:
                    return None  # two spaces in a row; a piece no slot keeps
                # the probe a word late: its slot fetched while the next word is scanned
                h = _word_end(h, k, i - start)
                KVG_PREFETCH(&self.slots[<Py_ssize_t>(h >> 7) & self.mask])
                if pieces > 1:
                    count = self._take(p + last, start - 1 - last, last_h, &out, &cap, count)
                    if count < 0:
                        return None
                last, last_h = start, h
                pieces += 1
            if pieces > 1:
                count = self._take(p + last, n - last, last_h, &out, &cap, count)
                if count < 0:
                    return None
            result = PyBytes_FromStringAndSize(<char *>out, 4 * count)
        finally:
            free(out)
        return first_end, result, pieces


cdef inline void *realloc_or_free(void *p, size_t size) nogil:
    """`realloc`, freeing `p` when it fails (NULL then)."""
    cdef void *q = realloc(p, size)
    if q == NULL:
        free(p)
    return q


def common_prefix(str a, str b):
    """`gateway.events.texts.common_prefix`: the length of the longest common prefix of `a`
    and `b`. Two texts of one kind (bytes a character: CPython stores a text in the fewest that
    hold its widest character) are compared 8 bytes a step, the first differing byte found by
    its lowest set bit; texts of two kinds character by character."""
    cdef Py_ssize_t n = min(PyUnicode_GET_LENGTH(a), PyUnicode_GET_LENGTH(b))
    cdef int kind = PyUnicode_KIND(a)
    cdef const uint8_t *pa = <const uint8_t *>PyUnicode_DATA(a)
    cdef const uint8_t *pb = <const uint8_t *>PyUnicode_DATA(b)
    cdef Py_ssize_t i = 0, size
    cdef uint64_t x, y
    if kind != PyUnicode_KIND(b):
        while i < n and PyUnicode_READ(kind, pa, i) == PyUnicode_READ(PyUnicode_KIND(b), pb, i):
            i += 1
        return i
    size = n * kind
    while KVG_SWAR and i + 8 <= size:
        memcpy(&x, pa + i, 8)
        memcpy(&y, pb + i, 8)
        if x != y:
            return (i + (KVG_CTZ64(x ^ y) >> 3)) // kind
        i += 8
    while i < size and pa[i] == pb[i]:
        i += 1
    return i // kind


cdef array.array U32_TEMPLATE = array.array("I")


cdef inline bint _be(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end, int size,
                     uint64_t *out) noexcept nogil:
    """The `size`-byte big-endian unsigned integer at `p[pos]` (advancing `pos`), or False
    when the buffer ends first."""
    cdef uint64_t v = 0
    cdef int i
    if end - pos[0] < size:
        return False
    for i in range(size):
        v = (v << 8) | p[pos[0] + i]
    pos[0] += size
    out[0] = v
    return True


def unpack_u32(raw):
    """`gateway.events.decode.unpack_u32`: a msgpack array of integers in 0..2**32-1 (true
    and false as 1 and 0), read from its bytes into an `array("I")`; None for anything
    else. No int object made a token (msgspec's decode made ~12k a request at bench point 2,
    ~80% of the batches' decode)."""
    cdef const uint8_t[::1] view = raw
    cdef const uint8_t *p = &view[0] if view.shape[0] > 0 else NULL
    cdef Py_ssize_t end = view.shape[0]
    cdef Py_ssize_t pos = 1
    cdef Py_ssize_t n, i
    cdef uint64_t v
    cdef uint8_t b
    cdef array.array out
    cdef uint32_t *ids
    if end == 0:
        return None
    b = p[0]
    if 0x90 <= b <= 0x9f:
        n = b & 0x0f
    elif b == 0xdc:
        if not _be(p, &pos, end, 2, &v):
            return None
        n = <Py_ssize_t>v
    elif b == 0xdd:
        if not _be(p, &pos, end, 4, &v):
            return None
        n = <Py_ssize_t>v
    else:
        return None
    if n > end - pos:  # every element takes a byte at least
        return None
    out = array.clone(U32_TEMPLATE, n, False)
    ids = out.data.as_uints
    for i in range(n):
        if pos >= end:
            return None
        b = p[pos]
        pos += 1
        if b <= 0x7f:
            v = b
        elif b == 0xc2 or b == 0xc3:  # false, true
            v = b - 0xc2
        elif 0xcc <= b <= 0xcf:  # uint 8, 16, 32, 64
            if not _be(p, &pos, end, 1 << (b - 0xcc), &v) or v >> 32:
                return None
        elif 0xd0 <= b <= 0xd3:  # int 8, 16, 32, 64: a negative one has its top bit set
            if not _be(p, &pos, end, 1 << (b - 0xd0), &v):
                return None
            if v >> ((8 << (b - 0xd0)) - 1) or v >> 32:
                return None
        else:
            return None
        ids[i] = <uint32_t>v
    if pos != end:  # bytes after the array: not one msgpack object
        return None
    return out
