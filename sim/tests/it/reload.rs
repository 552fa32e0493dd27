//! Hot reload: a valid change applies whole from the next step, a refused one changes nothing,
//! a changed manifest is refused, and the watcher reloads on file changes and SIGHUP.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use mstar_chunking::reload::{watch, watch_events, Applied, ReloadError, Reloader, WatchOutcome};
use mstar_chunking::ChunkingManagement;
use mstar_chunking_sim::config::{load, LoadOptions, SimSections, DEMO_MANIFEST_TOML};

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

async fn start(opts: &LoadOptions) -> (ChunkingManagement, Reloader<SimSections>) {
    let loaded = load(opts).unwrap();
    let cm = ChunkingManagement::start("test", loaded.manifest.submodules()).unwrap();
    cm.set_policies(loaded.manifest.policies()).await.unwrap();
    cm.set_budgets(loaded.manifest.budget_settings(&loaded.settings.chunking))
        .await
        .unwrap();
    let reloader = Reloader::<SimSections>::new(cm.clone(), opts.clone(), loaded.manifest);
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
    // Dropping the watcher aborts its task: a reload it had started read the file before the
    // write below, so nothing can apply that write until a watcher reads it again.
    drop(watcher);

    // Changed while nobody watched: only SIGHUP makes the new watcher read it. `watch` has
    // registered its SIGHUP handler when it returns, so the signal is not sent too early, and
    // the reload it causes is awaited with a bound.
    write_layer(dir.path(), "640");
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

#[actix::test]
async fn a_reload_says_what_it_applied_and_refuses_sections_fixed_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path());
    write_layer(dir.path(), "1024");
    let (cm, reloader) = start(&opts).await;
    assert_eq!(reloader.reload().await.unwrap(), Applied::default());
    assert_eq!(Applied::default().to_string(), "nothing changed");
    write_layer(dir.path(), "512");
    let applied = reloader.reload().await.unwrap();
    assert_eq!(applied.changed, ["chunking.max_batch_tokens.llm"]);
    assert_eq!(applied.to_string(), "applied chunking.max_batch_tokens.llm");
    for (extra, section) in [
        ("[log]\nlevel = \"debug\"\n", "`[log]`"),
        ("[metrics]\nlisten = \"off\"\n", "`[metrics]`"),
        ("[replay.cost]\nbase_ms = 4.0\n", "`[replay]`"),
    ] {
        let text = format!("[chunking.max_batch_tokens]\nllm = {{ mixed = 256 }}\n{extra}");
        std::fs::write(dir.path().join("layer.toml"), text).unwrap();
        let err = reloader.reload().await.unwrap_err();
        assert!(matches!(err, ReloadError::FixedSection { .. }), "{err}");
        assert_eq!(
            err.to_string(),
            format!("config reload refused: {section} changed, which cannot change at run time; restart to apply it (nothing was applied)")
        );
        assert_eq!(
            cm.max_batch_tokens("llm", "mixed").await.unwrap(),
            Some(512),
            "{section}: the budget change beside it was not applied either"
        );
    }
}

#[actix::test]
async fn a_fifo_or_device_swapped_in_is_refused_and_scheduling_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path());
    write_layer(dir.path(), "1024");
    let (cm, reloader) = start(&opts).await;
    let layer = dir.path().join("layer.toml");
    std::fs::remove_file(&layer).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(&layer)
        .status()
        .unwrap()
        .success());
    let err = reloader.reload().await.unwrap_err();
    assert!(
        err.to_string()
            .contains("is not a regular file (it is a FIFO)"),
        "{err}"
    );
    std::fs::remove_file(&layer).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &layer).unwrap();
    let err = reloader.reload().await.unwrap_err();
    assert!(err.to_string().contains("(it is a device)"), "{err}");
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(1024)
    );
}

/// A Kubernetes ConfigMap volume: `layer.toml -> ..data/layer.toml`, `..data -> ..vN`; an
/// update writes `..vN+1` and renames a new `..data` link over the old one.
fn configmap_version(dir: &Path, version: u32, mixed: &str) {
    let v = dir.join(format!("..v{version}"));
    std::fs::create_dir(&v).unwrap();
    std::fs::write(
        v.join("layer.toml"),
        format!("[chunking.max_batch_tokens]\nllm = {{ mixed = {mixed} }}\n"),
    )
    .unwrap();
    let tmp = dir.join("..data_tmp");
    std::os::unix::fs::symlink(format!("..v{version}"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
}

#[actix::test]
async fn every_configmap_update_applies_not_only_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path());
    configmap_version(dir.path(), 1, "1024");
    std::os::unix::fs::symlink("..data/layer.toml", dir.path().join("layer.toml")).unwrap();
    let (cm, reloader) = start(&opts).await;
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(1024)
    );
    let _watcher = watch(reloader).unwrap();
    for (version, mixed) in [(2, 768), (3, 640), (4, 512)] {
        configmap_version(dir.path(), version, &mixed.to_string());
        assert!(
            wait_for_budget(&cm, Some(mixed)).await,
            "update {version} was not applied"
        );
    }
}

/// An editor truncates the layer, then writes it whenever it likes (250 ms later, or much
/// later): the watcher, stepped through a stand-in for its file watcher, never applies the
/// empty file in between, and applies the write. No sleeps: each step awaits the outcome.
#[actix::test]
async fn a_truncated_layer_is_never_applied_however_late_the_write_comes() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(dir.path());
    write_layer(dir.path(), "1024");
    let (cm, reloader) = start(&opts).await;
    let (events, rx) = tokio::sync::mpsc::unbounded_channel();
    let (outcomes_tx, mut outcomes) = tokio::sync::mpsc::unbounded_channel();
    let _watcher = watch_events(reloader, rx, outcomes_tx);

    let layer = dir.path().join("layer.toml");
    std::fs::write(&layer, "").unwrap();
    events.send(()).unwrap();
    assert_eq!(
        outcomes.recv().await,
        Some(WatchOutcome::WaitingForWrite {
            path: layer.clone()
        })
    );
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(1024),
        "the empty layer was not applied"
    );
    // Another event while it is still empty (a chmod, say): still waiting.
    events.send(()).unwrap();
    assert_eq!(
        outcomes.recv().await,
        Some(WatchOutcome::WaitingForWrite { path: layer })
    );

    write_layer(dir.path(), "512");
    events.send(()).unwrap();
    assert_eq!(outcomes.recv().await, Some(WatchOutcome::Reloaded));
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(512)
    );
}
