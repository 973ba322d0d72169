//! A memory timeline picture (SVG) from a history: no browser needed.

use std::fmt::Write;

use super::lifetimes::{lifetimes, Lifetime};
use super::{Record, RecordKind};
use crate::error::Bytes;

/// How [`timeline_svg`] draws.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SvgOptions {
    /// Title at the top of the picture.
    pub title: String,
    /// Width of the picture in pixels (at least 400).
    pub width: u32,
    /// Height of the picture in pixels (at least 200).
    pub height: u32,
    /// Most allocations drawn as their own band, chosen by size × lifetime; the others are
    /// drawn together as one gray band.
    pub max_bands: usize,
}

impl Default for SvgOptions {
    /// 1200 × 600 pixels, 300 bands, title "pool memory timeline".
    fn default() -> Self {
        SvgOptions {
            title: "pool memory timeline".into(),
            width: 1200,
            height: 600,
            max_bands: 300,
        }
    }
}

impl SvgOptions {
    /// The defaults with `title`.
    pub fn titled(title: impl Into<String>) -> Self {
        SvgOptions { title: title.into(), ..SvgOptions::default() }
    }
}

const PALETTE: [&str; 12] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7",
    "#86bcb6", "#8cd17d", "#a0cbe8", "#ffbe7d",
];
const USED_COLOR: &str = "#1f2d3d";
const RESERVED_COLOR: &str = "#d62728";
const OTHER_COLOR: &str = "#c7c7c7";

const LEFT: f64 = 84.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 64.0;
const BOTTOM: f64 = 48.0;

/// Renders a memory timeline of `records` as a standalone SVG document, in the manner of
/// PyTorch's memory viz "active memory timeline":
///
/// - **stacked live allocations**: each allocation is a band whose height is its size,
///   from its `Alloc` to its `Free` record, stacked in allocation order (the oldest at the
///   bottom; when one is freed, those above move down). The [`SvgOptions::max_bands`]
///   allocations with the largest size × lifetime get their own band (a `<path>` with a
///   `<title>` tooltip: size, stream, times); the rest of the used bytes — small or
///   short allocations, and allocations made before the first record held — form one gray
///   band on top, so the stack's top is the pool's `used`;
/// - **used** (dark line) and **reserved** (red line over a light area) over time;
/// - out-of-memory events as red dashed vertical lines;
/// - axes with units: time on the records' clock (for a pool: since it was created;
///   ns/µs/ms/s), memory (B…GiB).
///
/// The picture is downsampled to one column per pixel: the `used` and `reserved` lines keep
/// each column's minimum and maximum, and the stack is drawn as it was at the column's peak
/// of `used`. The size is bounded by bands × their changes, not by the number of records.
pub fn timeline_svg(records: &[Record], options: &SvgOptions) -> String {
    let width = f64::from(options.width.max(400));
    let height = f64::from(options.height.max(200));
    let plot_w = width - LEFT - RIGHT;
    let plot_h = height - TOP - BOTTOM;
    let columns = plot_w.floor().max(1.0) as usize;

    let t0 = records.first().map_or(0, |r| r.t_ns);
    let t1 = records.last().map_or(1, |r| r.t_ns).max(t0 + 1);
    let span = (t1 - t0) as f64;
    let col_of = |t: u64| (((t - t0) as f64 / span * columns as f64) as usize).min(columns - 1);

    // Choose the bands: the largest size × lifetime.
    let lives = lifetimes(records);
    let mut order: Vec<usize> = (0..lives.len()).collect();
    let area = |l: &Lifetime| l.size as f64 * (l.end_ns - l.start_ns).max(1) as f64;
    order.sort_by(|&a, &b| area(&lives[b]).total_cmp(&area(&lives[a])));
    order.truncate(options.max_bands);
    order.sort_unstable(); // back to start order: band ids follow allocation order
    let bands: Vec<&Lifetime> = order.iter().map(|&i| &lives[i]).collect();
    // Record index -> band starting / ending there.
    let mut starts = vec![u32::MAX; records.len()];
    let mut ends = vec![u32::MAX; records.len()];
    let mut stack: Vec<u32> = Vec::new();
    for (b, l) in bands.iter().enumerate() {
        match l.alloc {
            Some(i) => starts[i] = b as u32,
            None => stack.push(b as u32),
        }
        if let Some(i) = l.free {
            ends[i] = b as u32;
        }
    }

    // Walk the records: per column, line envelopes and the stack at the peak of `used`.
    let mut used_line = Envelope::default();
    let mut reserved_line = Envelope::default();
    let mut band_pts: Vec<Vec<(usize, u64)>> = vec![Vec::new(); bands.len()];
    let mut other_pts: Vec<(usize, u64, u64)> = Vec::new(); // (column, bottom, top)
    let mut peak: Option<(u64, Vec<u32>)> = None; // this column's sample
    let mut col = 0usize;
    let (mut used, mut reserved) = records.first().map_or((0, 0), |r| (r.used, r.reserved));
    let mut ymax = 1u64;
    let mut ooms: Vec<&Record> = Vec::new();
    let mut flush = |col: usize, sample: (u64, &[u32])| {
        let mut y = 0u64;
        for &b in sample.1 {
            band_pts[b as usize].push((col, y));
            y += bands[b as usize].size;
        }
        if sample.0 > y {
            other_pts.push((col, y, sample.0));
        }
    };
    for (i, r) in records.iter().enumerate() {
        let c = col_of(r.t_ns);
        if c != col {
            let sample = peak.take().unwrap_or_else(|| (used, stack.clone()));
            flush(col, (sample.0, &sample.1));
            // Columns without records show the state carried over.
            for empty in col + 1..c {
                flush(empty, (used, &stack));
            }
            col = c;
        }
        if starts[i] != u32::MAX {
            stack.push(starts[i]);
        }
        if ends[i] != u32::MAX {
            if let Some(p) = stack.iter().position(|&b| b == ends[i]) {
                stack.remove(p);
            }
        }
        used_line.add(c, used, r.used);
        reserved_line.add(c, reserved, r.reserved);
        used = r.used;
        reserved = r.reserved;
        let banded: u64 = stack.iter().map(|&b| bands[b as usize].size).sum();
        ymax = ymax.max(r.used).max(r.reserved).max(banded);
        if peak.as_ref().is_none_or(|p| used >= p.0) {
            match &mut peak {
                Some(p) => {
                    p.0 = used;
                    p.1.clone_from(&stack);
                }
                None => peak = Some((used, stack.clone())),
            }
        }
        if r.kind == RecordKind::Oom {
            ooms.push(r);
        }
    }
    if !records.is_empty() {
        let sample = peak.take().unwrap_or_else(|| (used, stack.clone()));
        flush(col, (sample.0, &sample.1));
    }

    // Scales.
    let (ystep, yunit, ydiv) = nice_bytes_step(ymax);
    let ytop = ymax.div_ceil(ystep) * ystep;
    let x_of = |c: f64| LEFT + c / columns as f64 * plot_w;
    let x_of_t = |t: u64| LEFT + (t - t0) as f64 / span * plot_w;
    let y_of = |v: u64| TOP + plot_h - v as f64 / ytop as f64 * plot_h;

    let mut out = String::with_capacity(64 * 1024);
    let _ = write!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
         font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n\
         <rect x=\"0\" y=\"0\" width=\"{w}\" height=\"{h}\" fill=\"#ffffff\"/>\n",
        w = width,
        h = height
    );
    let _ = writeln!(
        out,
        "<text class=\"title\" x=\"{LEFT}\" y=\"22\" font-size=\"16\" font-weight=\"bold\">{}</text>",
        xml(&options.title)
    );
    // Legend.
    let legend = [
        (USED_COLOR, "used".to_string()),
        (RESERVED_COLOR, "reserved".to_string()),
        (
            PALETTE[0],
            format!(
                "live allocations, stacked ({} largest by size \u{d7} lifetime as bands)",
                bands.len()
            ),
        ),
        (OTHER_COLOR, "other live bytes".to_string()),
    ];
    let mut lx = LEFT;
    for (color, label) in &legend {
        let _ = writeln!(
            out,
            "<rect x=\"{lx:.1}\" y=\"34\" width=\"12\" height=\"12\" fill=\"{color}\"/>\
             <text x=\"{:.1}\" y=\"44\">{}</text>",
            lx + 16.0,
            xml(label)
        );
        lx += 16.0 + 6.4 * label.chars().count() as f64 + 18.0;
    }
    // Grid and y axis.
    out.push_str("<g class=\"y-axis\" stroke=\"#e0e0e0\">\n");
    let mut v = 0;
    while v <= ytop {
        let y = y_of(v);
        let _ = writeln!(
            out,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" stroke=\"none\" fill=\"#333\">{}</text>",
            LEFT + plot_w,
            LEFT - 6.0,
            y + 4.0,
            fmt_unit(v as f64 / ydiv, yunit)
        );
        v += ystep;
    }
    out.push_str("</g>\n");
    let _ = writeln!(
        out,
        "<text class=\"axis-label\" transform=\"translate(16 {:.1}) rotate(-90)\" text-anchor=\"middle\">memory ({yunit})</text>",
        TOP + plot_h / 2.0
    );
    // x axis.
    let (tstep, tunit, tdiv) = nice_time_step(t1 - t0);
    out.push_str("<g class=\"x-axis\" stroke=\"#e0e0e0\">\n");
    let mut t = t0.div_ceil(tstep) * tstep;
    while t <= t1 {
        let x = x_of_t(t);
        let _ = writeln!(
            out,
            "<line x1=\"{x:.1}\" y1=\"{TOP}\" x2=\"{x:.1}\" y2=\"{:.1}\"/>\
             <text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" stroke=\"none\" fill=\"#333\">{}</text>",
            TOP + plot_h,
            TOP + plot_h + 16.0,
            fmt_unit(t as f64 / tdiv, tunit)
        );
        t += tstep;
    }
    out.push_str("</g>\n");
    let _ = writeln!(
        out,
        "<text class=\"axis-label\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">time ({tunit})</text>",
        LEFT + plot_w / 2.0,
        height - 10.0
    );

    // Reserved area (behind everything).
    let reserved_pts = reserved_line.points(columns);
    if !reserved_pts.is_empty() {
        let mut d = format!("M{:.1},{:.1}", x_of(reserved_pts[0].0), y_of(0));
        for &(c, v) in &reserved_pts {
            let _ = write!(d, "L{:.1},{:.1}", x_of(c), y_of(v));
        }
        let _ = write!(d, "L{:.1},{:.1}Z", x_of(reserved_pts[reserved_pts.len() - 1].0), y_of(0));
        let _ = writeln!(
            out,
            "<path class=\"reserved-area\" d=\"{d}\" fill=\"{RESERVED_COLOR}\" fill-opacity=\"0.07\" stroke=\"none\"/>"
        );
    }
    // Bands.
    out.push_str("<g class=\"allocations\" stroke=\"none\">\n");
    for (b, pts) in band_pts.iter().enumerate() {
        if pts.is_empty() {
            continue;
        }
        let l = bands[b];
        let d = band_path(pts, l.size, &x_of, &y_of);
        let end =
            if l.free.is_some() { format!("{:.3} ms", ms(l.end_ns)) } else { "live at end".into() };
        let start = if l.alloc.is_some() {
            format!("{:.3} ms", ms(l.start_ns))
        } else {
            "before the first record".into()
        };
        let _ = writeln!(
            out,
            "<path class=\"alloc\" d=\"{d}\" fill=\"{}\"><title>{} on stream {} at offset {:#x}: {start} \u{2192} {end}</title></path>",
            PALETTE[b % PALETTE.len()],
            Bytes(l.size),
            l.stream,
            l.offset
        );
    }
    if !other_pts.is_empty() {
        // One polygon: bottoms left to right, tops right to left.
        let mut d = String::new();
        for run in split_runs(&other_pts) {
            let _ = write!(d, "M{:.1},{:.1}", x_of(run[0].0 as f64), y_of(run[0].1));
            for &(c, bottom, _) in run {
                let _ = write!(
                    d,
                    "L{:.1},{:.1}L{:.1},{:.1}",
                    x_of(c as f64),
                    y_of(bottom),
                    x_of(c as f64 + 1.0),
                    y_of(bottom)
                );
            }
            for &(c, _, top) in run.iter().rev() {
                let _ = write!(
                    d,
                    "L{:.1},{:.1}L{:.1},{:.1}",
                    x_of(c as f64 + 1.0),
                    y_of(top),
                    x_of(c as f64),
                    y_of(top)
                );
            }
            d.push('Z');
        }
        let _ = writeln!(
            out,
            "<path class=\"other\" d=\"{d}\" fill=\"{OTHER_COLOR}\"><title>other live bytes: allocations too small or short to get a band, and allocations made before the first record</title></path>"
        );
    }
    out.push_str("</g>\n");
    // Lines.
    for (class, line, color, width) in [
        ("reserved", &reserved_pts, RESERVED_COLOR, 1.5),
        ("used", &used_line.points(columns), USED_COLOR, 1.2),
    ] {
        if line.is_empty() {
            continue;
        }
        let mut p = String::new();
        for &(c, v) in line.iter() {
            let _ = write!(p, "{:.1},{:.1} ", x_of(c), y_of(v));
        }
        let _ = writeln!(
            out,
            "<polyline class=\"{class}\" points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"{width}\"><title>{class}</title></polyline>",
            p.trim_end()
        );
    }
    for r in ooms {
        let x = x_of_t(r.t_ns);
        let _ = writeln!(
            out,
            "<line class=\"oom\" x1=\"{x:.1}\" y1=\"{TOP}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"{RESERVED_COLOR}\" stroke-dasharray=\"4 3\"><title>out of memory: {} on stream {}</title></line>",
            TOP + plot_h,
            Bytes(r.requested),
            r.stream
        );
    }
    // Plot frame.
    let _ = writeln!(
        out,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{plot_w:.1}\" height=\"{plot_h:.1}\" fill=\"none\" stroke=\"#888\"/>"
    );
    out.push_str("</svg>\n");
    out
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// Per column: the value at its start, its min and max, and its value at the end.
#[derive(Default)]
struct Envelope {
    cols: Vec<(usize, u64, u64, u64, u64)>,
}

impl Envelope {
    fn add(&mut self, col: usize, before: u64, after: u64) {
        match self.cols.last_mut() {
            Some(e) if e.0 == col => {
                e.2 = e.2.min(after);
                e.3 = e.3.max(after);
                e.4 = after;
            }
            _ => self.cols.push((col, before, before.min(after), before.max(after), after)),
        }
    }

    /// Polyline points `(column position, value)`: each column's start, extremes and end;
    /// consecutive duplicates removed; the last value extends to the right edge.
    fn points(&self, columns: usize) -> Vec<(f64, u64)> {
        let mut pts: Vec<(f64, u64)> = Vec::with_capacity(self.cols.len() * 3);
        fn push(pts: &mut Vec<(f64, u64)>, p: (f64, u64)) {
            let n = pts.len();
            // Drop the middle of three points on one horizontal line.
            if n >= 2 && pts[n - 1].1 == p.1 && pts[n - 2].1 == p.1 {
                pts[n - 1] = p;
            } else if pts.last() != Some(&p) {
                pts.push(p);
            }
        }
        let push = |pts: &mut Vec<(f64, u64)>, p| push(pts, p);
        for &(c, start, min, max, end) in &self.cols {
            let x = c as f64;
            push(&mut pts, (x, start));
            if min != max {
                if start <= end {
                    push(&mut pts, (x + 0.5, min));
                    push(&mut pts, (x + 0.5, max));
                } else {
                    push(&mut pts, (x + 0.5, max));
                    push(&mut pts, (x + 0.5, min));
                }
            }
            push(&mut pts, (x + 1.0, end));
        }
        if let Some(&(_, v)) = pts.last() {
            push(&mut pts, (columns as f64, v));
        }
        pts
    }
}

/// A band's outline: its bottom edge left to right (a step per column where it changes),
/// then its top edge (bottom + size) right to left.
fn band_path(
    pts: &[(usize, u64)],
    size: u64,
    x_of: &dyn Fn(f64) -> f64,
    y_of: &dyn Fn(u64) -> f64,
) -> String {
    let mut d = String::new();
    let first = pts[0];
    let last = pts[pts.len() - 1];
    let _ = write!(d, "M{:.1},{:.1}", x_of(first.0 as f64), y_of(first.1));
    let mut prev = first.1;
    for &(c, bottom) in &pts[1..] {
        if bottom != prev {
            let _ = write!(d, "H{:.1}V{:.1}", x_of(c as f64), y_of(bottom));
            prev = bottom;
        }
    }
    let _ = write!(d, "H{:.1}V{:.1}", x_of(last.0 as f64 + 1.0), y_of(last.1 + size));
    let mut prev = last.1;
    for w in pts.windows(2).rev() {
        let (a, b) = (w[0], w[1]);
        if a.1 != prev {
            let _ = write!(d, "H{:.1}V{:.1}", x_of(b.0 as f64), y_of(a.1 + size));
            prev = a.1;
        }
    }
    let _ = write!(d, "H{:.1}Z", x_of(first.0 as f64));
    d
}

/// Splits column samples into runs of consecutive columns.
fn split_runs(pts: &[(usize, u64, u64)]) -> Vec<&[(usize, u64, u64)]> {
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=pts.len() {
        if i == pts.len() || pts[i].0 != pts[i - 1].0 + 1 {
            runs.push(&pts[start..i]);
            start = i;
        }
    }
    runs
}

/// A 1-2-5 step in a binary unit giving 4 to 8 ticks up to `max`: (step bytes, unit, unit
/// size).
fn nice_bytes_step(max: u64) -> (u64, &'static str, f64) {
    const UNITS: [(&str, u64); 5] =
        [("B", 1), ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40)];
    let (unit, div) = UNITS.iter().rev().find(|(_, d)| max >= *d * 2).copied().unwrap_or(UNITS[0]);
    let step = nice_step(max as f64 / div as f64);
    (((step * div as f64) as u64).max(1), unit, div as f64)
}

/// As [`nice_bytes_step`] for a time span in ns.
fn nice_time_step(span: u64) -> (u64, &'static str, f64) {
    const UNITS: [(&str, u64); 4] =
        [("ns", 1), ("\u{b5}s", 1_000), ("ms", 1_000_000), ("s", 1_000_000_000)];
    let (unit, div) = UNITS.iter().rev().find(|(_, d)| span >= *d * 2).copied().unwrap_or(UNITS[0]);
    let step = nice_step(span as f64 / div as f64);
    (((step * div as f64) as u64).max(1), unit, div as f64)
}

/// The 1-2-5 step that cuts `range` into 4 to 8 parts.
fn nice_step(range: f64) -> f64 {
    let raw = (range / 8.0).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let nice = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn fmt_unit(v: f64, unit: &str) -> String {
    if (v - v.round()).abs() < 1e-6 {
        format!("{} {unit}", v.round() as i64)
    } else {
        format!("{v:.1} {unit}")
    }
}

/// Escapes text for XML content and attribute values. Control characters other than tab,
/// newline and carriage return are not allowed in XML 1.0, escaped or not: they become U+FFFD.
fn xml(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || matches!(c, '\u{fffe}' | '\u{ffff}') => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_escapes_markup_and_replaces_characters_xml_forbids() {
        assert_eq!(xml("a<&>\"'b"), "a&lt;&amp;&gt;&quot;&apos;b");
        assert_eq!(xml("run\u{1b}[1m\t7\u{0}"), "run\u{fffd}[1m\t7\u{fffd}");
    }

    #[test]
    fn steps_are_nice() {
        assert_eq!(nice_bytes_step(620 << 20), (100 << 20, "MiB", (1u64 << 20) as f64));
        assert_eq!(nice_time_step(15_000_000).1, "ms");
        assert_eq!(xml("a<b&\"c\""), "a&lt;b&amp;&quot;c&quot;");
    }

    #[test]
    fn an_empty_history_is_an_empty_chart() {
        let svg = timeline_svg(&[], &SvgOptions::default());
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(!svg.contains("class=\"alloc\""));
    }

    #[test]
    fn one_allocation_is_one_band_under_the_used_line() {
        let rec = |t_ns, kind, used| Record {
            t_ns,
            size: 1 << 20,
            used,
            reserved: 2 << 20,
            stream: 7,
            ..Record::new(kind)
        };
        let records = [
            rec(0, RecordKind::Map, 0),
            rec(1_000, RecordKind::Alloc, 1 << 20),
            rec(9_000, RecordKind::Free, 0),
            rec(10_000, RecordKind::Trim, 0),
        ];
        let svg = timeline_svg(&records, &SvgOptions::titled("one"));
        assert_eq!(svg.matches("<path class=\"alloc\"").count(), 1);
        assert!(svg.contains("1.0 MiB on stream 7 at offset 0x0: 0.001 ms \u{2192} 0.009 ms"));
        assert!(svg.contains("memory (MiB)") && svg.contains(">time (\u{b5}s)<"));
        assert!(!svg.contains("class=\"other\""), "no bytes outside the band");
    }

    #[test]
    fn band_outline_steps_where_the_bottom_moves() {
        let x = |c: f64| c;
        let y = |v: u64| v as f64;
        let d = band_path(&[(0, 0), (1, 0), (2, 10), (3, 10)], 5, &x, &y);
        assert_eq!(d, "M0.0,0.0H2.0V10.0H4.0V15.0H2.0V5.0H0.0Z");
    }
}
