//! What a replay's fleet is, checked from `[replay.fleet]`: the workers, the router and, for a
//! disaggregated fleet, its two pools and the KV link between them. The setup both the fleet
//! loop (`fleet.rs`) and the prefill/decode loop (`disagg.rs`) run, and the settings, the
//! reports and the sweep read; it imports neither loop.

use serde::Serialize;

use super::router::RouterKind;
use crate::config::{FleetSection, ReplaySection};

/// The most workers a fleet replay runs: each keeps its own actors and a record per request of
/// the trace, so memory grows with workers × requests.
pub const MAX_WORKERS: u32 = 256;

/// `[replay.fleet]`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetSetup {
    /// Workers, from 1 to [`MAX_WORKERS`].
    pub workers: u32,
    /// The router's rule.
    pub router: RouterKind,
    /// `prefix_affinity`'s load guard, in outstanding requests.
    pub affinity_slack: u32,
    /// A prefill pool and a decode pool instead of `workers` colocated ones
    /// (`replay.fleet.prefill_workers` and `decode_workers`); `None`: colocated.
    pub disagg: Option<PdSetup>,
}

impl FleetSetup {
    /// Workers in the fleet: `workers`, or both pools of a disaggregated one.
    pub fn size(&self) -> u32 {
        self.disagg.as_ref().map_or(self.workers, |d| d.workers())
    }
}

impl Default for FleetSetup {
    fn default() -> Self {
        Self {
            workers: 1,
            router: RouterKind::RoundRobin,
            affinity_slack: FleetSection::default().affinity_slack,
            disagg: None,
        }
    }
}

/// Checks `[replay.fleet]`: a number of workers from 1 to [`MAX_WORKERS`] and a router's name;
/// each problem goes to `refuse` with its key.
pub fn check_fleet(
    f: &FleetSection,
    refuse: &mut impl FnMut(&'static str, Option<String>, String),
) -> FleetSetup {
    let mut setup = FleetSetup {
        workers: f.workers,
        affinity_slack: f.affinity_slack,
        ..FleetSetup::default()
    };
    if !(1..=MAX_WORKERS).contains(&f.workers) {
        refuse(
            "replay.fleet.workers",
            Some(f.workers.to_string()),
            format!("must be a whole number of workers from 1 to {MAX_WORKERS}"),
        );
        setup.workers = 1;
    }
    match f.router.parse::<RouterKind>() {
        Ok(r) => setup.router = r,
        Err(_) => refuse(
            "replay.fleet.router",
            Some(crate::config::problem::quote(&f.router)),
            format!("is not a router (routers: {})", RouterKind::names()),
        ),
    }
    setup.disagg = check_pd(f, refuse);
    setup
}

/// The fastest KV link, Gbit/s.
pub const MAX_LINK_GBPS: f64 = 1e6;
/// The slowest KV link, Gbit/s (1 Mbit/s): at it a 1,000-token prompt of Llama-2-7B's KV
/// takes about 70 simulated minutes. Slower rates (down to subnormal numbers) would put a
/// transfer's end where the clock cannot add a step's milliseconds.
pub const MIN_LINK_GBPS: f64 = 1e-3;
/// The longest fixed latency of a KV transfer, ms.
pub const MAX_LINK_LATENCY_MS: f64 = 1e6;

/// A disaggregated fleet, checked: its two pools and the KV link between them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdSetup {
    /// Workers that prefill only.
    pub prefill_workers: u32,
    /// Workers that decode only.
    pub decode_workers: u32,
    /// A prefill worker's link, Gbit/s.
    pub kv_link_gbps: f64,
    /// A transfer's fixed latency, ms.
    pub kv_link_latency_ms: f64,
    /// Bytes of KV one prompt token moves.
    pub kv_bytes_per_token: f64,
    /// Where `kv_bytes_per_token` came from.
    pub kv_bytes_source: String,
}

impl PdSetup {
    /// Milliseconds `tokens` tokens of KV occupy the link (the latency left out).
    pub fn wire_ms(&self, tokens: u64) -> f64 {
        let bits = tokens as f64 * self.kv_bytes_per_token * 8.0;
        bits / (self.kv_link_gbps * 1e9) * 1000.0
    }

    /// Workers in both pools.
    pub fn workers(&self) -> u32 {
        self.prefill_workers + self.decode_workers
    }
}

/// Checks the disaggregated part of `[replay.fleet]`: both pools' sizes or neither, each from 1
/// and together at most [`MAX_WORKERS`], `workers` left at 1, and the link's figures. Each
/// problem goes to `refuse` with its key. The KV bytes a token holds are filled in by
/// [`resolve_kv_bytes`].
pub fn check_pd(
    f: &FleetSection,
    refuse: &mut impl FnMut(&'static str, Option<String>, String),
) -> Option<PdSetup> {
    let mut ok = true;
    if !(f.kv_link_gbps.is_finite() && (MIN_LINK_GBPS..=MAX_LINK_GBPS).contains(&f.kv_link_gbps)) {
        refuse(
            "replay.fleet.kv_link_gbps",
            Some(crate::text::float(f.kv_link_gbps)),
            format!("must be a number of Gbit/s above 0, from {MIN_LINK_GBPS:e} (1 Mbit/s) to {MAX_LINK_GBPS:e}"),
        );
        ok = false;
    }
    let latency = f.kv_link_latency_ms;
    if !(latency.is_finite() && (0.0..=MAX_LINK_LATENCY_MS).contains(&latency)) {
        refuse(
            "replay.fleet.kv_link_latency_ms",
            Some(crate::text::float(latency)),
            format!("must be a number of milliseconds from 0 to {MAX_LINK_LATENCY_MS:e}"),
        );
        ok = false;
    }
    let pools = [
        ("replay.fleet.prefill_workers", f.prefill_workers),
        ("replay.fleet.decode_workers", f.decode_workers),
    ];
    for (key, n) in pools {
        if let Some(n) = n.filter(|n| !(1..=MAX_WORKERS).contains(n)) {
            refuse(
                key,
                Some(n.to_string()),
                format!("must be a whole number of workers from 1 to {MAX_WORKERS}: a disaggregated fleet needs both pools"),
            );
            ok = false;
        }
    }
    let (p, d) = match (f.prefill_workers, f.decode_workers) {
        (None, None) => return None,
        (Some(p), Some(d)) => (p, d),
        (given, _) => {
            let (missing, set) = if given.is_some() {
                ("replay.fleet.decode_workers", "prefill_workers")
            } else {
                ("replay.fleet.prefill_workers", "decode_workers")
            };
            refuse(
                missing,
                None,
                format!("is needed with `{set}`: a disaggregated fleet has a prefill pool and a decode pool"),
            );
            return None;
        }
    };
    if ok && p + d > MAX_WORKERS {
        refuse(
            "replay.fleet.prefill_workers",
            Some(p.to_string()),
            format!(
                "and `decode_workers` = {d} make {} workers, more than {MAX_WORKERS}",
                p + d
            ),
        );
        ok = false;
    }
    if f.workers != 1 {
        refuse(
            "replay.fleet.workers",
            Some(f.workers.to_string()),
            format!("sizes a colocated fleet, and `prefill_workers` = {p} and `decode_workers` = {d} make a disaggregated one of {} workers: set one or the other (leave `workers` at 1)", p + d),
        );
        ok = false;
    }
    ok.then(|| PdSetup {
        prefill_workers: p,
        decode_workers: d,
        kv_link_gbps: f.kv_link_gbps,
        kv_link_latency_ms: latency,
        kv_bytes_per_token: 0.0,
        kv_bytes_source: String::new(),
    })
}

/// The KV bytes one token holds, as the KV memory model reads them, and where from: the memory
/// budget's `replay.kv.kv_bytes_per_token`, else `replay.kv.preset`'s model, else
/// `replay.cost`'s preset's model, else Llama-2-7B's (the model every preset describes).
pub fn resolve_kv_bytes(r: &ReplaySection) -> (f64, String) {
    use mstar_chunking::latency::presets;
    if let Some(b) =
        r.kv.kv_bytes_per_token
            .filter(|b| b.is_finite() && *b > 0.0)
    {
        return (b, "replay.kv.kv_bytes_per_token".into());
    }
    if let Some(p) = r.kv.preset.as_deref().and_then(super::kv::memory_preset) {
        return (
            p.budget.kv_bytes_per_token,
            format!("replay.kv.preset {}", p.name),
        );
    }
    if let Some(p) = r.cost.preset.as_deref().and_then(presets::preset) {
        return (
            p.shape.kv_bytes_per_token(),
            format!("replay.cost preset {}", p.name),
        );
    }
    (
        presets::LLAMA2_7B.kv_bytes_per_token(),
        "Llama-2-7B: no KV or cost preset names a model".into(),
    )
}

/// A disaggregated fleet's workers, as the report and the sweep's settings name them.
pub fn label(pd: &PdSetup) -> String {
    format!(
        "{} prefill + {} decode workers",
        pd.prefill_workers, pd.decode_workers
    )
}

#[cfg(test)]
mod fleet_tests {
    use super::*;

    /// A refused setting: its key, its value and why.
    type Problem = (&'static str, Option<String>, String);

    fn checked(f: &FleetSection) -> (FleetSetup, Vec<Problem>) {
        let mut problems = Vec::new();
        let setup = check_fleet(f, &mut |k, v, r| problems.push((k, v, r)));
        (setup, problems)
    }

    #[test]
    fn the_default_section_is_one_worker_behind_round_robin() {
        let (setup, problems) = checked(&FleetSection::default());
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(setup, FleetSetup::default());
        assert_eq!(setup.workers, 1);
    }

    #[test]
    fn workers_and_router_are_refused_at_their_keys() {
        let (_, p) = checked(&FleetSection {
            workers: 0,
            router: "random".into(),
            affinity_slack: 8,
            ..FleetSection::default()
        });
        assert_eq!(p.len(), 2, "{p:?}");
        assert_eq!(p[0].0, "replay.fleet.workers");
        assert_eq!(p[0].1.as_deref(), Some("0"));
        assert!(p[0].2.contains("from 1 to 256"), "{p:?}");
        assert_eq!(p[1].0, "replay.fleet.router");
        assert_eq!(p[1].1.as_deref(), Some("\"random\""));
        assert!(
            p[1].2
                .contains("round_robin, least_outstanding, least_kv, prefix_affinity"),
            "{p:?}"
        );
        let (_, p) = checked(&FleetSection {
            workers: MAX_WORKERS + 1,
            ..FleetSection::default()
        });
        assert_eq!(p.len(), 1, "{p:?}");
        let (s, p) = checked(&FleetSection {
            workers: MAX_WORKERS,
            router: "prefix_affinity".into(),
            affinity_slack: 0,
            ..FleetSection::default()
        });
        assert!(p.is_empty());
        assert_eq!(
            (s.workers, s.router, s.affinity_slack),
            (256, RouterKind::PrefixAffinity, 0)
        );
    }
}

#[cfg(test)]
mod pd_tests {
    use super::*;

    type Problem = (&'static str, Option<String>, String);

    fn checked(f: &FleetSection) -> (Option<PdSetup>, Vec<Problem>) {
        let mut problems = Vec::new();
        let setup = check_pd(f, &mut |k, v, r| problems.push((k, v, r)));
        (setup, problems)
    }

    fn pools(p: Option<u32>, d: Option<u32>) -> FleetSection {
        FleetSection {
            prefill_workers: p,
            decode_workers: d,
            ..FleetSection::default()
        }
    }

    #[test]
    fn without_pools_the_fleet_is_colocated() {
        let (s, p) = checked(&FleetSection::default());
        assert!(s.is_none() && p.is_empty(), "{p:?}");
    }

    #[test]
    fn both_pools_make_a_disaggregated_fleet_with_the_link() {
        let (s, p) = checked(&FleetSection {
            kv_link_gbps: 50.0,
            kv_link_latency_ms: 0.0,
            ..pools(Some(2), Some(3))
        });
        assert!(p.is_empty(), "{p:?}");
        let s = s.unwrap();
        assert_eq!(
            (s.prefill_workers, s.decode_workers, s.workers()),
            (2, 3, 5)
        );
        assert_eq!((s.kv_link_gbps, s.kv_link_latency_ms), (50.0, 0.0));
        let (s, p) = checked(&pools(Some(128), Some(128)));
        assert!(p.is_empty() && s.is_some(), "{p:?}");
    }

    #[test]
    fn bad_pools_and_links_are_refused_at_their_keys() {
        for (f, key, why) in [
            (
                pools(Some(0), Some(1)),
                "replay.fleet.prefill_workers",
                "from 1 to 256",
            ),
            (
                pools(Some(1), Some(0)),
                "replay.fleet.decode_workers",
                "from 1 to 256",
            ),
            (
                pools(Some(1), Some(257)),
                "replay.fleet.decode_workers",
                "from 1 to 256",
            ),
            (
                pools(Some(2), None),
                "replay.fleet.decode_workers",
                "is needed with `prefill_workers`",
            ),
            (
                pools(None, Some(2)),
                "replay.fleet.prefill_workers",
                "is needed with `decode_workers`",
            ),
            (
                pools(Some(200), Some(57)),
                "replay.fleet.prefill_workers",
                "make 257 workers",
            ),
            (
                FleetSection {
                    workers: 4,
                    ..pools(Some(1), Some(1))
                },
                "replay.fleet.workers",
                "set one or the other",
            ),
            (
                FleetSection {
                    kv_link_gbps: 0.0,
                    ..FleetSection::default()
                },
                "replay.fleet.kv_link_gbps",
                "above 0",
            ),
            (
                FleetSection {
                    kv_link_gbps: f64::INFINITY,
                    ..FleetSection::default()
                },
                "replay.fleet.kv_link_gbps",
                "above 0",
            ),
            (
                FleetSection {
                    kv_link_latency_ms: -1.0,
                    ..FleetSection::default()
                },
                "replay.fleet.kv_link_latency_ms",
                "from 0",
            ),
            (
                FleetSection {
                    kv_link_latency_ms: f64::NAN,
                    ..FleetSection::default()
                },
                "replay.fleet.kv_link_latency_ms",
                "from 0",
            ),
        ] {
            let (s, p) = checked(&f);
            assert!(s.is_none(), "{f:?}");
            assert_eq!(p.len(), 1, "{f:?}: {p:?}");
            assert_eq!(p[0].0, key, "{p:?}");
            assert!(p[0].2.contains(why), "{p:?}");
        }
        // The largest link and latency are accepted.
        let (s, p) = checked(&FleetSection {
            kv_link_gbps: MAX_LINK_GBPS,
            kv_link_latency_ms: MAX_LINK_LATENCY_MS,
            ..pools(Some(1), Some(1))
        });
        assert!(p.is_empty() && s.is_some(), "{p:?}");
    }

    #[test]
    fn a_link_below_the_floor_is_refused_at_its_key_shown_in_exponent_form() {
        for (gbps, shown) in [
            (1e-300, "1e-300"),
            (1e-320, "1e-320"),
            (MIN_LINK_GBPS / 2.0, "0.0005"),
            (-1.0, "-1"),
        ] {
            let (s, p) = checked(&FleetSection {
                kv_link_gbps: gbps,
                ..pools(Some(1), Some(1))
            });
            assert!(s.is_none(), "{gbps}");
            assert_eq!(p.len(), 1, "{gbps}: {p:?}");
            assert_eq!(p[0].0, "replay.fleet.kv_link_gbps");
            assert_eq!(p[0].1.as_deref(), Some(shown));
            assert!(p[0].2.contains("from 1e-3 (1 Mbit/s)"), "{p:?}");
        }
        let (s, p) = checked(&FleetSection {
            kv_link_gbps: MIN_LINK_GBPS,
            ..pools(Some(1), Some(1))
        });
        assert!(p.is_empty() && s.is_some(), "{p:?}");
    }

    #[test]
    fn a_transfer_takes_its_bytes_at_the_link_rate() {
        let pd = PdSetup {
            prefill_workers: 1,
            decode_workers: 1,
            kv_link_gbps: 100.0,
            kv_link_latency_ms: 2.0,
            kv_bytes_per_token: 524_288.0,
            kv_bytes_source: String::new(),
        };
        // 1,000 tokens × 512 KiB × 8 bits at 100 Gbit/s: 41.943 04 ms.
        assert!((pd.wire_ms(1000) - 41.943_04).abs() < 1e-9);
        assert_eq!(pd.wire_ms(0), 0.0);
    }

    #[test]
    fn kv_bytes_come_from_the_memory_model_then_the_cost_preset() {
        let mut r = ReplaySection::default();
        assert_eq!(resolve_kv_bytes(&r).0, 524_288.0);
        assert!(resolve_kv_bytes(&r).1.contains("Llama-2-7B"));
        r.cost.preset = Some("llama2-7b-h100".into());
        assert_eq!(
            resolve_kv_bytes(&r),
            (524_288.0, "replay.cost preset llama2-7b-h100".into())
        );
        r.kv.preset = Some("llama2-7b-a100".into());
        assert_eq!(
            resolve_kv_bytes(&r),
            (524_288.0, "replay.kv.preset llama2-7b-a100".into())
        );
        r.kv.kv_bytes_per_token = Some(131_072.0);
        assert_eq!(
            resolve_kv_bytes(&r),
            (131_072.0, "replay.kv.kv_bytes_per_token".into())
        );
    }
}
