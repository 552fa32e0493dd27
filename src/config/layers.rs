//! The layers of the serving config (`docs/config.md#layers`) and, for each key, which layer set
//! it: built-in or `config/default.toml` → `config/$MSTAR_ENV.toml` → each `--config FILE` →
//! `MSTAR__SECTION__KEY` environment variables, later layers winning key by key.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use config::{Config, Environment, File, FileFormat, Source};

use super::decode::{
    first_yaml_alias, flatten, json_duplicate_key, line_of, non_decimal_integers, one_line,
};
use super::problem::{ConfigErrors, ConfigProblem};
use crate::input::{read_text, MAX_CONFIG_BYTES};

/// `config/default.toml`, built in so a program works from any directory (the base layer when
/// `config/default.toml` is absent).
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../config/default.toml");

/// Environment variables `MSTAR__SECTION__KEY` override the config files.
pub const ENV_PREFIX: &str = "MSTAR__";
/// The longest `$MSTAR_ENV` name taken.
pub const MAX_ENV_NAME: usize = 64;

/// Where the layers of the serving config and the model manifest come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// The model manifest; `None`: `config_dir/models/demo.toml`, else the built-in demo.
    pub model: Option<PathBuf>,
    /// `--config FILE` layers, applied in order after the `$MSTAR_ENV` layer.
    pub configs: Vec<PathBuf>,
    /// Where `default.toml` and `$MSTAR_ENV.toml` are looked up. Default `config`.
    pub config_dir: PathBuf,
    /// `$MSTAR_ENV`: adds the layer `config_dir/$MSTAR_ENV.toml`, which must exist. A name of
    /// letters, digits, `-` and `_` (see [`env_name_problem`]).
    pub mstar_env: Option<String>,
    /// The environment `MSTAR__…` overrides are read from; `None`: the process environment.
    pub env: Option<HashMap<String, String>>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            model: None,
            configs: Vec::new(),
            config_dir: PathBuf::from("config"),
            mstar_env: None,
            env: None,
        }
    }
}

impl LoadOptions {
    /// Options for the binary: `./config`, `$MSTAR_ENV` and the process environment.
    pub fn from_process(model: Option<PathBuf>, configs: Vec<PathBuf>) -> Self {
        Self {
            model,
            configs,
            mstar_env: std::env::var_os("MSTAR_ENV")
                .map(|v| v.to_string_lossy().into_owned())
                .filter(|v| !v.is_empty()),
            ..Self::default()
        }
    }

    /// The config files the layers read, in layer order (what a config watcher watches). The
    /// built-in default and the environment are not files and are not listed.
    pub fn config_files(&self) -> Vec<PathBuf> {
        let default = self.config_dir.join("default.toml");
        let mut files: Vec<PathBuf> = Vec::new();
        if default.is_file() {
            files.push(default);
        }
        files.extend(self.env_layer_path().ok().flatten());
        files.extend(self.configs.iter().cloned());
        files
    }

    /// `config_dir/$MSTAR_ENV.toml`, or why `$MSTAR_ENV` is refused.
    fn env_layer_path(&self) -> Result<Option<PathBuf>, String> {
        match &self.mstar_env {
            None => Ok(None),
            Some(env) => match env_name_problem(env) {
                Some(why) => Err(why),
                None => Ok(Some(self.config_dir.join(format!("{env}.toml")))),
            },
        }
    }

    /// The manifest file to read, or `None` for the built-in demo.
    pub fn model_path(&self) -> Option<PathBuf> {
        if let Some(model) = &self.model {
            return Some(model.clone());
        }
        let demo = self.config_dir.join("models").join("demo.toml");
        demo.is_file().then_some(demo)
    }
}

/// Why `$MSTAR_ENV` is not a layer name, if it is not: a name is 1 to [`MAX_ENV_NAME`]
/// letters, digits, `-` and `_`, looked up as `config_dir/NAME.toml` and nothing else (no
/// `..`, no `/`, no absolute path).
pub fn env_name_problem(name: &str) -> Option<String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_ENV_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    (!ok).then(|| {
        format!(
            "must be a name of 1 to {MAX_ENV_NAME} letters, digits, `-` or `_` (the layer config/NAME.toml), got {}",
            super::problem::quote(name)
        )
    })
}

/// One layer of the serving config and, for each key it sets, who set it.
struct Layer {
    label: String,
    config: Config,
    /// Dotted key -> who set it, for every leaf the layer sets.
    keys: BTreeMap<String, String>,
}

/// Which layer set each key, for naming it in a problem found after the load.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyOrigins(Vec<BTreeMap<String, String>>);

impl KeyOrigins {
    /// Who set `key` (or a key inside it, or the table holding it): the last layer that did.
    /// Logarithmic in the number of keys, so naming many problems stays linear.
    pub fn of(&self, key: &str) -> String {
        for layer in self.0.iter().rev() {
            if let Some(who) = layer.get(key) {
                return who.clone();
            }
            let inside = format!("{key}.");
            if let Some((_, who)) = layer
                .range::<str, _>((
                    std::ops::Bound::Included(inside.as_str()),
                    std::ops::Bound::Unbounded,
                ))
                .next()
                .filter(|(k, _)| k.starts_with(&inside))
            {
                return who.clone();
            }
            let mut at = key;
            while let Some((parent, _)) = at.rsplit_once('.') {
                if let Some(who) = layer.get(parent) {
                    return who.clone();
                }
                at = parent;
            }
        }
        "built-in default".to_string()
    }

    /// Adds a layer over the others: `dotted key -> who set it`.
    pub(super) fn push_layer(&mut self, keys: BTreeMap<String, String>) {
        self.0.push(keys);
    }

    /// A problem with the setting at `key`, naming the layer that set it.
    pub fn problem(&self, key: &str, value: Option<String>, reason: String) -> ConfigProblem {
        ConfigProblem::Setting {
            key: key.to_string(),
            layer: self.of(key),
            value,
            reason,
        }
    }
}

/// The layers in order, lowest first.
pub(super) struct Layers(Vec<Layer>);

impl Layers {
    /// Reads every layer; a layer that cannot be read is reported and skipped, so the problems
    /// of the others are reported in the same run.
    pub(super) fn read(opts: &LoadOptions, problems: &mut ConfigErrors) -> Self {
        let mut layers = Vec::new();
        let default = opts.config_dir.join("default.toml");
        if default.is_file() {
            layers.extend(file_layer(&default, problems));
        } else {
            let label = "built-in config/default.toml".to_string();
            layers.extend(text_layer(
                label,
                DEFAULT_CONFIG_TOML,
                FileFormat::Toml,
                problems,
            ));
        }
        match opts.env_layer_path() {
            Err(why) => problems.push(ConfigProblem::Setting {
                key: "MSTAR_ENV".into(),
                layer: "environment variable MSTAR_ENV".into(),
                value: None,
                reason: why,
            }),
            Ok(None) => {}
            Ok(Some(path)) if path.is_file() => layers.extend(file_layer(&path, problems)),
            Ok(Some(path)) => problems.push(ConfigProblem::File {
                path: path.display().to_string(),
                reason: format!(
                    "not found (MSTAR_ENV={:?} names this layer)",
                    opts.mstar_env.as_deref().unwrap_or_default()
                ),
            }),
        }
        for path in &opts.configs {
            layers.extend(file_layer(path, problems));
        }
        layers.extend(env_layer(opts, problems));
        Self(layers)
    }

    /// The layers' labels, in order; with `flags`, the command-line flags' layer last.
    pub(super) fn labels(&self, flags: bool) -> Vec<String> {
        let mut labels: Vec<String> = self.0.iter().map(|l| l.label.clone()).collect();
        if flags {
            labels.push(super::flags::FLAGS_LAYER.to_owned());
        }
        labels
    }

    /// Which layer set each key.
    pub(super) fn origins(&self) -> KeyOrigins {
        KeyOrigins(self.0.iter().map(|l| l.keys.clone()).collect())
    }

    /// The layers merged, or why they cannot be.
    pub(super) fn merged(&self) -> Result<config::Map<String, config::Value>, String> {
        let mut builder = Config::builder();
        for layer in &self.0 {
            builder = builder.add_source(layer.config.clone());
        }
        builder
            .build()
            .and_then(|c| c.collect())
            .map_err(|e| one_line(&e.to_string()))
    }
}

fn file_layer(path: &Path, problems: &mut ConfigErrors) -> Option<Layer> {
    let label = path.display().to_string();
    let format = match path.extension().and_then(|e| e.to_str()) {
        Some("toml") => FileFormat::Toml,
        Some("yaml" | "yml") => FileFormat::Yaml,
        Some("json") => FileFormat::Json,
        _ => {
            problems.push(ConfigProblem::File {
                path: label,
                reason: "unknown config format: name it .toml, .yaml or .json".into(),
            });
            return None;
        }
    };
    match read_text(path, MAX_CONFIG_BYTES) {
        Ok(text) => text_layer(label, &text, format, problems),
        Err(e) => {
            problems.push(ConfigProblem::File {
                path: label,
                reason: e.to_string(),
            });
            None
        }
    }
}

/// A layer from its text. Refuses what the strict spellings refuse before the config crate
/// sees it: YAML aliases and non-decimal TOML integers.
fn text_layer(
    label: String,
    text: &str,
    format: FileFormat,
    problems: &mut ConfigErrors,
) -> Option<Layer> {
    if format == FileFormat::Yaml {
        if let Some(line) = first_yaml_alias(text) {
            problems.push(ConfigProblem::File {
                path: label,
                reason: format!(
                    "YAML alias at line {line}: aliases are refused in config files (docs/config.md#limits); write the value out"
                ),
            });
            return None;
        }
    }
    if format == FileFormat::Json {
        if let Some(duplicate) = json_duplicate_key(text) {
            problems.push(ConfigProblem::File {
                path: label,
                reason: format!(
                    "{duplicate}: a key is given once per object in JSON layers, as in TOML and YAML (docs/config.md#spellings)"
                ),
            });
            return None;
        }
    }
    if format == FileFormat::Toml {
        let found = non_decimal_integers(text);
        if !found.is_empty() {
            for (key, raw) in found {
                problems.push(ConfigProblem::Setting {
                    key,
                    layer: label.clone(),
                    value: Some(raw),
                    reason: "integers are written in decimal; hexadecimal, octal and binary are refused (docs/config.md#spellings)".into(),
                });
            }
            return None;
        }
    }
    let built = Config::builder()
        .add_source(File::from_str(text, format))
        .build();
    let config = match built {
        Ok(c) => c,
        Err(e) => {
            // toml's own error names the line; the config crate's spans several lines.
            let reason = match (format, toml::from_str::<toml::Table>(text)) {
                (FileFormat::Toml, Err(te)) => format!(
                    "malformed TOML{}: {}",
                    te.span()
                        .map(|s| format!(" at line {}", line_of(text, s.start)))
                        .unwrap_or_default(),
                    one_line(te.message())
                ),
                _ => format!("malformed {format:?}: {}", one_line(&e.to_string())),
            };
            problems.push(ConfigProblem::File {
                path: label,
                reason,
            });
            return None;
        }
    };
    let mut keys = BTreeMap::new();
    if let Ok(table) = config.collect() {
        for (k, v) in table {
            flatten(&k, &v, &mut |key| {
                keys.insert(key, label.clone());
            });
        }
    }
    Some(Layer {
        label,
        config,
        keys,
    })
}

/// Environment variables that look meant for this program but are not in the documented
/// `MSTAR__SECTION__KEY` form: a name starting `MSTAR_` in any case, other than `MSTAR_ENV`,
/// that is not `MSTAR__` followed by upper-case letters, digits and `_`. One warning each,
/// naming the variable and never its value: with a single `_` (`MSTAR_CHUNKING__…`) it is
/// ignored; in lower or mixed case (`mstar__chunking__…`) it is applied, under its lowercased
/// key, but the documented spelling is upper case.
pub fn env_warnings(opts: &LoadOptions) -> Vec<String> {
    let names: Vec<String> = match &opts.env {
        Some(map) => map.keys().cloned().collect(),
        None => std::env::vars_os()
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect(),
    };
    let mut out: Vec<String> = names
        .into_iter()
        .filter_map(|name| env_name_warning(&name))
        .collect();
    out.sort();
    out
}

/// The warning [`env_warnings`] gives for a variable called `name`, if any.
fn env_name_warning(name: &str) -> Option<String> {
    const OURS: &str = "MSTAR_";
    if name == "MSTAR_ENV" || !name.get(..OURS.len())?.eq_ignore_ascii_case(OURS) {
        return None;
    }
    let shown = super::problem::escape(name);
    let applied = name
        .get(..ENV_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(ENV_PREFIX));
    let documented = name.starts_with(ENV_PREFIX)
        && name[ENV_PREFIX.len()..]
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
    if documented {
        return None;
    }
    Some(if applied {
        format!(
            "environment variable {shown} is applied as `{}`, but overrides are spelled MSTAR__SECTION__KEY in upper case (docs/config.md#layers)",
            super::problem::escape(&name[ENV_PREFIX.len()..].to_lowercase().replace("__", "."))
        )
    } else {
        format!(
            "environment variable {shown} is ignored: overrides are spelled MSTAR__SECTION__KEY, with two underscores after MSTAR and between names (e.g. MSTAR__CHUNKING__MIN_CHUNK_TOKENS), and MSTAR_ENV names a layer (docs/config.md#layers)"
        )
    })
}

/// `MSTAR__SECTION__KEY` variables: lowercased, `__` separates keys. Values that parse as
/// booleans or numbers are typed (the settings then refuse a number where a name belongs);
/// `chunking.no_chunking` is a comma-separated list.
fn env_layer(opts: &LoadOptions, problems: &mut ConfigErrors) -> Option<Layer> {
    let matches = |k: &str| {
        k.get(..ENV_PREFIX.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(ENV_PREFIX))
    };
    let vars: HashMap<String, String> = match &opts.env {
        Some(map) => map
            .iter()
            .filter(|(k, _)| matches(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        // Variables that are not UTF-8 cannot be ours; `std::env::vars` would panic on them.
        None => std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .filter(|(k, _)| matches(k))
            .collect(),
    };
    if vars.is_empty() {
        return None;
    }
    let keys: BTreeMap<String, String> = vars
        .keys()
        .map(|k| {
            let key = k[ENV_PREFIX.len()..].to_lowercase().replace("__", ".");
            (key, format!("environment variable {k}"))
        })
        .collect();
    // `MSTAR__CHUNKING=3` next to `MSTAR__CHUNKING__MIN_CHUNK_TOKENS=32`: which one wins
    // would depend on the map's order, so neither is taken. Each key's parents are looked up,
    // so this is linear in the number of variables.
    let mut conflicts = BTreeSet::new();
    for (inner, inner_who) in &keys {
        let mut at = inner.as_str();
        while let Some((outer, _)) = at.rsplit_once('.') {
            if let Some(who) = keys.get(outer) {
                if conflicts.insert(outer.to_string()) {
                    problems.push(ConfigProblem::Setting {
                        key: outer.to_string(),
                        layer: who.clone(),
                        value: None,
                        reason: format!("sets a whole section while {inner_who} sets `{inner}` inside it; set single keys"),
                    });
                }
            }
            at = outer;
        }
    }
    if !conflicts.is_empty() {
        return None;
    }
    let source = Environment::with_prefix(ENV_PREFIX.trim_end_matches('_'))
        .prefix_separator("__")
        .separator("__")
        .try_parsing(true)
        .list_separator(",")
        .with_list_parse_key("chunking.no_chunking")
        .source(Some(vars.into_iter().collect()));
    match Config::builder().add_source(source).build() {
        Ok(config) => Some(Layer {
            label: "environment variables MSTAR__*".into(),
            config,
            keys,
        }),
        Err(e) => {
            problems.push(ConfigProblem::File {
                path: "environment variables MSTAR__*".into(),
                reason: one_line(&e.to_string()),
            });
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misspelt_mstar_variables_are_named_never_their_values() {
        let env = |pairs: &[(&str, &str)]| LoadOptions {
            env: Some(
                pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                    .collect(),
            ),
            ..LoadOptions::default()
        };
        let w = env_warnings(&env(&[
            ("MSTAR__CHUNKING__MIN_CHUNK_TOKENS", "32"),
            ("MSTAR_ENV", "production"),
            ("MSTAR_CHUNKING__MIN_CHUNK_TOKENS", "secret-1"),
            ("mstar__chunking__min_chunk_tokens", "secret-2"),
            ("mstar_env", "secret-3"),
            ("MSTARX", "x"),
            ("PATH", "/bin"),
        ]));
        assert_eq!(w.len(), 3, "{w:?}");
        assert!(
            w[0].starts_with("environment variable MSTAR_CHUNKING__MIN_CHUNK_TOKENS is ignored"),
            "{w:?}"
        );
        assert!(w[1].starts_with("environment variable mstar__chunking__min_chunk_tokens is applied as `chunking.min_chunk_tokens`"), "{w:?}");
        assert!(
            w[2].starts_with("environment variable mstar_env is ignored"),
            "{w:?}"
        );
        assert!(w.iter().all(|w| !w.contains("secret")), "{w:?}");
    }

    #[test]
    fn mstar_env_is_a_name_and_nothing_else() {
        for good in ["production", "omni-worker", "a_1", "X"] {
            assert_eq!(env_name_problem(good), None, "{good}");
        }
        for bad in [
            "",
            "../x",
            "/etc/passwd",
            "a/b",
            "a.b",
            "a b",
            "x\n",
            &"a".repeat(65),
        ] {
            assert!(env_name_problem(bad).is_some(), "{bad:?}");
        }
        let o = LoadOptions {
            mstar_env: Some("../secrets".into()),
            ..LoadOptions::default()
        };
        assert!(o
            .config_files()
            .iter()
            .all(|f| !f.ends_with("secrets.toml")));
    }

    #[test]
    fn origins_name_the_last_layer_for_a_key_its_children_or_its_table() {
        let o = KeyOrigins(vec![
            BTreeMap::from([("chunking.min_chunk_tokens".to_string(), "a".to_string())]),
            BTreeMap::from([
                (
                    "chunking.max_batch_tokens.llm.mixed".to_string(),
                    "b".to_string(),
                ),
                ("replay".to_string(), "b".to_string()),
            ]),
        ]);
        assert_eq!(o.of("chunking.min_chunk_tokens"), "a");
        assert_eq!(o.of("chunking.max_batch_tokens.llm"), "b");
        assert_eq!(o.of("replay.cost.base_ms"), "b");
        assert_eq!(o.of("chunking.max_row_tokens"), "built-in default");
        assert_eq!(o.of("chunking.min"), "built-in default");
    }
}
