//! A step you can follow (`docs/monitoring.md#tracing`): every event of one step, from its
//! assembly to its completion, is recorded in a `step` span with the model, node, walk and step
//! id, and a request's events in a `request` span with its rid. The events are captured by a
//! layer of our own over the subscriber registry, installed for this thread only (the test is
//! a binary of its own: see `Cargo.toml`).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use mstar_chunking::{
    BudgetSettings, ChunkingError, ChunkingManagement, ChunkingPolicy, PreparedInput, RowWork,
    SubmoduleCaps,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// Field name -> value, as `Debug` prints it (strings without quotes).
#[derive(Debug, Clone, Default, PartialEq)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

/// One event: its fields (`message` among them) and the spans it is in, outermost first.
#[derive(Debug, Clone)]
struct Captured {
    fields: Fields,
    spans: Vec<(String, Fields)>,
}

impl Captured {
    fn message(&self) -> &str {
        self.fields.0.get("message").map_or("", String::as_str)
    }

    /// The fields of the span named `name` this event is in.
    fn span(&self, name: &str) -> Option<&Fields> {
        self.spans.iter().find(|(n, _)| n == name).map(|(_, f)| f)
    }
}

/// Keeps every event with the fields of the spans it is in.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Captured>>>);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let spans = ctx
            .event_scope(event)
            .map(|scope| {
                scope
                    .from_root()
                    .map(|s| {
                        let f = s.extensions().get::<Fields>().cloned().unwrap_or_default();
                        (s.name().to_owned(), f)
                    })
                    .collect()
            })
            .unwrap_or_default();
        self.0.lock().unwrap().push(Captured { fields, spans });
    }
}

fn tokens(n: u32) -> PreparedInput {
    PreparedInput::tokens((0..n).collect::<Vec<u32>>())
}

#[actix::test]
async fn every_event_of_a_step_carries_the_step_span_and_a_request_its_rid() {
    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry()
        .with(capture.clone())
        .with(tracing_subscriber::filter::LevelFilter::DEBUG);
    // This thread only: the actors run on the test's arbiter.
    let _guard = tracing::subscriber::set_default(subscriber);

    let cm = ChunkingManagement::start("traced", [("llm", SubmoduleCaps::new(["prefill"], false))])
        .unwrap();
    cm.set_policies([
        (("llm", "prefill"), ChunkingPolicy::budget(64)),
        (("llm", "decode"), ChunkingPolicy::budget(4)),
    ])
    .await
    .unwrap();
    cm.set_budgets(BudgetSettings::new(["prefill", "decode"]))
        .await
        .unwrap();
    // Request 6 is admitted and forgotten before any step; request 7 decodes.
    cm.admit(6, "llm", "prefill", tokens(100), 0).await.unwrap();
    cm.forget_request(6).await.unwrap();
    cm.continue_row(7, "llm", "decode", 1).await.unwrap();
    let batch = cm.assemble("llm", "decode").await.unwrap();
    assert!(matches!(batch.rows[0].work, RowWork::Continue { .. }));
    // A refused completion (one entry too many), then the row runs 10 tokens against a budget
    // of 4: an overrun.
    let refused = cm.complete(batch.step, vec![1, 1], None).await.unwrap_err();
    assert!(
        matches!(refused, ChunkingError::RanLengthMismatch { .. }),
        "{refused}"
    );
    let outcome = cm.complete(batch.step, vec![10], None).await.unwrap();
    assert!(outcome.overrun.is_some());
    // Asked after the completion: OverrunAccounting has recorded (and warned about) it.
    assert_eq!(cm.overrun_count("llm", "decode", None).await.unwrap(), 1);
    cm.forget_request(7).await.unwrap();

    let events = capture.0.lock().unwrap().clone();
    let step = batch.step.to_string();
    let of_step: Vec<&Captured> = events
        .iter()
        .filter(|e| {
            e.span("step")
                .is_some_and(|f| f.0.get("step") == Some(&step))
        })
        .collect();
    let messages: Vec<&str> = of_step.iter().map(|e| e.message()).collect();
    for want in [
        "step assembled",
        "step completion refused",
        "step completed",
    ] {
        assert!(messages.contains(&want), "{want:?} not in {messages:?}");
    }
    assert!(
        messages
            .iter()
            .any(|m| m.contains("tokens over its budget")),
        "the overrun warning is not in the step's span: {messages:?}"
    );
    for e in &of_step {
        let f = &e.span("step").unwrap().0;
        let got: Vec<&str> = ["model", "node", "walk", "step"]
            .iter()
            .map(|k| f.get(*k).map_or("", String::as_str))
            .collect();
        assert_eq!(got, ["traced", "llm", "decode", step.as_str()], "{e:?}");
    }
    for rid in ["6", "7"] {
        let of_request: Vec<&str> = events
            .iter()
            .filter(|e| {
                e.span("request")
                    .is_some_and(|f| f.0.get("rid").map(String::as_str) == Some(rid))
            })
            .map(Captured::message)
            .collect();
        assert_eq!(
            of_request,
            ["request admitted", "request forgotten"],
            "rid {rid}"
        );
    }
}
