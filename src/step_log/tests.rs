//! The step log's line, key by key, and its two files.

use std::sync::Arc;

use super::*;
use crate::latency::ModelSource;
use crate::overrun::{Overrun, OverrunReason, StepTokens, TimeOverrunReason};
use crate::range::ChunkRange;

fn name(s: &str) -> Name {
    Name::from(s)
}

/// A step on the combined walk `mixed`: a decode row, a first chunk after a cached prefix and
/// a later chunk that is its prompt's last.
fn batch() -> Batch {
    let row = |rid, walk, work, context| BatchRow {
        rid,
        walk,
        work,
        context,
        input: None,
    };
    Batch {
        step: 7,
        node: name("llm"),
        walk: name("mixed"),
        walks: Arc::from([name("mixed"), name("prefill"), name("decode")]),
        budget: Some(64),
        floor: Some(16),
        caps: Some(Arc::from([(name("prefill"), 48), (name("decode"), 16)])),
        rows: vec![
            row(3, 2, RowWork::Continue { estimate: 1 }, 40),
            row(
                5,
                1,
                RowWork::Chunk {
                    range: ChunkRange {
                        start: 16,
                        end: 48,
                        total: 100,
                        stride: 48,
                    },
                    cached: 16,
                },
                0,
            ),
            row(
                6,
                1,
                RowWork::Chunk {
                    range: ChunkRange {
                        start: 80,
                        end: 90,
                        total: 90,
                        stride: 10,
                    },
                    cached: 0,
                },
                0,
            ),
        ],
        scheduled_tokens: 43,
        uncut_over_budget: false,
        waiting: 2,
        max_step_ms: Some(50.0),
        predicted_ms: Some(12.0),
    }
}

fn outcome() -> StepOutcome {
    StepOutcome {
        step: 7,
        node: name("llm"),
        walk: name("mixed"),
        tokens: StepTokens {
            ran: 70,
            ..StepTokens::default()
        },
        overrun: Some(Overrun {
            node: name("llm"),
            walk: name("mixed"),
            budget: 64,
            tokens: 70,
            reason: OverrunReason::Other,
        }),
        finished: Vec::new(),
        chunks: 2,
        final_chunks: 1,
        unrun_chunks: 0,
        measured_ms: Some(99.0),
        predicted_ms: Some(12.34567),
        max_step_ms: Some(50.0),
        time_margin: Some(0.9),
        time_overrun: Some(TimeOverrunReason::Misprediction),
        time_inactive: None,
        model: (None, ModelSource::None),
    }
}

fn text<X: Extras>(line: &StepLine<'_, X>) -> String {
    let mut out = Vec::new();
    line.write_to(&mut out).unwrap();
    String::from_utf8(out).unwrap()
}

const ROWS: &str = r#""rows":[{"rid":3,"walk":"decode","kind":"continue","tokens":1,"context":41},{"rid":5,"walk":"prefill","kind":"chunk","tokens":32,"start":16,"end":48,"total":100,"stride":48,"final":false,"cached":16},{"rid":6,"walk":"prefill","kind":"chunk","tokens":10,"start":80,"end":90,"total":90,"stride":10,"final":true}]"#;

#[test]
fn a_line_has_every_key_in_order_with_times_to_the_microsecond() {
    let (b, o) = (batch(), outcome());
    let line = StepLine::new(&b, &o, 1_234.567_89, Some(2.000_49), &[41, 0, 0]);
    let head = r#"{"step":7,"t_ms":1234.568,"node":"llm","walk":"mixed","budget":64,"floor":16,"caps":{"prefill":48,"decode":16},"#;
    let tail = r#","scheduled_tokens":43,"ran_tokens":70,"overrun":{"reason":"other"},"waiting":2,"ms":2.0,"predicted_ms":12.346,"max_step_ms":50.0,"time_overrun":{"reason":"misprediction"}}"#;
    assert_eq!(text(&line), format!("{head}{ROWS}{tail}\n"));
    // The time margin, when asked for, after `max_step_ms`.
    let with = text(&line.with_time_margin());
    assert!(
        with.contains(r#""max_step_ms":50.0,"time_margin":0.9,"time_overrun""#),
        "{with}"
    );
}

#[test]
fn absent_values_are_null_and_a_row_without_a_context_shows_the_batchs() {
    let mut b = batch();
    b.budget = None;
    b.floor = None;
    b.caps = None;
    let mut o = outcome();
    o.overrun = None;
    o.predicted_ms = None;
    o.max_step_ms = None;
    o.time_margin = None;
    o.time_overrun = None;
    let s = text(&StepLine::new(&b, &o, 0.0, None, &[]).with_time_margin());
    for want in [
        r#""budget":null,"floor":null,"caps":null,"#,
        r#""kind":"continue","tokens":1,"context":40}"#,
        r#""overrun":null,"#,
        r#""ms":null,"predicted_ms":null,"max_step_ms":null,"time_margin":null,"time_overrun":null}"#,
    ] {
        assert!(s.contains(want), "{want} in {s}");
    }
}

struct Keys;

impl Extras for Keys {
    fn after_step<M: SerializeMap>(&self, m: &mut M) -> Result<(), M::Error> {
        m.serialize_entry("worker", &1)
    }

    fn at_end<M: SerializeMap>(&self, m: &mut M) -> Result<(), M::Error> {
        m.serialize_entry("kv", &2)
    }
}

#[test]
fn a_writers_keys_go_after_step_and_at_the_end() {
    let (b, o) = (batch(), outcome());
    let s = text(&StepLine::new(&b, &o, 1.0, Some(1.0), &[]).with_extras(Keys));
    assert!(s.starts_with(r#"{"step":7,"worker":1,"t_ms":1.0,"#), "{s}");
    assert!(
        s.ends_with("\"time_overrun\":{\"reason\":\"misprediction\"},\"kv\":2}\n"),
        "{s}"
    );
}

fn lines(n: usize) -> String {
    let (b, o) = (batch(), outcome());
    text(&StepLine::new(&b, &o, 1.0, Some(1.0), &[])).repeat(n)
}

fn write_lines(log: &mut StepLogFile, n: usize) {
    let (b, o) = (batch(), outcome());
    for _ in 0..n {
        log.write(&StepLine::new(&b, &o, 1.0, Some(1.0), &[]))
            .unwrap();
    }
}

/// The files in `dir`, by name.
fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn an_atomic_log_replaces_its_path_only_when_finished() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("steps.jsonl");
    std::fs::write(&path, "before\n").unwrap();
    let mut log = StepLogFile::create(&path).unwrap();
    assert_eq!(log.path(), path);
    write_lines(&mut log, 3);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "before\n");
    log.finish().unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), lines(3));
    assert_eq!(files(dir.path()), ["steps.jsonl"]);

    // Dropped unfinished: the path as it was, no temporary file left.
    let mut log = StepLogFile::create(&path).unwrap();
    write_lines(&mut log, 1);
    assert_eq!(files(dir.path()).len(), 2);
    drop(log);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), lines(3));
    assert_eq!(files(dir.path()), ["steps.jsonl"]);
}

#[test]
fn a_live_log_is_its_path_from_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("steps.jsonl");
    std::fs::write(&path, "before\n").unwrap();
    let mut log = StepLogFile::create_live(&path).unwrap();
    assert_eq!(log.path(), path);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
    write_lines(&mut log, 2);
    log.finish().unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), lines(2));
    assert_eq!(files(dir.path()), ["steps.jsonl"]);
}

#[test]
fn a_live_log_that_cannot_be_flushed_fails_when_finished() {
    let Ok(mut log) = StepLogFile::create_live(Path::new("/dev/full")) else {
        return; // no /dev/full here
    };
    write_lines(&mut log, 1);
    assert!(log.finish().is_err());
}

#[test]
fn an_atomic_file_flushes_to_its_temporary_file_and_cleans_up_a_failed_rename() {
    let dir = tempfile::tempdir().unwrap();
    // Its path is a directory that is not empty: the rename fails.
    let path = dir.path().join("out");
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("kept"), "").unwrap();
    let mut f = AtomicFile::create(&path).unwrap();
    f.write_all(b"abc").unwrap();
    f.flush().unwrap();
    assert_eq!(std::fs::read(&f.tmp).unwrap(), b"abc");
    assert!(f.commit().is_err());
    assert_eq!(files(dir.path()), ["out"]);
    assert!(path.join("kept").exists());

    let e = AtomicFile::create(Path::new("/")).err().unwrap();
    assert!(e.to_string().contains("names no file"), "{e}");
}
