//! The actor shell: one actix actor per piece of state, each wrapping a plain struct of the
//! functional core, plus the [`ChunkingManagement`] facade an engine holds.
//!
//! Keep the actors of one engine on one arbiter (the facade starts them on the current one): a
//! message to an actor on the same arbiter costs well under a microsecond.

mod budget_config;
mod facade;
mod overrun_accounting;
mod policy_registry;
mod prepared_inputs;
mod scheduler;

pub use budget_config::{
    BindPolicies, BudgetConfig, GetSnapshot, SetBudgets, Subscribe, UseSnapshot,
};
pub use facade::ChunkingManagement;
pub use overrun_accounting::{CheckStep, OverrunAccounting, OverrunCount, RecordOverrun};
pub use policy_registry::{GetPolicies, PolicyRegistry, SetPolicies};
pub use prepared_inputs::{
    Cut, ForgetInputs, GetPrepared, Insert, PreparedInputs, PreparedTotals, Release, ReleaseOne,
};
pub use scheduler::{
    Abandon, Admit, AdmitPrepared, Assemble, Complete, ContinueRow, Finish, ForgetRequest,
    ForgetRow, Scheduler, SchedulerStats,
};
