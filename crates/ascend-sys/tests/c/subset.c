/* Uses every type, enumerator, error code and function of the subset, as a program written
 * against CANN's headers would. Compiled (not linked) as C99 and C++ by tests/headers.rs. */
#include <acl/acl.h>
#include <string.h>

static void host_fn(void *args) { (void)args; }

int use_subset(void);
int use_subset(void) {
    aclError e = ACL_SUCCESS;
    int codes[] = {ACL_ERROR_INVALID_PARAM, ACL_ERROR_UNINITIALIZE, ACL_ERROR_BAD_ALLOC,
                   ACL_ERROR_INVALID_RESOURCE_HANDLE, ACL_ERROR_FEATURE_UNSUPPORTED,
                   ACL_ERROR_RT_PARAM_INVALID, ACL_ERROR_RT_INVALID_HANDLE,
                   ACL_ERROR_RT_FEATURE_NOT_SUPPORT, ACL_ERROR_RT_MEMORY_ALLOCATION};
    aclrtStream s = NULL;
    aclrtEvent ev = NULL;
    aclrtContext ctx = NULL;
    aclrtMemPool pool = NULL;
    aclrtDrvMemHandle h = NULL;
    aclrtHostFunc fn = host_fn;
    aclrtMemMallocPolicy pol[] = {ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEM_MALLOC_HUGE_ONLY,
                                  ACL_MEM_MALLOC_NORMAL_ONLY};
    aclrtMemcpyKind kinds[] = {ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE,
                               ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE,
                               ACL_MEMCPY_DEFAULT};
    aclrtEventRecordedStatus est = ACL_EVENT_RECORDED_STATUS_NOT_READY;
    aclrtStreamStatus sst = ACL_STREAM_STATUS_COMPLETE;
    aclrtStreamStatus sst2[] = {ACL_STREAM_STATUS_NOT_READY, ACL_STREAM_STATUS_RESERVED};
    aclrtMemAttr attrs[] = {ACL_DDR_MEM, ACL_HBM_MEM, ACL_DDR_MEM_HUGE, ACL_DDR_MEM_NORMAL,
                            ACL_HBM_MEM_HUGE, ACL_HBM_MEM_NORMAL};
    aclrtMemLocationType lt[] = {ACL_MEM_LOCATION_TYPE_HOST, ACL_MEM_LOCATION_TYPE_DEVICE,
                                 ACL_MEM_LOCATION_TYPE_UNREGISTERED,
                                 ACL_MEM_LOCATION_TYPE_MANAGED, ACL_MEM_LOCATION_TYPE_HOST_NUMA};
    aclrtMemHandleType ht[] = {ACL_MEM_HANDLE_TYPE_NONE, ACL_MEM_HANDLE_TYPE_POSIX};
    aclrtMemGranularityOptions go[] = {ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
                                       ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                                       ACL_RT_MEM_ALLOC_GRANULARITY_UNDEF};
    enum aclrtMemPoolAttr pa[] = {ACL_RT_MEM_POOL_REUSE_FOLLOW_EVENT_DEPENDENCIES,
                                  ACL_RT_MEM_POOL_REUSE_ALLOW_OPPORTUNISTIC,
                                  ACL_RT_MEM_POOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                                  ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD,
                                  ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT,
                                  ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH,
                                  ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT,
                                  ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH};
    struct aclrtMemLocation loc;
    struct aclrtPhysicalMemProp prop;
    aclrtMemPoolProps props;
    void *p = NULL, *hp = NULL, *va = NULL;
    int32_t dev = 0;
    uint32_t count = 0;
    size_t fr = 0, tot = 0, gran = 0;
    float ms = 0.0f;
    uint32_t u32v = 1;
    uint64_t u64v = 0;
    const char *msg;

    memset(&loc, 0, sizeof loc);
    memset(&prop, 0, sizeof prop);
    memset(&props, 0, sizeof props);
    loc.id = 0;
    loc.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    prop.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    prop.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    prop.memAttr = ACL_HBM_MEM_HUGE;
    prop.location = loc;
    prop.reserve = 0;
    props.allocType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    props.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    props.location = loc;
    props.maxSize = 2u << 20;
    props.reserved[31] = 0;

    e = aclInit(NULL);
    msg = aclGetRecentErrMsg();
    e = aclrtSetDevice(dev);
    e = aclrtGetDevice(&dev);
    e = aclrtGetDeviceCount(&count);
    e = aclrtCreateContext(&ctx, dev);
    e = aclrtSetCurrentContext(ctx);
    e = aclrtCreateStream(&s);
    e = aclrtCreateEvent(&ev);
    e = aclrtRecordEvent(ev, s);
    e = aclrtStreamWaitEvent(s, ev);
    e = aclrtQueryEventStatus(ev, &est);
    e = aclrtSynchronizeEvent(ev);
    e = aclrtEventElapsedTime(&ms, ev, ev);
    e = aclrtLaunchHostFunc(s, fn, NULL);
    e = aclrtStreamQuery(s, &sst);
    e = aclrtMalloc(&p, 64, pol[0]);
    e = aclrtMallocHost(&hp, 64);
    e = aclrtMemcpy(p, 64, hp, 64, kinds[1]);
    e = aclrtMemcpyAsync(hp, 64, p, 64, ACL_MEMCPY_DEVICE_TO_HOST, s);
    e = aclrtMemset(p, 64, 0, 64);
    e = aclrtMemsetAsync(p, 64, 0, 64, s);
    e = aclrtGetMemInfo(ACL_HBM_MEM, &fr, &tot);
    e = aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &gran);
    e = aclrtReserveMemAddress(&va, gran, 0, NULL, 0);
    e = aclrtMallocPhysical(&h, gran, &prop, 0);
    e = aclrtMapMem(va, gran, 0, h, 0);
    e = aclrtUnmapMem(va);
    e = aclrtFreePhysical(h);
    e = aclrtReleaseMemAddress(va);
    e = aclrtMemPoolCreate(&pool, &props);
    e = aclrtMemPoolSetAttr(pool, ACL_RT_MEM_POOL_REUSE_ALLOW_OPPORTUNISTIC, &u32v);
    e = aclrtMemPoolGetAttr(pool, ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT, &u64v);
    e = aclrtMemPoolMallocAsync(&p, 64, pool, s);
    e = aclrtMemPoolFreeAsync(p, s);
    e = aclrtMemPoolTrimTo(pool, 0);
    e = aclrtMemPoolDestroy(pool);
    e = aclrtSynchronizeStream(s);
    e = aclrtDestroyStream(s);
    e = aclrtDestroyEvent(ev);
    e = aclrtFree(p);
    e = aclrtFreeHost(hp);
    e = aclrtSynchronizeDevice();
    e = aclrtDestroyContext(ctx);
    e = aclrtResetDevice(dev);
    e = aclFinalize();
    (void)codes; (void)attrs; (void)lt; (void)ht; (void)go; (void)pa; (void)sst2; (void)msg;
    return e;
}
