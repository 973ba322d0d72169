//! soma: stream-ordered device memory pools for Ascend NPUs, in safe Rust.

#[cfg(feature = "ascend")]
pub mod ascend;
