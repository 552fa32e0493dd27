//! Tests of `fleet_axis.rs`: the fleet lists, a fleet's settings and the fewest workers.

use super::*;
use crate::sweep::axis::{combined_csv, write_files};
use crate::sweep::output::to_csv;
use crate::sweep::tests::options;
use crate::sweep::{run_sweep, Slo};

#[test]
fn fleet_sizes_parse_ascending_and_routers_in_the_order_given() {
    assert_eq!(parse_workers("1, 2,4,8").unwrap(), [1, 2, 4, 8]);
    let cases = [
        ("0", "from 1 to 256"),
        ("257", "from 1 to 256"),
        ("two", "\"two\""),
        ("4,2", "got 2 after 4"),
        ("2,2", "got 2 after 2"),
        ("1,", "without empty entries"),
    ];
    crate::sweep::grid::assert_refused("--workers", parse_workers, &cases);
    assert_eq!(
        parse_routers("prefix_affinity,round_robin").unwrap(),
        [RouterKind::PrefixAffinity, RouterKind::RoundRobin]
    );
    let e = parse_routers("random").unwrap_err().to_string();
    assert!(
        e.starts_with("`--routers` unknown router \"random\""),
        "{e}"
    );
    assert!(parse_routers("least_kv,least_kv")
        .unwrap_err()
        .to_string()
        .contains("names least_kv twice"));
}

#[test]
fn a_fleet_overrides_the_configs_and_names_its_directory() {
    let mut s = Settings::default();
    s.replay.fleet.workers = 3;
    let (out, label) = with_fleet(&s, RouterKind::LeastKv, 8);
    assert_eq!(
        (out.replay.fleet.workers, out.replay.fleet.router.as_str()),
        (8, "least_kv")
    );
    assert_eq!(label, "8 workers behind least_kv (--workers, --routers)");
    assert_eq!(
        dir_name(RouterKind::PrefixAffinity, 4),
        "fleet-prefix_affinity-4"
    );
}

#[test]
fn fleets_run_per_router_in_the_order_given_then_sizes_ascending() {
    let config = Fleet {
        router: RouterKind::LeastKv,
        workers: 3,
    };
    let fleets = |w, r| {
        parse_fleets(w, r, config).unwrap().map(|v| {
            v.iter()
                .map(|f| FleetAxis::dir_name(*f))
                .collect::<Vec<_>>()
        })
    };
    assert_eq!(fleets(None, None), None);
    assert_eq!(
        fleets(Some("1,4"), Some("round_robin,least_kv")).unwrap(),
        [
            "fleet-round_robin-1",
            "fleet-round_robin-4",
            "fleet-least_kv-1",
            "fleet-least_kv-4"
        ]
    );
    assert_eq!(fleets(Some("2"), None).unwrap(), ["fleet-least_kv-2"]);
    assert_eq!(
        fleets(None, Some("prefix_affinity")).unwrap(),
        ["fleet-prefix_affinity-3"]
    );
    let e = parse_fleets(Some("2"), Some("nope"), config).unwrap_err();
    assert_eq!(e.flag, "--routers");
}

/// A fake fleet: latency falls as workers share the load (rate / workers), more slowly
/// behind round robin than behind least outstanding.
fn run(router: RouterKind, workers: u32) -> FleetRun {
    let slo = Slo::new(Some(60.0), Some(5000.0)).unwrap();
    let share = match router {
        RouterKind::RoundRobin => 1.0,
        _ => 0.8,
    };
    let sweep = run_sweep(&options(Some(slo)), |b, r| {
        crate::sweep::tests::fake(b, r * share / f64::from(workers))
    })
    .unwrap();
    FleetRun {
        value: Fleet { router, workers },
        sweep,
    }
}

#[test]
fn the_fewest_workers_are_the_smallest_fleet_whose_cell_meets_the_objective() {
    let mut runs = Vec::new();
    for router in [RouterKind::RoundRobin, RouterKind::LeastOutstanding] {
        for n in [1, 2, 4] {
            runs.push(run(router, n));
        }
    }
    let cmp = FleetComparison::of(&runs);
    assert_eq!(cmp.routers, ["round_robin", "least_outstanding"]);
    assert_eq!(cmp.workers, [1, 2, 4]);
    // 2 routers × 3 budgets × 3 rates.
    assert_eq!(cmp.fewest.len(), 18);
    for row in &cmp.fewest {
        let mine: Vec<&FleetRun> = runs
            .iter()
            .filter(|r| r.value.router.as_str() == row.router)
            .collect();
        let meets = |n: u32| {
            mine.iter()
                .find(|r| r.value.workers == n)
                .and_then(|r| r.sweep.cell(row.budget, row.rate_scale))
                .and_then(|c| c.meets_slo)
                == Some(true)
        };
        match row.fewest_workers {
            Some(n) => {
                assert!(meets(n), "{row:?}");
                assert!([1, 2, 4].iter().filter(|&&m| m < n).all(|&m| !meets(m)));
            }
            None => assert!([1, 2, 4].iter().all(|&m| !meets(m)), "{row:?}"),
        }
    }
    // Least outstanding spreads better, so it never needs more workers.
    for (rr, lo) in cmp.fewest[..9].iter().zip(&cmp.fewest[9..]) {
        assert!(
            lo.fewest_workers.unwrap_or(u32::MAX) <= rr.fewest_workers.unwrap_or(u32::MAX),
            "{rr:?} vs {lo:?}"
        );
    }
    // Some rate needs more than one worker, and somewhere the fleet sizes make a difference.
    assert!(cmp.fewest.iter().any(|r| r.fewest_workers > Some(1)));
    assert_eq!(cmp.capacity.len(), 2 * 3 * 3);
    let table = cmp.table();
    assert!(table.contains("fewest workers"), "{table}");
    let csv = String::from_utf8(cmp.to_csv().unwrap()).unwrap();
    assert!(csv.starts_with("router,budget,rate_scale,fewest_workers,ttft_p90_ms,tbt_p99_ms\n"));
    assert_eq!(csv.lines().count(), 19);
    let dir = tempfile::tempdir().unwrap();
    let paths = write_files(dir.path(), &FleetAxis::compare(&runs).unwrap().files).unwrap();
    let names = crate::sweep::tests::names(&paths);
    assert_eq!(
        names,
        [
            "sweep.csv",
            "fleet.csv",
            "fleet.json",
            "fleet.svg",
            "fleet.png"
        ]
    );
    let svg = std::fs::read_to_string(dir.path().join(FLEET_SVG)).unwrap();
    for router in ["round_robin", "least_outstanding"] {
        assert!(svg.contains(&format!("{router}, budget 512")), "{router}");
    }
    let png = std::fs::read(dir.path().join(FLEET_PNG)).unwrap();
    assert_eq!(png[..4], [0x89, b'P', b'N', b'G']);
}

#[test]
fn the_combined_csv_is_each_runs_csv_with_router_and_workers_first() {
    let runs = [
        run(RouterKind::RoundRobin, 1),
        run(RouterKind::PrefixAffinity, 2),
    ];
    let all = String::from_utf8(combined_csv::<FleetAxis>(&runs).unwrap()).unwrap();
    let one = String::from_utf8(to_csv(&runs[0].sweep).unwrap()).unwrap();
    let header = one.lines().next().unwrap();
    assert_eq!(
        all.lines().next().unwrap(),
        format!("router,workers,{header}")
    );
    for (a, b) in all.lines().skip(1).zip(one.lines().skip(1)) {
        assert_eq!(a, format!("round_robin,1,{b}"));
    }
    assert!(all
        .lines()
        .last()
        .unwrap()
        .starts_with("prefix_affinity,2,"));
    // Without an objective there is nothing to find.
    let plain = run_sweep(&options(None), crate::sweep::tests::fake).unwrap();
    let cmp = FleetComparison::of(&[FleetRun {
        value: Fleet {
            router: RouterKind::RoundRobin,
            workers: 1,
        },
        sweep: plain,
    }]);
    assert!(cmp.fewest.is_empty() && cmp.capacity.is_empty());
}
