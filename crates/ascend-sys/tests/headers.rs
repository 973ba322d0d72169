//! The headers under `include/acl/` compile, as C99 and as C++, with warnings as errors, in a
//! program that uses every declaration of the subset (`tests/c/subset.c`), and each header
//! compiles when included alone. Skipped (with a message) when no C compiler is installed.

use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn have(compiler: &str) -> bool {
    Command::new(compiler).arg("--version").output().is_ok_and(|o| o.status.success())
}

fn compile(compiler: &str, lang: &str, std: &str, source: &Path) {
    let include = crate_dir().join("include");
    let out = Command::new(compiler)
        .args(["-x", lang, std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-fsyntax-only"])
        .arg(format!("-I{}", include.display()))
        .arg(source)
        .output()
        .expect("run the compiler");
    assert!(
        out.status.success(),
        "{compiler} -x {lang} {std} {} failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn subset_program_compiles_as_c_and_cpp() {
    let src = crate_dir().join("tests/c/subset.c");
    for (compiler, lang, std) in [("cc", "c", "-std=c99"), ("c++", "c++", "-std=c++11")] {
        if !have(compiler) {
            eprintln!("skipped: no `{compiler}` on PATH");
            continue;
        }
        compile(compiler, lang, std, &src);
    }
}

#[test]
fn each_header_compiles_alone() {
    if !have("cc") {
        eprintln!("skipped: no `cc` on PATH");
        return;
    }
    let dir = std::env::temp_dir().join(format!("ascend-sys-headers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for header in ["acl.h", "acl_base.h", "acl_rt.h", "acl_rt_memory_soma.h"] {
        let src = dir.join(format!("{header}.c"));
        // Included twice: the include guards must hold.
        std::fs::write(&src, format!("#include <acl/{header}>\n#include <acl/{header}>\n"))
            .unwrap();
        compile("cc", "c", "-std=c99", &src);
    }
    std::fs::remove_dir_all(&dir).ok();
}
