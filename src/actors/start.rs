//! Starting a model's actors: [`ChunkingManagement::start`] on the current actix arbiter, and
//! [`ChunkingManagement::start_on_own_thread`] on a thread of their own, in an actix System of
//! their own, for an engine on tokio or any other runtime.

use std::collections::BTreeMap;
use std::sync::Arc;

use actix::prelude::*;

use super::budget_config::{BudgetConfig, Subscribe};
use super::facade::{ChunkingManagement, DEFAULT_REQUEST_TIMEOUT};
use super::host::{ActorThread, RequestTimeout, ThreadKeeper};
use super::overrun_accounting::OverrunAccounting;
use super::policy_registry::PolicyRegistry;
use super::prepared_inputs::PreparedInputs;
use super::scheduler::Scheduler;
use crate::error::ChunkingError;
use crate::metrics::Instance;
use crate::policy::{Name, SubmoduleCaps};

/// An actix System for the chunking actors, on a current-thread tokio runtime with the time
/// driver only. The actors do no I/O (the metrics exporter, the config watcher and the replay's
/// signal handler run elsewhere, on runtimes of their own or the embedder's), and a runtime
/// without the I/O driver does not poll it (one `epoll_wait` system call) each time its
/// `block_on` future waits, which is once per round trip when the engine awaits the actors on
/// the same thread. [`ChunkingManagement::start_on_own_thread`] hosts the actors on one; an
/// engine that starts them on its own thread ([`ChunkingManagement::start`]) and needs no I/O
/// there should run on one too (`actix::System::new()` enables the I/O driver).
///
/// ```
/// use mstar_chunking::{actors::actor_system, ChunkingManagement, SubmoduleCaps};
///
/// let system = actor_system()?;
/// system.block_on(async {
///     let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
///     assert!(cm.queue_stats().await.is_ok());
///     Ok::<_, mstar_chunking::ChunkingError>(())
/// })?;
/// # Ok::<_, Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`ChunkingError::ThreadStart`] when the runtime cannot be built.
pub fn actor_system() -> Result<actix::SystemRunner, ChunkingError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| ChunkingError::ThreadStart {
            reason: format!("cannot build the actors' tokio runtime: {e}"),
        })?;
    Ok(actix::System::with_tokio_rt(move || runtime))
}

impl ChunkingManagement {
    /// Starts the actors of `model` (the value of every metric series' `model` label) on the
    /// current actix arbiter, for a model with these node submodules.
    ///
    /// # Errors
    /// [`ChunkingError::NoActixSystem`] when called outside an actix System.
    pub fn start<I, S>(model: &str, submodules: I) -> Result<Self, ChunkingError>
    where
        I: IntoIterator<Item = (S, SubmoduleCaps)>,
        S: AsRef<str>,
    {
        Self::start_labelled(Instance::new(Name::from(model)), submodules)
    }

    /// [`ChunkingManagement::start`] for one worker of a fleet (a replayed fleet has one
    /// instance per worker in one process): every metric series carries a `worker` label with
    /// `worker` besides `model`, so the workers export separate series.
    ///
    /// # Errors
    /// As [`ChunkingManagement::start`].
    pub fn start_worker<I, S>(
        model: &str,
        worker: &str,
        submodules: I,
    ) -> Result<Self, ChunkingError>
    where
        I: IntoIterator<Item = (S, SubmoduleCaps)>,
        S: AsRef<str>,
    {
        let instance = Instance::new(Name::from(model)).with_worker(Name::from(worker));
        Self::start_labelled(instance, submodules)
    }

    fn start_labelled<I, S>(instance: Instance, submodules: I) -> Result<Self, ChunkingError>
    where
        I: IntoIterator<Item = (S, SubmoduleCaps)>,
        S: AsRef<str>,
    {
        if actix::System::try_current().is_none() || actix::Arbiter::try_current().is_none() {
            return Err(ChunkingError::NoActixSystem);
        }
        let submodules: BTreeMap<Name, SubmoduleCaps> = submodules
            .into_iter()
            .map(|(n, c)| (Name::from(n.as_ref()), c))
            .collect();
        let model = instance.model_name().clone();
        instance.started();
        let instance_handle = instance.clone();
        // Supervised: an actor that panics is restarted with its state, on this arbiter.
        let budgets = {
            let instance = instance.clone();
            Supervisor::start(move |_| BudgetConfig::new(instance))
        };
        let policies = {
            let budgets = budgets.clone();
            Supervisor::start(move |_| PolicyRegistry::new(budgets))
        };
        let prepared = {
            let instance = instance.clone();
            let nodes: Vec<Name> = submodules.keys().cloned().collect();
            Supervisor::start(move |_| PreparedInputs::new(instance, &nodes))
        };
        let overruns = {
            let instance = instance.clone();
            Supervisor::start(move |_| OverrunAccounting::new(instance))
        };
        let scheduler = {
            let (prepared, overruns) = (prepared.clone(), overruns.clone());
            Supervisor::start(move |_| Scheduler::new(instance, prepared, overruns))
        };
        budgets.do_send(Subscribe(scheduler.clone().recipient()));
        Ok(Self {
            submodules: Arc::new(submodules),
            policies,
            budgets,
            prepared,
            overruns,
            scheduler,
            timeout: RequestTimeout {
                after: Some(DEFAULT_REQUEST_TIMEOUT),
                host: None,
                keeper: None,
            },
            model,
            metrics: instance_handle,
        })
    }

    /// Starts the actors on a thread of their own, in an actix System of their own, for an
    /// engine that runs on tokio (or any runtime) without one. Returns the handle (`Send`,
    /// usable from any thread) and the thread's guard. The thread runs while the guard or any
    /// clone of the handle lives, so dropping the guard early stops nothing; call
    /// [`ActorThread::stop`] (after [`drain`](Self::drain)) to stop the actors at shutdown.
    ///
    /// ```
    /// use mstar_chunking::{ChunkingManagement, ChunkingPolicy, SubmoduleCaps};
    ///
    /// let (cm, _actors) = ChunkingManagement::start_on_own_thread(
    ///     "demo",
    ///     [("llm", SubmoduleCaps::new(["prefill"], false))],
    /// )?;
    /// let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    /// rt.block_on(async {
    ///     cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    ///     assert_eq!(cm.max_batch_tokens("llm", "prefill").await?, Some(256));
    ///     Ok::<_, mstar_chunking::ChunkingError>(())
    /// })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`ChunkingError::ThreadStart`] when the thread or its System cannot start.
    pub fn start_on_own_thread<I, S>(
        model: &str,
        submodules: I,
    ) -> Result<(Self, ActorThread), ChunkingError>
    where
        I: IntoIterator<Item = (S, SubmoduleCaps)>,
        S: AsRef<str>,
    {
        let submodules: Vec<(String, SubmoduleCaps)> = submodules
            .into_iter()
            .map(|(n, c)| (n.as_ref().to_owned(), c))
            .collect();
        let model = model.to_owned();
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("mstar-chunking-{model}"))
            .spawn(move || {
                let system = match actor_system() {
                    Ok(system) => system,
                    Err(e) => {
                        // The receiver waits for this answer; if it went away there is no one
                        // to tell.
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                system.block_on(async {
                    let started = ChunkingManagement::start(&model, submodules).map(|mut cm| {
                        cm.timeout.host = Some(actix::Arbiter::current());
                        cm
                    });
                    // The receiver waits for this answer; if it went away there is no one to tell.
                    let _ = tx.send(started.map(|cm| (cm, actix::System::current())));
                });
                if let Err(e) = system.run() {
                    tracing::error!(error = %e, "the chunking actor System ended with an error");
                }
            })
            .map_err(|e| ChunkingError::ThreadStart {
                reason: e.to_string(),
            })?;
        let (mut cm, system) = rx.recv().map_err(|_| ChunkingError::ThreadStart {
            reason: "the actor thread ended before starting the actors".into(),
        })??;
        let keeper = Arc::new(ThreadKeeper {
            system,
            thread: std::sync::Mutex::new(Some(thread)),
        });
        cm.timeout.keeper = Some(keeper.clone());
        Ok((cm, ActorThread { keeper }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread that knows an actix System but runs no arbiter of it cannot start actors there:
    /// the same refusal as outside any System, not a panic when the first actor starts.
    #[test]
    fn a_system_without_an_arbiter_on_this_thread_is_refused() {
        let system = actix::System::new();
        let handle = actix::System::current();
        let refused = std::thread::spawn(move || {
            actix::System::set_current(handle);
            assert!(actix::System::try_current().is_some());
            assert!(actix::Arbiter::try_current().is_none());
            ChunkingManagement::start("x", [("llm", SubmoduleCaps::new(["prefill"], false))]).err()
        })
        .join()
        .expect("the thread answers rather than panics");
        assert_eq!(refused, Some(ChunkingError::NoActixSystem));
        drop(system);
    }
}
