/* A test double of the AscendCL runtime for the ascend backend's unit tests: the subset of
 * the ascend-sys headers over host memory, deterministic. Not a simulator (that is soma-capi over
 * soma-sim): tasks are queued per stream and run, in order, when the stream, an event recorded
 * on it, or the device is synchronized, or when mock_run_all() is called; a streamWaitEvent
 * task runs the recording stream's queue before going on. Device memory is host memory; copies really copy.
 *
 * Hooks for tests (not part of the API): mock_set_device_calls, mock_set_pool_supported,
 * mock_fail_next, mock_run_all, mock_live_streams, mock_live_events. */
#define FUNC_VISIBILITY
#include <acl/acl.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define GRAN ((size_t)2 << 20)
#define TOTAL ((size_t)64 << 30)
#define MAXQ 4096

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int set_device_calls;
static int pool_supported;
static int fail_next_code; /* the next failing-capable call returns this code */
static int live_streams, live_events;
static __thread char errmsg[256];
static __thread int current_device = -1;

enum kind { T_COPY, T_SET, T_HOST, T_RECORD, T_WAIT };
struct task { enum kind k; void *dst; const void *src; size_t n; int v; aclrtHostFunc fn; void *arg; struct event *ev; };
struct stream { struct task q[MAXQ]; int head, tail; int magic; };
struct event { int recorded, done; struct stream *on; int pos; int magic; double t; };
struct phys { size_t size; void *at; int magic; struct phys *next; };
static struct phys *all_phys;
struct pool { size_t max; int live; uint64_t attrs[9]; int magic; };

static struct stream default_stream = { .magic = 0x57 };
static double clock_ms;

static aclError fail(aclError code, const char *msg) {
    strncpy(errmsg, msg, sizeof errmsg - 1);
    return code;
}

static int take_fail(void) {
    int c = fail_next_code;
    fail_next_code = 0;
    return c;
}

static struct stream *S(aclrtStream s) { return s ? (struct stream *)s : &default_stream; }

static int stream_alive(void *p);

static void run_stream(struct stream *s) {
    while (s->head < s->tail) {
        struct task *t = &s->q[s->head % MAXQ];
        s->head++;
        switch (t->k) {
        case T_COPY: memmove(t->dst, t->src, t->n); break;
        case T_SET: memset(t->dst, t->v, t->n); break;
        case T_HOST:
            pthread_mutex_unlock(&mu);
            t->fn(t->arg);
            pthread_mutex_lock(&mu);
            break;
        case T_RECORD: t->ev->done = 1; t->ev->t = (clock_ms += 1.5); break;
        case T_WAIT: /* the recording stream (if still alive) catches up, past the record */
            if (t->dst && t->dst != s && stream_alive(t->dst)) run_stream(t->dst);
            break;
        }
    }
}

static aclError push(aclrtStream st, struct task t) {
    struct stream *s = S(st);
    if (s->magic != 0x57) return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: bad stream");
    if (s->tail - s->head >= MAXQ) return fail(ACL_ERROR_RT_PARAM_INVALID, "mock: queue full");
    s->q[s->tail % MAXQ] = t;
    s->tail++;
    return ACL_SUCCESS;
}

/* ---- hooks ---- */
int mock_set_device_calls(void) { return set_device_calls; }
void mock_set_pool_supported(int on) { pool_supported = on; }
void mock_fail_next(int code) { fail_next_code = code; }
int mock_live_streams(void) { return live_streams; }
int mock_live_events(void) { return live_events; }

/* ---- acl.h ---- */
aclError aclInit(const char *configPath) {
    (void)configPath;
    pthread_mutex_lock(&mu);
    int again = initialized;
    initialized = 1;
    pthread_mutex_unlock(&mu);
    return again ? fail(100002, "mock: repeat initialize") : ACL_SUCCESS;
}
aclError aclFinalize(void) { return ACL_SUCCESS; }
const char *aclGetRecentErrMsg(void) { return errmsg; }

/* ---- devices ---- */
aclError aclrtSetDevice(int32_t id) {
    if (id != 0) return fail(ACL_ERROR_RT_PARAM_INVALID, "mock: one device");
    __sync_fetch_and_add(&set_device_calls, 1);
    current_device = id;
    return ACL_SUCCESS;
}
aclError aclrtResetDevice(int32_t id) { (void)id; return ACL_SUCCESS; }
aclError aclrtGetDevice(int32_t *id) { *id = current_device; return ACL_SUCCESS; }
aclError aclrtGetDeviceCount(uint32_t *count) {
    if (!initialized) return fail(ACL_ERROR_UNINITIALIZE, "mock: aclInit first");
    *count = 1;
    return ACL_SUCCESS;
}
void mock_run_all(void);
aclError aclrtSynchronizeDevice(void) { mock_run_all(); return ACL_SUCCESS; }
/* One device: it has no peer. */
aclError aclrtDeviceCanAccessPeer(int32_t *can, int32_t id, int32_t peer) {
    (void)can; (void)id; (void)peer;
    return fail(ACL_ERROR_INVALID_PARAM, "mock: one device, no peer");
}
aclError aclrtDeviceEnablePeerAccess(int32_t peer, uint32_t flags) {
    (void)peer; (void)flags;
    return fail(ACL_ERROR_INVALID_PARAM, "mock: one device, no peer");
}
aclError aclrtDeviceDisablePeerAccess(int32_t peer) {
    (void)peer;
    return fail(ACL_ERROR_INVALID_PARAM, "mock: one device, no peer");
}
aclError aclrtCreateContext(aclrtContext *c, int32_t id) { (void)id; *c = &default_stream; return ACL_SUCCESS; }
aclError aclrtDestroyContext(aclrtContext c) { (void)c; return ACL_SUCCESS; }
aclError aclrtSetCurrentContext(aclrtContext c) { (void)c; return ACL_SUCCESS; }

/* ---- streams ---- */
#define MAXS 256
static struct stream *streams[MAXS];
static int stream_alive(void *p) {
    if (p == &default_stream) return 1;
    for (int i = 0; i < MAXS; i++) if (streams[i] == p) return 1;
    return 0;
}
void mock_run_all(void) {
    pthread_mutex_lock(&mu);
    run_stream(&default_stream);
    for (int i = 0; i < MAXS; i++)
        if (streams[i]) run_stream(streams[i]);
    pthread_mutex_unlock(&mu);
}
aclError aclrtCreateStream(aclrtStream *out) {
    if (current_device != 0) return fail(ACL_ERROR_RT_PARAM_INVALID, "mock: no current device");
    int c = take_fail();
    if (c) return fail(c, "mock: injected");
    struct stream *s = calloc(1, sizeof *s);
    s->magic = 0x57;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXS; i++) if (!streams[i]) { streams[i] = s; break; }
    live_streams++;
    pthread_mutex_unlock(&mu);
    *out = s;
    return ACL_SUCCESS;
}
aclError aclrtDestroyStream(aclrtStream st) {
    struct stream *s = st;
    if (!s || s->magic != 0x57) return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: bad stream");
    pthread_mutex_lock(&mu);
    run_stream(s);
    for (int i = 0; i < MAXS; i++) if (streams[i] == s) streams[i] = NULL;
    live_streams--;
    s->magic = 0;
    pthread_mutex_unlock(&mu);
    free(s);
    return ACL_SUCCESS;
}
aclError aclrtSynchronizeStream(aclrtStream st) {
    struct stream *s = S(st);
    if (s->magic != 0x57) return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: bad stream");
    pthread_mutex_lock(&mu);
    run_stream(s);
    pthread_mutex_unlock(&mu);
    return ACL_SUCCESS;
}
aclError aclrtStreamQuery(aclrtStream st, aclrtStreamStatus *status) {
    struct stream *s = S(st);
    if (s->magic != 0x57) return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: bad stream");
    pthread_mutex_lock(&mu);
    *status = s->head == s->tail ? ACL_STREAM_STATUS_COMPLETE : ACL_STREAM_STATUS_NOT_READY;
    pthread_mutex_unlock(&mu);
    return ACL_SUCCESS;
}

/* ---- events ---- */
aclError aclrtCreateEvent(aclrtEvent *out) {
    struct event *e = calloc(1, sizeof *e);
    e->magic = 0xE7;
    __sync_fetch_and_add(&live_events, 1);
    *out = e;
    return ACL_SUCCESS;
}
aclError aclrtDestroyEvent(aclrtEvent ev) {
    struct event *e = ev;
    if (!e || e->magic != 0xE7) return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: bad event");
    e->magic = 0;
    __sync_fetch_and_sub(&live_events, 1);
    free(e);
    return ACL_SUCCESS;
}
aclError aclrtRecordEvent(aclrtEvent ev, aclrtStream s) {
    struct event *e = ev;
    pthread_mutex_lock(&mu);
    e->recorded = 1;
    e->done = 0;
    e->on = S(s);
    struct task t = { .k = T_RECORD, .ev = e };
    aclError r = push(s, t);
    pthread_mutex_unlock(&mu);
    return r;
}
aclError aclrtStreamWaitEvent(aclrtStream s, aclrtEvent ev) {
    pthread_mutex_lock(&mu);
    struct event *e = ev;
    /* Resolved now: the event may be destroyed before the wait runs. */
    struct task t = { .k = T_WAIT, .dst = e->recorded ? (void *)e->on : NULL };
    aclError r = push(s, t);
    pthread_mutex_unlock(&mu);
    return r;
}
aclError aclrtSynchronizeEvent(aclrtEvent ev) {
    struct event *e = ev;
    pthread_mutex_lock(&mu);
    if (e->recorded && e->on) run_stream(e->on);
    pthread_mutex_unlock(&mu);
    return ACL_SUCCESS;
}
aclError aclrtQueryEventStatus(aclrtEvent ev, aclrtEventRecordedStatus *st) {
    struct event *e = ev;
    pthread_mutex_lock(&mu);
    *st = (!e->recorded || e->done) ? ACL_EVENT_RECORDED_STATUS_COMPLETE
                                    : ACL_EVENT_RECORDED_STATUS_NOT_READY;
    pthread_mutex_unlock(&mu);
    return ACL_SUCCESS;
}
aclError aclrtEventElapsedTime(float *ms, aclrtEvent a, aclrtEvent b) {
    struct event *x = a, *y = b;
    if (!x->done || !y->done) return fail(ACL_ERROR_INVALID_PARAM, "mock: not complete");
    *ms = (float)(y->t - x->t);
    return ACL_SUCCESS;
}
aclError aclrtLaunchHostFunc(aclrtStream s, aclrtHostFunc fn, void *args) {
    int c = take_fail();
    if (c) return fail(c, "mock: injected");
    pthread_mutex_lock(&mu);
    struct task t = { .k = T_HOST, .fn = fn, .arg = args };
    aclError r = push(s, t);
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- memory ---- */
static size_t used;
aclError aclrtMalloc(void **p, size_t size, aclrtMemMallocPolicy policy) {
    (void)policy;
    int c = take_fail();
    if (c) return fail(c, "mock: injected");
    if (size > TOTAL - used) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "mock: out of memory");
    char *b = malloc(size + 16); /* size in a 16-byte header */
    memcpy(b, &size, sizeof size);
    *p = b + 16;
    __sync_fetch_and_add(&used, size);
    return ACL_SUCCESS;
}
aclError aclrtFree(void *p) {
    size_t size;
    if (!p) return fail(ACL_ERROR_INVALID_PARAM, "mock: null");
    memcpy(&size, (char *)p - 16, sizeof size);
    __sync_fetch_and_sub(&used, size);
    free((char *)p - 16);
    return ACL_SUCCESS;
}
aclError aclrtMallocHost(void **p, size_t size) { *p = malloc(size); return ACL_SUCCESS; }
aclError aclrtFreeHost(void *p) { free(p); return ACL_SUCCESS; }
aclError aclrtMemcpy(void *dst, size_t max, const void *src, size_t n, aclrtMemcpyKind k) {
    (void)k;
    if (n > max) return fail(ACL_ERROR_INVALID_PARAM, "mock: count > destMax");
    memmove(dst, src, n);
    return ACL_SUCCESS;
}
aclError aclrtMemcpyAsync(void *dst, size_t max, const void *src, size_t n, aclrtMemcpyKind k,
                          aclrtStream s) {
    (void)k;
    if (n > max) return fail(ACL_ERROR_INVALID_PARAM, "mock: count > destMax");
    pthread_mutex_lock(&mu);
    struct task t = { .k = T_COPY, .dst = dst, .src = src, .n = n };
    aclError r = push(s, t);
    pthread_mutex_unlock(&mu);
    return r;
}
aclError aclrtMemset(void *p, size_t max, int32_t v, size_t n) {
    if (n > max) return fail(ACL_ERROR_INVALID_PARAM, "mock: count > maxCount");
    memset(p, v, n);
    return ACL_SUCCESS;
}
aclError aclrtMemsetAsync(void *p, size_t max, int32_t v, size_t n, aclrtStream s) {
    if (n > max) return fail(ACL_ERROR_INVALID_PARAM, "mock: count > maxCount");
    pthread_mutex_lock(&mu);
    struct task t = { .k = T_SET, .dst = p, .n = n, .v = v };
    aclError r = push(s, t);
    pthread_mutex_unlock(&mu);
    return r;
}
aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *fr, size_t *total) {
    (void)attr;
    *fr = TOTAL - used;
    *total = TOTAL;
    return ACL_SUCCESS;
}

/* ---- VMM: reservations are real (accessible) anonymous mappings ---- */
aclError aclrtReserveMemAddress(void **va, size_t size, size_t align, void *expect, uint64_t fl) {
    (void)align; (void)expect; (void)fl;
    if (size == 0 || size % GRAN) return fail(ACL_ERROR_INVALID_PARAM, "mock: size");
    void *p = mmap(NULL, size + GRAN, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return fail(ACL_ERROR_BAD_ALLOC, "mock: mmap");
    *va = (void *)(((uintptr_t)p + GRAN - 1) & ~(uintptr_t)(GRAN - 1));
    return ACL_SUCCESS;
}
aclError aclrtReleaseMemAddress(void *va) { (void)va; return ACL_SUCCESS; /* leaked: test double */ }
aclError aclrtMallocPhysical(aclrtDrvMemHandle *h, size_t size, const aclrtPhysicalMemProp *prop,
                             uint64_t fl) {
    (void)fl;
    int c = take_fail();
    if (c) return fail(c, "mock: injected");
    if (prop->location.type != ACL_MEM_LOCATION_TYPE_DEVICE ||
        prop->allocationType != ACL_MEM_ALLOCATION_TYPE_PINNED)
        return fail(ACL_ERROR_INVALID_PARAM, "mock: prop");
    if (size > TOTAL - used) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "mock: out of memory");
    struct phys *ph = calloc(1, sizeof *ph);
    ph->size = size;
    ph->magic = 0xF1;
    pthread_mutex_lock(&mu);
    ph->next = all_phys;
    all_phys = ph;
    used += size;
    pthread_mutex_unlock(&mu);
    *h = ph;
    return ACL_SUCCESS;
}
aclError aclrtFreePhysical(aclrtDrvMemHandle h) {
    struct phys *ph = h;
    if (!ph || ph->magic != 0xF1 || ph->at) return fail(ACL_ERROR_INVALID_PARAM, "mock: handle");
    pthread_mutex_lock(&mu);
    for (struct phys **pp = &all_phys; *pp; pp = &(*pp)->next)
        if (*pp == ph) { *pp = ph->next; break; }
    used -= ph->size;
    pthread_mutex_unlock(&mu);
    ph->magic = 0;
    free(ph);
    return ACL_SUCCESS;
}
aclError aclrtMapMem(void *va, size_t size, size_t off, aclrtDrvMemHandle h, uint64_t fl) {
    struct phys *ph = h;
    (void)fl;
    if (!ph || ph->magic != 0xF1 || ph->at || off || size != ph->size)
        return fail(ACL_ERROR_INVALID_PARAM, "mock: map");
    ph->at = va;
    return ACL_SUCCESS;
}
aclError aclrtUnmapMem(void *va) {
    pthread_mutex_lock(&mu);
    for (struct phys *p = all_phys; p; p = p->next)
        if (p->at == va) { p->at = NULL; pthread_mutex_unlock(&mu); return ACL_SUCCESS; }
    pthread_mutex_unlock(&mu);
    return fail(ACL_ERROR_INVALID_PARAM, "mock: not mapped");
}
aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop,
                                          aclrtMemGranularityOptions opt, size_t *g) {
    (void)prop; (void)opt;
    *g = GRAN;
    return ACL_SUCCESS;
}

/* ---- IPC: a process of its own, whose exports nobody imports ---- */
aclError aclrtMemExportToShareableHandle(aclrtDrvMemHandle h, aclrtMemHandleType t,
                                         uint64_t flags, uint64_t *out) {
    (void)t; (void)flags;
    *out = (uint64_t)(uintptr_t)h;
    return ACL_SUCCESS;
}
aclError aclrtMemSetPidToShareableHandle(uint64_t shareable, int32_t *pid, size_t n) {
    (void)shareable; (void)pid; (void)n;
    return ACL_SUCCESS;
}
aclError aclrtMemImportFromShareableHandle(uint64_t shareable, int32_t id,
                                           aclrtDrvMemHandle *h) {
    (void)shareable; (void)id; (void)h;
    return fail(ACL_ERROR_RT_PARAM_INVALID, "mock: import and export only across processes");
}
aclError aclrtDeviceGetBareTgid(int32_t *pid) {
    *pid = 4242;
    return ACL_SUCCESS;
}

/* ---- pools ---- */
aclError aclrtMemPoolCreate(aclrtMemPool *out, const aclrtMemPoolProps *p) {
    if (!pool_supported) return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "mock: not Atlas A2");
    if (!out || !p || p->allocType != ACL_MEM_ALLOCATION_TYPE_PINNED ||
        p->location.type != ACL_MEM_LOCATION_TYPE_DEVICE)
        return fail(ACL_ERROR_INVALID_PARAM, "mock: props");
    for (int i = 0; i < 32; i++) if (p->reserved[i]) return fail(ACL_ERROR_INVALID_PARAM, "mock: reserved");
    struct pool *pl = calloc(1, sizeof *pl);
    pl->max = p->maxSize ? (p->maxSize + GRAN - 1) / GRAN * GRAN : TOTAL;
    pl->magic = 0x9001;
    *out = pl;
    return ACL_SUCCESS;
}
aclError aclrtMemPoolDestroy(const aclrtMemPool mp) {
    struct pool *pl = mp;
    if (!pl || pl->magic != 0x9001) return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: pool");
    if (pl->live) return fail(ACL_ERROR_INVALID_PARAM, "mock: live allocations");
    pl->magic = 0;
    free(pl);
    return ACL_SUCCESS;
}
aclError aclrtMemPoolSetAttr(aclrtMemPool mp, aclrtMemPoolAttr a, void *v) {
    struct pool *pl = mp;
    if (a < 1 || a > 8) return fail(ACL_ERROR_INVALID_PARAM, "mock: attr");
    if (a == 5 || a == 7) return fail(ACL_ERROR_INVALID_PARAM, "mock: read-only");
    if (a <= 3) pl->attrs[a] = *(uint32_t *)v != 0;
    else pl->attrs[a] = *(uint64_t *)v;
    return ACL_SUCCESS;
}
aclError aclrtMemPoolGetAttr(aclrtMemPool mp, aclrtMemPoolAttr a, void *v) {
    struct pool *pl = mp;
    if (a < 1 || a > 8) return fail(ACL_ERROR_INVALID_PARAM, "mock: attr");
    if (a <= 3) *(uint32_t *)v = (uint32_t)pl->attrs[a];
    else if (a == 7) *(uint64_t *)v = (uint64_t)pl->live;
    else *(uint64_t *)v = pl->attrs[a];
    return ACL_SUCCESS;
}
/* Each pool allocation carries its pool in a 16-byte header. */
aclError aclrtMemPoolMallocAsync(void **p, size_t size, aclrtMemPool mp, aclrtStream s) {
    struct pool *pl = mp;
    (void)s;
    if (!pl || pl->magic != 0x9001) return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: pool");
    if (!size) return fail(ACL_ERROR_INVALID_PARAM, "mock: size 0");
    if (size > pl->max) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "mock: pool full");
    char *b = malloc(size + 16);
    memcpy(b, &pl, sizeof pl);
    *p = b + 16;
    pl->live++;
    return ACL_SUCCESS;
}
aclError aclrtMemPoolFreeAsync(void *p, aclrtStream s) {
    struct pool *pl;
    (void)s;
    if (!p) return fail(ACL_ERROR_INVALID_PARAM, "mock: null");
    memcpy(&pl, (char *)p - 16, sizeof pl);
    pl->live--;
    free((char *)p - 16); /* not stream-ordered: a test double */
    return ACL_SUCCESS;
}
aclError aclrtMemPoolTrimTo(aclrtMemPool mp, size_t keep) {
    struct pool *pl = mp;
    if (keep > pl->max) return fail(ACL_ERROR_INVALID_PARAM, "mock: keep > size");
    return ACL_SUCCESS;
}

/* ---- acl_rt.h, model runtime instances: this double offers no capture (the backend's capture
 * runs over soma-capi in the integration tests); it answers as a runtime without it would ---- */
aclError aclmdlRICaptureBegin(aclrtStream s, aclmdlRICaptureMode mode) {
    (void)s;
    (void)mode;
    return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "mock: no stream capture");
}
aclError aclmdlRICaptureGetInfo(aclrtStream s, aclmdlRICaptureStatus *status, aclmdlRI *m) {
    (void)s;
    *status = ACL_MODEL_RI_CAPTURE_STATUS_NONE;
    *m = NULL;
    return ACL_SUCCESS;
}
aclError aclmdlRICaptureEnd(aclrtStream s, aclmdlRI *m) {
    (void)s;
    (void)m;
    return fail(ACL_ERROR_RT_STREAM_NOT_CAPTURED, "mock: not capturing");
}
aclError aclmdlRICaptureThreadExchangeMode(aclmdlRICaptureMode *mode) {
    (void)mode;
    return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "mock: no stream capture");
}
aclError aclmdlRIExecuteAsync(aclmdlRI m, aclrtStream s) {
    (void)m;
    (void)s;
    return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: no models");
}
aclError aclmdlRIExecute(aclmdlRI m, int32_t timeout) {
    (void)m;
    (void)timeout;
    return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: no models");
}
aclError aclmdlRIDestroy(aclmdlRI m) {
    (void)m;
    return fail(ACL_ERROR_RT_INVALID_HANDLE, "mock: no models");
}
