/*
 * trace_replay.c - replays real PyTorch allocator traces (the workspace's data/traces, format
 * in its README) through the pool API on one stream, as an inference engine written against CANN
 * would allocate: aclrtMemPoolMallocAsync / aclrtMemPoolFreeAsync, no synchronisation until
 * the end. Then reads the pool's high-water marks and checks that peak reserved memory stays
 * within 5 % of peak used memory, both in whole allocation granules (the fragmentation target
 * of docs/performance.md).
 *
 * Usage: trace_replay [DIR]   (default: $SOMA_TRACES). DIR holds plain *.csv traces: this
 * program does not decompress, so the gzipped traces of data/traces are decompressed into a
 * directory first (`gzip -dc`), as scripts/run-c-examples.sh does. Without a directory the
 * program says so and does nothing; traces whose peak does not fit the device, and gzipped
 * files, are skipped with a printed reason. The last line before "ok" says how many of the
 * directory's traces were replayed.
 *
 * Build and run: scripts/run-c-examples.sh
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define MAX_FRAGMENTATION 1.05

/* One trace event: an allocation of `bytes` under `id`, or (bytes == 0) a free of `id`. */
typedef struct {
    uint64_t id;
    uint64_t bytes;
    int isAlloc;
} TraceOp;

typedef struct {
    TraceOp *ops;
    size_t count;
    uint64_t maxId;
    uint64_t peakLive; /* peak of the live requested bytes */
} Trace;

/* Parses a trace file; returns 0 on success, prints the reason and returns -1 otherwise. */
static int LoadTrace(const char *path, Trace *t)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "%s: cannot open\n", path);
        return -1;
    }
    char line[256];
    if (fgets(line, sizeof(line), f) == NULL || strncmp(line, "op,id,bytes,stream", 18) != 0) {
        fprintf(stderr, "%s: not a trace (bad header)\n", path);
        fclose(f);
        return -1;
    }
    size_t capacity = 1024;
    memset(t, 0, sizeof(*t));
    t->ops = malloc(capacity * sizeof(TraceOp));
    EXPECT(t->ops != NULL);
    size_t lineNo = 1;
    while (fgets(line, sizeof(line), f) != NULL) {
        lineNo++;
        char op = 0;
        unsigned long long id = 0;
        unsigned long long bytes = 0;
        unsigned long long stream = 0;
        if (sscanf(line, "%c,%llu,%llu,%llu", &op, &id, &bytes, &stream) != 4 ||
            (op != 'a' && op != 'f')) {
            fprintf(stderr, "%s:%zu: bad line: %s", path, lineNo, line);
            free(t->ops);
            fclose(f);
            return -1;
        }
        if (t->count == capacity) {
            capacity *= 2;
            TraceOp *grown = realloc(t->ops, capacity * sizeof(TraceOp));
            EXPECT(grown != NULL);
            t->ops = grown;
        }
        t->ops[t->count++] = (TraceOp){id, bytes, op == 'a'};
        if (id > t->maxId) {
            t->maxId = id;
        }
    }
    fclose(f);
    /* The peak of the live requested bytes (a free line carries 0 bytes: look its size up). */
    uint64_t *sizes = calloc(t->maxId + 1, sizeof(uint64_t));
    EXPECT(sizes != NULL);
    uint64_t live = 0;
    for (size_t i = 0; i < t->count; i++) {
        TraceOp *o = &t->ops[i];
        if (o->isAlloc) {
            sizes[o->id] = o->bytes;
            live += o->bytes;
            if (live > t->peakLive) {
                t->peakLive = live;
            }
        } else {
            live -= sizes[o->id];
        }
    }
    free(sizes);
    return 0;
}

/* The device's minimum allocation granularity (2 MiB on Ascend and on the software NPU). */
static uint64_t Granularity(void)
{
    aclrtPhysicalMemProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    prop.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    prop.memAttr = ACL_HBM_MEM_HUGE;
    prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t granularity = 0;
    CHECK(aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
                                           &granularity));
    EXPECT(granularity > 0);
    return granularity;
}

/* Replays `t` on a fresh pool; returns the fragmentation: peak reserved / peak used rounded
 * up to whole granules (reserved memory is whole granules; a trace smaller than one is 1.0). */
static double Replay(const char *name, const Trace *t, aclrtStream stream, uint64_t granularity)
{
    aclrtMemPoolProps props = PoolProps(0, 0);
    aclrtMemPool pool = NULL;
    CHECK(aclrtMemPoolCreate(&pool, &props));
    void **ptrs = calloc(t->maxId + 1, sizeof(void *));
    EXPECT(ptrs != NULL);
    for (size_t i = 0; i < t->count; i++) {
        const TraceOp *o = &t->ops[i];
        if (o->isAlloc) {
            /* A zero-byte request is invalid in the pool API; PyTorch never makes one. */
            EXPECT(o->bytes > 0 && ptrs[o->id] == NULL);
            CHECK(aclrtMemPoolMallocAsync(&ptrs[o->id], o->bytes, pool, stream));
        } else {
            EXPECT(ptrs[o->id] != NULL);
            CHECK(aclrtMemPoolFreeAsync(ptrs[o->id], stream));
            ptrs[o->id] = NULL;
        }
    }
    /* What the trace leaves live (the weights) is freed at the end. */
    for (uint64_t id = 0; id <= t->maxId; id++) {
        if (ptrs[id] != NULL) {
            CHECK(aclrtMemPoolFreeAsync(ptrs[id], stream));
        }
    }
    free(ptrs);
    CHECK(aclrtSynchronizeStream(stream));
    uint64_t usedHigh = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH);
    uint64_t reservedHigh = PoolAttr64(pool, ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH);
    CHECK(aclrtMemPoolDestroy(pool));
    /* Used memory counts requests rounded up to the pool's block alignment. */
    EXPECT(usedHigh >= t->peakLive);
    EXPECT(reservedHigh >= usedHigh);
    uint64_t usedGranules = (usedHigh + granularity - 1) / granularity * granularity;
    double fragmentation = (double)reservedHigh / (double)usedGranules;
    printf("  %-28s %7zu ops  peak requested %8.1f MiB  used high %8.1f MiB  reserved high "
           "%8.1f MiB  fragmentation %.4f\n",
           name, t->count, (double)t->peakLive / MIB, (double)usedHigh / MIB,
           (double)reservedHigh / MIB, fragmentation);
    return fragmentation;
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : getenv("SOMA_TRACES");
    if (dir == NULL) {
        printf("skipped: no trace directory (give one as argument or in $SOMA_TRACES)\n");
        printf("trace_replay: ok\n");
        return 0;
    }
    DIR *d = opendir(dir);
    if (d == NULL) {
        fprintf(stderr, "trace directory %s cannot be opened\n", dir);
        return 1;
    }
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(0));
    aclrtStream stream = NULL;
    CHECK(aclrtCreateStream(&stream));
    size_t freeBytes = 0;
    size_t totalBytes = 0;
    CHECK(aclrtGetMemInfo(ACL_HBM_MEM, &freeBytes, &totalBytes));
    const uint64_t granularity = Granularity();

    int replayed = 0;
    int found = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        size_t n = strlen(e->d_name);
        if (n > 7 && strcmp(e->d_name + n - 7, ".csv.gz") == 0) {
            printf("  skipped %s: gzipped (this program reads plain CSV)\n", e->d_name);
            continue;
        }
        if (n < 5 || strcmp(e->d_name + n - 4, ".csv") != 0) {
            continue;
        }
        found++;
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        Trace t;
        if (LoadTrace(path, &t) != 0) {
            exit(2);
        }
        /* Room for the peak plus what fragmentation may add. */
        if ((double)t.peakLive * MAX_FRAGMENTATION + 64.0 * MIB > (double)freeBytes) {
            printf("  skipped %s: its peak (%.0f MiB) does not fit the device's %.0f MiB free\n",
                   e->d_name, (double)t.peakLive / MIB, (double)freeBytes / MIB);
            free(t.ops);
            continue;
        }
        double fragmentation = Replay(e->d_name, &t, stream, granularity);
        free(t.ops);
        EXPECT(fragmentation <= MAX_FRAGMENTATION);
        replayed++;
    }
    closedir(d);
    printf("replayed %d of %d traces in %s\n", replayed, found, dir);

    CHECK(aclrtDestroyStream(stream));
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    printf("trace_replay: ok\n");
    return 0;
}
