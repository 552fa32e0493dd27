//! The two-trip facade step of `benches/instructions.rs` (`facade::two_trips`), written against
//! the public API of the build before `complete_and_assemble` existed, so that
//! `scripts/bench_before.py` can count that build's instructions beside this one's
//! (`make bench-before`). Not a target of this crate: the script copies it into a worktree of
//! the old revision. The workloads are those of `benches/common/mod.rs`.
use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;

use gungraun::{library_benchmark, library_benchmark_group};
use mstar_chunking::policy::ModelPolicies;
use mstar_chunking::Name;
use mstar_chunking::{BudgetSettings, ChunkingManagement, ChunkingPolicy, PreparedInput, SubmoduleCaps};

const NODE: &str = "llm";
const STEP_WALK: &str = "mixed";
const ALIGN: u32 = 16;
const WARM_STEPS: u64 = 200;
const STEPS: u64 = 100;
const FIRST_PROMPT_RID: u64 = 1 << 32;

#[derive(Clone, Copy)]
struct Workload { decode_rows: u64, prompts: u64, prompt_tokens: u32, budget: u32 }
const WORKLOADS: [Workload; 3] = [
    Workload { decode_rows: 256, prompts: 64, prompt_tokens: 2_048, budget: 2_048 },
    Workload { decode_rows: 1_024, prompts: 64, prompt_tokens: 8_192, budget: 8_192 },
    Workload { decode_rows: 32, prompts: 16, prompt_tokens: 512, budget: 512 },
];
fn n(s: &str) -> Name { Name::from(s) }
fn submodules() -> BTreeMap<Name, SubmoduleCaps> {
    BTreeMap::from([(n(NODE), SubmoduleCaps::new(["prefill", STEP_WALK], false))])
}
fn policies(w: Workload) -> BTreeMap<(Name, Name), ChunkingPolicy> {
    BTreeMap::from([((n(NODE), n(STEP_WALK)), ChunkingPolicy::budget(w.budget).aligned(ALIGN))])
}
fn settings(model: &ModelPolicies) -> BudgetSettings {
    BudgetSettings {
        walks: [n("prefill"), n("decode"), n(STEP_WALK)].into(),
        combined_walk_of: BTreeMap::from([(n("prefill"), n(STEP_WALK)), (n("decode"), n(STEP_WALK))]),
        override_mixed: BTreeSet::new(),
        ..BudgetSettings::defaults_for(model)
    }
}
struct Engine { chunking: ChunkingManagement, prompt: PreparedInput, next_rid: u64 }
impl Engine {
    async fn start(w: Workload) -> Self {
        let chunking = ChunkingManagement::start("bench", submodules()).unwrap();
        chunking.set_policies(policies(w)).await.expect("set_policies");
        let model = ModelPolicies::new(submodules(), policies(w)).expect("valid model");
        chunking.set_budgets(settings(&model)).await.expect("set_budgets");
        for rid in 1..=w.decode_rows {
            chunking.continue_row(rid, NODE, "decode", 1).await.expect("decode row");
        }
        let prompt = PreparedInput::tokens((0..w.prompt_tokens).collect::<Vec<u32>>());
        let mut e = Self { chunking, prompt, next_rid: FIRST_PROMPT_RID };
        for _ in 0..w.prompts { e.admit().await; }
        for _ in 0..WARM_STEPS { e.step().await; }
        e
    }
    async fn admit(&mut self) {
        self.chunking.admit(self.next_rid, NODE, "prefill", self.prompt.clone(), 0).await.expect("admit");
        self.next_rid += 1;
    }
    async fn step(&mut self) {
        let batch = self.chunking.assemble(NODE, STEP_WALK).await.expect("assemble");
        let ran: Vec<u32> = batch.rows.iter().map(|r| r.tokens()).collect();
        let step = batch.step;
        drop(black_box(batch));
        let outcome = self.chunking.complete(step, ran).await.expect("complete");
        for _ in &outcome.finished { self.admit().await; }
    }
}
fn facade_setup(w: usize) -> (actix::SystemRunner, Engine) {
    let sys = actix::System::new();
    let engine = sys.block_on(Engine::start(WORKLOADS[w]));
    (sys, engine)
}
#[library_benchmark]
#[bench::w1(args = (0), setup = facade_setup)]
#[bench::w2(args = (1), setup = facade_setup)]
#[bench::w3(args = (2), setup = facade_setup)]
fn two_trips(input: (actix::SystemRunner, Engine)) -> (actix::SystemRunner, Engine) {
    let (sys, mut engine) = input;
    sys.block_on(async { for _ in 0..STEPS { engine.step().await; } });
    (sys, engine)
}
library_benchmark_group!(name = facade; benchmarks = two_trips);
gungraun::main!(library_benchmark_groups = facade);
