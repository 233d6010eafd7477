/*
 * fakecomm.c - a fake NCCL/HCCL library for testing collective bindings without a GPU.
 *
 * It exports the NCCL and HCCL C functions with their real signatures and enum values, but
 * every buffer is a plain host pointer and every rank is its own process (or its own comm in
 * one process). The collectives have their real semantics: ranks exchange data through files
 * in a rendezvous directory. Every call of an API function is also appended to an in-memory
 * log (fakecomm_log) so tests can check the arguments a binding passed.
 *
 * Build:  gcc -std=c11 -D_GNU_SOURCE -Wall -Wextra -O2 -shared -fPIC -o libnccl.so.2 fakecomm.c -lpthread
 *   -DFAKECOMM_VERSION=22703  what ncclGetVersion reports (default 22105 = NCCL 2.21.5)
 *   -DFAKECOMM_WINDOW         also export ncclCommWindowRegister / ncclCommWindowDeregister
 *
 * File protocol. ncclGetUniqueId / HcclGetRootInfo create <dir> with
 * mkdtemp("$FAKECOMM_DIR/fakecomm-XXXXXX") ($FAKECOMM_DIR defaults to /tmp) and store its
 * NUL-terminated path at the start of the id. Inside <dir>:
 *   j<rank>           join marker; init waits until the markers of all nranks exist.
 *   c<s>.r<rank>      rank's part of the s-th collective of the comm (s counts from 0; every
 *                     collective takes one number, even with count 0). AllReduce, AllGather,
 *                     ReduceScatter, Reduce: every rank writes its send buffer. Broadcast: only
 *                     the root writes. AlltoAllV: nranks uint64 byte counts (one per
 *                     destination) followed by the pieces in destination order.
 *   p<src>.<dst>.<k>  the k-th send from src to dst. Sends never wait (buffered); the receiver
 *                     waits for the file, copies it and deletes it.
 * A file is written under ".tmp.<name>" and renamed into place, so a file that exists is
 * complete and never changes. Readers poll, sleeping 20 us backing off to 1 ms, and give up
 * after the timeout (fakecomm_set_timeout_ms, default 60 s) with ncclRemoteError, or at once
 * when another thread destroys or aborts the comm. Collective files are deleted lazily: a rank
 * that has read all nranks files of collective s knows that every rank has finished the
 * collectives before s, so it deletes its own older files.
 *
 * Semantics. Reductions combine ranks in rank order; float16/bfloat16 accumulate in float and
 * round to nearest even at the end; integers wrap; avg divides the sum (integer division for
 * integers). Groups are per thread, as in NCCL: inside a group every call runs at once except
 * receives, which are queued and run at the outermost group end, so sends and receives issued
 * in any order never deadlock. Every call of an API function appends one line to the log:
 * its name, then key=value pairs (count dtype op root peer nranks rank send recv comm stream;
 * pointers in hex, 0x0 for NULL).
 *
 * Test hooks: fakecomm_host_memory, fakecomm_log, fakecomm_log_clear, fakecomm_fail_next,
 * fakecomm_set_timeout_ms (< 0: wait forever), fakecomm_set_abort_delay_ms.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef FAKECOMM_VERSION
#define FAKECOMM_VERSION 22105
#endif

/* ---- NCCL and HCCL types (real values) ---- */
typedef enum { ncclSuccess, ncclUnhandledCudaError, ncclSystemError, ncclInternalError,
               ncclInvalidArgument, ncclInvalidUsage, ncclRemoteError, ncclInProgress } ncclResult_t;
typedef enum { ncclInt8, ncclUint8, ncclInt32, ncclUint32, ncclInt64, ncclUint64, ncclFloat16,
               ncclFloat32, ncclFloat64, ncclBfloat16, ncclFloat8e4m3, ncclFloat8e5m2 } ncclDataType_t;
typedef enum { ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg } ncclRedOp_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct fakeComm *ncclComm_t;
typedef void *cudaStream_t;

typedef enum { HCCL_SUCCESS = 0, HCCL_E_PARA = 1, HCCL_E_INTERNAL = 4, HCCL_E_NOT_SUPPORT = 5,
               HCCL_E_TIMEOUT = 9, HCCL_E_REMOTE = 21 } HcclResult;
typedef enum { HCCL_DATA_TYPE_INT8, HCCL_DATA_TYPE_INT16, HCCL_DATA_TYPE_INT32, HCCL_DATA_TYPE_FP16,
               HCCL_DATA_TYPE_FP32, HCCL_DATA_TYPE_INT64, HCCL_DATA_TYPE_UINT64, HCCL_DATA_TYPE_UINT8,
               HCCL_DATA_TYPE_UINT16, HCCL_DATA_TYPE_UINT32, HCCL_DATA_TYPE_FP64, HCCL_DATA_TYPE_BFP16 } HcclDataType;
typedef enum { HCCL_REDUCE_SUM, HCCL_REDUCE_PROD, HCCL_REDUCE_MAX, HCCL_REDUCE_MIN } HcclReduceOp;
typedef void *HcclComm;
typedef void *aclrtStream;
typedef struct { char internal[4108]; } HcclRootInfo;

/* Core data types: the NCCL values, plus int16/uint16 for HCCL. */
enum { DT_I8, DT_U8, DT_I32, DT_U32, DT_I64, DT_U64, DT_F16, DT_F32, DT_F64, DT_BF16, DT_F8A, DT_F8B,
       DT_I16, DT_U16, DT_N };
static const size_t dt_size[DT_N] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1, 2, 2};
static const int hccl_dt[12] = {DT_I8, DT_I16, DT_I32, DT_F16, DT_F32, DT_I64,
                                DT_U64, DT_U8, DT_U16, DT_U32, DT_F64, DT_BF16};

struct fakeComm {
  char *dir;
  int nranks, rank;
  unsigned long seq, gc_next;   /* next collective number; own files below gc_next are gone */
  unsigned long *sent, *rcvd;   /* per-peer p2p counters */
  atomic_int refs, aborted;     /* refs: owner + calls in flight; the last one frees */
};

/* ---- process-global state ---- */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_err[1024];
static char *g_log;
static size_t g_log_len, g_log_cap;
static int g_timeout_ms = 60000, g_abort_delay_ms, g_fail_armed, g_fail_rc;
#define LOG_MAX ((size_t)16 << 20) /* beyond this the oldest half of the log is dropped */
#define PF "0x%" PRIxPTR
#define P(p) ((uintptr_t)(const void *)(p))

__attribute__((format(printf, 2, 3))) static int set_err(int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&g_mu);
  vsnprintf(g_err, sizeof g_err, fmt, ap);
  pthread_mutex_unlock(&g_mu);
  va_end(ap);
  return rc;
}

__attribute__((format(printf, 1, 2))) static void log_call(const char *fmt, ...) {
  char *line;
  va_list ap;
  va_start(ap, fmt);
  int n = vasprintf(&line, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  size_t len = (size_t)n + 1;
  pthread_mutex_lock(&g_mu);
  if (g_log_len + len > LOG_MAX) {
    char *cut = memchr(g_log + g_log_len / 2, '\n', g_log_len - g_log_len / 2);
    size_t drop = cut ? (size_t)(cut - g_log) + 1 : g_log_len;
    memmove(g_log, g_log + drop, g_log_len - drop);
    g_log_len -= drop;
  }
  if (g_log_len + len + 1 > g_log_cap) {
    size_t cap = g_log_cap ? g_log_cap * 2 : 4096;
    while (cap < g_log_len + len + 1) cap *= 2;
    char *p = realloc(g_log, cap);
    if (!p) goto out;
    g_log = p, g_log_cap = cap;
  }
  memcpy(g_log + g_log_len, line, len - 1);
  g_log_len += len;
  g_log[g_log_len - 1] = '\n';
  g_log[g_log_len] = '\0';
out:
  pthread_mutex_unlock(&g_mu);
  free(line);
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void comm_release(struct fakeComm *c) {
  if (atomic_fetch_sub(&c->refs, 1) != 1) return;
  free(c->dir), free(c->sent), free(c->rcvd), free(c);
}

/* ---- files ---- */
typedef struct {
  struct fakeComm *c;
  const char *fn;     /* API function, for messages */
  char what[48];      /* "call #3", "recv #0", "init" */
  int timeout;
  double deadline;
} op_t;

static void op_init(op_t *o, struct fakeComm *c, const char *fn) {
  pthread_mutex_lock(&g_mu);
  o->timeout = g_timeout_ms;
  pthread_mutex_unlock(&g_mu);
  o->c = c, o->fn = fn, o->deadline = now_ms() + o->timeout;
  snprintf(o->what, sizeof o->what, "init");
}

static int io_all(int fd, void *p, size_t n, int wr) { /* whole read or write; -1 on error or early EOF */
  for (char *s = p; n;) {
    ssize_t k = wr ? write(fd, s, n) : read(fd, s, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    s += k, n -= (size_t)k;
  }
  return 0;
}

/* Write hdr+data to <dir>/<name> atomically. */
static int put_file(op_t *o, const char *name, const void *hdr, size_t hl, const void *data, size_t dl) {
  char tmp[PATH_MAX + 64], path[PATH_MAX + 64];
  snprintf(tmp, sizeof tmp, "%s/.tmp.%s", o->c->dir, name);
  snprintf(path, sizeof path, "%s/%s", o->c->dir, name);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return set_err(ncclSystemError, "fakecomm: %s: open %s: %s", o->fn, tmp, strerror(errno));
  int bad = io_all(fd, (void *)(uintptr_t)hdr, hl, 1) || io_all(fd, (void *)(uintptr_t)data, dl, 1);
  bad |= close(fd) != 0;
  if (bad || rename(tmp, path) != 0)
    return set_err(ncclSystemError, "fakecomm: %s: writing %s: %s", o->fn, path, strerror(errno));
  return ncclSuccess;
}

/* Wait for <dir>/<name> (written by rank `from`) and read it into a malloc'd buffer. */
static int get_file(op_t *o, const char *name, int from, int remove, char **buf, size_t *len) {
  char path[PATH_MAX + 64];
  snprintf(path, sizeof path, "%s/%s", o->c->dir, name);
  long us = 20;
  int fd;
  while ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
    if (errno != ENOENT) return set_err(ncclSystemError, "fakecomm: %s: open %s: %s", o->fn, path, strerror(errno));
    if (atomic_load(&o->c->aborted))
      return set_err(ncclRemoteError, "fakecomm: comm of rank %d was aborted while it waited for rank %d in %s (%s)",
                     o->c->rank, from, o->what, o->fn);
    if (o->timeout >= 0 && now_ms() >= o->deadline)
      return set_err(ncclRemoteError, "fakecomm: rank %d waited %d ms for rank %d in %s (%s)", o->c->rank,
                     o->timeout, from, o->what, o->fn);
    nanosleep(&(struct timespec){0, us * 1000}, NULL);
    us = us * 2 > 1000 ? 1000 : us * 2;
  }
  struct stat st;
  char *p = fstat(fd, &st) == 0 ? malloc((size_t)st.st_size + 1) : NULL;
  int bad = !p || io_all(fd, p, (size_t)st.st_size, 0);
  close(fd);
  if (bad) {
    free(p);
    return set_err(ncclSystemError, "fakecomm: %s: reading %s failed", o->fn, path);
  }
  if (remove) unlink(path);
  *buf = p, *len = (size_t)st.st_size;
  return ncclSuccess;
}

static int size_mismatch(op_t *o, int from, size_t want, size_t got) {
  return set_err(ncclInvalidUsage, "fakecomm: rank %d expected %zu bytes from rank %d but rank %d wrote %zu bytes in %s (%s)",
                 o->c->rank, want, from, from, got, o->what, o->fn);
}

/* Read c<s>.r<r> of every rank into bufs (sizes checked against want unless want == SIZE_MAX),
 * then delete this rank's files of the collectives before s. */
static int read_all(op_t *o, unsigned long s, size_t want, char **bufs, size_t *lens) {
  struct fakeComm *c = o->c;
  for (int r = 0; r < c->nranks; r++) {
    char name[64];
    snprintf(name, sizeof name, "c%lu.r%d", s, r);
    int rc = get_file(o, name, r, 0, &bufs[r], &lens[r]);
    if (!rc && want != SIZE_MAX && lens[r] != want) rc = size_mismatch(o, r, want, lens[r]);
    if (rc) return rc; /* the caller frees bufs */
  }
  for (unsigned long t = c->gc_next; t < s; t++) { /* everyone is past collective t now */
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/c%lu.r%d", c->dir, t, c->rank);
    unlink(path);
  }
  c->gc_next = s;
  return ncclSuccess;
}

/* ---- float16 / bfloat16 ---- */
static float bits_f(uint32_t x) { float f; memcpy(&f, &x, 4); return f; }
static uint32_t f_bits(float f) { uint32_t x; memcpy(&x, &f, 4); return x; }

static float h2f(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_f(sign | 0x7f800000 | man << 13);
  if (exp) return bits_f(sign | (exp + 112) << 23 | man << 13);
  float f = (float)man * 0x1p-24f; /* zero or subnormal */
  return sign ? -f : f;
}

static uint16_t f2h(float f) { /* round to nearest even */
  uint32_t x = f_bits(f), ax = x & 0x7fffffff;
  uint16_t sign = (uint16_t)(x >> 16 & 0x8000);
  if (ax > 0x7f800000) return sign | 0x7e00 | (uint16_t)(ax >> 13 & 0x3ff); /* NaN stays NaN */
  if (ax >= 0x477ff000) return sign | 0x7c00;                                 /* >= 65520: inf */
  uint32_t m = (ax & 0x7fffff) | 0x800000, e = ax >> 23, h, shift;
  if (ax >= 0x38800000) h = (e - 112) << 10 | (m >> 13 & 0x3ff), shift = 13; /* normal */
  else if (e >= 102) h = m >> (126 - e), shift = 126 - e;                    /* subnormal */
  else return sign;
  uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (h & 1))) h++; /* a carry into the exponent is right */
  return sign | (uint16_t)h;
}

static float bf2f(uint16_t b) { return bits_f((uint32_t)b << 16); }
static uint16_t f2bf(float f) {
  uint32_t x = f_bits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)(x >> 16 | 0x40);
  return (uint16_t)((x + 0x7fff + (x >> 16 & 1)) >> 16);
}

/* ---- reductions: out[i] = in[0][i] op in[1][i] op ... (rank order), A accumulates, U wraps ints ---- */
#define ID(x) (x)
#define RED(T, A, U, LD, ST)                                                                    \
  for (size_t i = 0; i < count; i++) {                                                          \
    A acc = LD(((const T *)(in[0] + off))[i]);                                                  \
    for (int r = 1; r < n; r++) {                                                               \
      A v = LD(((const T *)(in[r] + off))[i]);                                                  \
      if (op == ncclSum || op == ncclAvg) acc = (A)((U)acc + (U)v);                             \
      else if (op == ncclProd) acc = (A)((U)acc * (U)v);                                        \
      else if (op == ncclMax) acc = v > acc ? v : acc;                                          \
      else acc = v < acc ? v : acc;                                                             \
    }                                                                                           \
    if (op == ncclAvg) acc = (A)(acc / n);                                                      \
    ((T *)out)[i] = ST(acc);                                                                    \
  }                                                                                             \
  break;

static void reduce(void *out, char *const *in, size_t off, int n, size_t count, int dt, int op) {
  switch (dt) {
  case DT_I8: RED(int8_t, int8_t, unsigned, ID, ID)
  case DT_U8: RED(uint8_t, uint8_t, unsigned, ID, ID)
  case DT_I16: RED(int16_t, int16_t, unsigned, ID, ID)
  case DT_U16: RED(uint16_t, uint16_t, unsigned, ID, ID)
  case DT_I32: RED(int32_t, int32_t, uint32_t, ID, ID)
  case DT_U32: RED(uint32_t, uint32_t, uint32_t, ID, ID)
  case DT_I64: RED(int64_t, int64_t, uint64_t, ID, ID)
  case DT_U64: RED(uint64_t, uint64_t, uint64_t, ID, ID)
  case DT_F32: RED(float, float, float, ID, ID)
  case DT_F64: RED(double, double, double, ID, ID)
  case DT_F16: RED(uint16_t, float, float, h2f, f2h)
  case DT_BF16: RED(uint16_t, float, float, bf2f, f2bf)
  }
}

/* ---- the core: one call of a collective or p2p function ---- */
enum { K_ALLREDUCE, K_ALLGATHER, K_REDSCAT, K_BCAST, K_REDUCE, K_SEND, K_RECV, K_A2AV };
typedef struct {
  int kind, dt, op, root, rdt; /* core dtype/op (-1: unknown); root is the peer for send/recv; rdt: recv dtype */
  const char *fn;
  struct fakeComm *c;
  const void *send;
  void *recv;
  size_t count;
  const uint64_t *sc, *sd, *rc, *rd; /* AlltoAllV counts and displacements */
} call_t;

static int work(const call_t *a, op_t *o) {
  struct fakeComm *c = a->c;
  int n = c->nranks, me = c->rank, rc = ncclSuccess;
  size_t es = dt_size[a->dt], bytes = a->count * es;
  char name[64], **in = calloc((size_t)n, sizeof *in);
  size_t *len = calloc((size_t)n, sizeof *len), got;
  if (!in || !len) { rc = set_err(ncclSystemError, "fakecomm: %s: out of memory", a->fn); goto out; }
  if (a->kind == K_SEND || a->kind == K_RECV) {
    int send = a->kind == K_SEND, src = send ? me : a->root, dst = send ? a->root : me;
    unsigned long k = send ? c->sent[dst]++ : c->rcvd[src]++;
    snprintf(name, sizeof name, "p%d.%d.%lu", src, dst, k);
    snprintf(o->what, sizeof o->what, "%s #%lu", send ? "send" : "recv", k);
    if (send) { rc = put_file(o, name, NULL, 0, a->send, bytes); goto out; }
    if ((rc = get_file(o, name, src, 1, &in[0], &got))) goto out;
    if (got != bytes) rc = size_mismatch(o, src, bytes, got);
    else if (bytes) memcpy(a->recv, in[0], bytes);
    goto out;
  }
  unsigned long s = c->seq++;
  snprintf(o->what, sizeof o->what, "call #%lu", s);
  snprintf(name, sizeof name, "c%lu.r%d", s, me);
  switch (a->kind) {
  case K_ALLREDUCE: case K_REDUCE: case K_ALLGATHER:
    if ((rc = put_file(o, name, NULL, 0, a->send, bytes)) || (a->kind == K_REDUCE && me != a->root)) break;
    if ((rc = read_all(o, s, bytes, in, len))) break;
    if (a->kind == K_ALLGATHER) {
      for (int r = 0; r < n && bytes; r++) memcpy((char *)a->recv + (size_t)r * bytes, in[r], bytes);
    } else reduce(a->recv, in, 0, n, a->count, a->dt, a->op);
    break;
  case K_REDSCAT:
    if ((rc = put_file(o, name, NULL, 0, a->send, bytes * (size_t)n)) || (rc = read_all(o, s, bytes * (size_t)n, in, len))) break;
    reduce(a->recv, in, (size_t)me * bytes, n, a->count, a->dt, a->op);
    break;
  case K_BCAST:
    if (me == a->root) {
      if ((rc = put_file(o, name, NULL, 0, a->send, bytes)) == 0 && a->recv != a->send && bytes) memmove(a->recv, a->send, bytes);
      break;
    }
    snprintf(name, sizeof name, "c%lu.r%d", s, a->root);
    if ((rc = get_file(o, name, a->root, 0, &in[0], &got))) break;
    if (got != bytes) rc = size_mismatch(o, a->root, bytes, got);
    else if (bytes) memcpy(a->recv, in[0], bytes);
    break;
  case K_A2AV: {
    size_t hl = (size_t)n * sizeof(uint64_t), total = 0;
    uint64_t *hdr = malloc(hl);
    for (int d = 0; hdr && d < n; d++) total += (hdr[d] = a->sc[d] * es);
    char *data = hdr ? malloc(total + 1) : NULL;
    if (!data) { free(hdr); rc = set_err(ncclSystemError, "fakecomm: %s: out of memory", a->fn); break; }
    for (size_t d = 0, off = 0; d < (size_t)n; off += hdr[d++])
      if (hdr[d]) memcpy(data + off, (const char *)a->send + a->sd[d] * es, hdr[d]);
    rc = put_file(o, name, hdr, hl, data, total);
    free(hdr), free(data);
    if (rc || (rc = read_all(o, s, SIZE_MAX, in, len))) break;
    for (int r = 0; r < n && !rc; r++) {
      uint64_t *h = (uint64_t *)in[r], want = a->rc[r] * dt_size[a->rdt], off = hl;
      if (len[r] < hl) { rc = size_mismatch(o, r, hl, len[r]); break; }
      for (int d = 0; d < me; d++) off += h[d];
      if (h[me] != want) rc = size_mismatch(o, r, want, h[me]);
      else if (off + want > len[r]) rc = set_err(ncclInternalError, "fakecomm: %s: short file from rank %d", a->fn, r);
      else if (want) memcpy((char *)a->recv + a->rd[r] * dt_size[a->rdt], in[r] + off, want);
    }
    break;
  }
  }
out:
  for (int r = 0; in && r < n; r++) free(in[r]);
  free(in), free(len);
  return rc;
}

/* Group state is per thread, as in NCCL: receives issued inside a group are queued here. */
static _Thread_local int t_depth;
static _Thread_local call_t *t_pend;
static _Thread_local size_t t_npend, t_cap;
static int execute(const call_t *a, int rc);

static int run(call_t a) {
  pthread_mutex_lock(&g_mu);
  int armed = g_fail_armed, frc = g_fail_rc;
  g_fail_armed = 0;
  pthread_mutex_unlock(&g_mu);
  if (armed) return set_err(frc, "fakecomm: injected failure");
  struct fakeComm *c = a.c;
  if (!c) return set_err(ncclInvalidArgument, "fakecomm: %s: comm is NULL", a.fn);
  if (a.dt < 0 || (a.kind == K_A2AV && a.rdt < 0))
    return set_err(ncclInvalidArgument, "fakecomm: %s: unknown data type", a.fn);
  int n = c->nranks, me = c->rank, reduces = a.kind == K_ALLREDUCE || a.kind == K_REDSCAT || a.kind == K_REDUCE;
  if (reduces && (a.op < 0 || a.op > ncclAvg)) return set_err(ncclInvalidArgument, "fakecomm: %s: unknown reduction op", a.fn);
  if (reduces && (a.dt == DT_F8A || a.dt == DT_F8B))
    return set_err(ncclInvalidArgument, "fakecomm: %s: reductions on fp8 data types are not supported", a.fn);
  if ((a.kind == K_BCAST || a.kind == K_REDUCE || a.kind == K_SEND || a.kind == K_RECV) && (a.root < 0 || a.root >= n))
    return set_err(ncclInvalidArgument, "fakecomm: %s: %s %d out of range for %d ranks", a.fn,
                   a.kind >= K_SEND ? "peer" : "root", a.root, n);
  size_t es = dt_size[a.dt], bytes = a.count * es;
  if (a.count > SIZE_MAX / es / (size_t)n) return set_err(ncclInvalidArgument, "fakecomm: %s: count %zu too large", a.fn, a.count);
  size_t sb = a.kind == K_REDSCAT ? bytes * (size_t)n : bytes, rb = a.kind == K_ALLGATHER ? bytes * (size_t)n : bytes;
  int need_send = a.kind != K_RECV && a.kind != K_A2AV && (a.kind != K_BCAST || me == a.root);
  int need_recv = a.kind != K_SEND && a.kind != K_A2AV && (a.kind != K_REDUCE || me == a.root);
  if ((need_send && sb && !a.send) || (need_recv && rb && !a.recv))
    return set_err(ncclInvalidArgument, "fakecomm: %s: NULL buffer", a.fn);
  if (a.kind == K_A2AV) {
    if (!a.sc || !a.sd || !a.rc || !a.rd) return set_err(ncclInvalidArgument, "fakecomm: %s: NULL counts or displacements", a.fn);
    if (dt_size[a.dt] != dt_size[a.rdt]) return set_err(ncclInvalidArgument, "fakecomm: %s: send and recv types differ in size", a.fn);
  }
  atomic_fetch_add(&c->refs, 1);
  if (a.kind == K_RECV && t_depth > 0) { /* inside a group: receive at the outermost group end */
    if (t_npend == t_cap) {
      size_t cap = t_cap ? 2 * t_cap : 16;
      call_t *p = realloc(t_pend, cap * sizeof *p);
      if (!p) { comm_release(c); return set_err(ncclSystemError, "fakecomm: %s: out of memory", a.fn); }
      t_pend = p, t_cap = cap;
    }
    t_pend[t_npend++] = a;
    return ncclSuccess;
  }
  return execute(&a, ncclSuccess);
}

/* Run a validated call (or, if rc is already an error, just drop it) and release its comm reference. */
static int execute(const call_t *a, int rc) {
  op_t o;
  op_init(&o, a->c, a->fn);
  if (!rc) rc = work(a, &o);
  comm_release(a->c);
  return rc;
}

static int group(int delta, const char *fn) {
  if (t_depth + delta < 0) return set_err(ncclInvalidUsage, "fakecomm: %s without a matching group start", fn);
  int rc = ncclSuccess;
  if ((t_depth += delta) > 0 || delta > 0) return rc;
  for (size_t i = 0; i < t_npend; i++) rc = execute(&t_pend[i], rc);
  free(t_pend), t_pend = NULL, t_npend = t_cap = 0;
  return rc;
}

/* ---- init and ids ---- */
static int make_dir(char *out, size_t cap, const char *fn) {
  const char *base = getenv("FAKECOMM_DIR");
  char tmpl[PATH_MAX];
  if (!base || !*base) base = "/tmp";
  int k = snprintf(tmpl, sizeof tmpl, "%s/fakecomm-XXXXXX", base);
  if (k < 0 || (size_t)k >= cap || (size_t)k >= sizeof tmpl)
    return set_err(ncclSystemError, "fakecomm: %s: '%s/fakecomm-XXXXXX' does not fit in the id", fn, base);
  if (!mkdtemp(tmpl)) return set_err(ncclSystemError, "fakecomm: %s: mkdtemp %s: %s", fn, tmpl, strerror(errno));
  memset(out, 0, cap);
  memcpy(out, tmpl, (size_t)k + 1);
  return ncclSuccess;
}

static int comm_init(struct fakeComm **out, int n, const char *id, size_t idlen, int rank, const char *fn) {
  struct stat st;
  if (!out) return set_err(ncclInvalidArgument, "fakecomm: %s: comm pointer is NULL", fn);
  *out = NULL;
  if (n < 1 || rank < 0 || rank >= n) return set_err(ncclInvalidArgument, "fakecomm: %s: invalid rank %d of %d ranks", fn, rank, n);
  if (!memchr(id, 0, idlen) || stat(id, &st) != 0 || !S_ISDIR(st.st_mode))
    return set_err(ncclInvalidArgument, "fakecomm: %s: the id does not name a rendezvous directory", fn);
  struct fakeComm *c = calloc(1, sizeof *c);
  if (!c || !(c->dir = strdup(id)) || !(c->sent = calloc((size_t)n, sizeof *c->sent)) ||
      !(c->rcvd = calloc((size_t)n, sizeof *c->rcvd))) {
    if (c) free(c->dir), free(c->sent), free(c);
    return set_err(ncclSystemError, "fakecomm: %s: out of memory", fn);
  }
  c->nranks = n, c->rank = rank;
  atomic_init(&c->refs, 1);
  atomic_init(&c->aborted, 0);
  op_t o;
  op_init(&o, c, fn);
  char name[32], *buf;
  size_t len;
  snprintf(name, sizeof name, "j%d", rank);
  int rc = put_file(&o, name, NULL, 0, NULL, 0);
  for (int r = 0; r < n && !rc; r++) {
    snprintf(name, sizeof name, "j%d", r);
    if (!(rc = get_file(&o, name, r, 0, &buf, &len))) free(buf);
  }
  if (rc) comm_release(c);
  else *out = c;
  return rc;
}

static int comm_free(struct fakeComm *c, const char *fn, int delay_ms) {
  if (!c) return set_err(ncclInvalidArgument, "fakecomm: %s: comm is NULL", fn);
  if (delay_ms > 0) nanosleep(&(struct timespec){delay_ms / 1000, (long)(delay_ms % 1000) * 1000000}, NULL);
  atomic_store(&c->aborted, 1); /* wakes calls still waiting in other threads */
  comm_release(c);
  return ncclSuccess;
}

static int nccl_dt(ncclDataType_t d) { return (int)d >= 0 && (int)d < 12 ? (int)d : -1; }

/* ---- NCCL API (every function first logs its call) ---- */
#define LOG(fmt, ...) log_call("%s " fmt, __func__, __VA_ARGS__)
#define LOGC(fmt, ...) log_call("%s " fmt " comm=" PF " stream=" PF, __func__, __VA_ARGS__, P(comm), P(stream))
static int coll(int kind, const char *fn, void *comm, const void *send, void *recv, size_t count, int dt, int op, int root) {
  return run((call_t){.kind = kind, .fn = fn, .c = comm, .send = send, .recv = recv, .count = count, .dt = dt, .op = op, .root = root});
}
static int query(const char *fn, const struct fakeComm *c, int *out, int value) {
  if (!c || !out) return set_err(ncclInvalidArgument, "fakecomm: %s: NULL argument", fn);
  *out = value;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t result) {
  static const char *const s[] = {"no error", "unhandled cuda error", "unhandled system error", "internal error",
                                  "invalid argument", "invalid usage", "remote process exited or there was a network error",
                                  "NCCL operation in progress"};
  LOG("result=%d", (int)result);
  return (int)result >= 0 && (int)result < 8 ? s[result] : "unknown result code";
}
const char *ncclGetLastError(ncclComm_t comm) { LOG("comm=" PF, P(comm)); return g_err; }
ncclResult_t ncclGetVersion(int *version) {
  log_call("ncclGetVersion");
  if (!version) return set_err(ncclInvalidArgument, "fakecomm: %s: version is NULL", __func__);
  *version = FAKECOMM_VERSION;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  log_call("ncclGetUniqueId");
  return id ? make_dir(id->internal, sizeof id->internal, __func__) : set_err(ncclInvalidArgument, "fakecomm: %s: id is NULL", __func__);
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  int rc = comm_init(comm, nranks, commId.internal, sizeof commId.internal, rank, __func__);
  LOG("nranks=%d rank=%d comm=" PF, nranks, rank, P(comm ? *comm : NULL));
  return rc;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) { LOG("comm=" PF, P(comm)); return comm_free(comm, __func__, 0); }
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  LOG("comm=" PF, P(comm));
  pthread_mutex_lock(&g_mu);
  int delay = g_abort_delay_ms;
  pthread_mutex_unlock(&g_mu);
  return comm_free(comm, __func__, delay);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  LOG("comm=" PF, P(comm));
  if (!comm || !asyncError) return set_err(ncclInvalidArgument, "fakecomm: %s: NULL argument", __func__);
  *asyncError = ncclSuccess;
  return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) { LOG("comm=" PF, P(comm)); return query(__func__, comm, count, comm ? comm->nranks : 0); }
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) { LOG("comm=" PF, P(comm)); return query(__func__, comm, rank, comm ? comm->rank : 0); }

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  LOGC("send=" PF " recv=" PF " count=%zu dtype=%d op=%d", P(sendbuff), P(recvbuff), count, (int)datatype, (int)op);
  return coll(K_ALLREDUCE, __func__, comm, sendbuff, recvbuff, count, nccl_dt(datatype), (int)op, 0);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm,
                           cudaStream_t stream) {
  LOGC("send=" PF " recv=" PF " count=%zu dtype=%d", P(sendbuff), P(recvbuff), sendcount, (int)datatype);
  return coll(K_ALLGATHER, __func__, comm, sendbuff, recvbuff, sendcount, nccl_dt(datatype), 0, 0);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  LOGC("send=" PF " recv=" PF " count=%zu dtype=%d op=%d", P(sendbuff), P(recvbuff), recvcount, (int)datatype, (int)op);
  return coll(K_REDSCAT, __func__, comm, sendbuff, recvbuff, recvcount, nccl_dt(datatype), (int)op, 0);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  LOGC("send=" PF " recv=" PF " count=%zu dtype=%d root=%d", P(sendbuff), P(recvbuff), count, (int)datatype, root);
  return coll(K_BCAST, __func__, comm, sendbuff, recvbuff, count, nccl_dt(datatype), 0, root);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  LOGC("send=" PF " recv=" PF " count=%zu dtype=%d op=%d root=%d", P(sendbuff), P(recvbuff), count, (int)datatype, (int)op, root);
  return coll(K_REDUCE, __func__, comm, sendbuff, recvbuff, count, nccl_dt(datatype), (int)op, root);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream) {
  LOGC("send=" PF " count=%zu dtype=%d peer=%d", P(sendbuff), count, (int)datatype, peer);
  return coll(K_SEND, __func__, comm, sendbuff, NULL, count, nccl_dt(datatype), 0, peer);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream) {
  LOGC("recv=" PF " count=%zu dtype=%d peer=%d", P(recvbuff), count, (int)datatype, peer);
  return coll(K_RECV, __func__, comm, NULL, recvbuff, count, nccl_dt(datatype), 0, peer);
}

ncclResult_t ncclGroupStart(void) { log_call("ncclGroupStart"); return group(1, __func__); }
ncclResult_t ncclGroupEnd(void) { log_call("ncclGroupEnd"); return group(-1, __func__); }

#ifdef FAKECOMM_WINDOW
static char g_window; /* every registration gets this dummy handle */
ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, void **win, int winFlags) {
  LOG("comm=" PF " buff=" PF " size=%zu flags=%d", P(comm), P(buff), size, winFlags);
  if (!comm || !win) return set_err(ncclInvalidArgument, "fakecomm: %s: NULL argument", __func__);
  *win = &g_window;
  return ncclSuccess;
}
ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, void *win) { LOG("comm=" PF " win=" PF, P(comm), P(win)); return ncclSuccess; }
#endif

/* ---- HCCL API: the same core, with HCCL enums and result codes ---- */
static int hdt(HcclDataType d) { return (int)d >= 0 && (int)d < 12 ? hccl_dt[d] : -1; }
static int hop(HcclReduceOp op) { return (int)op >= 0 && (int)op <= 3 ? (int)op : -1; }
static int hrank(uint32_t r) { return r > INT_MAX ? -1 : (int)r; }
static HcclResult to_hccl(int rc) {
  return rc == ncclSuccess ? HCCL_SUCCESS : rc == ncclInvalidArgument || rc == ncclInvalidUsage ? HCCL_E_PARA
         : rc == ncclRemoteError ? HCCL_E_TIMEOUT : HCCL_E_INTERNAL;
}

HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo) {
  log_call("HcclGetRootInfo");
  return to_hccl(rootInfo ? make_dir(rootInfo->internal, sizeof rootInfo->internal, __func__)
                          : set_err(ncclInvalidArgument, "fakecomm: %s: rootInfo is NULL", __func__));
}

HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, HcclComm *comm) {
  struct fakeComm *c = NULL;
  int rc = !rootInfo || !comm || nRanks > INT_MAX ? set_err(ncclInvalidArgument, "fakecomm: %s: invalid argument", __func__)
           : comm_init(&c, (int)nRanks, rootInfo->internal, sizeof rootInfo->internal, hrank(rank), __func__);
  if (comm) *comm = c;
  LOG("nranks=%" PRIu32 " rank=%" PRIu32 " comm=" PF, nRanks, rank, P(c));
  return to_hccl(rc);
}

HcclResult HcclCommDestroy(HcclComm comm) { LOG("comm=" PF, P(comm)); return to_hccl(comm_free(comm, __func__, 0)); }

const char *HcclGetErrorString(HcclResult code) {
  LOG("result=%d", (int)code);
  switch ((int)code) {
  case HCCL_SUCCESS: return "no error";
  case HCCL_E_PARA: return "parameter error";
  case HCCL_E_INTERNAL: return "internal error";
  case HCCL_E_NOT_SUPPORT: return "not supported";
  case HCCL_E_TIMEOUT: return "timeout";
  case HCCL_E_REMOTE: return "remote error";
  default: return "unknown error";
  }
}

HcclResult HcclGroupStart(void) { log_call("HcclGroupStart"); return to_hccl(group(1, __func__)); }
HcclResult HcclGroupEnd(void) { log_call("HcclGroupEnd"); return to_hccl(group(-1, __func__)); }

HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType, HcclReduceOp op, HcclComm comm,
                         aclrtStream stream) {
  LOGC("send=" PF " recv=" PF " count=%" PRIu64 " dtype=%d op=%d", P(sendBuf), P(recvBuf), count, (int)dataType, (int)op);
  return to_hccl(coll(K_ALLREDUCE, __func__, comm, sendBuf, recvBuf, count, hdt(dataType), hop(op), 0));
}

HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType, uint32_t root, HcclComm comm, aclrtStream stream) {
  LOGC("send=" PF " recv=" PF " count=%" PRIu64 " dtype=%d root=%" PRIu32, P(buf), P(buf), count, (int)dataType, root);
  return to_hccl(coll(K_BCAST, __func__, comm, buf, buf, count, hdt(dataType), 0, hrank(root)));
}

HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, HcclDataType dataType, HcclComm comm, aclrtStream stream) {
  LOGC("send=" PF " recv=" PF " count=%" PRIu64 " dtype=%d", P(sendBuf), P(recvBuf), sendCount, (int)dataType);
  return to_hccl(coll(K_ALLGATHER, __func__, comm, sendBuf, recvBuf, sendCount, hdt(dataType), 0, 0));
}

HcclResult HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount, HcclDataType dataType, HcclReduceOp op,
                             HcclComm comm, aclrtStream stream) {
  LOGC("send=" PF " recv=" PF " count=%" PRIu64 " dtype=%d op=%d", P(sendBuf), P(recvBuf), recvCount, (int)dataType, (int)op);
  return to_hccl(coll(K_REDSCAT, __func__, comm, sendBuf, recvBuf, recvCount, hdt(dataType), hop(op), 0));
}

HcclResult HcclReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType, HcclReduceOp op, uint32_t root,
                      HcclComm comm, aclrtStream stream) {
  LOGC("send=" PF " recv=" PF " count=%" PRIu64 " dtype=%d op=%d root=%" PRIu32, P(sendBuf), P(recvBuf), count, (int)dataType, (int)op, root);
  return to_hccl(coll(K_REDUCE, __func__, comm, sendBuf, recvBuf, count, hdt(dataType), hop(op), hrank(root)));
}

HcclResult HcclSend(void *sendBuf, uint64_t count, HcclDataType dataType, uint32_t destRank, HcclComm comm, aclrtStream stream) {
  LOGC("send=" PF " count=%" PRIu64 " dtype=%d peer=%" PRIu32, P(sendBuf), count, (int)dataType, destRank);
  return to_hccl(coll(K_SEND, __func__, comm, sendBuf, NULL, count, hdt(dataType), 0, hrank(destRank)));
}

HcclResult HcclRecv(void *recvBuf, uint64_t count, HcclDataType dataType, uint32_t srcRank, HcclComm comm, aclrtStream stream) {
  LOGC("recv=" PF " count=%" PRIu64 " dtype=%d peer=%" PRIu32, P(recvBuf), count, (int)dataType, srcRank);
  return to_hccl(coll(K_RECV, __func__, comm, NULL, recvBuf, count, hdt(dataType), 0, hrank(srcRank)));
}

static char *join_u64(char *out, size_t cap, const uint64_t *v, int n) { /* "1,2,3" */
  size_t k = 0;
  out[0] = '\0';
  for (int i = 0; v && i < n && k < cap; i++) k += (size_t)snprintf(out + k, cap - k, "%s%" PRIu64, i ? "," : "", v[i]);
  return out;
}

HcclResult HcclAlltoAllV(const void *sendBuf, const void *sendCounts, const void *sdispls, HcclDataType sendType,
                         const void *recvBuf, const void *recvCounts, const void *rdispls, HcclDataType recvType,
                         HcclComm comm, aclrtStream stream) {
  int n = comm ? ((struct fakeComm *)comm)->nranks : 0;
  size_t cap = (size_t)n * 21 + 1;
  char *a = malloc(4 * cap);
  if (a) LOGC("send=" PF " recv=" PF " dtype=%d recvdtype=%d sendcounts=%s sdispls=%s recvcounts=%s rdispls=%s", P(sendBuf),
              P(recvBuf), (int)sendType, (int)recvType, join_u64(a, cap, sendCounts, n), join_u64(a + cap, cap, sdispls, n),
              join_u64(a + 2 * cap, cap, recvCounts, n), join_u64(a + 3 * cap, cap, rdispls, n));
  free(a);
  return to_hccl(run((call_t){.kind = K_A2AV, .fn = __func__, .c = comm, .send = sendBuf, .recv = (void *)(uintptr_t)recvBuf,
                              .dt = hdt(sendType), .rdt = hdt(recvType), .sc = sendCounts, .sd = sdispls, .rc = recvCounts, .rd = rdispls}));
}

/* ---- test hooks ---- */
int fakecomm_host_memory(void) { return 1; }

size_t fakecomm_log(char *buf, size_t cap) {
  pthread_mutex_lock(&g_mu);
  size_t n = g_log_len;
  if (buf && cap) {
    size_t k = n < cap - 1 ? n : cap - 1;
    if (k) memcpy(buf, g_log, k);
    buf[k] = '\0';
  }
  pthread_mutex_unlock(&g_mu);
  return n;
}

void fakecomm_log_clear(void) {
  pthread_mutex_lock(&g_mu);
  g_log_len = 0;
  if (g_log) g_log[0] = '\0';
  pthread_mutex_unlock(&g_mu);
}

void fakecomm_fail_next(int rc) {
  pthread_mutex_lock(&g_mu);
  g_fail_armed = 1, g_fail_rc = rc;
  pthread_mutex_unlock(&g_mu);
}

#define SETTER(name, var) \
  void name(int ms) { pthread_mutex_lock(&g_mu); var = ms; pthread_mutex_unlock(&g_mu); }
SETTER(fakecomm_set_timeout_ms, g_timeout_ms)
SETTER(fakecomm_set_abort_delay_ms, g_abort_delay_ms)
