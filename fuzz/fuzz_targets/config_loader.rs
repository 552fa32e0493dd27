//! Fuzzes the config loader: a manifest, a config layer and environment overrides, separated by
//! lines `---`. Any input must load or be refused with errors; never panic.
#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use mstar_chunking::manifest::Manifest;
use mstar_chunking_sim::config::{load, LoadOptions};

fn scratch() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a scratch dir"))
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut parts = text.splitn(3, "\n---\n");
    let manifest = parts.next().unwrap_or_default();
    let layer = parts.next().unwrap_or_default();
    let env: HashMap<String, String> = parts
        .next()
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let _ = Manifest::from_toml(manifest, "fuzz");
    let dir = scratch().path();
    let (model, config) = (dir.join("model.toml"), dir.join("layer.toml"));
    if std::fs::write(&model, manifest).is_err() || std::fs::write(&config, layer).is_err() {
        return;
    }
    let opts = LoadOptions {
        model: Some(model),
        configs: vec![config],
        config_dir: dir.join("no-such-dir"),
        mstar_env: None,
        env: Some(env),
    };
    if let Ok(loaded) = load(&opts) {
        let _ = loaded.rows();
    }
});
