//! Compaction ([`MemPool::compact`](super::MemPool::compact)): moving a stream's allocations
//! to the lowest free addresses below them, with stream-ordered device-to-device copies,
//! mapping unmapped space there when the mapped free space does not fit them.

use super::allocate::insert_dependency;
use super::free::wait_for_uses;
use super::handle::Relocatable;
use super::order::Order;
use super::shards::Cores;
use crate::engine::FreeTag;
use crate::error::Result;
use crate::hal::PoolAnnotation;
use crate::stream::Stream;

impl Cores<'_> {
    /// Moves each of `allocations` (all of this pool and of `stream`, checked by the caller)
    /// to a lower free block of its shard, if there is one or one can be mapped; returns how
    /// many moved.
    pub(super) fn compact<A: Relocatable>(
        self,
        stream: &Stream<'_>,
        allocations: &mut [&mut A],
    ) -> Result<usize> {
        let mut order_idx: Vec<usize> = (0..allocations.len()).collect();
        order_idx.sort_by_key(|&i| allocations[i].device_ptr());
        let mut moved = 0;
        for i in order_idx {
            let a = &mut *allocations[i];
            let core = self.core_at(a.shard());
            let order = Order::for_request(core, stream);
            let Some(block) = a.block() else { continue };
            if core.is_graph_block(block) {
                // A graph's launches use it where it is.
                continue;
            }
            // Free space below that recycling or a release unmapped is mapped again (within
            // max_size): compaction is what an out-of-memory report recommends right after
            // the failed request's retry gave idle memory back.
            let target = {
                let mut inner = core.lock();
                let (engine, mut backing) = inner.parts(core);
                engine.relocate_lower_mapping(block, stream.slot(), &order, &mut backing)?
            };
            let Some(target) = target else { continue };
            if let Some(tag) = target.dependency {
                if let Err(e) = insert_dependency(tag, stream) {
                    let _ = core.lock().engine.free(target.block, tag);
                    return Err(e);
                }
            }
            // The copy reads the old block: order it after every other stream's recorded use
            // (a write enqueued there before the compaction must land first).
            let uses = a.uses_snapshot();
            if let Err(e) = wait_for_uses(stream, &uses) {
                let tag = FreeTag { stream: stream.slot(), pos: stream.position() };
                let _ = core.lock().engine.free(target.block, tag);
                return Err(e);
            }
            let new_ptr = core.ptr_at(target.offset);
            if core.annotate {
                // The moved allocation is a new allocation of the block for the sanitizer.
                core.hal().annotate(PoolAnnotation::Alloc {
                    pool: core.id,
                    ptr: new_ptr,
                    size: a.byte_len(),
                    stream: stream.id(),
                    position: stream.hal().enqueued(),
                });
            }
            if let Err(e) = stream.hal().copy_d2d(new_ptr, a.device_ptr(), a.byte_len()) {
                if core.annotate {
                    core.hal().annotate(PoolAnnotation::Free {
                        pool: core.id,
                        ptr: new_ptr,
                        stream: stream.id(),
                        position: stream.hal().enqueued(),
                    });
                }
                let tag = FreeTag { stream: stream.slot(), pos: stream.position() };
                let _ = core.lock().engine.free(target.block, tag);
                return Err(e.into());
            }
            let uses = a.relocate(target.block, new_ptr);
            core.free_block(block, stream, &uses, None)?;
            moved += 1;
        }
        Ok(moved)
    }
}
