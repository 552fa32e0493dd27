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
    /// The model: `smollm2` (SmolLM2-135M-Instruct from the cache `make model` fills), or the
    /// random-weight `tiny` or `small` over a byte vocabulary.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Serve this llama-architecture GGUF file (weights and tokenizer) instead of `--model`.
    #[arg(long, conflicts_with_all = ["weights", "seed"])]
    gguf: Option<PathBuf>,
    /// Seed of the random weights (`tiny`, `small`).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A safetensors file with Llama tensor names (instead of random weights).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The device: `cpu`, or `cuda` / `cuda:N` (needs the `cuda` build feature; untested here).
    #[arg(long, default_value = "cpu")]
    device: String,
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
    /// KV cache capacity in tokens over all requests. The default holds two full 8,192-token
    /// contexts of SmolLM2 (~46 KB of f32 keys and values a token: ~720 MiB).
    #[arg(long, default_value_t = 16_384)]
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

/// `cpu`, `cuda` or `cuda:N`.
fn device(s: &str) -> Result<candle_core::Device, String> {
    let ordinal = match s {
        "cpu" => return Ok(candle_core::Device::Cpu),
        "cuda" => 0,
        s => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| format!("--device `{s}`: `cpu`, `cuda` or `cuda:N`"))?,
    };
    candle_core::Device::new_cuda(ordinal).map_err(|e| format!("--device `{s}`: {e}"))
}

fn load_model(a: &ServeArgs, device: &candle_core::Device) -> Result<(Model, String), String> {
    use mstar_engine::model::gguf;
    let from_gguf = |p: &std::path::Path| {
        gguf::load(p, device, gguf::DEFAULT_FORMAT).map_err(|e| e.to_string())
    };
    if let Some(p) = &a.gguf {
        return Ok((from_gguf(p)?, p.display().to_string()));
    }
    if a.model == "smollm2" {
        if a.weights.is_some() {
            return Err("--weights goes with `--model tiny` or `small`".into());
        }
        let p = gguf::smollm2_path()?;
        return Ok((from_gguf(&p)?, "SmolLM2-135M-Instruct".into()));
    }
    let config = Config::by_name(&a.model)
        .map_err(|_| format!("--model `{}`: smollm2, tiny or small", a.model))?;
    let model = match &a.weights {
        Some(p) => Model::load(config, p, device),
        None => Model::random(config, a.seed, device),
    }
    .map_err(|e| e.to_string())?;
    Ok((model, a.model.clone()))
}

fn serve(a: ServeArgs) -> Result<(), String> {
    let device = device(&a.device)?;
    let (model, shown) = load_model(&a, &device)?;
    let config = model.config;
    let s = settings(&a.engine, &a.served_name)?;
    let (handle, thread) = engine::start(model, s)?;
    let grace = Duration::from_secs_f64(a.grace_secs.max(0.0));
    actix_web::rt::System::new().block_on(async move {
        let srv = server::Server::start(handle, &a.served_name, &a.listen)
            .map_err(|e| format!("listening on {}: {e}", a.listen))?;
        println!(
            "mstar-engine listening on http://{} (model {shown}, {} layers, d = {}, vocabulary {})",
            srv.addr, config.layers, config.hidden, config.vocab
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
