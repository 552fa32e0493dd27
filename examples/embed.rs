//! How an engine embeds mstar-chunking: an engine actor admits requests, asks for each step's
//! batch, "runs" it, reports the tokens each row ran, and aborts one request midway.
//!
//! `cargo run --example embed` prints every step.

use std::num::NonZeroU32;

use actix::prelude::*;
use mstar_chunking::{
    BudgetSettings, ChunkingManagement, ChunkingPolicy, PreparedInput, SubmoduleCaps, Work,
};

/// The engine's side: owns the model's requests and calls the chunking facade each step.
struct Engine {
    chunking: ChunkingManagement,
}

impl Actor for Engine {
    type Context = Context<Self>;
}

/// Runs one engine step; answers whether anything ran.
#[derive(Message)]
#[rtype(result = "Result<bool, mstar_chunking::ChunkingError>")]
struct Step;

impl Handler<Step> for Engine {
    type Result = ResponseFuture<Result<bool, mstar_chunking::ChunkingError>>;

    fn handle(&mut self, _: Step, _: &mut Self::Context) -> Self::Result {
        let cm = self.chunking.clone();
        Box::pin(async move {
            let batch = cm.assemble("llm", "mixed").await?;
            let rows: Vec<String> = batch
                .rows
                .iter()
                .map(|r| match r.work {
                    Work::Continue { estimate } => format!("rid {} decode {estimate}", r.rid),
                    Work::Chunk { range, .. } => format!(
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
            let outcome = cm.complete(batch.step, ran).await?;
            // Requests whose prompt finished generate two tokens with decode rows.
            for rid in &outcome.finished {
                cm.continue_row(*rid, "llm", "decode", 1).await?;
            }
            Ok(!batch.rows.is_empty())
        })
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
                // Requests 0 and 1 are done generating: ending a request drops its rows.
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
