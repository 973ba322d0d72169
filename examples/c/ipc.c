/*
 * ipc.c - CANN's flow for physical memory shared between two processes.
 *
 * Process A allocates physical memory (aclrtMallocPhysical), maps it, fills it, exports it
 * (aclrtMemExportToShareableHandle) and starts process B (this program again, "child"),
 * whose id it puts on the whitelist (aclrtMemSetPidToShareableHandle) before B goes on. B
 * imports the handle (aclrtMemImportFromShareableHandle), maps it in its own reservation,
 * reads A's bytes and writes its own; A reads them after B exits. B is refused a second
 * export whose whitelist does not name it, and A is refused importing its own export.
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

/* The physical memory's property on device 0. */
static aclrtPhysicalMemProp Prop(void)
{
    aclrtPhysicalMemProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    prop.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    prop.memAttr = ACL_HBM_MEM_HUGE;
    prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    return prop;
}

static size_t Granularity(void)
{
    aclrtPhysicalMemProp prop = Prop();
    size_t g = 0;
    CHECK(aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED, &g));
    return g;
}

/* Process B: imports `shared`, checks A's bytes and writes its own; `foreign` is refused. */
static int Child(uint64_t shared, uint64_t foreign)
{
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(0));
    int32_t pid = 0;
    CHECK(aclrtDeviceGetBareTgid(&pid));
    printf("ipc child: process %" PRId32 " imports %#" PRIx64 "\n", pid, shared);

    aclrtDrvMemHandle handle = NULL;
    CHECK_FAILS(aclrtMemImportFromShareableHandle(foreign, 0, &handle), ACL_ERROR_RT_PARAM_INVALID);
    CHECK(aclrtMemImportFromShareableHandle(shared, 0, &handle));
    CHECK_FAILS(aclrtMemImportFromShareableHandle(shared, 0, &handle), ACL_ERROR_RT_PARAM_INVALID);

    size_t g = Granularity();
    void *va = NULL;
    CHECK(aclrtReserveMemAddress(&va, g, 0, NULL, 0));
    CHECK(aclrtMapMem(va, g, 0, handle, 0));
    unsigned char bytes[2] = {0, 0};
    CHECK(aclrtMemcpy(&bytes[0], 1, va, 1, ACL_MEMCPY_DEVICE_TO_HOST));
    CHECK(aclrtMemcpy(&bytes[1], 1, (char *)va + g - 1, 1, ACL_MEMCPY_DEVICE_TO_HOST));
    EXPECT(bytes[0] == 0x5A && bytes[1] == 0x5A);
    CHECK(aclrtMemset(va, 4096, 0xC3, 4096));
    CHECK(aclrtUnmapMem(va));
    CHECK(aclrtFreePhysical(handle));
    CHECK(aclrtReleaseMemAddress(va));
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    printf("ipc child: read A's bytes, wrote 4096 of its own\n");
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "child") == 0) {
        return Child(strtoull(argv[2], NULL, 0), strtoull(argv[3], NULL, 0));
    }
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(0));
    size_t g = Granularity();
    aclrtPhysicalMemProp prop = Prop();

    /* A's memory: mapped and filled, then exported. */
    aclrtDrvMemHandle handle = NULL;
    void *va = NULL;
    CHECK(aclrtMallocPhysical(&handle, g, &prop, 0));
    CHECK(aclrtReserveMemAddress(&va, g, 0, NULL, 0));
    CHECK(aclrtMapMem(va, g, 0, handle, 0));
    CHECK(aclrtMemset(va, g, 0x5A, g));
    uint64_t shared = 0;
    CHECK(aclrtMemExportToShareableHandle(handle, ACL_MEM_HANDLE_TYPE_NONE,
                                          ACL_RT_VMM_EXPORT_FLAG_DEFAULT, &shared));
    CHECK_FAILS(aclrtMemExportToShareableHandle(handle, ACL_MEM_HANDLE_TYPE_NONE,
                                                ACL_RT_VMM_EXPORT_FLAG_DEFAULT, &shared),
                ACL_ERROR_RT_PARAM_INVALID);
    /* A second export, whose whitelist stays empty. */
    aclrtDrvMemHandle other = NULL;
    uint64_t foreign = 0;
    CHECK(aclrtMallocPhysical(&other, g, &prop, 0));
    CHECK(aclrtMemExportToShareableHandle(other, ACL_MEM_HANDLE_TYPE_NONE,
                                          ACL_RT_VMM_EXPORT_FLAG_DEFAULT, &foreign));
    aclrtDrvMemHandle own = NULL;
    CHECK_FAILS(aclrtMemImportFromShareableHandle(shared, 0, &own), ACL_ERROR_RT_PARAM_INVALID);

    /* Process B: waits on a pipe until its id is on the whitelist, then runs this program. */
    int go[2];
    EXPECT(pipe(go) == 0);
    fflush(stdout);
    pid_t child = fork();
    EXPECT(child >= 0);
    if (child == 0) {
        char byte;
        close(go[1]);
        if (read(go[0], &byte, 1) != 1) {
            _exit(3);
        }
        char shared_arg[32], foreign_arg[32];
        snprintf(shared_arg, sizeof(shared_arg), "%" PRIu64, shared);
        snprintf(foreign_arg, sizeof(foreign_arg), "%" PRIu64, foreign);
        char *args[] = {argv[0], "child", shared_arg, foreign_arg, NULL};
        execv("/proc/self/exe", args);
        _exit(4);
    }
    close(go[0]);
    int32_t pid = (int32_t)child;
    CHECK(aclrtMemSetPidToShareableHandle(shared, &pid, 1));
    EXPECT(write(go[1], "g", 1) == 1);
    close(go[1]);
    int status = 0;
    EXPECT(waitpid(child, &status, 0) == child);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);

    /* B's bytes, in A's mapping. */
    unsigned char bytes[3] = {0, 0, 0};
    CHECK(aclrtMemcpy(&bytes[0], 1, va, 1, ACL_MEMCPY_DEVICE_TO_HOST));
    CHECK(aclrtMemcpy(&bytes[1], 1, (char *)va + 4095, 1, ACL_MEMCPY_DEVICE_TO_HOST));
    CHECK(aclrtMemcpy(&bytes[2], 1, (char *)va + 4096, 1, ACL_MEMCPY_DEVICE_TO_HOST));
    EXPECT(bytes[0] == 0xC3 && bytes[1] == 0xC3 && bytes[2] == 0x5A);
    printf("ipc: process %d wrote 0x%02X into A's memory\n", (int)child, bytes[0]);

    CHECK(aclrtUnmapMem(va));
    CHECK(aclrtFreePhysical(handle));
    CHECK(aclrtFreePhysical(other));
    CHECK(aclrtReleaseMemAddress(va));
    /* Freed: the export is withdrawn. */
    CHECK_FAILS(aclrtMemSetPidToShareableHandle(shared, &pid, 1), ACL_ERROR_RT_INVALID_HANDLE);
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    printf("ipc: ok\n");
    return 0;
}
