//! Fuzzes the environment's say: the first line is `$MSTAR_ENV`, the rest `KEY=VALUE`
//! variables (`MSTAR__SECTION__KEY` overrides among them). Any input must load or be refused;
//! never panic. `$MSTAR_ENV` only ever names a file inside the config folder, and a refusal's
//! lines carry no raw control characters.
#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use mstar_chunking::config::layers::env_name_problem;
use mstar_chunking_sim::config::{load, LoadOptions};

fn scratch() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a scratch dir");
        std::fs::write(dir.path().join("staging.toml"), "[chunking]\nmin_chunk_tokens = 32\n")
            .expect("the staging layer");
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut lines = text.lines();
    let mstar_env = lines.next().map(str::to_string).filter(|e| !e.is_empty());
    if let Some(name) = &mstar_env {
        if env_name_problem(name).is_none() {
            assert!(!name.contains('/') && !name.contains('.'), "{name:?} escapes the folder");
        }
    }
    let env: HashMap<String, String> = lines
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let opts = LoadOptions {
        model: None,
        configs: Vec::new(),
        config_dir: scratch().path().to_path_buf(),
        mstar_env,
        env: Some(env),
    };
    match load(&opts) {
        Ok(loaded) => {
            let _ = loaded.rows();
        }
        Err(errors) => {
            for line in errors.lines() {
                assert!(!line.chars().any(char::is_control), "raw control character: {line:?}");
            }
        }
    }
});
