//! Hot reload of the serving config (issue: reliability). A reload re-reads every layer and
//! applies the result whole from the next assembled step; a refused one changes nothing. The
//! model's policies are fixed at load: a changed manifest is refused.
//!
//! Triggers: [`Reloader::reload`] (what an embedding engine calls, or
//! [`ChunkingManagement::set_budgets`] with settings it built), and [`watch`], which reloads
//! when a config file changes or the process gets SIGHUP.

use std::path::PathBuf;
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::error::ChunkingError;
use crate::manifest::Manifest;
use crate::settings::{load_settings, ConfigErrors, LoadOptions};
use crate::ChunkingManagement;

/// Why a reload was refused. The previous budgets stay in force.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("config reload refused:\n{0}")]
    Config(ConfigErrors),
    #[error("config reload refused: the model manifest {path} changed; model policies are fixed at load, restart to load a new model")]
    ManifestChanged { path: String },
    #[error("config reload refused: {0}")]
    Refused(#[from] ChunkingError),
}

/// Re-reads the layered config for a running component.
#[derive(Clone)]
pub struct Reloader {
    cm: ChunkingManagement,
    opts: LoadOptions,
    manifest: Manifest,
}

impl Reloader {
    /// A reloader for `cm`, which runs `manifest` and was configured from `opts`.
    pub fn new(cm: ChunkingManagement, opts: LoadOptions, manifest: Manifest) -> Self {
        Self { cm, opts, manifest }
    }

    /// The files a watcher watches: every config layer file and the manifest.
    pub fn files(&self) -> Vec<PathBuf> {
        let mut files = self.opts.config_files();
        files.extend(self.opts.model_path());
        files
    }

    /// Re-reads every layer and applies it whole. Counted in `config_reloads_total`; a refusal
    /// is logged with every problem.
    ///
    /// # Errors
    /// A layer that does not load or validate, a changed manifest, or budgets the component
    /// refused; in each case the previous budgets stay.
    pub async fn reload(&self) -> Result<(), ReloadError> {
        let result = self.apply().await;
        match &result {
            Ok(()) => tracing::info!("config reloaded"),
            Err(e) => tracing::warn!("{e}"),
        }
        result
    }

    async fn apply(&self) -> Result<(), ReloadError> {
        if let Some(path) = self.opts.model_path() {
            let unchanged = Manifest::load(&path).is_ok_and(|m| m == self.manifest);
            if !unchanged {
                self.cm.count_refused_reload();
                return Err(ReloadError::ManifestChanged {
                    path: path.display().to_string(),
                });
            }
        }
        let (settings, _) = load_settings(&self.opts, &self.manifest).map_err(|e| {
            self.cm.count_refused_reload();
            ReloadError::Config(e)
        })?;
        // BudgetConfig counts the outcome of applying them.
        self.cm
            .set_budgets(self.manifest.budget_settings(&settings.chunking))
            .await?;
        Ok(())
    }
}

/// A running config watcher; dropping it stops watching.
pub struct ConfigWatcher {
    _watcher: RecommendedWatcher,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ConfigWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How long a burst of file events (an editor's write, rename, chmod) is left to settle before
/// one reload.
const SETTLE: Duration = Duration::from_millis(100);

/// Reloads through `reloader` whenever one of its files changes, or on SIGHUP. Must be called
/// inside an actix system; the reloads run on the current arbiter.
///
/// # Errors
/// The file watcher or the signal handler cannot be set up.
pub fn watch(reloader: Reloader) -> Result<ConfigWatcher, String> {
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let files: Vec<PathBuf> = reloader
        .files()
        .into_iter()
        .map(|f| std::fs::canonicalize(&f).unwrap_or(f))
        .collect();
    let watched = files.clone();
    let events = tx.clone();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(event) = res else { return };
        if event.kind.is_access() {
            return;
        }
        if event.paths.iter().any(|p| watched.contains(p)) {
            let _ = events.send(());
        }
    })
    .map_err(|e| format!("cannot watch the config files: {e}"))?;
    // Watch the directories: editors replace a file by renaming a new one over it.
    let mut dirs: Vec<PathBuf> = files
        .iter()
        .filter_map(|f| f.parent().map(PathBuf::from))
        .collect();
    dirs.sort();
    dirs.dedup();
    for dir in &dirs {
        watcher
            .watch(dir, RecursiveMode::NonRecursive)
            .map_err(|e| format!("cannot watch {}: {e}", dir.display()))?;
    }
    #[cfg(unix)]
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(|e| format!("cannot handle SIGHUP: {e}"))?;
    let task = async move {
        loop {
            #[cfg(unix)]
            let woke = tokio::select! {
                e = rx.recv() => e.is_some(),
                s = hangup.recv() => s.is_some(),
            };
            #[cfg(not(unix))]
            let woke = rx.recv().await.is_some();
            if !woke {
                return;
            }
            tokio::time::sleep(SETTLE).await;
            while rx.try_recv().is_ok() {}
            let _ = reloader.reload().await;
        }
    };
    let handle = actix::spawn(task);
    drop(tx);
    Ok(ConfigWatcher {
        _watcher: watcher,
        task: handle,
    })
}
