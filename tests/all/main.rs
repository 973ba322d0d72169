//! Integration tests of the workspace, as one binary (a module per topic): the pool end to end
//! on the software NPU, and the `ascend` backend over soma-capi loaded as `libascendcl.so`.

mod alignment;
mod ascend_backend;
mod bad_input;
mod common;
mod compaction;
mod cross_device;
mod default_pool;
mod driver_alloc;
mod faults;
mod foreign_work;
mod graph_capture;
mod graph_memory;
mod host_transfers;
mod ipc;
mod observe;
mod owned;
mod peer_access;
mod pool;
mod pool_stats;
mod reuse_rules;
mod sanitizer;
mod shards;
mod state_machine;
mod stress;
mod teardown;
mod views;
mod warm_replays;
