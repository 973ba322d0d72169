//! A minimal JSON writer: what the exports need, with RFC 8259 string escaping.

use std::fmt::Write;

/// Appends `s` as a JSON string literal (quotes included).
pub(crate) fn string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || c == '\u{2028}' || c == '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Builds one JSON object: `{"k":v,...}`.
pub(crate) struct Object<'a> {
    out: &'a mut String,
    first: bool,
}

impl<'a> Object<'a> {
    pub(crate) fn new(out: &'a mut String) -> Self {
        out.push('{');
        Object { out, first: true }
    }

    fn key(&mut self, key: &str) -> &mut String {
        if !self.first {
            self.out.push(',');
        }
        self.first = false;
        string(self.out, key);
        self.out.push(':');
        self.out
    }

    pub(crate) fn u64(&mut self, key: &str, v: u64) -> &mut Self {
        let _ = write!(self.key(key), "{v}");
        self
    }

    /// A number of microseconds from nanoseconds, with nanosecond precision (`1.234`).
    pub(crate) fn micros(&mut self, key: &str, ns: u64) -> &mut Self {
        let _ = write!(self.key(key), "{}.{:03}", ns / 1000, ns % 1000);
        self
    }

    pub(crate) fn str(&mut self, key: &str, v: &str) -> &mut Self {
        let out = self.key(key);
        string(out, v);
        self
    }

    pub(crate) fn bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.key(key).push_str(if v { "true" } else { "false" });
        self
    }

    pub(crate) fn null(&mut self, key: &str) -> &mut Self {
        self.key(key).push_str("null");
        self
    }

    pub(crate) fn opt_str(&mut self, key: &str, v: Option<&str>) -> &mut Self {
        match v {
            Some(v) => self.str(key, v),
            None => self.null(key),
        }
    }

    pub(crate) fn opt_u64(&mut self, key: &str, v: Option<u64>) -> &mut Self {
        match v {
            Some(v) => self.u64(key, v),
            None => self.null(key),
        }
    }

    /// A nested value written by `f` (which must write exactly one JSON value).
    pub(crate) fn raw(&mut self, key: &str, f: impl FnOnce(&mut String)) -> &mut Self {
        f(self.key(key));
        self
    }

    pub(crate) fn finish(&mut self) {
        self.out.push('}');
    }
}

/// Appends a source location as `{"file":…,"line":…,"column":…}` or `null`.
pub(crate) fn location(out: &mut String, loc: Option<&std::panic::Location<'_>>) {
    match loc {
        Some(l) => {
            let mut o = Object::new(out);
            o.str("file", l.file()).u64("line", u64::from(l.line()));
            o.u64("column", u64::from(l.column())).finish();
        }
        None => out.push_str("null"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_strings() {
        let mut s = String::new();
        string(&mut s, "a\"b\\c\nd\u{1}é");
        assert_eq!(s, r#""a\"b\\c\nd\u0001é""#);
    }

    #[test]
    fn objects() {
        let mut s = String::new();
        Object::new(&mut s).u64("a", 1).micros("t", 1_234_567).opt_str("n", None).finish();
        assert_eq!(s, r#"{"a":1,"t":1234.567,"n":null}"#);
    }
}
