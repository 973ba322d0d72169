//! A library that exports only part of the subset loads; the missing functions are error
//! values naming them, at lookup, never a panic. The library is compiled from C at test time
//! (skipped with a message when there is no `cc`).

use std::path::PathBuf;
use std::process::Command;

use ascend_sys::{acl_fn, Acl, AclError, LoadError, FUNCTIONS, REQUIRED_SYMBOLS};

fn build(name: &str, source: &str) -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("ascend-sys-partial-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let c = dir.join(format!("{name}.c"));
    let so = dir.join(format!("lib{name}.so"));
    std::fs::write(&c, source).unwrap();
    let include = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("include");
    match Command::new("cc")
        .args(["-std=c99", "-shared", "-fPIC", "-Wall", "-Werror"])
        .arg(format!("-I{}", include.display()))
        .arg(&c)
        .arg("-o")
        .arg(&so)
        .output()
    {
        Ok(o) if o.status.success() => Some(so),
        Ok(o) => panic!("{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            eprintln!("skipped: no C compiler ({e})");
            None
        }
    }
}

const MINIMAL: &str = r#"
#define FUNC_VISIBILITY
#include <acl/acl.h>
aclError aclInit(const char *configPath) { (void)configPath; return ACL_SUCCESS; }
aclError aclrtSetDevice(int32_t deviceId) {
    return deviceId == 0 ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
}
"#;

#[test]
fn missing_functions_are_errors_at_lookup() {
    let Some(so) = build("minimal", MINIMAL) else { return };
    // SAFETY: the library defines the two functions with the header's signatures.
    let acl = unsafe { Acl::open(&so) }.expect("a library with the required symbols loads");
    assert_eq!(acl.path(), so.as_os_str());
    assert!(acl.has("aclInit") && acl.has("aclrtSetDevice"));
    assert!(!acl.has("aclrtMalloc"));
    assert!(!acl.has("notAnAclFunction"));
    let missing = acl.missing_symbols();
    assert_eq!(missing.len(), FUNCTIONS.len() - REQUIRED_SYMBOLS.len());
    assert!(missing.contains(&"aclrtMemPoolCreate"));

    let set = acl_fn!(acl, aclrtSetDevice).unwrap();
    // SAFETY: plain integer argument.
    assert_eq!(unsafe { set(0) }, AclError::SUCCESS);
    // SAFETY: as above.
    assert_eq!(unsafe { set(3) }.result(), Err(AclError::ERROR_RT_PARAM_INVALID));

    match acl_fn!(acl, aclrtMalloc) {
        Err(LoadError::MissingSymbol { symbol, library, .. }) => {
            assert_eq!(symbol, "aclrtMalloc");
            assert_eq!(library, so.to_string_lossy());
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    // Through an Arc too.
    let shared = std::sync::Arc::new(acl);
    assert!(acl_fn!(shared, aclrtFree).is_err());
    assert!(acl_fn!(&shared, aclInit).is_ok());
}

#[test]
fn a_library_without_the_required_symbols_is_rejected() {
    let src = "#define FUNC_VISIBILITY\n#include <acl/acl.h>\n\
               aclError aclInit(const char *p) { (void)p; return ACL_SUCCESS; }\n";
    let Some(so) = build("no_set_device", src) else { return };
    // SAFETY: the library defines aclInit with the header's signature and nothing else.
    match unsafe { Acl::open(&so) } {
        Err(LoadError::MissingSymbol { symbol, .. }) => assert_eq!(symbol, "aclrtSetDevice"),
        other => panic!("{other:?}"),
    }
}
