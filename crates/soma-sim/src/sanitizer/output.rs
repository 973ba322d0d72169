//! Where the sanitizer's reports go as they are found, besides the device's collection
//! ([`SimDevice::sanitizer_reports`](crate::SimDevice::sanitizer_reports)): with the `tracing`
//! feature, every report is a `tracing` event; without it, the reports are printed to stderr
//! when the mode came from `SOMA_SANITIZER`.

use super::SanitizerReport;

#[cfg(feature = "tracing")]
mod imp {
    use super::SanitizerReport;

    /// Every report becomes a `warn` event of target `soma_sim::sanitizer`, with the report
    /// as its message and its parts as fields; the subscriber decides what is shown.
    pub(crate) struct ReportOutput;

    impl ReportOutput {
        /// The output; with events for every report, the mode coming from `SOMA_SANITIZER`
        /// asks for nothing more.
        pub(crate) fn new(_from_env: bool) -> Self {
            ReportOutput
        }

        pub(crate) fn emit(&self, reports: &[SanitizerReport], _message: &str) {
            for r in reports {
                let allocation = r.allocation.as_ref();
                let other = r.other.as_ref();
                tracing::warn!(
                    target: "soma_sim::sanitizer",
                    kind = ?r.kind,
                    stream = r.stream,
                    position = r.position,
                    task = r.task.as_str(),
                    addr = r.addr,
                    len = r.len,
                    write = r.write,
                    allocation.pool = allocation.and_then(|a| a.pool),
                    allocation.ptr = allocation.map(|a| a.ptr),
                    allocation.size = allocation.map(|a| a.size),
                    allocation.stream = allocation.map(|a| a.stream),
                    allocation.position = allocation.map(|a| a.position),
                    other.what = other.map(|o| o.what),
                    other.stream = other.map(|o| o.stream),
                    other.position = other.map(|o| o.position),
                    "{r}"
                );
            }
        }
    }
}

#[cfg(not(feature = "tracing"))]
mod imp {
    use super::SanitizerReport;

    /// Reports are printed to stderr (a line per task or call with findings) when the mode
    /// came from `SOMA_SANITIZER` (`SOMA_SANITIZER=report cargo test -- --nocapture` shows
    /// them).
    pub(crate) struct ReportOutput {
        stderr: bool,
    }

    impl ReportOutput {
        /// The output; `from_env`: the mode came from `SOMA_SANITIZER`.
        pub(crate) fn new(from_env: bool) -> Self {
            ReportOutput { stderr: from_env }
        }

        pub(crate) fn emit(&self, _reports: &[SanitizerReport], message: &str) {
            if self.stderr {
                eprintln!("{message}");
            }
        }
    }
}

pub(crate) use imp::ReportOutput;
