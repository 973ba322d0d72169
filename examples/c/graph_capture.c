/*
 * graph_capture.c - building a model runtime instance by capturing streams ("ACL graph"):
 * the tasks issued on a stream between aclmdlRICaptureBegin and aclmdlRICaptureEnd do not
 * run; they are stored in an aclmdlRI, which aclmdlRIExecuteAsync runs once per call.
 *
 *   1. single-stream capture of a "step": input copied in from pinned host memory, a
 *      device-to-device copy, a memset, the result copied out, a host function counting
 *      the runs; captured once, executed for several inputs;
 *   2. cross-stream capture: a second stream joins the capture by waiting on an event
 *      recorded on the capturing stream, and rejoins it through another event;
 *   3. what a capture forbids: a synchronous copy under ACL_MODEL_RI_CAPTURE_MODE_GLOBAL fails
 *      and invalidates the capture, unless the thread switched itself to relaxed mode.
 *
 * Build and run: scripts/run-c-examples.sh
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

static const size_t N = 4096;

/* A host function captured into the model: it runs at every execution. */
static void CountRun(void *args)
{
    ++*(uint32_t *)args;
}

static aclmdlRICaptureStatus Status(aclrtStream stream, aclmdlRI *model)
{
    aclmdlRICaptureStatus status = ACL_MODEL_RI_CAPTURE_STATUS_NONE;
    CHECK(aclmdlRICaptureGetInfo(stream, &status, model));
    return status;
}

static void SingleStream(aclrtStream stream)
{
    uint8_t *hostIn = NULL, *hostOut = NULL;
    void *devIn = NULL, *devOut = NULL;
    CHECK(aclrtMallocHost((void **)&hostIn, N)); /* captured copies need pinned memory */
    CHECK(aclrtMallocHost((void **)&hostOut, N));
    CHECK(aclrtMalloc(&devIn, N, ACL_MEM_MALLOC_HUGE_FIRST));
    CHECK(aclrtMalloc(&devOut, N, ACL_MEM_MALLOC_HUGE_FIRST));
    uint32_t runs = 0;

    CHECK(aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL));
    CHECK(aclrtMemcpyAsync(devIn, N, hostIn, N, ACL_MEMCPY_HOST_TO_DEVICE, stream));
    CHECK(aclrtMemcpyAsync(devOut, N, devIn, N, ACL_MEMCPY_DEVICE_TO_DEVICE, stream));
    CHECK(aclrtMemsetAsync(devOut, N, 0xFF, 64, stream));
    CHECK(aclrtMemcpyAsync(hostOut, N, devOut, N, ACL_MEMCPY_DEVICE_TO_HOST, stream));
    CHECK(aclrtLaunchHostFunc(stream, CountRun, &runs));
    aclmdlRI during = NULL;
    EXPECT(Status(stream, &during) == ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE);
    aclmdlRI model = NULL;
    CHECK(aclmdlRICaptureEnd(stream, &model));
    EXPECT(model != NULL && model == during);
    CHECK(aclrtSynchronizeStream(stream));
    EXPECT(runs == 0); /* captured, not run */

    for (uint8_t step = 1; step <= 4; ++step) {
        memset(hostIn, step, N);
        CHECK(aclmdlRIExecuteAsync(model, stream));
        CHECK(aclrtSynchronizeStream(stream));
        EXPECT(hostOut[0] == 0xFF && hostOut[63] == 0xFF);
        EXPECT(hostOut[64] == step && hostOut[N - 1] == step);
    }
    EXPECT(runs == 4);
    printf("single stream: one capture, %u executions, outputs follow the inputs\n", runs);

    CHECK(aclmdlRIDestroy(model));
    CHECK(aclrtFree(devIn));
    CHECK(aclrtFree(devOut));
    CHECK(aclrtFreeHost(hostIn));
    CHECK(aclrtFreeHost(hostOut));
}

static void CrossStream(aclrtStream main, aclrtStream side)
{
    aclrtEvent fork = NULL, join = NULL;
    CHECK(aclrtCreateEvent(&fork));
    CHECK(aclrtCreateEvent(&join));
    uint32_t mainRuns = 0, sideRuns = 0;

    CHECK(aclmdlRICaptureBegin(main, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL));
    CHECK(aclrtLaunchHostFunc(main, CountRun, &mainRuns));
    CHECK(aclrtRecordEvent(fork, main));
    CHECK(aclrtStreamWaitEvent(side, fork)); /* the side stream enters the capture */
    aclmdlRI joined = NULL, model = NULL;
    EXPECT(Status(side, &joined) == ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE);
    CHECK(aclrtLaunchHostFunc(side, CountRun, &sideRuns));
    CHECK(aclrtRecordEvent(join, side));
    CHECK(aclrtStreamWaitEvent(main, join)); /* ... and returns to the main stream */
    CHECK(aclmdlRICaptureEnd(main, &model));
    EXPECT(model == joined);
    EXPECT(Status(side, &joined) == ACL_MODEL_RI_CAPTURE_STATUS_NONE);

    for (int i = 0; i < 3; ++i) {
        CHECK(aclmdlRIExecuteAsync(model, main));
    }
    CHECK(aclrtSynchronizeStream(main));
    EXPECT(mainRuns == 3 && sideRuns == 3);
    printf("cross stream: both streams' tasks ran at each of %u executions\n", sideRuns);
    CHECK(aclmdlRIDestroy(model));
    CHECK(aclrtDestroyEvent(fork));
    CHECK(aclrtDestroyEvent(join));
}

static void Forbidden(aclrtStream stream)
{
    void *dev = NULL;
    uint8_t host[16];
    CHECK(aclrtMalloc(&dev, N, ACL_MEM_MALLOC_HUGE_FIRST));
    aclmdlRI model = NULL;

    CHECK(aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL));
    CHECK_FAILS(aclrtMemcpy(host, sizeof(host), dev, sizeof(host), ACL_MEMCPY_DEVICE_TO_HOST),
                ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    EXPECT(Status(stream, &model) == ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED);
    CHECK_FAILS(aclmdlRICaptureEnd(stream, &model), ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED);

    /* A thread in relaxed mode may make the call without harming the capture. */
    aclmdlRICaptureMode mode = ACL_MODEL_RI_CAPTURE_MODE_RELAXED;
    CHECK(aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL));
    CHECK(aclmdlRICaptureThreadExchangeMode(&mode));
    CHECK(aclrtMemcpy(host, sizeof(host), dev, sizeof(host), ACL_MEMCPY_DEVICE_TO_HOST));
    CHECK(aclmdlRICaptureThreadExchangeMode(&mode)); /* back to the previous mode */
    EXPECT(mode == ACL_MODEL_RI_CAPTURE_MODE_RELAXED);
    CHECK_FAILS(aclrtSynchronizeStream(stream), ACL_ERROR_RT_STREAM_CAPTURED);
    CHECK_FAILS(aclmdlRICaptureEnd(stream, &model), ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED);
    printf("forbidden calls: refused and the capture invalidated, as documented\n");
    CHECK(aclrtFree(dev));
}

int main(void)
{
    CHECK(aclInit(NULL));
    CHECK(aclrtSetDevice(0));
    aclrtStream s1 = NULL, s2 = NULL;
    CHECK(aclrtCreateStream(&s1));
    CHECK(aclrtCreateStream(&s2));

    SingleStream(s1);
    CrossStream(s1, s2);
    Forbidden(s1);

    CHECK(aclrtDestroyStream(s1));
    CHECK(aclrtDestroyStream(s2));
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    printf("graph_capture: ok\n");
    return 0;
}
