//! The `tojson` filter as transformers defines it for chat templates:
//! `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
//! sort_keys=False)`, Python's output reproduced byte for byte (separators,
//! indentation, string escapes, float `repr`), not minijinja's HTML-safe
//! `tojson`. Values json.dumps cannot encode (undefined, bytes, objects) are
//! errors, as they are in Python.
use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Error, ErrorKind, Value};
use std::fmt::Write;

/// Nesting deeper than this is refused rather than recursed into (Python
/// stops at its recursion limit too).
const MAX_DEPTH: usize = 256;
/// The widest indentation accepted, in spaces.
const MAX_INDENT: i64 = 64;

/// How to encode, as json.dumps' keyword arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// `None`: one line; `Some(unit)`: one item a line, `unit` per level.
    pub indent: Option<String>,
    /// Between items.
    pub item_separator: String,
    /// Between a key and its value.
    pub key_separator: String,
    /// Objects' keys in sorted order rather than insertion order.
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    /// transformers' defaults: ensure_ascii off, no indent, `", "` and `": "`.
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

/// The filter: `x|tojson`, `x|tojson(indent=2)`, with transformers'
/// positional order `(ensure_ascii, indent, separators, sort_keys)`.
pub fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            format!("tojson takes at most {} arguments", NAMES.len()),
        ));
    }
    let mut given: [Option<Value>; 4] = Default::default();
    for (slot, arg) in given.iter_mut().zip(args.iter()) {
        *slot = Some(arg.clone());
    }
    for (slot, name) in given.iter_mut().zip(NAMES) {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slot.is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            *slot = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = given;
    let opts = options(ensure_ascii, indent, separators, sort_keys)?;
    dumps(value, &opts).map(Value::from)
}

/// json.dumps' reading of its keyword arguments (None means the default).
fn options(
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    sort_keys: Option<Value>,
) -> Result<DumpOptions, Error> {
    let indent = match present(&indent) {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().into()),
        // Python's `' ' * indent`: a negative count is no indentation (but
        // still one item a line).
        Some(v) if v.is_integer() => match v.as_i64() {
            Some(n) if n <= MAX_INDENT => Some(" ".repeat(n.max(0) as usize)),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent of {v} is beyond {MAX_INDENT}"),
                ))
            }
        },
        Some(v) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: indent must be an integer or a string, not {}",
                    v.kind()
                ),
            ))
        }
    };
    let (item_separator, key_separator) = match present(&separators) {
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => (
                    item.as_str().unwrap_or_default().to_string(),
                    key.as_str().unwrap_or_default().to_string(),
                ),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings (item, key)",
                    ))
                }
            }
        }
        // json.dumps: no trailing space after a comma when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    Ok(DumpOptions {
        ensure_ascii: present(&ensure_ascii).is_some_and(Value::is_true),
        indent,
        item_separator,
        key_separator,
        sort_keys: present(&sort_keys).is_some_and(Value::is_true),
    })
}

/// An argument given as something other than none.
fn present(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_none() && !v.is_undefined())
}

/// `value` as json.dumps writes it with `opts`.
pub fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    encode(value, opts, 0, &mut out)?;
    Ok(out)
}

fn not_serializable(value: &Value) -> Error {
    let kind = match value.kind() {
        ValueKind::Undefined => "Undefined".to_string(),
        kind => kind.to_string(),
    };
    Error::new(
        ErrorKind::InvalidOperation,
        format!("tojson: Object of type {kind} is not JSON serializable"),
    )
}

fn encode(value: &Value, opts: &DumpOptions, level: usize, out: &mut String) -> Result<(), Error> {
    if level > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: nested deeper than {MAX_DEPTH} levels"),
        ));
    }
    if super::py_none::is(value) {
        out.push_str("null");
        return Ok(());
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => number(value, out)?,
        ValueKind::String => string(value.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                separator(i, opts, level + 1, out);
                encode(item, opts, level + 1, out)?;
            }
            close(opts, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                sort_entries(&mut entries)?;
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                separator(i, opts, level + 1, out);
                let key = key_text(key)?;
                string(&key, opts.ensure_ascii, out);
                out.push_str(&opts.key_separator);
                encode(item, opts, level + 1, out)?;
            }
            close(opts, level, out);
            out.push('}');
        }
        // Undefined, bytes, plain objects: as in Python, not encodable.
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

/// Before item `i` of a container at `level`: the item separator after the
/// first, then a new line and the indentation when indenting.
fn separator(i: usize, opts: &DumpOptions, level: usize, out: &mut String) {
    if i > 0 {
        out.push_str(&opts.item_separator);
    }
    if let Some(unit) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(unit);
        }
    }
}

/// Before the closing bracket of a container at `level`.
fn close(opts: &DumpOptions, level: usize, out: &mut String) {
    if let Some(unit) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(unit);
        }
    }
}

/// sort_keys: Python sorts the keys themselves, which works for all-string
/// or all-number keys and raises for a mix.
fn sort_entries(entries: &mut [(Value, Value)]) -> Result<(), Error> {
    let all = |kind| entries.iter().all(|(k, _)| k.kind() == kind);
    if !(all(ValueKind::String) || all(ValueKind::Number)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: sort_keys needs keys of one type (all strings or all numbers)",
        ));
    }
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(())
}

/// json.dumps' conversion of a dict key to the string it writes.
fn key_text(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number => {
            let mut s = String::new();
            number(key, &mut s)?;
            s
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

fn number(value: &Value, out: &mut String) -> Result<(), Error> {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return Ok(());
    }
    let f = f64::try_from(value.clone())?;
    out.push_str(&float_repr(f));
    Ok(())
}

/// Python's `float.__repr__` (the shortest round-trip digits; positional
/// from 1e-4 up to 1e16, scientific with a two-digit exponent otherwise),
/// with json's names for the non-finite values.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f < 0.0 { "-Infinity" } else { "Infinity" }.into();
    }
    // Rust's `{:e}` gives the same shortest digits as Python's repr.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        } else {
            let point = exp as usize + 1;
            if digits.len() <= point {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', point - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..point]);
                out.push('.');
                out.push_str(&digits[point..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// A JSON string literal as json.dumps writes it.
fn string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dump(v: Value) -> String {
        dumps(&v, &DumpOptions::default()).unwrap()
    }

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.25e100, "1.25e+100"),
            (123456.789, "123456.789"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn strings_escape_as_json_dumps_without_ensure_ascii() {
        let v = Value::from("a\"b\\c\nd\te\u{1}\u{7f} é 日本 🙂");
        assert_eq!(
            dump(v.clone()),
            r#""a\"b\\c\nd\te\u0001"#.to_string() + "\u{7f} é 日本 🙂\""
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &ascii).unwrap(),
            r#""a\"b\\c\nd\te\u0001\u007f \u00e9 \u65e5\u672c \ud83d\ude42""#
        );
    }

    #[test]
    fn containers_use_python_separators_and_indentation() {
        let v = Value::from_pairs([
            ("name", Value::from("f")),
            (
                "args",
                Value::from(vec![Value::from(1), Value::from(()), Value::from(true)]),
            ),
            ("empty", Value::from(Vec::<Value>::new())),
        ]);
        assert_eq!(
            dump(v.clone()),
            r#"{"name": "f", "args": [1, null, true], "empty": []}"#
        );
        let indented = DumpOptions {
            indent: Some("  ".into()),
            item_separator: ",".into(),
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &indented).unwrap(),
            "{\n  \"name\": \"f\",\n  \"args\": [\n    1,\n    null,\n    true\n  ],\n  \"empty\": []\n}"
        );
    }

    #[test]
    fn undefined_is_not_serializable() {
        let err = dumps(&Value::UNDEFINED, &DumpOptions::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("Undefined is not JSON serializable"),
            "{err}"
        );
    }
}
