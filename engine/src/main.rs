//! `mstar-engine`: `serve` runs the reference engine behind the OpenAI-compatible API;
//! `bench` replays a trace against a running server.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use mstar_engine::engine::{self, Chunking, EngineSettings};
use mstar_engine::model::{Config, Model};
use mstar_engine::{bench, files, server};
use tokio::signal::unix::{signal, SignalKind};

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
    /// Write a GGUF model's tokenizer as a Hugging Face tokenizer directory (`tokenizer.json`,
    /// `tokenizer_config.json`, and the model's shape in `config.json`), offline, for clients that need one (`vllm bench serve
    /// --tokenizer DIR`).
    ExportTokenizer(ExportTokenizerArgs),
}

#[derive(Args)]
struct ExportTokenizerArgs {
    /// `smollm2` (SmolLM2-135M-Instruct from the cache `make model` fills).
    #[arg(long, default_value = "smollm2", conflicts_with = "gguf")]
    model: String,
    /// This llama-architecture GGUF file's tokenizer instead of `--model`'s.
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// The directory written (created if missing); its three files are replaced whole.
    #[arg(long)]
    out: PathBuf,
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
    /// How a GGUF model's weights are kept: `native` (as stored: Q4_1 for SmolLM2, with
    /// llama.cpp's arithmetic; the fastest here), `q8_0` (requantized at load) or `dense`
    /// (f32; the most memory).
    #[arg(long, default_value = "native", value_parser = parse_format)]
    weight_format: mstar_engine::model::gguf::WeightFormat,
    /// Seed of the random weights (`tiny`, `small`).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A safetensors file with Llama tensor names (instead of random weights).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// The device: `cpu`, or `cuda` / `cuda:N` (needs the `cuda` build feature; untested here).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The model name the API serves (default: the model's own, `SmolLM2-135M-Instruct`, a
    /// GGUF file's name without `.gguf`, or `tiny` / `small`); an empty name is the default,
    /// as vLLM takes it.
    #[arg(long, alias = "served-name")]
    served_model_name: Option<String>,
    #[command(flatten)]
    engine: EngineArgs,
    /// Seconds running requests get to finish after SIGTERM or SIGINT before they are aborted
    /// (0 to 86400); a second signal stops at once.
    #[arg(long, default_value = "10", value_parser = parse_grace, allow_negative_numbers = true)]
    grace_secs: Duration,
    /// Connections open at once, idle ones included; further clients wait in the listen
    /// queue, and each one accepted into the last slot sheds the connection waiting longest on
    /// its client (default: what the descriptor limit allows, less 64, which the server raises
    /// to its hard limit at start).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    max_connections: Option<u32>,
    /// Requests whose bodies are read at once; more wait for a slot within their body deadline.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    max_active_requests: u32,
    /// Seconds a client may take to send a request's body.
    #[arg(long, default_value = "10", value_parser = parse_body_timeout)]
    body_timeout_secs: Duration,
}

/// `--weight-format`: `q8_0`, `native` or `dense`.
fn parse_format(s: &str) -> Result<mstar_engine::model::gguf::WeightFormat, String> {
    mstar_engine::model::gguf::WeightFormat::by_name(s)
        .ok_or_else(|| format!("`{s}`: q8_0, native or dense"))
}

/// `--grace-secs`: a finite number of seconds from 0 to one day.
fn parse_grace(s: &str) -> Result<Duration, String> {
    seconds(s, 0.0, engine::MAX_GRACE.as_secs_f64())
}

/// `--body-timeout-secs`: a finite number of seconds above 0, at most an hour.
fn parse_body_timeout(s: &str) -> Result<Duration, String> {
    let d = seconds(s, 0.0, 3600.0)?;
    if d.is_zero() {
        return Err("must be more than 0 seconds".into());
    }
    Ok(d)
}

fn seconds(s: &str, min: f64, max: f64) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(v.is_finite() && (min..=max).contains(&v)) {
        return Err(format!(
            "`{s}`: must be a number of seconds from {min} to {max}"
        ));
    }
    Ok(Duration::from_secs_f64(v))
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
    /// Latency model to plan with: `base_ms,per_token_ms,per_kv_token_ms,per_attention_pair_ms`,
    /// and optionally `,per_row_ms`.
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
    /// Requests that may wait for KV memory before new ones get 503 (at least 1; a request
    /// that fits at once never counts).
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
            // Four coefficients, or five with `per_row_ms`.
            let mut c = [0.0; mstar_chunking::latency::TERMS];
            if !(v.len() == 4 || v.len() == c.len()) {
                return Err(format!(
                    "--cost `{s}`: four comma-separated numbers (base_ms,per_token_ms,per_kv_token_ms,per_attention_pair_ms), or five with per_row_ms"
                ));
            }
            c[..v.len()].copy_from_slice(&v);
            Some(
                mstar_chunking::latency::LatencyModel::from_terms(c)
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
        before_step: None,
    })
}

/// The most bytes a `--weights` file may have beyond its tensors' f32 data: the safetensors
/// header (names, shapes and offsets of a few hundred tensors), with room to spare.
const WEIGHTS_HEADER_ALLOWANCE: u64 = 16 << 20;

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

/// The model, how the start-up line shows it, and its own name (the default served name).
fn load_model(
    a: &ServeArgs,
    device: &candle_core::Device,
) -> Result<(Model, String, String), String> {
    use mstar_engine::model::gguf;
    let from_gguf =
        |p: &std::path::Path| gguf::load(p, device, a.weight_format).map_err(|e| e.to_string());
    if let Some(p) = &a.gguf {
        let own = p.file_stem().map_or_else(
            || p.display().to_string(),
            |s| s.to_string_lossy().into_owned(),
        );
        return Ok((from_gguf(p)?, p.display().to_string(), own));
    }
    if a.model == "smollm2" {
        if a.weights.is_some() {
            return Err("--weights goes with `--model tiny` or `small`".into());
        }
        let p = gguf::smollm2_path()?;
        let name = gguf::SMOLLM2_NAME.to_owned();
        return Ok((from_gguf(&p)?, name.clone(), name));
    }
    let config = Config::by_name(&a.model)
        .map_err(|_| format!("--model `{}`: smollm2, tiny or small", a.model))?;
    if let Some(p) = &a.weights {
        // f32 tensors at most (a narrower dtype is smaller), plus the header.
        let max = (config.parameters() as u64)
            .saturating_mul(4)
            .saturating_add(WEIGHTS_HEADER_ALLOWANCE);
        files::check_input(p, "--weights", max)?;
    }
    let model = match &a.weights {
        Some(p) => Model::load(config, p, device),
        None => Model::random(config, a.seed, device),
    }
    .map_err(|e| e.to_string())?;
    Ok((model, a.model.clone(), a.model.clone()))
}

fn serve(a: ServeArgs) -> Result<(), String> {
    if let Some(p) = &a.engine.step_log {
        let inputs: Vec<(&str, &std::path::Path)> =
            [("--weights", &a.weights), ("--gguf", &a.gguf)]
                .into_iter()
                .filter_map(|(f, p)| p.as_deref().map(|p| (f, p)))
                .collect();
        files::check_output(p, "--step-log", &inputs)?;
    }
    let device = device(&a.device)?;
    let (model, shown, own_name) = load_model(&a, &device)?;
    let served = a
        .served_model_name
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or(own_name);
    let config = model.config;
    let s = settings(&a.engine, &served)?;
    let (handle, thread) = engine::start(model, s)?;
    let grace = a.grace_secs;
    if let Some(n) = server::raise_descriptor_limit() {
        tracing::debug!(descriptors = n, "open-descriptor limit");
    }
    let limits = server::ServerLimits {
        max_connections: a
            .max_connections
            .map_or_else(server::default_max_connections, |n| n as usize),
        max_active_requests: a.max_active_requests as usize,
        body_timeout: a.body_timeout_secs,
        ..server::ServerLimits::default()
    };
    actix_web::rt::System::new().block_on(async move {
        let srv = server::Server::start_with(handle, &served, &a.listen, limits)
            .map_err(|e| format!("listening on {}: {e}", a.listen))?;
        println!(
            "mstar-engine listening on http://{} (model {shown}, {} layers, d = {}, vocabulary {})",
            srv.addr, config.layers, config.hidden, config.vocab
        );
        let _ = std::io::stdout().flush();
        let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
        let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
        let first = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(
            signal = first,
            grace_secs = grace.as_secs_f64(),
            "shutting down; a second signal stops at once"
        );
        eprintln!(
            "mstar-engine: {first}: shutting down (grace {grace:?}; a second signal stops at once)"
        );
        // A second signal: stop now, with the status of a process killed by it.
        actix_web::rt::spawn(async move {
            let code = tokio::select! {
                _ = term.recv() => 143,
                _ = int.recv() => 130,
            };
            eprintln!("mstar-engine: second signal: stopping at once");
            std::process::exit(code);
        });
        srv.shutdown(grace).await.map_err(|e| e.to_string())
    })?;
    thread
        .join()
        .map_err(|_| "the engine thread panicked".to_owned())??;
    Ok(())
}

/// `export-tokenizer`: the GGUF's tokenizer read without its weights, written as Hugging
/// Face's two files and a `config.json` of the model's shape (what tools read to learn the
/// model's kind and context; no weights are written), each through a temporary file renamed over it (a reader never sees half
/// a file; an interrupted run leaves the previous file).
fn export_tokenizer(a: &ExportTokenizerArgs) -> Result<(), String> {
    use mstar_engine::model::gguf;
    let path = match &a.gguf {
        Some(p) => p.clone(),
        None if a.model == "smollm2" => gguf::smollm2_path()?,
        None => {
            return Err(format!(
                "--model `{}`: only `smollm2` has a tokenizer to export (or give --gguf)",
                a.model
            ))
        }
    };
    let file = gguf::GgufFile::open(&path).map_err(|e| e.to_string())?;
    let tokenizer = file.tokenizer().map_err(|e| e.to_string())?;
    let hf = tokenizer
        .hugging_face(file.config.max_positions)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let c = file.config;
    let config_json = serde_json::to_string_pretty(&serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden,
        "intermediate_size": c.ffn,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "max_position_embeddings": c.max_positions,
        "rms_norm_eps": c.eps as f32,
        "rope_theta": c.rope_theta,
        "vocab_size": c.vocab,
        "bos_token_id": tokenizer.bos(),
        "eos_token_id": tokenizer.eos(),
        "tie_word_embeddings": file.tied_head(),
    }))
    .map_err(|e| format!("config.json: {e}"))?;
    let shown = a.out.display();
    if a.out.exists() && !a.out.is_dir() {
        return Err(format!("--out {shown}: exists and is not a directory"));
    }
    std::fs::create_dir_all(&a.out).map_err(|e| format!("--out {shown}: {e}"))?;
    for (name, body) in [
        ("config.json", &config_json),
        ("tokenizer.json", &hf.tokenizer_json),
        ("tokenizer_config.json", &hf.tokenizer_config_json),
    ] {
        let target = a.out.join(name);
        files::check_output(&target, "--out", &[("--gguf", &path)])?;
        let tmp = a.out.join(format!(".{name}.{}.tmp", std::process::id()));
        let written = std::fs::write(&tmp, body).and_then(|()| std::fs::rename(&tmp, &target));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(format!("--out {}: {e}", target.display()));
        }
    }
    println!("{}", a.out.display());
    Ok(())
}

/// Logs to stderr, as the component's binary does: `RUST_LOG` when set (a bad filter is said,
/// and `info` used), else `info`; colour only at a terminal without `NO_COLOR`.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let env = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty());
    let (filter, bad) = match env.as_deref().map(|v| EnvFilter::builder().parse(v)) {
        Some(Ok(f)) => (f, None),
        Some(Err(e)) => (EnvFilter::new("info"), Some(e)),
        None => (EnvFilter::new("info"), None),
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .try_init();
    if let (Ok(()), Some(e)) = (installed, bad) {
        tracing::warn!(error = %e, "RUST_LOG is not a valid filter; logging at info");
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let r = match cli.cmd {
        Cmd::Serve(a) => serve(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::ExportTokenizer(a) => export_tokenizer(&a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mstar-engine: {e}");
            ExitCode::FAILURE
        }
    }
}
