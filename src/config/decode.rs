//! Strict decoding helpers (`docs/config.md#spellings`): config values go through JSON so that
//! nothing is coerced (the config crate's own deserializer turns `false`, `"off"` and `1.5`
//! into integers); integers written in another notation than decimal (TOML `0x800`) and YAML
//! aliases (a 399-byte alias bomb expands to gigabytes) are refused before any value is used.

use config::ValueKind;

/// Config values to JSON, so that settings are deserialized strictly.
pub fn to_json(v: config::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v.kind {
        ValueKind::Nil => J::Null,
        ValueKind::Boolean(b) => J::Bool(b),
        ValueKind::I64(n) => J::from(n),
        ValueKind::U64(n) => J::from(n),
        ValueKind::I128(n) => i64::try_from(n).map_or_else(|_| J::String(n.to_string()), J::from),
        ValueKind::U128(n) => u64::try_from(n).map_or_else(|_| J::String(n.to_string()), J::from),
        ValueKind::Float(f) => {
            serde_json::Number::from_f64(f).map_or_else(|| J::String(f.to_string()), J::Number)
        }
        ValueKind::String(s) => J::String(s),
        ValueKind::Table(t) => J::Object(t.into_iter().map(|(k, v)| (k, to_json(v))).collect()),
        ValueKind::Array(a) => J::Array(a.into_iter().map(to_json).collect()),
    }
}

/// Calls `leaf` with the dotted key of every leaf under `key` (an empty table is a leaf).
/// Iterative, so a deeply nested file cannot exhaust the stack.
pub fn flatten(key: &str, v: &config::Value, leaf: &mut impl FnMut(String)) {
    let mut stack = vec![(key.to_string(), v)];
    while let Some((key, v)) = stack.pop() {
        match &v.kind {
            ValueKind::Table(t) if !t.is_empty() => {
                stack.extend(t.iter().map(|(k, child)| (format!("{key}.{k}"), child)));
            }
            _ => leaf(key),
        }
    }
}

/// A serde path as key segments; list indexes are their own segments.
pub fn segments(path: &serde_path_to_error::Path) -> Vec<String> {
    use serde_path_to_error::Segment;
    path.iter()
        .filter_map(|s| match s {
            Segment::Map { key } => Some(key.clone()),
            Segment::Seq { index } => Some(index.to_string()),
            Segment::Enum { variant } => Some(variant.clone()),
            Segment::Unknown => None,
        })
        .collect()
}

/// The value at `path` in `tree`.
pub fn lookup<'a>(tree: &'a serde_json::Value, path: &[String]) -> Option<&'a serde_json::Value> {
    path.iter().try_fold(tree, |v, seg| match v {
        serde_json::Value::Object(m) => m.get(seg),
        serde_json::Value::Array(a) => a.get(seg.parse::<usize>().ok()?),
        _ => None,
    })
}

/// Removes the value at `path`; false when there is none (then retrying would loop).
pub fn remove(tree: &mut serde_json::Value, path: &[String]) -> bool {
    let Some((last, parent)) = path.split_last() else {
        return false;
    };
    let parent = parent.iter().try_fold(tree, |v, seg| match v {
        serde_json::Value::Object(m) => m.get_mut(seg),
        serde_json::Value::Array(a) => a.get_mut(seg.parse::<usize>().ok()?),
        _ => None,
    });
    match parent {
        Some(serde_json::Value::Object(m)) => m.remove(last).is_some(),
        Some(serde_json::Value::Array(a)) => match last.parse::<usize>() {
            Ok(i) if i < a.len() => {
                a.remove(i);
                true
            }
            _ => false,
        },
        _ => false,
    }
}

/// A value as the user would write it, cut to 80 characters.
pub fn render(v: &serde_json::Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}…", s.chars().take(80).collect::<String>())
    } else {
        s
    }
}

/// `s` on one line, whitespace runs collapsed.
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The 1-based line of byte offset `at` in `text`.
pub fn line_of(text: &str, at: usize) -> usize {
    text.get(..at).map_or(0, |t| t.matches('\n').count()) + 1
}

/// Every integer of a TOML text written in another notation than decimal (`0x800`, `0o4000`,
/// `0b1`), as `(dotted key, as written)`. A text that does not parse gives none: the parse
/// error is reported by the layer.
pub fn non_decimal_integers(text: &str) -> Vec<(String, String)> {
    use toml_edit::{Item, Value};
    // The parsed-in-place document keeps each value's span in `text`: how it was written.
    let Ok(doc) = toml_edit::ImDocument::parse(text) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    let mut items: Vec<(String, &Item)> = doc
        .as_table()
        .iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let mut values: Vec<(String, &Value)> = Vec::new();
    while !items.is_empty() || !values.is_empty() {
        if let Some((key, item)) = items.pop() {
            match item {
                Item::Value(v) => values.push((key, v)),
                Item::Table(t) => items.extend(t.iter().map(|(k, v)| (format!("{key}.{k}"), v))),
                Item::ArrayOfTables(a) => {
                    for (i, t) in a.iter().enumerate() {
                        items.extend(t.iter().map(|(k, v)| (format!("{key}.{i}.{k}"), v)));
                    }
                }
                Item::None => {}
            }
            continue;
        }
        if let Some((key, v)) = values.pop() {
            match v {
                Value::Integer(_) => {
                    let raw = v
                        .span()
                        .and_then(|r| text.get(r))
                        .unwrap_or_default()
                        .trim();
                    let digits = raw.trim_start_matches(['+', '-']);
                    if ["0x", "0o", "0b"].iter().any(|p| digits.starts_with(p)) {
                        found.push((key, raw.to_string()));
                    }
                }
                Value::Array(a) => {
                    values.extend(a.iter().enumerate().map(|(i, v)| (format!("{key}.{i}"), v)))
                }
                Value::InlineTable(t) => {
                    values.extend(t.iter().map(|(k, v)| (format!("{key}.{k}"), v)))
                }
                _ => {}
            }
        }
    }
    found.sort();
    found
}

/// Whether a YAML text uses an alias (`*name`), and the line of the first. Aliases are refused:
/// their expansion is what makes a few hundred bytes take gigabytes. Only the event stream is
/// read, which never expands anything. A text that does not parse gives `None`: the parse
/// error is reported by the layer.
pub fn first_yaml_alias(text: &str) -> Option<usize> {
    use yaml_rust2::parser::{Event, Parser};
    let mut parser = Parser::new_from_str(text);
    loop {
        match parser.next_token() {
            Ok((Event::Alias(_), mark)) => return Some(mark.line()),
            Ok((Event::StreamEnd, _)) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}

/// The first key a JSON text repeats within one object, as a problem naming its dotted key,
/// line and column; `None` when every key is once per object or the text is not JSON (the
/// parse that follows reports that). The config crate, like `serde_json`, would keep the last
/// value silently; TOML and YAML refuse a repeated key, and so do JSON layers.
pub fn json_duplicate_key(text: &str) -> Option<String> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    match (KeyPath(String::new())).deserialize(&mut de) {
        Err(e) if e.is_data() => Some(e.to_string()),
        _ => None,
    }
}

/// Walks a JSON value, refusing a key repeated within an object; holds the dotted path so far.
struct KeyPath(String);

impl KeyPath {
    fn child(&self, key: &str) -> Self {
        if self.0.is_empty() {
            Self(key.to_string())
        } else {
            Self(format!("{}.{key}", self.0))
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for KeyPath {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for KeyPath {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        while seq.next_element_seed(self.child(&i.to_string()))?.is_some() {
            i += 1;
        }
        Ok(())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            let child = self.child(&key);
            if !seen.insert(key) {
                return Err(serde::de::Error::custom(format!(
                    "duplicate key `{}`",
                    super::problem::escape(&child.0)
                )));
            }
            map.next_value_seed(child)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_in_other_notations_are_found_with_their_keys() {
        let text = "[chunking]\nmin_chunk_tokens = 0x40\nmax_row_tokens = 512\n[chunking.max_batch_tokens]\nllm = { mixed = 0o4000, prefill = 2048 }\n[replay]\nspeculation = { seed = 0b1 }\nlist = [1, 0x2]\n";
        assert_eq!(
            non_decimal_integers(text),
            [
                (
                    "chunking.max_batch_tokens.llm.mixed".to_string(),
                    "0o4000".to_string()
                ),
                ("chunking.min_chunk_tokens".to_string(), "0x40".to_string()),
                ("replay.list.1".to_string(), "0x2".to_string()),
                ("replay.speculation.seed".to_string(), "0b1".to_string()),
            ]
        );
        assert!(non_decimal_integers("a = 1_000\nb = \"0x10\"\n").is_empty());
        assert!(non_decimal_integers("not toml [").is_empty());
    }

    #[test]
    fn yaml_aliases_are_found_without_expanding_them() {
        assert_eq!(first_yaml_alias("a: &x 1\nb: *x\n"), Some(2));
        assert_eq!(first_yaml_alias("a: 1\nb: [2, 3]\n"), None);
        let bomb = "a: &a [\"x\",\"x\",\"x\",\"x\",\"x\",\"x\",\"x\",\"x\",\"x\"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n";
        assert_eq!(first_yaml_alias(bomb), Some(2));
    }

    #[test]
    fn deep_tables_flatten_without_recursion() {
        let mut v = config::Value::new(None, 1);
        for _ in 0..2_000 {
            let mut t = config::Map::new();
            t.insert("a".to_string(), v);
            v = config::Value::new(None, config::ValueKind::Table(t));
        }
        let mut n = 0;
        flatten("k", &v, &mut |_| n += 1);
        assert_eq!(n, 1);
    }
}
