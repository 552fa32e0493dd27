//! Fuzzes what a config reload reads: one config layer (its format chosen by the first byte:
//! TOML, YAML or JSON) loaded again against the demo model, then compared with the settings in
//! force as a reload does. Any input must load or be refused with errors; never panic, and a
//! refusal never lists more than the cap.
#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use mstar_chunking::config::{load_settings, problem, LoadOptions, Settings, DEMO_MANIFEST_TOML};
use mstar_chunking_sim::config::SimSections;
use mstar_chunking::manifest::Manifest;
use mstar_chunking::reload::{chunking_changes, fixed_changes};

fn scratch() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a scratch dir"))
}

fn demo() -> &'static Manifest {
    static DEMO: OnceLock<Manifest> = OnceLock::new();
    DEMO.get_or_init(|| Manifest::from_toml(DEMO_MANIFEST_TOML, "demo").expect("the demo model"))
}

fuzz_target!(|data: &[u8]| {
    let Some((&format, text)) = data.split_first() else { return };
    let ext = ["toml", "yaml", "json"][usize::from(format % 3)];
    let layer = scratch().path().join(format!("layer.{ext}"));
    if std::fs::write(&layer, text).is_err() {
        return;
    }
    let opts = LoadOptions {
        model: None,
        configs: vec![layer],
        config_dir: scratch().path().join("no-such-dir"),
        mstar_env: None,
        env: Some(HashMap::new()),
    };
    match load_settings::<SimSections>(&opts, demo()) {
        Ok((settings, _replay, _table)) => {
            let running = Settings::default();
            let _ = fixed_changes(&running, &settings);
            let _ = chunking_changes(&running, &settings);
            let _ = demo().budget_settings(&settings.chunking);
        }
        Err(errors) => {
            assert!(errors.problems.len() <= problem::MAX_PROBLEMS);
            for line in errors.lines() {
                assert!(!line.contains('\n'), "a problem spans lines: {line:?}");
            }
        }
    }
});
