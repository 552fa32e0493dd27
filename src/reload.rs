//! Hot reload of the serving config (`docs/config.md#reload`). A reload re-reads every layer and
//! applies the result whole from the next assembled step; a refused one changes nothing. Only
//! `[chunking]` can change at run time: a changed manifest, or a change to `[log]`,
//! `[metrics]` or `[replay]`, is refused (restart to apply it) rather than reported as applied.
//!
//! Files are read on a blocking thread with a timeout ([`READ_TIMEOUT`]), never on the actors'
//! thread, so a file that blocks cannot freeze scheduling.
//!
//! Triggers: [`Reloader::reload`] (what an embedding engine calls, or
//! [`ChunkingManagement::set_budgets`] with settings it built), and [`watch`], which reloads
//! when a config file changes or the process gets SIGHUP. The watcher follows the watched
//! paths, not the files they pointed to at start: a Kubernetes ConfigMap swaps a `..data`
//! symlink to a new directory on every update, and every update applies. A burst of changes
//! is left to settle, and a reload applies only a parse that is the same twice in a row with
//! no watched file empty, so an editor's truncate-then-write is not applied in passing, however
//! late the write comes.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::config::{
    load_manifest, load_settings, ConfigErrors, ExtraSections, LoadOptions, NoExtraSections,
    Settings,
};
use crate::error::ChunkingError;
use crate::manifest::Manifest;
use crate::ChunkingManagement;

/// How long reading the layers and the manifest may take before a reload gives up.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a reload was refused. The previous budgets stay in force.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// A layer that does not load or validate.
    #[error("config reload refused:\n{0}")]
    Config(ConfigErrors),
    /// The manifest is not the one loaded at start.
    #[error("config reload refused: the model manifest {path} changed; model policies are fixed at load, restart to load a new model")]
    ManifestChanged {
        /// The manifest file.
        path: String,
    },
    /// A section that cannot change at run time changed.
    #[error("config reload refused: {} changed, which cannot change at run time; restart to apply it (nothing was applied)", .sections.iter().map(|s| format!("`[{s}]`")).collect::<Vec<_>>().join(", "))]
    FixedSection {
        /// The sections that changed: `log`, `metrics`, or the program's own.
        sections: Vec<&'static str>,
    },
    /// Reading the files took longer than [`READ_TIMEOUT`] (a FIFO or a stuck file system).
    #[error("config reload refused: reading the config files took longer than {0:?}")]
    Timeout(Duration),
    /// The component refused the budgets.
    #[error("config reload refused: {0}")]
    Refused(#[from] ChunkingError),
}

/// What a reload applied: the `[chunking]` keys whose values changed (empty: nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Applied {
    /// Dotted keys, sorted.
    pub changed: Vec<String>,
}

impl std::fmt::Display for Applied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.changed.is_empty() {
            f.write_str("nothing changed")
        } else {
            write!(f, "applied {}", self.changed.join(", "))
        }
    }
}

/// The `[chunking]` keys whose values differ between `old` and `new`.
pub fn chunking_changes(old: &Settings, new: &Settings) -> Vec<String> {
    let (a, b) = (&old.chunking, &new.chunking);
    let mut changed = Vec::new();
    if a.min_chunk_tokens != b.min_chunk_tokens {
        changed.push("chunking.min_chunk_tokens".to_string());
    }
    if a.no_chunking != b.no_chunking {
        changed.push("chunking.no_chunking".to_string());
    }
    if a.max_row_tokens != b.max_row_tokens {
        changed.push("chunking.max_row_tokens".to_string());
    }
    if a.max_partial_prefills != b.max_partial_prefills {
        changed.push("chunking.max_partial_prefills".to_string());
    }
    if a.slots_per_row != b.slots_per_row {
        changed.push("chunking.slots_per_row".to_string());
    }
    let nodes: BTreeSet<&String> = a
        .max_batch_tokens
        .keys()
        .chain(b.max_batch_tokens.keys())
        .collect();
    for node in nodes {
        if a.max_batch_tokens.get(node) != b.max_batch_tokens.get(node) {
            changed.push(format!(
                "chunking.max_batch_tokens.{}",
                crate::config::problem::escape(node)
            ));
        }
    }
    changed.sort();
    changed
}

/// The sections that cannot change at run time and differ between `old` and `new`: `[log]`
/// and `[metrics]`.
pub fn fixed_changes(old: &Settings, new: &Settings) -> Vec<&'static str> {
    let mut sections = Vec::new();
    if old.log != new.log {
        sections.push("log");
    }
    if old.metrics != new.metrics {
        sections.push("metrics");
    }
    sections
}

/// Re-reads the layered config for a running component; `X` are the program's own sections
/// ([`ExtraSections`]), which cannot change at run time either.
#[derive(Clone)]
pub struct Reloader<X: ExtraSections = NoExtraSections> {
    cm: ChunkingManagement,
    opts: LoadOptions,
    manifest: Manifest,
    /// The settings in force: what a reload compares with.
    running: Arc<Mutex<(Settings, X)>>,
}

impl<X: ExtraSections> Reloader<X> {
    /// A reloader for `cm`, which runs `manifest` and was configured from `opts`. The settings
    /// in force are taken to be what `opts` gives now (or the defaults, if that is refused);
    /// [`Reloader::running`] sets them when the caller has them.
    pub fn new(cm: ChunkingManagement, opts: LoadOptions, manifest: Manifest) -> Self {
        let running = load_settings::<X>(&opts, &manifest)
            .map(|(s, x, _)| (s, x))
            .unwrap_or_default();
        Self {
            cm,
            opts,
            manifest,
            running: Arc::new(Mutex::new(running)),
        }
    }

    /// Sets the settings in force, and the program's sections.
    #[must_use]
    pub fn running(self, settings: Settings, extra: X) -> Self {
        *self.running.lock().unwrap_or_else(|e| e.into_inner()) = (settings, extra);
        self
    }

    /// The files a watcher watches: every config layer file and the manifest.
    pub fn files(&self) -> Vec<PathBuf> {
        let mut files = self.opts.config_files();
        files.extend(self.opts.model_path());
        files
    }

    /// Re-reads every layer (off this thread, with a timeout) and applies it whole. Counted in
    /// `config_reloads_total`; logs what it applied, or every problem of a refusal.
    ///
    /// # Errors
    /// A layer that does not load or validate, a changed manifest, a change to a section that
    /// cannot change at run time, a read that timed out, or budgets the component refused; in
    /// each case the previous budgets stay.
    pub async fn reload(&self) -> Result<Applied, ReloadError> {
        let result = match self.read().await {
            Ok(settings) => self.apply(settings).await,
            Err(e) => {
                self.cm.count_refused_reload();
                Err(e)
            }
        };
        match &result {
            Ok(applied) => tracing::info!("config reloaded: {applied}"),
            Err(e) => tracing::warn!("{e}"),
        }
        result
    }

    /// Reads the manifest and the layers on a blocking thread, within [`READ_TIMEOUT`].
    async fn read(&self) -> Result<(Settings, X), ReloadError> {
        let (opts, manifest) = (self.opts.clone(), self.manifest.clone());
        let work = tokio::task::spawn_blocking(move || -> Result<(Settings, X), ReloadError> {
            if let Some(path) = opts.model_path() {
                if !load_manifest(&path).is_ok_and(|m| m == manifest) {
                    return Err(ReloadError::ManifestChanged {
                        path: crate::config::problem::escape(&path.display().to_string()),
                    });
                }
            }
            load_settings::<X>(&opts, &manifest)
                .map(|(s, x, _)| (s, x))
                .map_err(ReloadError::Config)
        });
        match tokio::time::timeout(READ_TIMEOUT, work).await {
            Ok(Ok(result)) => result,
            // The reading thread failed: nothing read, nothing applied.
            Ok(Err(e)) => {
                let mut errors = ConfigErrors::default();
                errors.push(crate::config::ConfigProblem::File {
                    path: "config reload".into(),
                    reason: format!("reading the config files failed: {e}"),
                });
                Err(ReloadError::Config(errors))
            }
            Err(_) => Err(ReloadError::Timeout(READ_TIMEOUT)),
        }
    }

    async fn apply(&self, (settings, extra): (Settings, X)) -> Result<Applied, ReloadError> {
        let (old, old_extra) = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut sections = fixed_changes(&old, &settings);
        if old_extra != extra {
            sections.extend(X::NAMES);
        }
        if !sections.is_empty() {
            self.cm.count_refused_reload();
            return Err(ReloadError::FixedSection { sections });
        }
        let mut budgets = self.manifest.budget_settings(&settings.chunking);
        budgets.time.learn |= extra.learns_cost();
        // BudgetConfig counts the outcome of applying them.
        self.cm.reload(budgets).await?;
        let changed = chunking_changes(&old, &settings);
        *self.running.lock().unwrap_or_else(|e| e.into_inner()) = (settings, extra);
        Ok(Applied { changed })
    }
}

/// A running config watcher; dropping it stops watching.
pub struct ConfigWatcher {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ConfigWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How long a burst of file events (an editor's write, rename, chmod) is left to settle: a
/// reload starts once no event came for this long.
pub const SETTLE: Duration = Duration::from_millis(100);
/// A burst that never settles is read anyway after this long.
const MAX_SETTLE: Duration = Duration::from_secs(2);
/// Between the two reads whose parses must agree before a reload applies.
pub const STABLE: Duration = Duration::from_millis(100);
/// Settle-and-read rounds before a file that keeps changing is read as it is.
const MAX_RETRIES: u32 = 10;

/// The directories to watch for `files`: each path's own directory (where a ConfigMap swaps its
/// `..data` link, or an editor renames a new file over the old) and the directory of what it
/// points to now (where a write through a symlink lands).
fn watch_dirs(files: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut dirs = BTreeSet::new();
    for f in files {
        let abs = std::path::absolute(f).unwrap_or_else(|_| f.clone());
        dirs.extend(abs.parent().map(PathBuf::from));
        if let Ok(target) = std::fs::canonicalize(f) {
            dirs.extend(target.parent().map(PathBuf::from));
        }
    }
    dirs
}

/// The file names whose changes matter: each watched file's, and its current target's.
fn watched_names(files: &[PathBuf]) -> BTreeSet<std::ffi::OsString> {
    let mut names = BTreeSet::new();
    for f in files {
        names.extend(f.file_name().map(ToOwned::to_owned));
        if let Ok(target) = std::fs::canonicalize(f) {
            names.extend(target.file_name().map(ToOwned::to_owned));
        }
    }
    names
}

/// Whether an event on `path` can change a watched file: one of `names`, or a ConfigMap's
/// `..data` link and its `..`-prefixed versions. Other files in the same directories (a step
/// log written beside a config layer) do not wake the watcher.
fn relevant(names: &BTreeSet<std::ffi::OsString>, path: &std::path::Path) -> bool {
    path.file_name()
        .is_some_and(|n| names.contains(n) || n.to_string_lossy().starts_with(".."))
}

/// What the watcher did with a settled burst of changes: reported to a test's stand-in
/// (`watch_events`, behind the `test-hooks` feature) so that it can step the watcher
/// without sleeping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchOutcome {
    /// A reload ran (applied or refused, as its log and `config_reloads_total` say).
    Reloaded,
    /// A watched file was empty: an editor truncates before it writes, so the watcher waits
    /// for the next change instead of applying a config without that file's settings.
    WaitingForWrite {
        /// The empty file.
        path: PathBuf,
    },
    /// The two reads disagreed or the files changed meanwhile: read again.
    Unsettled,
}

/// The first of `files` that exists and is empty (0 bytes): a file between an editor's
/// truncation and its write. An empty layer on purpose is written as a comment.
fn empty_file(files: &[PathBuf]) -> Option<PathBuf> {
    files
        .iter()
        .find(|f| std::fs::metadata(f).is_ok_and(|m| m.is_file() && m.len() == 0))
        .cloned()
}

/// Reloads through `reloader` whenever one of its files (or what it points to) changes, or on
/// SIGHUP. A change is applied once the files have settled, two reads agree, and no watched
/// file is empty (an editor's truncation, however long before its write: the watcher waits
/// for the next change). Must be called inside an actix system whose runtime has tokio's I/O
/// driver (SIGHUP is read through it): `actix::System::new()`, not
/// [`actor_system`](crate::actors::actor_system); the reloads run on the current arbiter.
///
/// # Errors
/// The file watcher or the signal handler cannot be set up.
pub fn watch<X: ExtraSections>(reloader: Reloader<X>) -> Result<ConfigWatcher, String> {
    let (tx, rx) = mpsc::unbounded_channel::<()>();
    let events = tx.clone();
    let files = reloader.files();
    let names = watched_names(&files);
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(event) = res else { return };
        if !event.kind.is_access() && event.paths.iter().any(|p| relevant(&names, p)) {
            let _ = events.send(());
        }
    })
    .map_err(|e| format!("cannot watch the config files: {e}"))?;
    let mut watched = BTreeSet::new();
    for dir in watch_dirs(&files) {
        watcher
            .watch(&dir, RecursiveMode::NonRecursive)
            .map_err(|e| format!("cannot watch {}: {e}", dir.display()))?;
        watched.insert(dir);
    }
    #[cfg(unix)]
    let hangup = Some(
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(|e| format!("cannot handle SIGHUP: {e}"))?,
    );
    #[cfg(not(unix))]
    let hangup = None;
    let watching = Watching {
        watcher: Some(watcher),
        watched,
        hangup,
        outcomes: None,
    };
    let handle = actix::spawn(watch_loop(reloader, rx, watching));
    drop(tx);
    Ok(ConfigWatcher { task: handle })
}

/// [`watch`] fed by a stand-in for the file watcher: each `()` sent on `events` is a change to
/// the files, and each settled burst's [`WatchOutcome`] is sent on `outcomes`. No SIGHUP, no
/// file watcher: a test steps it deterministically (`sim/tests/it/reload.rs`).
#[cfg(any(test, feature = "test-hooks"))]
pub fn watch_events<X: ExtraSections>(
    reloader: Reloader<X>,
    events: mpsc::UnboundedReceiver<()>,
    outcomes: mpsc::UnboundedSender<WatchOutcome>,
) -> ConfigWatcher {
    let watching = Watching {
        watcher: None,
        watched: BTreeSet::new(),
        hangup: None,
        outcomes: Some(outcomes),
    };
    ConfigWatcher {
        task: actix::spawn(watch_loop(reloader, events, watching)),
    }
}

/// What the watch loop holds besides its reloader and events.
struct Watching {
    watcher: Option<notify::RecommendedWatcher>,
    watched: BTreeSet<PathBuf>,
    #[cfg(unix)]
    hangup: Option<tokio::signal::unix::Signal>,
    #[cfg(not(unix))]
    hangup: Option<()>,
    outcomes: Option<mpsc::UnboundedSender<WatchOutcome>>,
}

impl Watching {
    fn report(&self, outcome: WatchOutcome) {
        if let Some(tx) = &self.outcomes {
            let _ = tx.send(outcome);
        }
    }

    /// The next change (`Some(false)`) or SIGHUP (`Some(true)`); `None` once the events end.
    async fn next(&mut self, rx: &mut mpsc::UnboundedReceiver<()>) -> Option<bool> {
        #[cfg(unix)]
        if let Some(hangup) = &mut self.hangup {
            return tokio::select! {
                e = rx.recv() => e.map(|()| false),
                s = hangup.recv() => s.map(|()| true),
            };
        }
        rx.recv().await.map(|()| false)
    }
}

async fn watch_loop<X: ExtraSections>(
    reloader: Reloader<X>,
    mut rx: mpsc::UnboundedReceiver<()>,
    mut w: Watching,
) {
    let files = reloader.files();
    // Reads that disagreed, or changes seen while reading: settle and read again, a few
    // times at most (a file rewritten forever is read as it is then).
    let mut retries = 0u32;
    loop {
        let signalled = if retries > 0 {
            false
        } else {
            match w.next(&mut rx).await {
                Some(signalled) => signalled,
                None => return,
            }
        };
        if !signalled {
            if !settle(&mut rx).await {
                return;
            }
            // The same parse twice, with nothing changing in between, and no file left
            // empty by a truncation (checked before and after the reads).
            let empty_before = empty_file(&files);
            let first = reloader.read().await.ok();
            tokio::time::sleep(STABLE).await;
            let changed_meanwhile = rx.try_recv().is_ok();
            let second = reloader.read().await.ok();
            if let Some(path) = empty_before.or_else(|| empty_file(&files)) {
                tracing::info!(
                    "config file {} is empty: waiting for it to be written before reloading",
                    crate::config::problem::escape(&path.display().to_string())
                );
                retries = 0;
                w.report(WatchOutcome::WaitingForWrite { path });
                continue;
            }
            if (changed_meanwhile || first != second) && retries < MAX_RETRIES {
                retries += 1;
                w.report(WatchOutcome::Unsettled);
                continue;
            }
        }
        retries = 0;
        let _ = reloader.reload().await;
        w.report(WatchOutcome::Reloaded);
        // A ConfigMap update points the paths into a new directory: watch it too.
        if let Some(watcher) = &mut w.watcher {
            for dir in watch_dirs(&files) {
                if !w.watched.contains(&dir)
                    && watcher.watch(&dir, RecursiveMode::NonRecursive).is_ok()
                {
                    w.watched.insert(dir);
                }
            }
        }
    }
}

/// Waits until no event came for [`SETTLE`] (at most [`MAX_SETTLE`]); false when the
/// channel closed.
async fn settle(rx: &mut mpsc::UnboundedReceiver<()>) -> bool {
    let deadline = tokio::time::Instant::now() + MAX_SETTLE;
    loop {
        match tokio::time::timeout(SETTLE, rx.recv()).await {
            Err(_) => return true,
            Ok(None) => return false,
            Ok(Some(())) if tokio::time::Instant::now() >= deadline => return true,
            Ok(Some(())) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_changed_chunking_key_is_named_once() {
        let old = Settings::default();
        assert!(chunking_changes(&old, &old).is_empty());
        let mut new = old.clone();
        new.chunking.slots_per_row = 2;
        new.chunking.max_partial_prefills = Some(3);
        assert_eq!(
            chunking_changes(&old, &new),
            ["chunking.max_partial_prefills", "chunking.slots_per_row"]
        );
    }

    use crate::config::tests::Sim;

    /// The demo model's component started from one layer file, which `write` rewrites.
    struct Running {
        _dir: tempfile::TempDir,
        layer: std::path::PathBuf,
        opts: LoadOptions,
    }

    impl Running {
        fn new(text: &str) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let layer = dir.path().join("layer.toml");
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
            let opts = LoadOptions {
                model: Some(root.join("models/demo.toml")),
                config_dir: root,
                configs: vec![layer.clone()],
                env: Some(std::collections::HashMap::new()),
                ..LoadOptions::default()
            };
            let r = Self {
                _dir: dir,
                layer,
                opts,
            };
            r.write(text);
            r
        }

        fn write(&self, text: &str) {
            std::fs::write(&self.layer, text).unwrap();
        }

        /// The component under the layers as they are now, and what they loaded.
        async fn start(&self) -> (ChunkingManagement, crate::config::LoadedConfig<Sim>) {
            let loaded = crate::config::load_with::<Sim>(&self.opts, &[]).unwrap();
            let m = &loaded.manifest;
            let cm = ChunkingManagement::start("reload", m.submodules()).unwrap();
            cm.set_policies(m.policies()).await.unwrap();
            cm.set_budgets(loaded.table.settings().clone())
                .await
                .unwrap();
            (cm, loaded)
        }
    }

    #[test]
    fn a_reload_applies_the_new_layers_and_refuses_a_change_to_the_programs_sections() {
        let r = Running::new("[chunking.max_batch_tokens]\nllm = { mixed = 1024 }\n");
        let write = |text: &str| r.write(text);
        actix::System::new().block_on(async {
            let (cm, loaded) = r.start().await;
            let m = loaded.manifest;
            let reloader = Reloader::<Sim>::new(cm.clone(), r.opts.clone(), m);
            assert_eq!(
                cm.max_batch_tokens("llm", "mixed").await.unwrap(),
                Some(1024)
            );
            // A new budget applies, naming what changed.
            write("[chunking.max_batch_tokens]\nllm = { mixed = 512 }\n");
            let applied = reloader.reload().await.unwrap();
            assert_eq!(applied.changed, ["chunking.max_batch_tokens.llm"]);
            assert_eq!(
                cm.max_batch_tokens("llm", "mixed").await.unwrap(),
                Some(512)
            );
            // A change to `[sim]` is refused whole: the budget beside it does not apply.
            write("[chunking.max_batch_tokens]\nllm = { mixed = 256 }\n[sim]\nlearn = true\n");
            match reloader.reload().await {
                Err(ReloadError::FixedSection { sections }) => assert_eq!(sections, ["sim"]),
                other => panic!("{other:?}"),
            }
            assert_eq!(
                cm.max_batch_tokens("llm", "mixed").await.unwrap(),
                Some(512)
            );
        });
    }

    #[test]
    fn a_reloaded_section_that_learns_the_cost_keeps_a_time_budget_without_a_model() {
        let r = Running::new("[chunking.max_step_ms]\nllm = 50\n[sim]\nlearn = true\n");
        let write = |text: &str| r.write(text);
        actix::System::new().block_on(async {
            let (cm, loaded) = r.start().await;
            let m = loaded.manifest;
            let reloader = Reloader::<Sim>::new(cm.clone(), r.opts.clone(), m)
                .running(loaded.settings, loaded.extra);
            write("[chunking.max_step_ms]\nllm = 40\n[sim]\nlearn = true\n");
            // Refused as a time budget without a latency model, were `learn` not honoured.
            reloader.reload().await.unwrap();
        });
    }
}
