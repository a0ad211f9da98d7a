/*
 * The byte-plane codec's per-block work in single calls that drop the GIL once (private;
 * see s3kv/_planes.py, which owns the wire format and the Python code these must match
 * byte for byte).
 *
 * Why it exists: the Python encoder makes about ten calls that drop and retake the GIL per
 * block (a numpy shift, a zstd frame per plane chunk, a strided copy per low plane), the
 * grouped decoder three (a libzstd call, two numpy merges). With eight codec threads every
 * retake is a hand-off between threads, and the hand-offs, not the coding, bound how far
 * threads scale. Here the encoder's split into planes, probe, Huffman-only frames and raw
 * frames are one call, and so are the decoder's libzstd call and merge.
 *
 * libzstd is not linked: the caller passes the addresses of ZSTD_compressSequencesAndLiterals
 * and ZSTD_decompressDCtx in the libzstd that python-zstandard's cffi module carries, and
 * contexts it configured (compression level 1, explicit block delimiters), so the kernel
 * and the Python code use the same library and settings and write the same bytes.
 *
 * Built against the limited API of CPython 3.11 (Py_buffer is in it from 3.11), so one
 * build serves every later CPython; where it is not built, s3kv uses the Python encoder.
 */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030B0000
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* libzstd's ZSTD_Sequence (zstd.h, experimental API). */
typedef struct {
    unsigned int offset;
    unsigned int litLength;
    unsigned int matchLength;
    unsigned int rep;
} Sequence;

typedef size_t (*DecompressDCtx)(void *dctx, void *dst, size_t dst_capacity, const void *src,
                                 size_t src_size);

typedef size_t (*CompressSequencesAndLiterals)(void *cctx, void *dst, size_t dst_capacity,
                                               const Sequence *sequences, size_t count,
                                               const void *literals, size_t literal_size,
                                               size_t literal_capacity,
                                               size_t decompressed_size);

/* Values mirrored from s3kv/_zstd.py, which checks them against its own at import. */
#define MAX_ENTROPY_CHUNK (256 * 1024)
#define ZSTD_BLOCK (128 * 1024)
#define LITERAL_SLACK 8
#define FRAME_BOUND (MAX_ENTROPY_CHUNK + (MAX_ENTROPY_CHUNK >> 8) + 64)
#define RAW_FRAME_PREFIX 9
#define BLOCK_HEADER 3

typedef struct {
    void *cctx;
    CompressSequencesAndLiterals compress;
    uint8_t *payload;
    size_t capacity;
    size_t at;
    size_t count;
    size_t room; /* entries of sections */
    size_t sections[];
} Writer;

/* Status codes of encode(): 0 is success. */
enum { OK = 0, NO_ROOM = 1, TOO_MANY_SECTIONS = 2 };

static void put_le(uint8_t *out, uint64_t value, int bytes) {
    for (int i = 0; i < bytes; i++) out[i] = (uint8_t)(value >> (8 * i));
}

/* Huffman-code plane[:n] as one frame at the writer's end (as ThreadZstd.entropy_frame_into:
 * one sequence of literals and no match per zstd block); its length, or 0 where that is not
 * smaller than n. */
static size_t entropy_frame(Writer *w, const uint8_t *plane, size_t n, uint8_t *dst) {
    Sequence sequences[MAX_ENTROPY_CHUNK / ZSTD_BLOCK + 1];
    size_t count = 0;
    for (size_t start = 0; start < n; start += ZSTD_BLOCK) {
        size_t left = n - start;
        sequences[count].offset = 0;
        sequences[count].litLength = (unsigned int)(left < ZSTD_BLOCK ? left : ZSTD_BLOCK);
        sequences[count].matchLength = 0;
        sequences[count].rep = 0;
        count++;
    }
    size_t size = w->compress(w->cctx, dst, FRAME_BOUND, sequences, count, plane, n,
                              n + LITERAL_SLACK, n);
    /* An error code is larger than any capacity: "incompressible", as in _zstd.py. */
    return size < n ? size : 0;
}

/* plane[:n] as a raw frame of equal zstd blocks at the writer's end (as _planes._add_raw_frame
 * writes it). */
static int raw_frame(Writer *w, const uint8_t *plane, size_t n) {
    size_t blocks = (n + ZSTD_BLOCK - 1) / ZSTD_BLOCK;
    size_t size = (n + blocks - 1) / blocks;
    size_t equal = n / size;
    size_t rest = n - equal * size;
    size_t length = RAW_FRAME_PREFIX + (equal + (rest ? 1 : 0)) * BLOCK_HEADER + n;
    if (w->at + length > w->capacity) return NO_ROOM;
    uint8_t *out = w->payload + w->at;
    static const uint8_t magic[4] = {0x28, 0xb5, 0x2f, 0xfd};
    memcpy(out, magic, 4);
    out[4] = 0xA0; /* single segment, 4-byte content size, no checksum */
    put_le(out + 5, n, 4);
    out += RAW_FRAME_PREFIX;
    for (size_t b = 0; b < equal; b++) {
        int last = !rest && b + 1 == equal;
        put_le(out, ((uint64_t)size << 3) | (uint64_t)last, BLOCK_HEADER);
        memcpy(out + BLOCK_HEADER, plane + b * size, size);
        out += BLOCK_HEADER + size;
    }
    if (rest) {
        put_le(out, ((uint64_t)rest << 3) | 1u, BLOCK_HEADER);
        memcpy(out + BLOCK_HEADER, plane + equal * size, rest);
    }
    w->at += length;
    return OK;
}

static int add_section(Writer *w, size_t length) {
    if (w->count == w->room) return TOO_MANY_SECTIONS;
    w->sections[w->count++] = length;
    return OK;
}

/* plane[:n] as a raw frame section (_planes._add_raw_frame). */
static int add_raw_frame(Writer *w, const uint8_t *plane, size_t n) {
    size_t start = w->at;
    int status = raw_frame(w, plane, n);
    return status ? status : add_section(w, w->at - start);
}

/* A Huffman frame of plane[:n], or a raw one where that is not smaller (_planes._add_plane). */
static int add_plane(Writer *w, const uint8_t *plane, size_t n) {
    if (w->at + FRAME_BOUND > w->capacity) return NO_ROOM;
    size_t size = entropy_frame(w, plane, n, w->payload + w->at);
    if (size) {
        w->at += size;
        return add_section(w, size);
    }
    return add_raw_frame(w, plane, n);
}

/* _planes.encode_planes' loop over chunks of `step` elements, without the hashing. */
static int encode(Writer *w, const uint8_t *words, size_t n, size_t step, size_t probe,
                  uint8_t *high, uint8_t *low) {
    int try_low = 0;
    if (probe) {
        /* The probe's frame goes where the first section will: overwritten before it counts. */
        if (w->at + FRAME_BOUND > w->capacity) return NO_ROOM;
        for (size_t i = 0; i < probe; i++) low[i] = words[2 * i];
        try_low = entropy_frame(w, low, probe, w->payload + w->at) > 0;
    }
    for (size_t first = 0; first < n; first += step) {
        size_t count = n - first < step ? n - first : step;
        const uint8_t *chunk = words + 2 * first;
        for (size_t i = 0; i < count; i++) {
            low[i] = chunk[2 * i];
            high[i] = chunk[2 * i + 1];
        }
        int status = add_plane(w, high, count);
        if (!status) status = try_low ? add_plane(w, low, count) : add_raw_frame(w, low, count);
        if (status) return status;
    }
    return OK;
}

static int get_address(PyObject *value, void **out, const char *name) {
    *out = PyLong_AsVoidPtr(value);
    if (*out == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: a null address", name);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(encode_planes_doc,
"encode_planes(words, payload, at, step, probe, high, low, cctx, compress) -> (end, sections)\n"
"\n"
"Little-endian 16-bit elements (``words``, bytes) as high/low byte-plane frames written\n"
"into ``payload`` from ``at``, chunk by chunk of ``step`` elements, exactly as\n"
"s3kv._planes.encode_planes writes them; the first ``probe`` elements' low bytes decide\n"
"whether low planes are Huffman-coded (0: never; at most ``step`` and the elements).\n"
"``high`` and ``low`` are scratch of\n"
"``step`` bytes plus 8; ``cctx`` and ``compress`` are the addresses of a libzstd context\n"
"(level 1, explicit block delimiters) and of its ZSTD_compressSequencesAndLiterals.\n"
"Returns the payload's new end and every section's length. Raises ValueError where\n"
"``payload`` or the scratch lacks room or an argument is out of range (a caller bug).");

static PyObject *encode_planes(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer words, payload, high, low;
    Py_ssize_t at, step, probe;
    PyObject *cctx_arg, *compress_arg;
    if (!PyArg_ParseTuple(args, "y*w*nnnw*w*OO", &words, &payload, &at, &step, &probe, &high,
                          &low, &cctx_arg, &compress_arg))
        return NULL;
    PyObject *result = NULL;
    Writer *w = NULL;
    void *cctx, *compress;
    if (get_address(cctx_arg, &cctx, "cctx") || get_address(compress_arg, &compress, "compress"))
        goto done;
    size_t n = (size_t)words.len / 2;
    if (words.len % 2 || step <= 0 || step > MAX_ENTROPY_CHUNK || probe < 0 || probe > step
        || (size_t)probe > n || at < 0
        || at > payload.len || high.len < step + LITERAL_SLACK
        || low.len < step + LITERAL_SLACK) {
        PyErr_SetString(PyExc_ValueError, "encode_planes: arguments out of range (a caller bug)");
        goto done;
    }
    size_t room = 2 * ((n + (size_t)step - 1) / (size_t)step);
    w = PyMem_Malloc(sizeof(Writer) + room * sizeof(size_t));
    if (w == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    w->cctx = cctx;
    w->compress = (CompressSequencesAndLiterals)compress;
    w->payload = payload.buf;
    w->capacity = (size_t)payload.len;
    w->at = (size_t)at;
    w->count = 0;
    w->room = room;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = encode(w, words.buf, n, (size_t)step, (size_t)probe, high.buf, low.buf);
    Py_END_ALLOW_THREADS
    if (status) {
        PyErr_SetString(PyExc_ValueError, status == NO_ROOM
                        ? "encode_planes: payload too small (a caller bug)"
                        : "encode_planes: too many sections (a caller bug)");
        goto done;
    }
    PyObject *sections = PyTuple_New((Py_ssize_t)w->count);
    if (sections == NULL) goto done;
    for (size_t i = 0; i < w->count; i++) {
        PyObject *length = PyLong_FromSize_t(w->sections[i]);
        if (length == NULL) {
            Py_DECREF(sections);
            goto done;
        }
        PyTuple_SetItem(sections, (Py_ssize_t)i, length);
    }
    result = Py_BuildValue("(nN)", (Py_ssize_t)w->at, sections);
done:
    PyMem_Free(w);
    PyBuffer_Release(&words);
    PyBuffer_Release(&payload);
    PyBuffer_Release(&high);
    PyBuffer_Release(&low);
    return result;
}

/* Interleave planes (high, low, high, low... chunk by chunk) into little-endian words. */
static void merge(const uint8_t *planes, size_t elements, size_t step, uint8_t *out) {
    for (size_t first = 0; first < elements; first += step) {
        size_t count = elements - first < step ? elements - first : step;
        const uint8_t *high = planes + 2 * first;
        const uint8_t *low = high + count;
        uint8_t *words = out + 2 * first;
        for (size_t i = 0; i < count; i++) {
            words[2 * i] = low[i];
            words[2 * i + 1] = high[i];
        }
    }
}

PyDoc_STRVAR(decode_planes_doc,
"decode_planes(frames, planes, target, at, size, step, dctx, decompress) -> int\n"
"\n"
"Decode ``frames`` (a group of chunks' high and low plane frames, back to back) into\n"
"``planes[:size]`` in one libzstd call and, where that gives exactly ``size`` bytes, merge\n"
"them into ``target[at:at + size]`` as little-endian 16-bit words, chunk by chunk of\n"
"``step`` elements (the last may be shorter), as s3kv._planes' grouped decoder does.\n"
"Returns what ZSTD_decompressDCtx returned (``size``, or an error code or another\n"
"length, in which case ``target`` is untouched). ``dctx`` and ``decompress`` are the\n"
"addresses of a libzstd decompression context and of its ZSTD_decompressDCtx. Raises\n"
"ValueError where an argument is out of range (a caller bug).");

static PyObject *decode_planes(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer frames, planes, target;
    Py_ssize_t at, size, step;
    PyObject *dctx_arg, *decompress_arg;
    if (!PyArg_ParseTuple(args, "y*w*w*nnnOO", &frames, &planes, &target, &at, &size, &step,
                          &dctx_arg, &decompress_arg))
        return NULL;
    PyObject *result = NULL;
    void *dctx, *decompress;
    if (get_address(dctx_arg, &dctx, "dctx")
        || get_address(decompress_arg, &decompress, "decompress"))
        goto done;
    if (size < 0 || size % 2 || step <= 0 || at < 0 || size > planes.len
        || at > target.len - size) {
        PyErr_SetString(PyExc_ValueError, "decode_planes: arguments out of range (a caller bug)");
        goto done;
    }
    size_t decoded;
    Py_BEGIN_ALLOW_THREADS
    decoded = ((DecompressDCtx)decompress)(dctx, planes.buf, (size_t)size, frames.buf,
                                           (size_t)frames.len);
    if (decoded == (size_t)size)
        merge(planes.buf, (size_t)size / 2, (size_t)step, (uint8_t *)target.buf + at);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSize_t(decoded);
done:
    PyBuffer_Release(&frames);
    PyBuffer_Release(&planes);
    PyBuffer_Release(&target);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_planes", encode_planes, METH_VARARGS, encode_planes_doc},
    {"decode_planes", decode_planes, METH_VARARGS, decode_planes_doc},
    {NULL, NULL, 0, NULL},
};

/* The constants the kernel was built with, which s3kv._planes checks against its own. */
static int exec_module(PyObject *m) {
    if (PyModule_AddIntConstant(m, "MAX_ENTROPY_CHUNK", MAX_ENTROPY_CHUNK)
        || PyModule_AddIntConstant(m, "ZSTD_BLOCK", ZSTD_BLOCK)
        || PyModule_AddIntConstant(m, "LITERAL_SLACK", LITERAL_SLACK)
        || PyModule_AddIntConstant(m, "FRAME_BOUND", FRAME_BOUND)
        || PyModule_AddIntConstant(m, "RAW_FRAME_PREFIX", RAW_FRAME_PREFIX)
        || PyModule_AddIntConstant(m, "BLOCK_HEADER", BLOCK_HEADER))
        return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "s3kv._planes_native",
    "One-call byte-plane encoder and grouped decoder (private; see s3kv._planes).",
    0,
    methods,
    slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__planes_native(void) { return PyModuleDef_Init(&module); }
