//! A driver call that fails under the pool surfaces as the driver's own error: the variant,
//! code and message the backend reported, not one rebuilt from text.

use soma_core::hal::DriverError;
use soma_core::{Device, Error, MemPool};
use soma_sim::{FaultKind, Npu};

#[test]
fn a_failed_map_surfaces_the_drivers_error() {
    for kind in [FaultKind::Map, FaultKind::AllocPhysical] {
        let npu = Npu::builder().build().unwrap();
        let sim = npu.device(0).unwrap();
        let dev = Device::new(sim.clone());
        let s = dev.create_stream().unwrap();
        let pool = MemPool::builder().max_size(64 << 20).build(&dev).unwrap();
        sim.faults().fail_nth(kind, 1);
        let err = pool.alloc_async::<u8>(1 << 20, &s).unwrap_err();
        assert!(matches!(&err, Error::Driver(DriverError::Injected(_))), "{kind:?}: {err:?}");
        // The fault fired once: the next attempt maps.
        drop(pool.alloc_async::<u8>(1 << 20, &s).unwrap());
    }
}
