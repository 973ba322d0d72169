//! The IPC calls through the exported functions, in one process: the codes of every bad
//! input (the flow across two processes is `examples/c/ipc.c`'s, run by the C examples test).

mod common;

use ascend_sys::{
    aclrtMemAllocationType, aclrtMemAttr, aclrtMemHandleType, aclrtMemLocation,
    aclrtMemLocationType, aclrtPhysicalMemProp, AclError, ACL_RT_VMM_EXPORT_FLAG_DEFAULT,
    ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION,
};
use ascendcl::*;
use common::*;

const G: usize = 2 << 20;
const NONE: aclrtMemHandleType = aclrtMemHandleType::ACL_MEM_HANDLE_TYPE_NONE;

fn prop() -> aclrtPhysicalMemProp {
    aclrtPhysicalMemProp {
        allocationType: aclrtMemAllocationType::ACL_MEM_ALLOCATION_TYPE_PINNED,
        location: aclrtMemLocation {
            id: 0,
            type_: aclrtMemLocationType::ACL_MEM_LOCATION_TYPE_DEVICE,
        },
        memAttr: aclrtMemAttr::ACL_HBM_MEM_HUGE,
        ..Default::default()
    }
}

#[test]
fn ipc_calls_refuse_bad_input_with_cann_codes() {
    init(&[("SOMA_SIM_DEVICES", "2"), ("SOMA_SIM_CAPACITY", "1G")]);
    let default = u64::from(ACL_RT_VMM_EXPORT_FLAG_DEFAULT);
    let open = u64::from(ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION);
    // SAFETY: valid pointers throughout, null ones where the test says so.
    unsafe {
        let mut pid = 0;
        ok(aclrtDeviceGetBareTgid(&mut pid));
        assert_eq!(pid, std::process::id() as i32);
        fails(aclrtDeviceGetBareTgid(std::ptr::null_mut()), AclError::ERROR_INVALID_PARAM, "null");

        let mut h = std::ptr::null_mut();
        ok(aclrtMallocPhysical(&mut h, G, &prop(), 0));
        let mut shareable = 0u64;
        let invalid = AclError::ERROR_INVALID_PARAM;
        fails(
            aclrtMemExportToShareableHandle(h, NONE, default, std::ptr::null_mut()),
            invalid,
            "null out",
        );
        fails(
            aclrtMemExportToShareableHandle(h, aclrtMemHandleType(7), default, &mut shareable),
            invalid,
            "handle type",
        );
        fails(aclrtMemExportToShareableHandle(h, NONE, 2, &mut shareable), invalid, "flags");
        fails(
            aclrtMemExportToShareableHandle(
                std::ptr::dangling_mut(),
                NONE,
                default,
                &mut shareable,
            ),
            AclError::ERROR_RT_INVALID_HANDLE,
            "unknown handle",
        );
        ok(aclrtMemExportToShareableHandle(h, NONE, default, &mut shareable));
        assert_eq!(shareable >> 32, u64::from(std::process::id()), "the exporting process");
        fails(
            aclrtMemExportToShareableHandle(h, NONE, open, &mut shareable),
            AclError::ERROR_RT_PARAM_INVALID,
            "one shareable handle per handle",
        );

        let mut pids = [pid + 1];
        fails(aclrtMemSetPidToShareableHandle(shareable, std::ptr::null_mut(), 1), invalid, "null");
        fails(aclrtMemSetPidToShareableHandle(shareable, pids.as_mut_ptr(), 0), invalid, "none");
        fails(
            aclrtMemSetPidToShareableHandle(shareable ^ 0xff, pids.as_mut_ptr(), 1),
            AclError::ERROR_RT_INVALID_HANDLE,
            "not exported",
        );
        ok(aclrtMemSetPidToShareableHandle(shareable, pids.as_mut_ptr(), 1));

        let mut imported = std::ptr::null_mut();
        fails(
            aclrtMemImportFromShareableHandle(shareable, 0, std::ptr::null_mut()),
            invalid,
            "null out",
        );
        fails(aclrtMemImportFromShareableHandle(shareable, 5, &mut imported), invalid, "device");
        fails(
            aclrtMemImportFromShareableHandle(shareable, 1, &mut imported),
            AclError::ERROR_RT_PARAM_INVALID,
            "same process",
        );
        assert!(msg().contains("across processes"), "{}", msg());
        fails(
            aclrtMemImportFromShareableHandle(0x7fff_fff0 << 32 | 1, 0, &mut imported),
            AclError::ERROR_RT_INVALID_HANDLE,
            "no such process",
        );

        // Freed: the export is withdrawn.
        ok(aclrtFreePhysical(h));
        fails(
            aclrtMemSetPidToShareableHandle(shareable, pids.as_mut_ptr(), 1),
            AclError::ERROR_RT_INVALID_HANDLE,
            "freed",
        );
        fails(
            aclrtMemExportToShareableHandle(h, NONE, default, &mut shareable),
            AclError::ERROR_RT_INVALID_HANDLE,
            "freed handle",
        );
    }
}
