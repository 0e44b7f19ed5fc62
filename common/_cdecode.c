/* clmq.common._cdecode: the compiled fast paths of the record format: common/_many.py's
 * decode_records_many (records of a fetch answer into LazyRecord objects), and for the
 * broker's encoder each record's CRC32C written in place (fill_crcs) and the all-ASCII
 * property check (props_ok).
 *
 * Optional: built when a C compiler and Python's headers are there (pyproject.toml's
 * ext-modules, optional = true); without it the pure-Python decoder does the same.
 *
 * It handles well-formed input only. Anything the pure-Python decoder would report (a
 * header that does not walk, lengths that do not add up, a CRC mismatch, text that is
 * not UTF-8, a trailing partial record) makes decode() return None, and the caller
 * decodes the same bytes in Python, which raises the error naming the record. So the
 * two paths can differ only in speed: tests/test_decode_compiled.py checks they agree
 * on random valid and damaged answers.
 *
 * Records are made as the dataclass would make them, without running its __init__:
 * the object is allocated by its type and each slot is written at the offset of its
 * member descriptor (Record's 15 slots; LazyRecord adds none). Properties stay
 * encoded (bytes), as LazyRecord expects.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if !PY_LITTLE_ENDIAN
#error "clmq.common._cdecode reads the record format's little-endian fields natively"
#endif
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define HEADER_SIZE 106
#define CRC_START 12
#define RECORD_MAGIC 0x636C6D01u
#define NFIELDS 15

/* Record's fields in dataclass order (common/_record.py). */
static const char *FIELD_NAMES[NFIELDS] = {
    "topic", "queue_id", "queue_offset", "commitlog_offset", "size", "body", "tags", "keys",
    "properties", "flags", "born_timestamp_ms", "store_timestamp_ms", "born_host", "store_host",
    "reconsume_times",
};
enum { F_TOPIC, F_QID, F_QOFF, F_CLOFF, F_SIZE, F_BODY, F_TAGS, F_KEYS, F_PROPS, F_FLAGS,
       F_BORN_TS, F_STORE_TS, F_BORN_HOST, F_STORE_HOST, F_RECONSUME };

static PyTypeObject *record_type = NULL; /* LazyRecord */
static Py_ssize_t slot_offsets[NFIELDS];
static PyObject *decode_host_fn = NULL; /* common._record.decode_host(bytes16, port) */

/* ------------------------------------------------------------------ CRC32C */
static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc_soft(const unsigned char *p, size_t n) { /* slice-by-8 */
    uint32_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c; /* little-endian */
        c = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^ crc_table[5][(w >> 16) & 0xFF] ^
            crc_table[4][(w >> 24) & 0xFF] ^ crc_table[3][(w >> 32) & 0xFF] ^ crc_table[2][(w >> 40) & 0xFF] ^
            crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && PY_LITTLE_ENDIAN
#include <nmmintrin.h>
#define HAVE_HW_CRC 1
__attribute__((target("sse4.2"))) static uint32_t crc_hw(const unsigned char *p, size_t n) {
    uint64_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return c32 ^ 0xFFFFFFFFu;
}
#endif

static int use_hw_crc = 0;

static uint32_t crc32c(const unsigned char *p, size_t n) {
#ifdef HAVE_HW_CRC
    if (use_hw_crc) return crc_hw(p, n);
#endif
    return crc_soft(p, n);
}

/* ------------------------------------------------------------------ reading */
static inline uint16_t rd16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* A text field, reused from the previous record when its bytes are the same (one
 * topic, one tag: the usual answer). New reference, or NULL with an error set. */
typedef struct { const unsigned char *p; Py_ssize_t n; PyObject *obj; } TextCache;

static PyObject *text(TextCache *c, const unsigned char *p, Py_ssize_t n) {
    if (c->obj != NULL && c->n == n && memcmp(c->p, p, (size_t)n) == 0) {
        Py_INCREF(c->obj);
        return c->obj;
    }
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "strict");
    if (s == NULL) return NULL;
    Py_XSETREF(c->obj, Py_NewRef(s));
    c->p = p;
    c->n = n;
    return s;
}

typedef struct { unsigned char ip[16]; uint16_t port; PyObject *obj; } HostCache;

static PyObject *host(HostCache *c, const unsigned char *ip, uint16_t port) {
    if (c->obj != NULL && c->port == port && memcmp(c->ip, ip, 16) == 0) {
        Py_INCREF(c->obj);
        return c->obj;
    }
    PyObject *h = PyObject_CallFunction(decode_host_fn, "y#H", (const char *)ip, (Py_ssize_t)16, port);
    if (h == NULL) return NULL;
    Py_XSETREF(c->obj, Py_NewRef(h));
    memcpy(c->ip, ip, 16);
    c->port = port;
    return h;
}

typedef struct { TextCache topic, tags, keys; HostCache born, store; } Caches;

static void caches_clear(Caches *k) {
    Py_CLEAR(k->topic.obj); Py_CLEAR(k->tags.obj); Py_CLEAR(k->keys.obj);
    Py_CLEAR(k->born.obj); Py_CLEAR(k->store.obj);
}

/* Whether [p, p + size) is one well-formed record (the checks of the Python path). */
static int well_formed(const unsigned char *p, uint32_t size) {
    uint64_t parts = (uint64_t)HEADER_SIZE + rd16(p + 92) + rd16(p + 94) + rd16(p + 96) + rd32(p + 98) + rd32(p + 102);
    return parts == size && crc32c(p + CRC_START, size - CRC_START) == rd32(p + 8);
}

static int set_slot(PyObject *rec, int field, PyObject *value) { /* steals value */
    if (value == NULL) return -1;
    *(PyObject **)((char *)rec + slot_offsets[field]) = value;
    return 0;
}

/* One record at p (well formed), or NULL with an error set. */
static PyObject *make_record(const unsigned char *p, uint32_t size, Caches *k) {
    PyObject *rec = record_type->tp_alloc(record_type, 0);
    if (rec == NULL) return NULL;
    Py_ssize_t tl = rd16(p + 92), gl = rd16(p + 94), kl = rd16(p + 96);
    Py_ssize_t pl = rd32(p + 98), bl = rd32(p + 102);
    const unsigned char *t = p + HEADER_SIZE, *g = t + tl, *kk = g + gl, *pr = kk + kl, *b = pr + pl;
    if (set_slot(rec, F_TOPIC, text(&k->topic, t, tl)) || set_slot(rec, F_TAGS, text(&k->tags, g, gl)) ||
        set_slot(rec, F_KEYS, text(&k->keys, kk, kl)) ||
        set_slot(rec, F_QID, PyLong_FromUnsignedLong(rd32(p + 28))) ||
        set_slot(rec, F_QOFF, PyLong_FromUnsignedLongLong(rd64(p + 20))) ||
        set_slot(rec, F_CLOFF, PyLong_FromUnsignedLongLong(rd64(p + 12))) ||
        set_slot(rec, F_SIZE, PyLong_FromUnsignedLong(size)) ||
        set_slot(rec, F_BODY, PyBytes_FromStringAndSize((const char *)b, bl)) ||
        set_slot(rec, F_PROPS, PyBytes_FromStringAndSize((const char *)pr, pl)) ||
        set_slot(rec, F_FLAGS, PyLong_FromUnsignedLong(rd32(p + 32))) ||
        set_slot(rec, F_BORN_TS, PyLong_FromUnsignedLongLong(rd64(p + 36))) ||
        set_slot(rec, F_STORE_TS, PyLong_FromUnsignedLongLong(rd64(p + 44))) ||
        set_slot(rec, F_BORN_HOST, host(&k->born, p + 52, rd16(p + 68))) ||
        set_slot(rec, F_STORE_HOST, host(&k->store, p + 70, rd16(p + 86))) ||
        set_slot(rec, F_RECONSUME, PyLong_FromUnsignedLong(rd32(p + 88)))) {
        Py_DECREF(rec); /* the slots set so far are released with it */
        return NULL;
    }
    return rec;
}

/* How many records [0, n) holds back to back, each well formed; -1 if anything is not. */
static Py_ssize_t count_records(const unsigned char *d, Py_ssize_t n) {
    Py_ssize_t pos = 0, count = 0;
    while (n - pos >= 8) {
        uint32_t size = rd32(d + pos);
        if (rd32(d + pos + 4) != RECORD_MAGIC || size < HEADER_SIZE || (Py_ssize_t)size > n - pos) return -1;
        if (!well_formed(d + pos, size)) return -1;
        pos += size;
        count++;
    }
    return pos == n ? count : -1;
}

static PyObject *decode(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (record_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "clmq.common._cdecode: setup() was not called");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *d = view.buf;
    Py_ssize_t count = count_records(d, view.len);
    if (count < 0) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE; /* the Python path says what is wrong */
    }
    PyObject *out = PyList_New(count);
    Caches k;
    memset(&k, 0, sizeof k);
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        uint32_t size = rd32(d + pos);
        PyObject *rec = make_record(d + pos, size, &k);
        if (rec == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, rec);
        pos += size;
    }
    caches_clear(&k);
    PyBuffer_Release(&view);
    if (out == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        Py_RETURN_NONE; /* text that is not UTF-8: the Python path reports it */
    }
    return out;
}

static int find_offsets(PyObject *base) {
    PyObject *dict = PyObject_GetAttrString(base, "__dict__");
    if (dict == NULL) return -1;
    for (int i = 0; i < NFIELDS; i++) {
        PyObject *descr = PyMapping_GetItemString(dict, FIELD_NAMES[i]);
        if (descr == NULL) { Py_DECREF(dict); return -1; }
        if (!Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "%s is not a slot", FIELD_NAMES[i]);
            Py_DECREF(descr); Py_DECREF(dict);
            return -1;
        }
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_TypeError, "slot %s has an unexpected type", FIELD_NAMES[i]);
            Py_DECREF(descr); Py_DECREF(dict);
            return -1;
        }
        slot_offsets[i] = m->offset;
        Py_DECREF(descr);
    }
    Py_DECREF(dict);
    return 0;
}

/* setup(record_cls, slots_cls, decode_host): records are record_cls instances whose
 * slots are slots_cls's (LazyRecord and Record). */
static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *cls, *base, *fn;
    if (!PyArg_ParseTuple(args, "O!O!O:setup", &PyType_Type, &cls, &PyType_Type, &base, &fn)) return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)base)) {
        PyErr_SetString(PyExc_TypeError, "the record class must derive from the slots class");
        return NULL;
    }
    if (((PyTypeObject *)cls)->tp_basicsize != ((PyTypeObject *)base)->tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "the record class adds slots");
        return NULL;
    }
    if (find_offsets(base) < 0) return NULL;
    Py_XSETREF(record_type, (PyTypeObject *)Py_NewRef(cls));
    Py_XSETREF(decode_host_fn, Py_NewRef(fn));
    Py_RETURN_NONE;
}

static PyObject *crc(PyObject *self, PyObject *args) {
    Py_buffer view;
    int table = 0;
    if (!PyArg_ParseTuple(args, "y*|p:crc32c", &view, &table)) return NULL;
    uint32_t c = table ? crc_soft(view.buf, (size_t)view.len) : crc32c(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

/* props_ok(data) -> bool: True if data is a property encoding (u16 key length, key,
 * u32 value length, value, ...) that walks exactly to its end and is all ASCII (so
 * every text is UTF-8). False says only "not shown valid here": the caller checks it
 * in Python, which accepts other UTF-8 and names what is wrong. */
static PyObject *props_ok(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *d = view.buf;
    Py_ssize_t n = view.len, pos = 0;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) ok = d[i] < 0x80;
    while (ok && pos < n) {
        if (n - pos < 2) { ok = 0; break; }
        pos += 2 + (Py_ssize_t)rd16(d + pos);
        if (pos > n || n - pos < 4) { ok = 0; break; }
        pos += 4 + (Py_ssize_t)rd32(d + pos);
    }
    ok = ok && pos == n;
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* fill_crcs(data, starts, ends): for each record [s, e) of the writable buffer, the
 * CRC32C of [s + 12, e) written little-endian at s + 8 (the encoder's last step). */
static PyObject *fill_crcs(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *starts, *ends;
    if (!PyArg_ParseTuple(args, "w*O!O!:fill_crcs", &view, &PyList_Type, &starts, &PyList_Type, &ends)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(starts);
    if (PyList_GET_SIZE(ends) != count) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "fill_crcs: starts and ends differ in length");
        return NULL;
    }
    unsigned char *d = view.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(starts, i));
        Py_ssize_t e = PyLong_AsSsize_t(PyList_GET_ITEM(ends, i));
        if ((s == -1 || e == -1) && PyErr_Occurred()) { PyBuffer_Release(&view); return NULL; }
        if (s < 0 || e < s + CRC_START || e > view.len) {
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError, "fill_crcs: record [%zd, %zd) outside a buffer of %zd bytes", s, e, view.len);
            return NULL;
        }
        uint32_t c = crc32c(d + s + CRC_START, (size_t)(e - s - CRC_START));
        memcpy(d + s + 8, &c, 4); /* little-endian machines only (the record format's order) */
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"props_ok", props_ok, METH_O, "props_ok(data) -> True if an all-ASCII property encoding walks exactly."},
    {"fill_crcs", fill_crcs, METH_VARARGS, "fill_crcs(data, starts, ends): each record's CRC32C written in place."},
    {"setup", setup, METH_VARARGS, "setup(record_cls, slots_cls, decode_host): what decode() makes."},
    {"decode", decode, METH_O, "decode(data) -> list of records, or None if anything is not well formed."},
    {"crc32c", crc, METH_VARARGS, "crc32c(data, table=False): the CRC32C decode() checks (table: the portable code), for tests."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cdecode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cdecode(void) {
    crc_init();
#ifdef HAVE_HW_CRC
    __builtin_cpu_init();
    use_hw_crc = __builtin_cpu_supports("sse4.2") != 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "HARDWARE_CRC", use_hw_crc) < 0) Py_CLEAR(m);
    return m;
}
