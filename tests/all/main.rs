//! Integration tests of the workspace, as one binary (a module per topic): the pool end to end
//! on the software NPU, and the `ascend` backend over soma-capi loaded as `libascendcl.so`.

mod ascend_backend;
mod bad_input;
mod common;
mod driver_alloc;
mod faults;
mod graph_capture;
mod observe;
mod pool;
mod reuse_rules;
mod sanitizer;
mod shards;
mod state_machine;
mod stress;
