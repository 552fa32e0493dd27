//! `mstar-engine`: `serve` runs the reference engine behind the OpenAI-compatible API;
//! `bench` replays a trace against a running server.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use mstar_engine::engine::{self, Chunking, EngineSettings};
use mstar_engine::model::{Config, Model};
use mstar_engine::{bench, server};

/// mimalloc instead of the system allocator: a step allocates and frees its activations and
/// each row's grown KV cache, megabytes at a time, and glibc's malloc serves blocks that large
/// with fresh mappings whose pages fault in on every step, which made a 1-token step ~1.7 times
/// slower and its time noisier (`examples/step_cost.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "mstar-engine",
    version,
    about = "The mstar-chunking reference engine"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the model over the OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Replay a trace in real time against a server with streaming clients.
    Bench(bench::BenchArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// Model size: tiny or small.
    #[arg(long, default_value = "small")]
    model: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A safetensors file with Llama tensor names (instead of random weights).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The model name the API serves.
    #[arg(long, default_value = "mstar-engine")]
    served_name: String,
    #[command(flatten)]
    engine: EngineArgs,
    /// Seconds running requests get to finish after SIGTERM before they are aborted.
    #[arg(long, default_value_t = 10.0)]
    grace_secs: f64,
}

/// The engine's scheduling and memory flags.
#[derive(Args)]
struct EngineArgs {
    /// Token budget per step, or `off` (no chunking).
    #[arg(long, default_value = "256")]
    budget: String,
    /// Chunk alignment in tokens.
    #[arg(long, default_value_t = 16)]
    align: u32,
    /// The floor: the fewest tokens a prompt is cut to.
    #[arg(long, default_value_t = 16)]
    min_chunk_tokens: u32,
    /// Time budget per step in ms.
    #[arg(long)]
    max_step_ms: Option<f64>,
    /// Latency model to plan with: `base_ms,per_token_ms,per_kv_token_ms,per_attention_pair_ms`.
    #[arg(long)]
    cost: Option<String>,
    /// Fit the latency model online from measured step times.
    #[arg(long)]
    learn_cost: bool,
    /// Plan timed steps against the time budget divided by this quantile (0-1] of the recent
    /// measured / predicted step times.
    #[arg(long)]
    time_margin: Option<f64>,
    /// KV cache capacity in tokens over all requests.
    #[arg(long, default_value_t = 65_536)]
    kv_tokens: u64,
    /// Requests that may wait for admission before new ones get 503.
    #[arg(long, default_value_t = 1024)]
    max_waiting: usize,
    /// Write the step log (JSON Lines, as `mstar-chunking replay --step-log`).
    #[arg(long)]
    step_log: Option<PathBuf>,
}

fn settings(a: &EngineArgs, name: &str) -> Result<EngineSettings, String> {
    let chunking = match a.budget.as_str() {
        "off" => Chunking::Off,
        n => Chunking::Tokens(
            n.parse::<u32>()
                .ok()
                .filter(|&b| b > 0)
                .ok_or_else(|| format!("--budget `{n}`: a positive whole number or `off`"))?,
        ),
    };
    let cost = match &a.cost {
        None => None,
        Some(s) => {
            let v: Vec<f64> = s
                .split(',')
                .map(|x| x.trim().parse::<f64>())
                .collect::<Result<_, _>>()
                .map_err(|e| format!("--cost `{s}`: {e}"))?;
            let c: [f64; 4] = v
                .try_into()
                .map_err(|_| format!("--cost `{s}`: four comma-separated numbers"))?;
            Some(
                mstar_chunking::latency::LatencyModel::from_coefficients(c)
                    .map_err(|e| format!("--cost `{s}`: {e}"))?,
            )
        }
    };
    Ok(EngineSettings {
        name: name.to_owned(),
        chunking,
        align: a.align,
        min_chunk_tokens: a.min_chunk_tokens,
        max_step_ms: a.max_step_ms,
        cost,
        learn_cost: a.learn_cost,
        time_margin: a.time_margin,
        kv_tokens: a.kv_tokens,
        max_waiting: a.max_waiting,
        step_log: a.step_log.clone(),
    })
}

fn serve(a: ServeArgs) -> Result<(), String> {
    let config = Config::by_name(&a.model).map_err(|e| e.to_string())?;
    let device = candle_core::Device::Cpu;
    let model = match &a.weights {
        Some(p) => Model::load(config, p, &device),
        None => Model::random(config, a.seed, &device),
    }
    .map_err(|e| e.to_string())?;
    let s = settings(&a.engine, &a.served_name)?;
    let (handle, thread) = engine::start(model, s)?;
    let grace = Duration::from_secs_f64(a.grace_secs.max(0.0));
    actix_web::rt::System::new().block_on(async move {
        let srv = server::Server::start(handle, &a.served_name, &a.listen)
            .map_err(|e| format!("listening on {}: {e}", a.listen))?;
        println!(
            "mstar-engine listening on http://{} (model {}, {} parameters)",
            srv.addr,
            a.model,
            config.parameters()
        );
        let _ = std::io::stdout().flush();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| e.to_string())?;
        tokio::select! {
            _ = term.recv() => {},
            _ = tokio::signal::ctrl_c() => {},
        }
        eprintln!("mstar-engine: shutting down (grace {:?})", grace);
        srv.shutdown(grace).await.map_err(|e| e.to_string())
    })?;
    thread
        .join()
        .map_err(|_| "the engine thread panicked".to_owned())?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Serve(a) => serve(a),
        Cmd::Bench(a) => bench::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mstar-engine: {e}");
            ExitCode::FAILURE
        }
    }
}
