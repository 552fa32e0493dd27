use super::*;
use crate::policy::Name;

fn prompt(seq: u64, total: u32) -> PrefillRow {
    PrefillRow {
        seq,
        rid: seq,
        walk: Name::from("prefill"),
        total,
        cached: 0,
        progress: 0,
        started: false,
        priority: 0,
        arrival_ms: None,
        admitted_step: 0,
        wait_from_step: 0,
        wait_from_ms: None,
    }
}

fn ranked(order: NodeOrder, clock: StepClock, rows: &[PrefillRow]) -> Vec<u64> {
    let mut out = vec![99];
    rank(order, clock, rows, &mut out);
    out.iter().map(|&i| rows[i as usize].seq).collect()
}

fn by(order: Order) -> NodeOrder {
    NodeOrder {
        order,
        bound: WaitBound::default(),
    }
}

#[test]
fn every_order_reads_back_from_its_name_and_an_unknown_one_is_refused_by_name() {
    for o in Order::ALL {
        assert_eq!(o.as_str().parse::<Order>(), Ok(o));
        assert_eq!(format!(" {o} ").parse::<Order>(), Ok(o), "trimmed");
        assert_eq!(o.to_string(), o.as_str());
        assert_eq!(o.is_fcfs(), o == Order::Fcfs);
    }
    assert_eq!(Order::default(), Order::Fcfs);
    let e = "lpm".parse::<Order>().unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown order \"lpm\": expected one of fcfs, priority, shortest_first, longest_prefix"
    );
    let long = "x".repeat(100);
    assert_eq!(long.parse::<Order>().unwrap_err().value.len(), 64);
    assert!("FCFS".parse::<Order>().is_err(), "names are exact");
}

#[test]
fn admit_options_default_to_plain_admission() {
    let o = AdmitOptions::cached(7);
    assert_eq!(
        (o.cached, o.priority, o.arrival_ms),
        (7, 0, None),
        "only the cached prefix"
    );
    assert_eq!(AdmitOptions::default(), AdmitOptions::cached(0));
}

#[test]
fn a_wait_counts_steps_since_admission_and_ms_only_when_both_times_are_known() {
    let mut r = prompt(1, 10);
    r.admitted_step = 3;
    let at = |step, now_ms| StepClock { step, now_ms };
    assert_eq!(Wait::of(&r, at(10, Some(5.0))), Wait { steps: 7, ms: None });
    assert_eq!(Wait::of(&r, at(2, None)).steps, 0, "never below 0 steps");
    r.arrival_ms = Some(100.0);
    assert_eq!(Wait::of(&r, at(3, None)).ms, None, "no step time");
    assert_eq!(Wait::of(&r, at(3, Some(250.5))).ms, Some(150.5));
    assert_eq!(
        Wait::of(&r, at(3, Some(40.0))).ms,
        Some(0.0),
        "a step before the arrival"
    );
}

#[test]
fn a_prompt_is_starved_at_the_bound_exactly_and_not_a_step_or_ms_before() {
    let ms = WaitBound {
        max_wait_ms: Some(500.0),
        max_wait_steps: None,
    };
    let wait = |steps, ms| Wait { steps, ms };
    assert!(ms.starved(wait(0, Some(500.0))));
    assert!(!ms.starved(wait(0, Some(499.999))));
    assert!(ms.starved(wait(0, Some(501.0))));
    assert!(
        !ms.starved(wait(u64::MAX, None)),
        "no times: the ms bound cannot apply"
    );
    let steps = WaitBound {
        max_wait_ms: None,
        max_wait_steps: Some(4),
    };
    assert!(steps.starved(wait(4, None)));
    assert!(steps.starved(wait(5, None)));
    assert!(!steps.starved(wait(3, Some(1e12))));
    let both = WaitBound {
        max_wait_ms: Some(500.0),
        max_wait_steps: Some(4),
    };
    assert!(both.starved(wait(4, Some(0.0))), "steps reached first");
    assert!(both.starved(wait(0, Some(500.0))), "ms reached first");
    assert!(!both.starved(wait(3, Some(499.0))));
    assert!(!WaitBound::default().starved(wait(u64::MAX, Some(f64::MAX))));
    assert!(WaitBound::default().is_off());
    assert!(!ms.is_off() && !steps.is_off() && !both.is_off());
}

#[test]
fn mid_prefill_rows_come_first_in_admission_order_under_every_order() {
    let mut rows: Vec<PrefillRow> = (1..=5).map(|s| prompt(s, 100 - s as u32)).collect();
    rows[1].started = true;
    rows[3].started = true;
    rows[3].priority = -5;
    rows[1].priority = 5;
    for o in Order::ALL {
        let seqs = ranked(by(o), StepClock::default(), &rows);
        assert_eq!(&seqs[..2], &[2, 4], "{o}");
        assert_eq!(seqs.len(), 5, "{o}: every row once");
    }
}

#[test]
fn each_order_ranks_the_waiting_prompts_by_its_key_ties_by_admission() {
    let mut rows: Vec<PrefillRow> = (1..=5).map(|s| prompt(s, 100)).collect();
    // priority: 3, 1, 2, 1, 0; remaining: 100, 40, 70, 40, 90; cached: 0, 60, 30, 60, 10.
    for (r, (p, cached)) in rows
        .iter_mut()
        .zip([(3, 0), (1, 60), (2, 30), (1, 60), (0, 10)])
    {
        r.priority = p;
        r.cached = cached;
        r.progress = cached;
    }
    let clock = StepClock::default();
    assert_eq!(ranked(by(Order::Fcfs), clock, &rows), [1, 2, 3, 4, 5]);
    assert_eq!(ranked(by(Order::Priority), clock, &rows), [5, 2, 4, 3, 1]);
    assert_eq!(
        ranked(by(Order::ShortestFirst), clock, &rows),
        [2, 4, 3, 5, 1]
    );
    assert_eq!(
        ranked(by(Order::LongestPrefix), clock, &rows),
        [2, 4, 3, 5, 1]
    );
    // Negative priorities go before 0, and `i32`'s extremes order as numbers.
    rows[0].priority = i32::MIN;
    rows[2].priority = i32::MAX;
    assert_eq!(ranked(by(Order::Priority), clock, &rows), [1, 5, 2, 4, 3]);
    // Shortest first counts what is left to run, not the total.
    rows[0].total = 20;
    rows[0].progress = 0;
    assert_eq!(ranked(by(Order::ShortestFirst), clock, &rows)[0], 1);
}

#[test]
fn starved_prompts_go_first_oldest_first_from_the_bound_on() {
    // Shortest first would take 3, then 2, then 1: the long prompt 1 waits behind them.
    let rows = [prompt(1, 900), prompt(2, 50), prompt(3, 10)];
    let steps = NodeOrder {
        order: Order::ShortestFirst,
        bound: WaitBound {
            max_wait_ms: None,
            max_wait_steps: Some(3),
        },
    };
    let at = |step| StepClock { step, now_ms: None };
    assert_eq!(
        ranked(steps, at(2), &rows),
        [3, 2, 1],
        "a step before the bound"
    );
    assert_eq!(
        ranked(steps, at(3), &rows),
        [1, 2, 3],
        "all starved: oldest first"
    );
    // By ms, only the prompts whose wait reached the bound are promoted.
    let mut rows = rows;
    rows[0].arrival_ms = Some(0.0);
    rows[1].arrival_ms = Some(100.0);
    rows[2].arrival_ms = Some(200.0);
    let ms = NodeOrder {
        order: Order::ShortestFirst,
        bound: WaitBound {
            max_wait_ms: Some(250.0),
            max_wait_steps: None,
        },
    };
    let now = |now_ms| StepClock {
        step: 0,
        now_ms: Some(now_ms),
    };
    assert_eq!(ranked(ms, now(249.0), &rows), [3, 2, 1]);
    assert_eq!(
        ranked(ms, now(250.0), &rows),
        [1, 3, 2],
        "1 waited 250 ms exactly"
    );
    assert_eq!(
        ranked(ms, now(350.0), &rows),
        [1, 2, 3],
        "1 and 2 starved, by admission"
    );
}

#[test]
fn the_head_is_the_earliest_admitted_prompt_that_has_not_started() {
    let mut rows = [prompt(1, 10), prompt(2, 10), prompt(3, 10)];
    rows[0].started = true;
    rows[1].admitted_step = 2;
    rows[1].arrival_ms = Some(10.0);
    let clock = StepClock {
        step: 5,
        now_ms: Some(30.0),
    };
    assert_eq!(
        head_wait(&rows, clock),
        Some(Wait {
            steps: 3,
            ms: Some(20.0)
        })
    );
    for r in &mut rows {
        r.started = true;
    }
    assert_eq!(head_wait(&rows, clock), None);
    assert_eq!(head_wait(&[], clock), None);
}
