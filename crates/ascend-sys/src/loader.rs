//! [`Acl`]: the AscendCL library, opened at run time.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::mem::ManuallyDrop;
use std::path::PathBuf;

use crate::bindings::AclLib;

/// File name of the CANN runtime library.
pub const LIBRARY_NAME: &str = "libascendcl.so";

/// Symbols [`Acl::open`] requires: without them the library is not an AscendCL runtime.
/// Every other symbol may be missing; using it is then a [`LoadError::MissingSymbol`].
pub const REQUIRED_SYMBOLS: [&str; 2] = ["aclInit", "aclrtSetDevice"];

/// Why the AscendCL library could not be loaded, or a function of it could not be found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadError {
    /// No candidate library could be opened; one entry per path tried, in order.
    Open {
        /// `(path or file name, reason)` for every attempt.
        attempts: Vec<(String, String)>,
    },
    /// The library was opened but lacks a symbol.
    MissingSymbol {
        /// The function's name.
        symbol: &'static str,
        /// The library it was looked up in.
        library: String,
        /// The loader's message.
        reason: String,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Open { attempts } => {
                f.write_str("cannot load the AscendCL library")?;
                for (i, (path, reason)) in attempts.iter().enumerate() {
                    let sep = if i == 0 { ": " } else { "; " };
                    write!(f, "{sep}{path}: {reason}")?;
                }
                Ok(())
            }
            LoadError::MissingSymbol { symbol, library, reason } => {
                write!(f, "AscendCL library {library} has no function {symbol}: {reason}")
            }
        }
    }
}

impl std::error::Error for LoadError {}

/// The AscendCL runtime library, loaded with `dlopen`.
///
/// Holds the generated [`AclLib`] table: one `Result<fn, libloading::Error>` per function of
/// the subset, so a library that lacks some functions (an older CANN without the pool API)
/// still loads. Get a function with [`acl_fn!`](crate::acl_fn) (or [`Acl::entry`]): a missing
/// symbol is then a [`LoadError::MissingSymbol`] naming it, never a panic.
///
/// The convenience methods that bindgen generates on [`AclLib`] (`lib.aclrtSetDevice(0)`)
/// **panic** when the symbol is missing; do not use them.
///
/// Dropping an `Acl` never unloads the library: a runtime starts threads in `aclInit` that
/// outlive every handle (soma never calls `aclFinalize`), and unmapping their code would crash
/// the process. The library stays loaded until the process exits.
///
/// ```
/// use ascend_sys::{acl_fn, Acl, LoadError};
///
/// // SAFETY: loading a path that does not exist runs no code.
/// let err = unsafe { Acl::open("/nonexistent/libascendcl.so") }.unwrap_err();
/// assert!(matches!(err, LoadError::Open { .. }));
///
/// # fn use_it(acl: &Acl) -> Result<(), Box<dyn std::error::Error>> {
/// let mut count = 0u32;
/// // SAFETY: `count` is a valid out-pointer for the call.
/// unsafe { acl_fn!(acl, aclrtGetDeviceCount)?(&mut count) }.result()?;
/// # Ok(()) }
/// ```
pub struct Acl {
    lib: AclLib,
    /// A second reference to the same library (the loader counts references), for
    /// [`Acl::symbol`] (bindgen's table owns its own and does not expose it). Never dropped:
    /// it keeps the library loaded for the rest of the process, see [`Acl`].
    extra: ManuallyDrop<libloading::Library>,
    path: OsString,
}

impl fmt::Debug for Acl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acl").field("path", &self.path).finish_non_exhaustive()
    }
}

impl Acl {
    /// Opens the CANN runtime from its usual places, in order:
    /// `$ASCEND_TOOLKIT_HOME/lib64/libascendcl.so` when the variable is set, then
    /// `libascendcl.so` by name (the dynamic loader's search path, `LD_LIBRARY_PATH`).
    ///
    /// # Errors
    /// [`LoadError::Open`] listing every attempt when none could be opened;
    /// [`LoadError::MissingSymbol`] when the library opened lacks a
    /// [`REQUIRED_SYMBOLS`] entry.
    ///
    /// # Safety
    /// As [`Acl::open`], for whichever library is found.
    pub unsafe fn load() -> Result<Self, LoadError> {
        let mut candidates: Vec<OsString> = Vec::new();
        if let Some(home) = std::env::var_os("ASCEND_TOOLKIT_HOME").filter(|h| !h.is_empty()) {
            candidates.push(PathBuf::from(home).join("lib64").join(LIBRARY_NAME).into());
        }
        candidates.push(LIBRARY_NAME.into());
        let mut attempts = Vec::new();
        for candidate in candidates {
            // SAFETY: forwarded to our caller (see `# Safety`).
            match unsafe { Self::open(&candidate) } {
                Ok(acl) => return Ok(acl),
                Err(LoadError::Open { attempts: mut a }) => attempts.append(&mut a),
                Err(other) => return Err(other),
            }
        }
        Err(LoadError::Open { attempts })
    }

    /// Opens the library at `path` (a path, or a file name for the loader's search path):
    /// `libascendcl.so` of CANN, or soma's `libsoma_capi.so` (the same API over the software
    /// NPU).
    ///
    /// # Errors
    /// [`LoadError::Open`] when the library cannot be opened, [`LoadError::MissingSymbol`] when
    /// it lacks a [`REQUIRED_SYMBOLS`] entry.
    ///
    /// # Safety
    /// Opening a library runs its initialisers. The library must be an implementation of the
    /// AscendCL runtime API: every function it exports under a name of the subset has the
    /// signature declared in `include/acl/*.h` and behaves as documented (the safe layers
    /// above this crate rely on that).
    pub unsafe fn open(path: impl AsRef<OsStr>) -> Result<Self, LoadError> {
        let path = path.as_ref();
        // SAFETY: the caller guarantees the library is an AscendCL implementation (initialisers
        // included); `from_library` only looks symbols up, and the declared types of those
        // symbols are the signatures of the headers, which the caller guarantees.
        let lib = unsafe { AclLib::new(path) }.map_err(|e| LoadError::Open {
            attempts: vec![(path.to_string_lossy().into_owned(), e.to_string())],
        })?;
        // SAFETY: the same library is already open (this only takes another reference), so no
        // initialiser runs again.
        let extra = unsafe { libloading::Library::new(path) }.map_err(|e| LoadError::Open {
            attempts: vec![(path.to_string_lossy().into_owned(), e.to_string())],
        })?;
        let acl = Acl { lib, extra: ManuallyDrop::new(extra), path: path.to_owned() };
        for symbol in REQUIRED_SYMBOLS {
            if let Some(err) = acl.symbol_error(symbol) {
                // Not a runtime: nothing of it ran beyond its initialisers, so it may go.
                let Acl { extra, .. } = acl;
                drop(ManuallyDrop::into_inner(extra));
                return Err(err);
            }
        }
        Ok(acl)
    }

    /// The path or name the library was opened from.
    pub fn path(&self) -> &OsStr {
        &self.path
    }

    /// The generated function table. Prefer [`acl_fn!`](crate::acl_fn): the methods of
    /// [`AclLib`] panic on missing symbols.
    pub fn lib(&self) -> &AclLib {
        &self.lib
    }

    /// The function `symbol`, selected from the table by `field`, or an error naming it.
    /// [`acl_fn!`](crate::acl_fn) writes both arguments from one identifier.
    ///
    /// # Errors
    /// [`LoadError::MissingSymbol`] when the library does not export `symbol`.
    pub fn entry<F: Copy>(
        &self,
        symbol: &'static str,
        field: impl FnOnce(&AclLib) -> &Result<F, libloading::Error>,
    ) -> Result<F, LoadError> {
        match field(&self.lib) {
            Ok(f) => Ok(*f),
            Err(e) => Err(LoadError::MissingSymbol {
                symbol,
                library: self.path.to_string_lossy().into_owned(),
                reason: e.to_string(),
            }),
        }
    }

    /// Any symbol of the library by name, typed by the caller: for functions outside the
    /// subset (e.g. a newer CANN's queries) or a test library's hooks.
    ///
    /// # Errors
    /// [`LoadError::MissingSymbol`] when the library does not export `symbol`.
    ///
    /// # Safety
    /// `T` must be the symbol's true type (a function pointer type with the C signature, or a
    /// pointer for data), as for [`libloading::Library::get`], and the value must not be used
    /// after `self` is dropped (the library may be unloaded then).
    pub unsafe fn symbol<T: Copy>(&self, symbol: &'static str) -> Result<T, LoadError> {
        // SAFETY: the caller guarantees `T` and that the copied value does not outlive `self`,
        // which keeps the library open.
        match unsafe { self.extra.get::<T>(symbol.as_bytes()) } {
            Ok(sym) => Ok(*sym),
            Err(e) => Err(LoadError::MissingSymbol {
                symbol,
                library: self.path.to_string_lossy().into_owned(),
                reason: e.to_string(),
            }),
        }
    }

    /// Whether the library exports `symbol` (a function of the subset).
    ///
    /// Unknown names (not in [`FUNCTIONS`](crate::FUNCTIONS)) are reported as absent.
    pub fn has(&self, symbol: &str) -> bool {
        crate::FUNCTIONS.contains(&symbol) && self.symbol_error(symbol).is_none()
    }

    /// The functions of the subset that the library does not export.
    pub fn missing_symbols(&self) -> Vec<&'static str> {
        crate::FUNCTIONS.iter().copied().filter(|s| self.symbol_error(s).is_some()).collect()
    }

    fn symbol_error(&self, symbol: &str) -> Option<LoadError> {
        crate::functions::lookup_error(self, symbol)
    }
}

/// The function `$name` of an [`Acl`] (an `Acl`, `&Acl`, `Arc<Acl>`: anything that auto-derefs
/// to one in a method call), as
/// `Result<fn pointer, LoadError>`: `unsafe { acl_fn!(acl, aclrtSetDevice)?(0) }`.
///
/// The name is checked at compile time against the generated table.
#[macro_export]
macro_rules! acl_fn {
    ($acl:expr, $name:ident) => {
        ($acl).entry(::core::stringify!($name), |lib| &lib.$name)
    };
}
