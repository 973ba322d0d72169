//! Physical memory shared between processes: the exports of this process, the imports it
//! holds, and the way a memory file travels from one to the other.
//!
//! A [`ShareableHandle`] is `pid << 32 | service << 28 | n`: the exporting process, its
//! service and the number of the export in it. The exporting process serves its exports on a
//! Unix socket of the abstract namespace, `soma-sim-ipc-<pid>` (`-<service>` after it when a
//! copy of this library in the same process took that name first, e.g. the C library loaded
//! beside a Rust program), started with its first export: an importer connects,
//! sends the number, and gets the memory file back (`SCM_RIGHTS`), or a refusal — the kernel
//! tells the exporter who connects (`SO_PEERCRED`), and the exporter checks the whitelist
//! itself. Nothing else crosses: streams, events and the in-flight table stay per process.
//!
//! An export lives until its physical allocation is freed (or its device dropped); an import
//! holds the memory file, so the bytes live on in the importer until it frees its handle,
//! whatever the exporter does meanwhile.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use soma_core::hal::{DriverError, DriverResult, ShareableHandle};

use crate::memory::SharedPages;

mod service;

pub(crate) use service::fetch;

/// One export of this process.
struct Export {
    pages: Arc<SharedPages>,
    /// `None`: any process may import (whitelist check off).
    allowed: Option<HashSet<i32>>,
}

#[derive(Default)]
struct Exports {
    by_number: HashMap<u32, Export>,
    next: u32,
}

static EXPORTS: Mutex<Option<Exports>> = Mutex::new(None);

/// The shareable handles this process holds an import of.
static IMPORTED: Mutex<Option<HashSet<u64>>> = Mutex::new(None);

/// This process's id, as whitelists name it.
pub(crate) fn own_pid() -> i32 {
    // Linux process ids fit in 22 bits.
    std::process::id() as i32
}

/// Bits of a shareable handle's low word that number the export (the rest name the service).
const NUMBER_BITS: u32 = 28;

/// The process that exported `handle`, its service, and the number of the export there.
pub(crate) fn split(handle: ShareableHandle) -> (i32, u32, u32) {
    let low = handle.0 as u32;
    ((handle.0 >> 32) as i32, low >> NUMBER_BITS, low & ((1 << NUMBER_BITS) - 1))
}

/// Registers an export of `pages` and starts serving it; its shareable handle.
pub(crate) fn export(pages: Arc<SharedPages>, check_pids: bool) -> DriverResult<ShareableHandle> {
    let service = service::ensure_serving()?;
    let mut guard = EXPORTS.lock();
    let exports = guard.get_or_insert_with(Exports::default);
    exports.next =
        exports.next.checked_add(1).filter(|&n| n < 1 << NUMBER_BITS).ok_or_else(|| {
            DriverError::InvalidValue("this process ran out of shareable handle numbers".into())
        })?;
    let n = exports.next;
    exports.by_number.insert(n, Export { pages, allowed: check_pids.then(HashSet::new) });
    let low = service << NUMBER_BITS | n;
    Ok(ShareableHandle((own_pid() as u64) << 32 | u64::from(low)))
}

/// Withdraws an export (its memory was freed): later imports fail.
pub(crate) fn withdraw(handle: ShareableHandle) {
    let (_, _, n) = split(handle);
    if let Some(exports) = EXPORTS.lock().as_mut() {
        exports.by_number.remove(&n);
    }
}

/// Adds `pids` to the whitelist of an export of this process.
pub(crate) fn allow(handle: ShareableHandle, pids: &[i32]) -> DriverResult<()> {
    if pids.is_empty() {
        return Err(DriverError::InvalidValue("an empty list of process ids".into()));
    }
    let (pid, service, n) = split(handle);
    let mut guard = EXPORTS.lock();
    let export = guard
        .as_mut()
        .and_then(|e| e.by_number.get_mut(&n))
        .filter(|_| pid == own_pid() && service::serves(service))
        .ok_or_else(|| not_exported_here(handle))?;
    if let Some(allowed) = &mut export.allowed {
        allowed.extend(pids.iter().copied());
    }
    Ok(())
}

fn not_exported_here(handle: ShareableHandle) -> DriverError {
    DriverError::InvalidHandle(format!(
        "shareable handle {:#x} is not an export of this process (never exported, or its \
         memory was freed)",
        handle.0
    ))
}

/// Why an export was not handed to a process (the serving side's answer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No such export (never made, or its memory was freed).
    Unknown = 1,
    /// The process is not on the whitelist.
    NotAllowed = 2,
}

/// The memory of export `n` for process `pid`, or why not.
fn lookup(n: u32, pid: i32) -> Result<Arc<SharedPages>, Refusal> {
    let guard = EXPORTS.lock();
    let export = guard.as_ref().and_then(|e| e.by_number.get(&n)).ok_or(Refusal::Unknown)?;
    match &export.allowed {
        Some(allowed) if !allowed.contains(&pid) => Err(Refusal::NotAllowed),
        _ => Ok(Arc::clone(&export.pages)),
    }
}

/// Claims the import of `handle` for this process: one handle per shareable handle. The
/// claim is given back with [`release_import`].
pub(crate) fn claim_import(handle: ShareableHandle) -> DriverResult<()> {
    let (pid, _, _) = split(handle);
    if pid == own_pid() {
        return Err(DriverError::InvalidValue(format!(
            "shareable handle {:#x} was exported by this process: import and export only work \
             across processes",
            handle.0
        )));
    }
    let mut guard = IMPORTED.lock();
    if !guard.get_or_insert_with(HashSet::new).insert(handle.0) {
        return Err(DriverError::InvalidValue(format!(
            "shareable handle {:#x} is already imported in this process (one handle per \
             shareable handle; free the first one)",
            handle.0
        )));
    }
    Ok(())
}

/// Gives back the claim of [`claim_import`] (the imported handle was freed, or the import
/// failed).
pub(crate) fn release_import(handle: ShareableHandle) {
    if let Some(set) = IMPORTED.lock().as_mut() {
        set.remove(&handle.0);
    }
}
