//! soma-core: the driver HAL trait, typed device handles, happens-before tracking and the
//! stream-ordered pool engine. Users depend on `soma`, which re-exports what they need.

pub mod engine;
pub mod hal;
