//! How an engine embeds mstar-chunking: an engine actor admits requests, "runs" each step's
//! batch, reports the tokens each row ran and gets the next step's batch in the same round trip
//! (`complete_and_assemble` with a `NextStep`), and aborts one request midway.
//!
//! `cargo run --example embed` prints every step.

use std::num::NonZeroU32;
use std::sync::Arc;

use actix::prelude::*;
use mstar_chunking::{
    Batch, BudgetSettings, ChunkingManagement, ChunkingPolicy, NextStep, PreparedInput, RowWork,
    SubmoduleCaps,
};

/// The engine's side: owns the model's requests and calls the chunking facade each step.
struct Engine {
    chunking: ChunkingManagement,
    /// The next step's batch, answered with the last completion.
    pending: Option<Arc<Batch>>,
}

impl Actor for Engine {
    type Context = Context<Self>;
}

/// Runs one engine step; answers whether anything ran.
#[derive(Message)]
#[rtype(result = "Result<bool, mstar_chunking::ChunkingError>")]
struct Step;

impl Handler<Step> for Engine {
    type Result = ResponseActFuture<Self, Result<bool, mstar_chunking::ChunkingError>>;

    fn handle(&mut self, _: Step, _: &mut Self::Context) -> Self::Result {
        let cm = self.chunking.clone();
        let pending = self.pending.take();
        let step = async move {
            // The first step is assembled alone; every later one came with a completion.
            let batch = match pending {
                Some(batch) => batch,
                None => cm.assemble("llm", "mixed").await?,
            };
            let rows: Vec<String> = batch
                .rows
                .iter()
                .map(|r| match r.work {
                    RowWork::Continue { estimate } => format!("rid {} decode {estimate}", r.rid),
                    RowWork::Chunk { range, .. } => format!(
                        "rid {} chunk [{}, {}) of {}{}",
                        r.rid,
                        range.start,
                        range.end,
                        range.total,
                        if range.is_final() { " final" } else { "" }
                    ),
                })
                .collect();
            // A step without a budget (chunking off for the walk) says so instead of a number.
            let budget = batch
                .budget
                .map_or_else(|| "no budget".to_string(), |b| format!("budget {b}"));
            println!(
                "step {:>2}: {:>4} tokens, {budget} | {}",
                batch.step,
                batch.scheduled_tokens,
                rows.join(", ")
            );
            // A real engine runs the batch on the GPU here, reading each chunk's token ids from
            // `row.input`; this one runs exactly what was scheduled.
            let ran: Vec<u32> = batch.rows.iter().map(|r| r.tokens()).collect();
            if batch.rows.is_empty() {
                cm.complete(batch.step, ran, None).await?;
                return Ok((false, None));
            }
            // Requests whose prompt finishes now generate tokens with decode rows from the
            // next step on: queued before it is planned.
            let mut next = NextStep::new("llm", "mixed");
            for r in &batch.rows {
                if matches!(r.work, RowWork::Chunk { range, .. } if range.is_final()) {
                    next = next.continue_row(r.rid, "decode", 1);
                }
            }
            let done = cm
                .complete_and_assemble(batch.step, ran, None, next)
                .await?;
            Ok((true, Some(done.next?)))
        };
        Box::pin(step.into_actor(self).map(
            |answer: Result<_, mstar_chunking::ChunkingError>, act, _| {
                let (ran, next) = answer?;
                act.pending = next;
                Ok(ran)
            },
        ))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    System::new().block_on(async {
        let cm = ChunkingManagement::start(
            "embed-demo",
            [("llm", SubmoduleCaps::new(["prefill", "mixed"], false))],
        )?;
        cm.set_policies([(("llm", "mixed"), ChunkingPolicy::budget(512).aligned(16))])
            .await?;
        let settings = BudgetSettings::new(["prefill", "decode", "mixed"])
            .combined("mixed", ["prefill", "decode"])
            .budget(
                "llm",
                NonZeroU32::new(256).expect("a budget is at least 1 token"),
            )
            .min_chunk_tokens(NonZeroU32::new(32).expect("non-zero"));
        cm.set_budgets(settings).await?;
        for (rid, len) in [(0u64, 700u32), (1, 90), (2, 400)] {
            let ids: Vec<u32> = (0..len).collect();
            cm.admit(rid, "llm", "prefill", PreparedInput::tokens(ids), 0)
                .await?;
        }
        let engine = Engine {
            chunking: cm.clone(),
            pending: None,
        }
        .start();
        let mut step = 0;
        while engine.send(Step).await?? {
            step += 1;
            if step == 2 {
                println!("abort rid 2");
                cm.forget_request(2).await?;
            }
            if step == 5 {
                // Requests 0 and 1 are done generating: ending a request drops its rows (the
                // next step, answered with the last completion, still runs them without
                // advancing; an engine that knows earlier passes `NextStep::forget_request`).
                for rid in 0..2 {
                    cm.forget_request(rid).await?;
                }
            }
        }
        let (rows, tokens) = cm.prepared_totals().await?;
        println!("done: {rows} prepared inputs ({tokens} tokens) left");
        Ok(())
    })
}
