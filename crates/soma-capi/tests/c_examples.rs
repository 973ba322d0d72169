//! Compiles the C examples (`examples/c/*.c`) with the system C compiler against our headers,
//! links them with the cdylib built for this test run, and runs them. Skipped, with a printed
//! reason, when no C compiler is available.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace's traces, gzipped in `data/traces`.
const TRACES: [&str; 4] =
    ["bert_base_infer", "gpt2_small_infer", "gpt2_small_train", "llama_tinyllama_infer"];

/// The directory holding `libascendcl.so`, found next to this test binary (cargo puts a
/// test's cdylib dependencies in its `deps` directory or the one above). The
/// examples run with `LD_LIBRARY_PATH` set to it: cargo's own `LD_LIBRARY_PATH` for tests
/// lists `target/debug` too, whose copy of the library a `cargo build` left there may be
/// stale, and it takes precedence over the examples' runpath.
fn cdylib_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("SOMA_CAPI_LIB_DIR") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test binary directory");
    for dir in [deps, deps.parent().unwrap_or(deps)] {
        if dir.join("libascendcl.so").exists() {
            return dir.to_path_buf();
        }
    }
    panic!("libascendcl.so not found next to {}", exe.display());
}

fn compiler() -> Option<String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc).arg("--version").output() {
        Ok(o) if o.status.success() => Some(cc),
        _ => None,
    }
}

/// Decompresses the workspace's gzipped traces into `dir` (trace_replay reads plain CSV).
fn decompress_traces(root: &Path, dir: &Path) {
    std::fs::create_dir_all(dir).expect("trace directory");
    for name in TRACES {
        let gz = root.join("data/traces").join(format!("{name}.csv.gz"));
        let raw = std::fs::read(&gz).unwrap_or_else(|e| panic!("{}: {e}", gz.display()));
        let mut csv = Vec::new();
        flate2::read::MultiGzDecoder::new(&raw[..]).read_to_end(&mut csv).expect("gunzip");
        std::fs::write(dir.join(format!("{name}.csv")), csv).expect("write the trace");
    }
}

#[test]
fn c_examples_compile_link_and_pass() {
    let Some(cc) = compiler() else {
        println!("SKIPPED: no C compiler (set CC or install cc) — the C examples were not run");
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let examples = root.join("examples/c");
    let include = root.join("crates/ascend-sys/include");
    let lib = cdylib_dir();
    let out = lib.join("c-examples-test");
    std::fs::create_dir_all(&out).expect("output directory");
    // trace_replay reads `$SOMA_TRACES` when set, else a decompressed copy of the workspace's
    // traces; those larger than the 4 GiB device are skipped with a printed reason.
    let traces = std::env::var_os("SOMA_TRACES").map_or_else(
        || {
            let dir = out.join("traces");
            decompress_traces(&root, &dir);
            dir
        },
        PathBuf::from,
    );
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&examples)
        .expect("examples/c")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "c"))
        .collect();
    sources.sort();
    assert!(sources.len() >= 3, "expected at least three C examples, found {sources:?}");
    for src in sources {
        let name = src.file_stem().expect("stem").to_string_lossy().into_owned();
        let exe = out.join(&name);
        let status = Command::new(&cc)
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror"])
            .arg("-I")
            .arg(&include)
            .arg("-I")
            .arg(&examples)
            .arg(&src)
            .arg("-o")
            .arg(&exe)
            .arg("-L")
            .arg(&lib)
            .arg("-lascendcl")
            .arg(format!("-Wl,-rpath,{}", lib.display()))
            .status()
            .expect("run the C compiler");
        assert!(status.success(), "{name}: compilation failed");
        let run = Command::new(&exe)
            .env("LD_LIBRARY_PATH", &lib)
            .env_remove("SOMA_SIM_PRODUCT")
            .env_remove("SOMA_SIM_DEVICES")
            .env("SOMA_SIM_CAPACITY", "4G")
            .env("SOMA_TRACES", &traces)
            .output()
            .expect("run the example");
        let stdout = String::from_utf8_lossy(&run.stdout);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(
            run.status.success() && stdout.contains(&format!("{name}: ok")),
            "{name} failed ({}):\n{stdout}\n{stderr}",
            run.status
        );
        if name == "trace_replay" && std::env::var_os("SOMA_TRACES").is_none() {
            // Every trace but the training one (5.8 GB at its peak) fits the 4 GiB device.
            assert!(stdout.contains("replayed 3 of 4 traces"), "{stdout}");
            assert!(stdout.contains("skipped gpt2_small_train.csv: its peak"), "{stdout}");
        }
        println!("{name}: passed\n{stdout}");
    }
}

#[test]
fn pool_examples_fail_cleanly_off_atlas_a2() {
    let Some(cc) = compiler() else {
        println!("SKIPPED: no C compiler (set CC or install cc)");
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let lib = cdylib_dir();
    let out = lib.join("c-examples-test");
    std::fs::create_dir_all(&out).expect("output directory");
    let exe = out.join("pool_lifecycle_duo");
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror"])
        .arg("-I")
        .arg(root.join("crates/ascend-sys/include"))
        .arg("-I")
        .arg(root.join("examples/c"))
        .arg(root.join("examples/c/pool_lifecycle.c"))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg("-lascendcl")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .status()
        .expect("run the C compiler");
    assert!(status.success());
    let run = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib)
        .env("SOMA_SIM_PRODUCT", "atlas-300i-duo")
        .env("SOMA_SIM_CAPACITY", "4G")
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("aclrtMemPoolCreate") && stderr.contains("207000"), "{stderr}");
}
