//! `soma-replay` end to end: which streams a trace's ops run on, its JSON output, its help and
//! its errors.

use std::path::PathBuf;
use std::process::Command;

/// A trace on two recorded streams (0 and 5) in which both allocations made before the
/// frees are freed on the other stream.
const TWO_STREAMS: &str = "op,id,bytes,stream\n\
a,0,3000000,0\n\
a,1,1000000,5\n\
f,0,0,5\n\
a,2,2000000,5\n\
f,1,0,0\n\
f,2,0,5\n";

fn trace_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("soma-replay-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// `soma-replay PATH ARGS --json`: (streams, cross-stream frees).
fn replay(path: &PathBuf, args: &[&str]) -> (u64, u64) {
    let out = Command::new(env!("CARGO_BIN_EXE_soma-replay"))
        .arg(path)
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json = String::from_utf8(out.stdout).unwrap();
    let field = |name: &str| -> u64 {
        let at = json.find(&format!("\"{name}\":")).unwrap() + name.len() + 3;
        json[at..].split([',', '}']).next().unwrap().parse().unwrap()
    };
    (field("streams"), field("hand_offs"))
}

#[test]
fn ops_run_on_their_recorded_streams_unless_streams_is_given() {
    let path = trace_file("two_streams.csv", TWO_STREAMS);
    // Recorded: ids 0 and 1 are each freed on the other stream, through a hand-off.
    assert_eq!(replay(&path, &[]), (2, 2));
    // `--streams 1` puts everything on one stream; `--streams 3` spreads the ops round-robin
    // (op k on stream k mod 3: ids 0 and 2, allocated on stream 0, are freed on stream 2; id 1
    // on stream 1, where it was allocated).
    assert_eq!(replay(&path, &["--streams", "1"]), (1, 0));
    assert_eq!(replay(&path, &["--streams", "3"]), (3, 2));
}

#[test]
fn stream_per_replay_runs_each_replay_on_the_next_stream() {
    let path = trace_file("one_stream.csv", &TWO_STREAMS.replace(",5\n", ",0\n"));
    // The reuses of the last replay under `rule` (as `soma-replay` prints them).
    let reuses = |args: &[&str], rule: &str| -> u64 {
        let out =
            Command::new(env!("CARGO_BIN_EXE_soma-replay")).arg(&path).args(args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let at = text.find(&format!("{rule} ")).unwrap() + rule.len() + 1;
        text[at..].split([',', ')']).next().unwrap().parse().unwrap()
    };
    // The last of three replays runs on the third stream, so it reuses the blocks the second
    // one freed on another stream: their frees have completed (the opportunistic rule), or,
    // with a synchronisation after each replay, the host has observed them. All on one
    // stream, every reuse is a same-stream one.
    let in_turn = ["--streams", "3", "--replays", "3", "--stream-per-replay"];
    assert!(reuses(&in_turn, "opportunistic") > 0);
    assert_eq!(reuses(&in_turn, "host sync"), 0);
    let synchronized = [&in_turn[..], &["--sync-per-replay"]].concat();
    assert!(reuses(&synchronized, "host sync") > 0);
    assert_eq!(reuses(&synchronized, "opportunistic"), 0);
    assert_eq!(reuses(&["--streams", "1", "--replays", "3"], "opportunistic"), 0);
    assert_eq!(replay(&path, &in_turn), (3, 0));
    let out = Command::new(env!("CARGO_BIN_EXE_soma-replay"))
        .args([path.to_str().unwrap(), "--stream-per-replay"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "--stream-per-replay without --streams is refused");
}

/// `--json` escapes the trace's name: a quote, a backslash or a tab in a file name still
/// gives one valid JSON string.
#[test]
fn json_output_escapes_the_trace_name() {
    let path = trace_file("q\"uo\\te\tx.csv", TWO_STREAMS);
    let out = Command::new(env!("CARGO_BIN_EXE_soma-replay")).arg(&path).arg("--json").output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json = String::from_utf8(out.stdout).unwrap();
    assert!(json.starts_with("{\"trace\":\"q\\\"uo\\\\te\\tx\","), "{json}");
    assert!(!json.contains('\t'), "{json}");
}

/// The bundled traces replay as they are, gzipped: the BERT trace's requested peak is the one
/// its README gives, and the pool holds at least that much.
#[test]
fn replays_a_bundled_trace() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/traces/bert_base_infer.csv.gz");
    let out = Command::new(env!("CARGO_BIN_EXE_soma-replay")).arg(&path).arg("--json").output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json = String::from_utf8(out.stdout).unwrap();
    let field = |name: &str| -> u64 {
        let at = json.find(&format!("\"{name}\":")).unwrap() + name.len() + 3;
        json[at..].split([',', '}']).next().unwrap().parse().unwrap()
    };
    assert!(json.starts_with("{\"trace\":\"bert_base_infer\","), "{json}");
    assert_eq!(field("ops"), 9_321);
    assert_eq!(field("peak_live_requested"), 578_544_704);
    assert!(field("peak_reserved") >= 578_544_704, "{json}");
}

/// Without arguments the help is printed as an error: it names where the bundled traces are.
#[test]
fn usage_points_at_the_bundled_traces() {
    let out = Command::new(env!("CARGO_BIN_EXE_soma-replay")).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("data/traces/"), "{text}");
}

/// `--help` succeeds and documents every option with its default.
#[test]
fn help_documents_every_option_and_its_default() {
    let out = Command::new(env!("CARGO_BIN_EXE_soma-replay")).arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let options = [
        ("--alignment <BYTES>", "[default: the pool's, 512 B]"),
        ("--max-size <BYTES>", "[default: the pool's, the device's total memory]"),
        ("--release-threshold <BYTES>", "[default: the pool's, the max size]"),
        ("--streams <N>", "[default: the trace's `stream` column"),
        ("--shards <S>", "[default: 1]"),
        ("--sync-every <K>", "[default: 0]"),
        ("--capacity <BYTES>", "[default: 64G]"),
        ("--recycle", "[default: the pool's, off]"),
        ("--no-recycle", "the pool's default"),
        ("--replays <R>", "[default: 1]"),
        ("--resident", "[default: freed between replays]"),
        ("--stream-per-replay", "[default: ops spread over the streams]"),
        ("--sync-per-replay", "[default: no synchronization between replays]"),
        ("--json", "instead of a table"),
    ];
    for (option, default) in options {
        // The option's help runs from its name to the next option's.
        let at = text.find(&format!("  {option}\n")).unwrap_or_else(|| panic!("{option}: {text}"));
        let help: String = text[at + option.len() + 3..]
            .lines()
            .take_while(|line| !line.trim_start().starts_with('-'))
            .collect();
        assert!(help.contains(default), "{option}: {default} not in {help:?}");
    }
}

/// Bad input is refused with exit code 2 and a message that names the option and the
/// problem; a trace that cannot be read fails with exit code 1.
#[test]
fn bad_arguments_exit_with_code_2_and_say_what_is_wrong() {
    let path = trace_file("bad_arguments.csv", TWO_STREAMS);
    let path = path.to_str().unwrap();
    for (args, message) in [
        (&[path, "--streams", "0"][..], "'--streams <N>': must be at least 1"),
        (&[path, "--replays", "0"], "'--replays <R>': must be at least 1"),
        (&[path, "--max-size", "3Q"], "bad size \"3Q\""),
        (&[path, "--sync-every", "x"], "'--sync-every <K>'"),
        (&[path, "--stream-per-replay"], "--streams <N>"),
        (&[path, "--no-such-option"], "unexpected argument '--no-such-option'"),
        (&[path, path], "unexpected argument"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_soma-replay")).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains(message), "{args:?}: {message} not in {text}");
    }
    let out =
        Command::new(env!("CARGO_BIN_EXE_soma-replay")).arg("no/such/trace.csv").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("soma-replay: no/such/trace.csv"));
}

/// `--replays 3` reports every replay: the first maps what the trace needs, the later ones
/// reuse it without a driver call; each replay's modelled driver time follows its calls.
#[test]
fn every_replay_reports_its_driver_calls() {
    let path = trace_file("per_replay.csv", &TWO_STREAMS.replace(",5\n", ",0\n"));
    let run = |json: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_soma-replay"));
        cmd.arg(&path).args(["--replays", "3"]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let json = run(true);
    let replays = &json[json.find("\"replays\":[").expect("a replays array")..];
    // Every value of `name` in the replays array, in order.
    let values = |name: &str| -> Vec<f64> {
        replays
            .match_indices(&format!("\"{name}\":"))
            .map(|(at, _)| {
                let rest = &replays[at + name.len() + 3..];
                rest.split([',', '}']).next().unwrap().parse().unwrap()
            })
            .collect()
    };
    let maps = values("map_calls");
    assert_eq!(maps.len(), 3, "{json}");
    assert!(maps[0] > 0.0, "{json}");
    assert_eq!(&maps[1..], &[0.0, 0.0], "{json}");
    assert_eq!(values("unmap_calls"), [0.0, 0.0, 0.0], "{json}");
    let driver = values("driver_ns_per_op");
    assert!(driver[0] > 0.0 && driver[1..] == [0.0, 0.0], "{json}");
    // The physical allocations behind the maps, by kind.
    assert_eq!(values("alloc_physical"), maps, "{json}");
    // The text report has one line per replay.
    let text = run(false);
    let table = &text[text.find("per replay").expect("a per-replay table")..];
    assert_eq!(table.lines().count(), 4, "{text}");
}
