//! The engine's `/metrics`: every series the component and the engine describe is there from
//! the first scrape (its own test binary, so no other test has recorded anything first), and
//! `engine/README.md`'s metric table lists exactly the engine's metrics.

use std::collections::BTreeSet;
use std::time::Duration;

use candle_core::Device;
use mstar_chunking::latency::LatencyModel;
use mstar_engine::engine::{self, EngineSettings};
use mstar_engine::model::{Config, Model};
use mstar_engine::server::Server;

/// With a time budget, a latency model and a margin, so the time series exist too.
fn timed() -> EngineSettings {
    EngineSettings {
        max_step_ms: Some(50.0),
        cost: Some(LatencyModel::try_new(2.0, 0.1, 0.0, 0.0).unwrap()),
        learn_cost: true,
        time_margin: Some(0.95),
        ..EngineSettings::default()
    }
}

#[actix_web::test]
async fn every_described_series_is_on_the_first_scrape() {
    let model = Model::random(Config::tiny(), 5, &Device::Cpu).unwrap();
    let (handle, thread) = engine::start(model, timed()).unwrap();
    let srv = Server::start(handle, "tiny", "127.0.0.1:0").unwrap();
    let text = reqwest::get(format!("http://{}/metrics", srv.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut missing = Vec::new();
    for name in mstar_chunking::metrics::ALL
        .iter()
        .chain(mstar_engine::metrics::ALL.iter())
    {
        let described = text.contains(&format!("# HELP {name} "));
        let sampled = text.lines().any(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{', '_']))
        });
        if !(described && sampled) {
            missing.push(*name);
        }
    }
    assert!(
        missing.is_empty(),
        "missing from /metrics: {missing:?}\n{text}"
    );
    for name in [
        "mstar_chunking_prepared_inputs",
        "mstar_chunking_rows_waiting",
        "mstar_chunking_time_overruns_total",
        "mstar_chunking_latency_model_coefficient",
    ] {
        assert!(text.contains(name), "{name}:\n{text}");
    }
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// The metric table of `engine/README.md` (rows whose first cell is a backquoted `engine_`
/// name) names exactly [`mstar_engine::metrics::ALL`].
#[test]
fn the_readme_metric_table_and_the_code_agree() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let table: BTreeSet<String> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `engine_"))
        .filter_map(|rest| rest.split('`').next())
        .map(|n| format!("engine_{n}"))
        .collect();
    let code: BTreeSet<String> = mstar_engine::metrics::ALL
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(table, code, "README metric table against metrics::ALL");
}
