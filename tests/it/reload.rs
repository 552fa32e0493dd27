//! Hot reload: a valid change applies whole from the next step, a refused one changes nothing,
//! a changed manifest is refused, and the watcher reloads on file changes and SIGHUP.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use mstar_chunking::reload::{watch, ReloadError, Reloader};
use mstar_chunking::settings::{load, LoadOptions, DEMO_MANIFEST_TOML};
use mstar_chunking::ChunkingManagement;

fn options(dir: &Path) -> LoadOptions {
    std::fs::write(dir.join("model.toml"), DEMO_MANIFEST_TOML).unwrap();
    LoadOptions {
        model: Some(dir.join("model.toml")),
        configs: vec![dir.join("layer.toml")],
        config_dir: dir.to_path_buf(),
        mstar_env: None,
        env: Some(HashMap::new()),
    }
}

fn write_layer(dir: &Path, mixed: &str) {
    let text = format!("[chunking.max_batch_tokens]\nllm = {{ mixed = {mixed} }}\n");
    std::fs::write(dir.join("layer.toml"), text).unwrap();
}

async fn start(opts: &LoadOptions) -> (ChunkingManagement, Reloader) {
    let loaded = load(opts).unwrap();
    let cm = ChunkingManagement::start("test", loaded.manifest.submodules()).unwrap();
    cm.set_policies(loaded.manifest.policies()).await.unwrap();
    cm.set_budgets(loaded.manifest.budget_settings(&loaded.settings.chunking))
        .await
        .unwrap();
    let reloader = Reloader::new(cm.clone(), opts.clone(), loaded.manifest);
    (cm, reloader)
}

async fn wait_for_budget(cm: &ChunkingManagement, want: Option<u32>) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if cm.max_batch_tokens("llm", "mixed").await.unwrap() == want {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[actix::test]
async fn a_valid_reload_applies_and_a_bad_one_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path());
    write_layer(dir.path(), "1024");
    let (cm, reloader) = start(&opts).await;
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(1024)
    );

    write_layer(dir.path(), "512");
    reloader.reload().await.unwrap();
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(512)
    );

    for bad in ["0", "-5", "\"none\"", "1.5", "{ oops"] {
        write_layer(dir.path(), bad);
        let err = reloader.reload().await.unwrap_err();
        assert!(matches!(err, ReloadError::Config(_)), "{bad}: {err}");
        assert!(
            err.to_string().contains("layer.toml"),
            "names the file: {err}"
        );
        assert_eq!(
            cm.max_batch_tokens("llm", "mixed").await.unwrap(),
            Some(512),
            "{bad} changed nothing"
        );
    }

    write_layer(dir.path(), "\"off\"");
    reloader.reload().await.unwrap();
    assert_eq!(cm.max_batch_tokens("llm", "mixed").await.unwrap(), None);
}

#[actix::test]
async fn a_changed_manifest_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path());
    write_layer(dir.path(), "1024");
    let (cm, reloader) = start(&opts).await;
    let changed = DEMO_MANIFEST_TOML.replace("max_batch_tokens = 2048", "max_batch_tokens = 4096");
    assert_ne!(changed, DEMO_MANIFEST_TOML);
    std::fs::write(dir.path().join("model.toml"), changed).unwrap();
    write_layer(dir.path(), "512");
    let err = reloader.reload().await.unwrap_err();
    assert!(matches!(err, ReloadError::ManifestChanged { .. }), "{err}");
    assert!(err.to_string().contains("restart to load a new model"));
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(1024)
    );
}

#[actix::test]
async fn the_watcher_reloads_on_a_file_change_and_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path());
    write_layer(dir.path(), "1024");
    let (cm, reloader) = start(&opts).await;
    let watcher = watch(reloader.clone()).unwrap();
    write_layer(dir.path(), "768");
    assert!(
        wait_for_budget(&cm, Some(768)).await,
        "reloaded on the file change"
    );
    drop(watcher);

    // Changed while nobody watched: only SIGHUP makes the watcher read it.
    write_layer(dir.path(), "640");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(768),
        "not watched"
    );
    let _watcher = watch(reloader).unwrap();
    let status = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(wait_for_budget(&cm, Some(640)).await, "reloaded on SIGHUP");
}
