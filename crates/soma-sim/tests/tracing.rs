//! With the `tracing` feature, every sanitizer report is a `tracing` event: warn level, target
//! `soma_sim::sanitizer`, the report as its message and its parts as fields. (Own test binary,
//! built with the feature: it installs the process-wide subscriber, since reports about tasks
//! are found on the streams' worker threads.)

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Mutex;

use soma_sim::hal::{DeviceHal, PoolAnnotation, StreamHal};
use soma_sim::{Npu, ReportKind, SanitizerMode};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// An event as the subscriber saw it: its fields as text.
struct Captured {
    level: Level,
    target: String,
    fields: BTreeMap<String, String>,
}

static EVENTS: Mutex<Vec<Captured>> = Mutex::new(Vec::new());

/// A subscriber that keeps every event in [`EVENTS`].
struct Capture;

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        EVENTS.lock().unwrap().push(Captured {
            level: *event.metadata().level(),
            target: event.metadata().target().to_string(),
            fields: fields.0,
        });
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

#[derive(Default)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

#[test]
fn every_report_is_a_warn_event_with_its_parts() {
    tracing::subscriber::set_global_default(Capture).unwrap();
    let dev = Npu::builder().sanitizer(SanitizerMode::Report).build().unwrap().device(0).unwrap();
    let s = dev.create_sim_stream().unwrap();

    // Out of bounds of a `malloc`, found on the stream's worker.
    let m = dev.malloc(4096).unwrap();
    s.memset(m, 0, 4097).unwrap();
    s.synchronize().unwrap();

    // A use after a pool free on the same stream: the report names the free.
    let g = dev.info().granularity;
    let base = dev.reserve(g).unwrap();
    dev.map(base, dev.alloc_physical(g).unwrap()).unwrap();
    let (stream, position) = (s.id(), s.enqueued());
    dev.annotate(PoolAnnotation::Alloc { pool: 3, ptr: base, size: 256, stream, position });
    dev.annotate(PoolAnnotation::Free { pool: 3, ptr: base, stream, position });
    s.memset(base, 0, 16).unwrap();
    s.synchronize().unwrap();

    let reports = dev.take_sanitizer_reports();
    let kinds: Vec<ReportKind> = reports.iter().map(|r| r.kind).collect();
    assert_eq!(kinds, [ReportKind::OutOfBounds, ReportKind::UseAfterFree]);
    let events = EVENTS.lock().unwrap();
    let events: Vec<&Captured> =
        events.iter().filter(|e| e.target == "soma_sim::sanitizer").collect();
    assert_eq!(events.len(), reports.len());
    for (e, r) in events.iter().zip(&reports) {
        assert_eq!(e.level, Level::WARN);
        assert_eq!(e.fields["message"], r.to_string());
    }

    let field = |i: usize, name: &str| events[i].fields.get(name).cloned();
    let text = |v: u64| Some(v.to_string());
    assert_eq!(field(0, "kind").as_deref(), Some("OutOfBounds"));
    assert_eq!(field(0, "stream"), text(s.id()));
    assert_eq!(field(0, "position"), text(1));
    assert_eq!(field(0, "task").as_deref(), Some("memset"));
    assert_eq!(field(0, "addr"), text(m.addr()));
    assert_eq!(field(0, "len"), text(4097));
    assert_eq!(field(0, "write").as_deref(), Some("true"));
    assert_eq!(field(0, "allocation.ptr"), text(m.addr()));
    assert_eq!(field(0, "allocation.size"), text(4096));
    assert_eq!(field(0, "allocation.pool"), None, "malloc memory has no pool");
    assert_eq!(field(0, "other.what"), None);

    assert_eq!(field(1, "kind").as_deref(), Some("UseAfterFree"));
    assert_eq!(field(1, "allocation.pool"), text(3));
    assert_eq!(field(1, "allocation.stream"), text(s.id()));
    assert_eq!(field(1, "allocation.position"), text(position));
    assert_eq!(field(1, "other.what").as_deref(), Some("freed"));
    assert_eq!(field(1, "other.stream"), text(s.id()));
    assert_eq!(field(1, "other.position"), text(position));
}
