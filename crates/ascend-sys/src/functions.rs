//! The list of functions of the subset, checked against the generated table.

use crate::{Acl, LoadError};

macro_rules! functions {
    ($($name:ident),* $(,)?) => {
        /// The name of every function of the subset, in header order (`acl.h` last).
        pub const FUNCTIONS: &[&str] = &[$(::core::stringify!($name)),*];

        /// The lookup error of `symbol` in `acl`, `None` when present (or not in the list).
        pub(crate) fn lookup_error(acl: &Acl, symbol: &str) -> Option<LoadError> {
            match symbol {
                $(::core::stringify!($name) => $crate::acl_fn!(acl, $name).err(),)*
                _ => None,
            }
        }
    };
}

functions! {
    aclrtSetDevice,
    aclrtResetDevice,
    aclrtGetDevice,
    aclrtGetDeviceCount,
    aclrtSynchronizeDevice,
    aclrtDeviceCanAccessPeer,
    aclrtDeviceEnablePeerAccess,
    aclrtDeviceDisablePeerAccess,
    aclrtCreateContext,
    aclrtDestroyContext,
    aclrtSetCurrentContext,
    aclrtCreateStream,
    aclrtDestroyStream,
    aclrtSynchronizeStream,
    aclrtStreamQuery,
    aclrtCreateEvent,
    aclrtDestroyEvent,
    aclrtRecordEvent,
    aclrtStreamWaitEvent,
    aclrtSynchronizeEvent,
    aclrtQueryEventStatus,
    aclrtEventElapsedTime,
    aclrtLaunchHostFunc,
    aclrtMalloc,
    aclrtFree,
    aclrtMallocHost,
    aclrtFreeHost,
    aclrtMemcpy,
    aclrtMemcpyAsync,
    aclrtMemset,
    aclrtMemsetAsync,
    aclrtGetMemInfo,
    aclrtReserveMemAddress,
    aclrtReleaseMemAddress,
    aclrtMallocPhysical,
    aclrtFreePhysical,
    aclrtMapMem,
    aclrtUnmapMem,
    aclrtMemGetAllocationGranularity,
    aclrtMemExportToShareableHandle,
    aclrtMemSetPidToShareableHandle,
    aclrtMemImportFromShareableHandle,
    aclrtDeviceGetBareTgid,
    aclmdlRICaptureBegin,
    aclmdlRICaptureGetInfo,
    aclmdlRICaptureEnd,
    aclmdlRICaptureThreadExchangeMode,
    aclmdlRIExecuteAsync,
    aclmdlRIExecute,
    aclmdlRIDestroy,
    aclrtMemPoolCreate,
    aclrtMemPoolDestroy,
    aclrtMemPoolSetAttr,
    aclrtMemPoolGetAttr,
    aclrtMemPoolMallocAsync,
    aclrtMemPoolFreeAsync,
    aclrtMemPoolTrimTo,
    aclInit,
    aclFinalize,
    aclGetRecentErrMsg,
}
