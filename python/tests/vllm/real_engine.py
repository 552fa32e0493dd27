#!/usr/bin/env python3
"""vLLM's real engine (`LLM(...)`, the model run by vLLM's own model runner) with
`mstar_chunking.vllm.Scheduler`, against vLLM's own scheduler on the same prompts.

    python real_engine.py --model MODEL_DIR [--out RESULTS.md] [--json FILE]

MODEL_DIR is a Hugging Face directory on disk (`python/scripts/gguf-to-hf.py` writes SmolLM2's
from the engine's GGUF); nothing is fetched. The run, each in a process of its own (one model
load each):

1. `vllm`: vLLM's own scheduler, token budget `--budget`;
2. `plugin`: `mstar_chunking.vllm.Scheduler` with vLLM's settings (the same token budget);
3. `plugin-time`: the plugin with a time budget set in its settings (`chunking_settings()`:
   `max_step_ms`, `cost`, `learn_cost`): the latency model fitted to the `vllm` run's step times
   (base and per-token terms, least squares), refined online, with the time margin at the
   `--time-margin` quantile (default 0.99); the budget `--max-step-ms`, or, by default, what that
   model predicts for half the token budget;
4. `vllm-hog` and `plugin-time-hog` (unless `--hog off`): runs 1 and 3 again with a CPU hog (a
   busy loop at the engine's niceness, pinned to `--hog-cpu`, default the last core) from ON to
   OFF seconds into `generate` (`--hog ON,OFF`, default 5,14): per phase (before, during,
   after) the TBT p99 of both and the time budget's step p99 ÷ X.

The same 20 prompts (windows of the repository's docs, 50 to 1,500 tokens, as token ids) go to
each, all at once, greedy. Checked, each a failure naming the run and request: every request
finishes; every completion's token ids and text equal vLLM's own scheduler's; no step schedules
more than the token budget; at the end every KV block is free and the plugin's component holds
no request. Each step's time is measured by the same rule in every run: from its `schedule()`
returning to its own `update_from_output()` (under async scheduling a step can be queued behind
the one before: then from that step's `update_from_output()`). TBT is the gap between two
tokens of one request as `update_from_output()` hands them out. The figures go to stdout,
`--out` (Markdown) and `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PROMPTS = 20
MIN_LEN, MAX_LEN = 50, 1500


def percentile(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def make_prompts(model: Path) -> list[dict]:
    """20 prompts, token windows of the docs (no two overlapping, so the prefix cache plays no
    part), lengths spread evenly over 50..1,500, with 16..64 tokens to generate."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = tok.encode(text, add_special_tokens=False).ids
    prompts, at = [], 0
    for i in range(PROMPTS):
        n = MIN_LEN + round(i * (MAX_LEN - MIN_LEN) / (PROMPTS - 1))
        if at + n > len(ids):
            raise SystemExit(f"real_engine: the docs have {len(ids)} tokens, too few for {PROMPTS} prompts")
        prompts.append({"id": f"p{i:02d}", "tokens": ids[at : at + n], "max_tokens": 16 + (i * 7) % 49})
        at += n
    # Interleave long and short so chunks and decodes share steps from the start.
    order = [i for pair in zip(range(PROMPTS // 2), range(PROMPTS - 1, PROMPTS // 2 - 1, -1)) for i in pair]
    return [prompts[i] for i in order]


# -- in the child: one engine, one scheduler -------------------------------------------------


class _Timing:
    """Measures each step (the rule above) and each token's hand-out time; mixed in outermost."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.real_steps: list[dict] = []
        self.token_times: dict[str, list[float]] = {}
        self._queued: list[tuple[Any, dict, float]] = []
        self._last_update_at = 0.0
        self.over_budget: list[int] = []

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        at = time.perf_counter()
        total = out.total_num_scheduled_tokens
        rec = {"tokens": total, "rows": len(out.num_scheduled_tokens), "ms": None, "at": at}
        unc = getattr(self, "_uncompleted", None)
        if unc is not None:
            rec["step"] = unc.step
        if total > self.max_num_scheduled_tokens:  # type: ignore[attr-defined]
            self.over_budget.append(len(self.real_steps))
        self.real_steps.append(rec)
        self._queued.append((out, rec, at))
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        now = time.perf_counter()
        for i, (out, rec, at) in enumerate(self._queued):
            if out is scheduler_output:
                del self._queued[i]
                rec["ms"] = (now - max(at, self._last_update_at)) * 1e3
                break
        self._last_update_at = now
        result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        for eco in result.values():
            for o in eco.outputs:
                if o.new_token_ids:
                    self.token_times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
        return result


class Hog:
    """A CPU hog (a busy loop in a process of its own, at the engine's niceness) pinned to `cpu`
    from `on_s` to `off_s` seconds after `arm`: other work landing on the engine's cores. The
    loop ends itself at `off_s` whatever happens to this process; `disarm` stops it earlier."""

    def __init__(self, cpu: int, on_s: float, off_s: float) -> None:
        self.cpu, self.on_s, self.off_s = cpu, on_s, off_s
        self.proc: Optional[subprocess.Popen] = None
        self.on_at: Optional[float] = None
        self.off_at: Optional[float] = None
        self.timers: list[Any] = []

    def arm(self, t0: float) -> None:
        import threading

        self.timers = [threading.Timer(self.on_s, self._start), threading.Timer(self.off_s, self._stop)]
        for t in self.timers:
            t.daemon = True
            t.start()

    def _start(self) -> None:
        loop = f"import time\nend = time.monotonic() + {self.off_s - self.on_s + 1.0}\nwhile time.monotonic() < end: pass\n"
        self.on_at = time.perf_counter()
        self.proc = subprocess.Popen(["taskset", "-c", str(self.cpu), sys.executable, "-c", loop])

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.on_at is not None and self.off_at is None:
            self.off_at = time.perf_counter()

    def disarm(self) -> None:
        for t in self.timers:
            t.cancel()
        self._stop()


def _scheduler_classes(
    kind: str, max_step_ms: Optional[float], cost: Optional[list[float]], time_margin: Optional[float] = None
) -> Any:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsync
    from vllm.v1.core.sched.scheduler import Scheduler as VllmSync

    if kind.startswith("vllm"):

        class TimedVllm(_Timing, VllmSync):
            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                cfg = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
                if cfg.scheduler_config.async_scheduling and cls is TimedVllm:
                    cls = TimedVllmAsync
                return object.__new__(cls)

        class TimedVllmAsync(TimedVllm, VllmAsync):
            pass

        return TimedVllm

    from mstar_chunking.vllm import Scheduler

    class TimedPlugin(_Timing, Scheduler):
        def chunking_settings(self) -> dict[str, Any]:
            settings = super().chunking_settings()
            if max_step_ms is not None:
                settings.update(max_step_ms=max_step_ms, cost=tuple(cost), learn_cost=True)
                if time_margin is not None:
                    settings.update(time_margin=time_margin)
            return settings

    return TimedPlugin


def child(args: argparse.Namespace) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process, to read it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(args.prompts).read_text())
    cost = [float(x) for x in args.cost.split(",")] if args.cost else None
    cls = _scheduler_classes(args.kind, args.max_step_ms, cost, args.time_margin)
    t0 = time.perf_counter()
    llm = LLM(
        model=str(args.model),
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=args.budget,
        max_num_seqs=args.max_num_seqs,
        scheduler_cls=cls,
        seed=0,
        enforce_eager=True,
    )
    load_s = time.perf_counter() - t0
    core = llm.llm_engine.engine_core.engine_core
    s = core.scheduler
    params = [SamplingParams(temperature=0.0, max_tokens=p["max_tokens"]) for p in prompts]
    load_before = os.getloadavg()[0]
    hog = Hog(args.hog_cpu, *args.hog) if args.hog and args.kind.endswith("-hog") else None
    t0 = time.perf_counter()
    try:
        if hog is not None:
            hog.arm(t0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p["tokens"]) for p in prompts], params, use_tqdm=False)
    finally:
        if hog is not None:
            hog.disarm()
    gen_s = time.perf_counter() - t0
    pool = s.kv_cache_manager.block_pool
    result = {
        "kind": args.kind,
        "scheduler": type(s).__module__ + "." + type(s).__qualname__,
        "async": bool(s.vllm_config.scheduler_config.async_scheduling),
        "budget": s.max_num_scheduled_tokens,
        "block_size": s.block_size,
        "load_s": load_s,
        "generate_s": gen_s,
        "outputs": {},
        "steps": s.real_steps,
        "over_budget_steps": s.over_budget,
        "token_times": s.token_times,
        "requests_left": len(s.requests),
        "free_blocks": pool.get_num_free_blocks(),
        "blocks": pool.num_gpu_blocks - 1,  # less the null block
        "max_step_ms": args.max_step_ms,
        "loadavg": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # 1-minute, before and after
        "hog": None if hog is None else {"cpu": args.hog_cpu, "on": hog.on_at, "off": hog.off_at},
    }
    # vLLM's request ids in the outputs are the engine's; map them back through the order.
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        result["outputs"][p["id"]] = {
            "request_id": o.request_id,
            "text": c.text,
            "token_ids": list(c.token_ids),
            "finish_reason": c.finish_reason,
        }
    if not args.kind.startswith("vllm"):
        st = s.mstar_stats
        result["component_held"] = len(s._rid_of) + len(s.chunking.prepared)
        result["handed_back"] = st.handed_back
        reasons: dict[int, Optional[str]] = {}
        predicted: dict[int, Optional[float]] = {}
        for o in list(st.outcomes):
            reasons[o.step] = o.time_overrun
            predicted[o.step] = o.predicted_ms
        for o in list(st.late_outcomes):
            step = o["step"] if isinstance(o, dict) else o.step
            reason = o["time_overrun"] if isinstance(o, dict) else o.time_overrun
            if reason is not None or step not in reasons:
                reasons[step] = reason
        for rec in s.real_steps:
            if "step" in rec:
                rec["time_overrun"] = reasons.get(rec["step"])
                rec["predicted_ms"] = predicted.get(rec["step"])
    Path(args.result).write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()
    return 0


# -- in the parent: three runs, the checks, the figures --------------------------------------


def run_child(
    args: argparse.Namespace, kind: str, prompts_file: Path, max_step_ms: Optional[float], cost: Optional[list[float]] = None
) -> dict:
    out = Path(args.work) / f"{kind}.json"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--model",
        str(args.model),
        "--prompts",
        str(prompts_file),
        "--result",
        str(out),
        "--budget",
        str(args.budget),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    if max_step_ms is not None:
        cmd += ["--max-step-ms", repr(max_step_ms), "--cost", ",".join(repr(c) for c in cost or ())]
        if args.time_margin is not None:
            cmd += ["--time-margin", repr(args.time_margin)]
    if kind.endswith("-hog"):
        cmd += ["--hog", f"{args.hog[0]},{args.hog[1]}", "--hog-cpu", str(args.hog_cpu)]
    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = Path(args.work) / f"{kind}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout)
    if p.returncode != 0:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"real_engine: run {kind!r} exited {p.returncode} (log {log}):\n{tail}")
    r = json.loads(out.read_text())
    r["wall_s"] = time.perf_counter() - t0
    return r


def fit_cost(r: dict) -> list[float]:
    """(base_ms, per_token_ms, 0, 0): least squares of a run's step times on its tokens."""
    pts = [(st["tokens"], st["ms"]) for st in r["steps"] if st["ms"] is not None and st["tokens"] > 0]
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    slope = max(slope, 1e-6)
    base = max(my - slope * mx, 0.0)
    return [round(base, 3), round(slope, 6), 0.0, 0.0]


def step_figures(r: dict, max_step_ms: Optional[float], reasons: bool) -> dict:
    ms = [st["ms"] for st in r["steps"] if st["ms"] is not None]
    tbt = []
    for times in r["token_times"].values():
        tbt += [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    fig = {
        "steps": len(r["steps"]),
        "step_ms_p50": percentile(ms, 0.5),
        "step_ms_p99": percentile(ms, 0.99),
        "step_ms_max": max(ms) if ms else None,
        "tbt_ms_p50": percentile(tbt, 0.5),
        "tbt_ms_p99": percentile(tbt, 0.99),
        "tbt_samples": len(tbt),
        "max_tokens_in_a_step": max((st["tokens"] for st in r["steps"]), default=0),
        "generate_s": r["generate_s"],
        "load_s": r["load_s"],
        "loadavg": r["loadavg"],
    }
    if max_step_ms is not None:
        over = [st for st in r["steps"] if st["ms"] is not None and st["ms"] > max_step_ms]
        fig["over_time_budget"] = len(over)
        if reasons:
            by: dict[str, int] = {}
            for st in over:
                key = str(st.get("time_overrun") or "not reported")
                by[key] = by.get(key, 0) + 1
            fig["over_by_reason"] = by
    return fig


SETTLE_STEPS = 8  # a phase's first steps, in which the online fit meets the changed machine


def phase_figures(vllm: dict, plugin: dict, max_step_ms: float) -> list[dict]:
    """Per phase of the hog (before, during, after; each run's own hog times): TBT p99 of both
    runs (a gap counted in the phase its second token is in), and the plugin's step p99 ÷ the
    time budget and its steps over it by reason, all of the phase's steps and after its first
    `SETTLE_STEPS`."""

    def phase_of(r: dict) -> Any:
        h = r["hog"] or {}
        on, off = h.get("on"), h.get("off")
        return lambda t: "before" if on is None or t < on else ("during" if off is None or t < off else "after")

    def tbt(r: dict) -> dict[str, list[float]]:
        of, out = phase_of(r), {}
        for times in r["token_times"].values():
            for a, b in zip(times, times[1:]):
                out.setdefault(of(b), []).append((b - a) * 1e3)
        return out

    steps: dict[str, list[dict]] = {}
    of = phase_of(plugin)
    for st in plugin["steps"]:
        if st["ms"] is not None:
            steps.setdefault(of(st["at"]), []).append(st)
    theirs, ours = tbt(vllm), tbt(plugin)
    rows = []
    for phase in ("before", "during", "after"):
        ph = steps.get(phase, [])
        settled = ph[SETTLE_STEPS:]
        over: dict[str, int] = {}
        for st in ph:
            if st["ms"] > max_step_ms:
                key = str(st.get("time_overrun") or "not reported")
                over[key] = over.get(key, 0) + 1
        p99 = lambda xs: percentile(xs, 0.99)  # noqa: E731
        rows.append({
            "phase": phase,
            "vllm_tbt_p99": p99(theirs.get(phase, [])),
            "plugin_tbt_p99": p99(ours.get(phase, [])),
            "steps": len(ph),
            "step_p99_x": None if not ph else p99([st["ms"] for st in ph]) / max_step_ms,
            "settled_step_p99_x": None if not settled else p99([st["ms"] for st in settled]) / max_step_ms,
            "over": over,
        })
    return rows


def check(runs: dict[str, dict], prompts: list[dict]) -> list[str]:
    bad = []
    ref = runs["vllm"]["outputs"]
    for kind, r in runs.items():
        if r["over_budget_steps"]:
            bad.append(f"{kind}: steps over the token budget: {r['over_budget_steps'][:10]}")
        if r["requests_left"]:
            bad.append(f"{kind}: {r['requests_left']} requests still in the scheduler at the end")
        if r["free_blocks"] != r["blocks"]:
            bad.append(f"{kind}: {r['blocks'] - r['free_blocks']} KV blocks held at the end")
        if r.get("component_held"):
            bad.append(f"{kind}: the component still holds {r['component_held']} requests")
        for p in prompts:
            o = r["outputs"].get(p["id"])
            if o is None or o["finish_reason"] not in ("length", "stop"):
                bad.append(f"{kind}: request {p['id']} did not finish ({o and o['finish_reason']})")
                continue
            if kind != "vllm" and (o["token_ids"] != ref[p["id"]]["token_ids"] or o["text"] != ref[p["id"]]["text"]):
                bad.append(
                    f"{kind}: request {p['id']} ({len(p['tokens'])} prompt tokens): completion differs from "
                    f"vLLM's own scheduler's: {o['text']!r} vs {ref[p['id']]['text']!r}"
                )
    return bad


def fmt(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.1f}"
    return str(x)


def report(
    runs: dict[str, dict], figs: dict[str, dict], prompts: list[dict], max_step_ms: float, cost: list[float], bad: list[str]
) -> str:
    v = runs["vllm"]
    margin = v.get("time_margin")
    lines = [
        "# vLLM's real engine with mstar_chunking.vllm.Scheduler (SmolLM2-135M-Instruct, CPU)",
        "",
        "Written by `python/tests/vllm/real_engine.py` (`make test-vllm-real`).",
        "",
        f"- vLLM {runs['vllm'].get('vllm_version', '?')}, scheduler class per run below, "
        f"async scheduling {'on' if v['async'] else 'off'}; float32, token budget {v['budget']}, "
        f"block size {v['block_size']}, `max_num_seqs` {runs['vllm'].get('max_num_seqs', '?')}.",
        f"- {len(prompts)} prompts of {min(len(p['tokens']) for p in prompts)}–"
        f"{max(len(p['tokens']) for p in prompts)} tokens ({sum(len(p['tokens']) for p in prompts)} in all), "
        f"{sum(p['max_tokens'] for p in prompts)} output tokens at most, all submitted at once, greedy.",
        f"- Time budget of `plugin-time`: {max_step_ms:.1f} ms, what the latency model predicts for half the "
        f"token budget; the model (`cost`, base {cost[0]:.1f} ms + {cost[1]:.3f} ms a token) fitted by least "
        "squares to the step times of the `vllm` run, refined online (`learn_cost`), with "
        + (f"the time margin at the {margin:g} quantile (`time_margin`)" if margin else "no time margin")
        + ": all in `chunking_settings()`.",
        "",
        "| run | scheduler | steps | step ms p50 / p99 / max | TBT ms p50 / p99 | steps over "
        f"{max_step_ms:.0f} ms (by reason) | most tokens in a step | generate s | load average |",
        "|---|---|---:|---|---|---|---:|---:|---|",
    ]
    for kind, f in figs.items():
        over = f.get("over_time_budget")
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(f.get("over_by_reason", {}).items()))
        lines.append(
            f"| {kind} | `{runs[kind]['scheduler'].rsplit('.', 1)[-1]}` | {f['steps']} | "
            f"{fmt(f['step_ms_p50'])} / {fmt(f['step_ms_p99'])} / {fmt(f['step_ms_max'])} | "
            f"{fmt(f['tbt_ms_p50'])} / {fmt(f['tbt_ms_p99'])} | {fmt(over)}{f' ({reasons})' if reasons else ''} | "
            f"{f['max_tokens_in_a_step']} | {f['generate_s']:.1f} | {f['loadavg'][0]} → {f['loadavg'][1]} |"
        )
    lines += [
        "",
        "Steps over the time budget are counted in every run; under the time budget with the reason "
        "the component gave (`time_overrun`). The load average (1 minute, before and after the run's "
        "`generate`) is the machine's: the runs are one after the other, so their times compare only "
        "where the load was alike.",
        "",
        "Checks: " + ("every one passed (every request finished, every completion's tokens and text equal "
                      "vLLM's own scheduler's, no step over the token budget, every KV block free and "
                      "nothing held by the component at the end)." if not bad else "FAILED:"),
    ]
    lines += [f"- {b}" for b in bad]
    if "plugin-time-hog" in runs:
        hv = runs["vllm-hog"]["hog"]
        on_s, off_s = runs["vllm-hog"]["hog_s"]
        lines += [
            "",
            "## Under interference",
            "",
            f"`vllm-hog` and `plugin-time-hog` ran again with a CPU hog (a busy loop at the engine's niceness) "
            f"pinned to core {hv['cpu'] if hv else '?'} from {on_s:g} s to {off_s:g} s into each run's `generate`. Per phase: TBT p99 of both, "
            f"and the time budget's steps: p99 ÷ X ({max_step_ms:.1f} ms) over all the phase's steps and after its "
            f"first {SETTLE_STEPS}, and the steps over X by reason.",
            "",
            "| phase | vLLM's own TBT p99 ms | plugin TBT p99 ms | plugin ÷ vLLM | steps | step p99 ÷ X | after "
            f"{SETTLE_STEPS} steps | over X (by reason) |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in phase_figures(runs["vllm-hog"], runs["plugin-time-hog"], max_step_ms):
            ratio = (
                None
                if not (row["vllm_tbt_p99"] and row["plugin_tbt_p99"])
                else row["plugin_tbt_p99"] / row["vllm_tbt_p99"]
            )
            over = ", ".join(f"{k} {n}" for k, n in sorted(row["over"].items())) or "0"
            two = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
            lines.append(
                f"| {row['phase']} | {fmt(row['vllm_tbt_p99'])} | {fmt(row['plugin_tbt_p99'])} | {two(ratio)} | "
                f"{row['steps']} | {two(row['step_p99_x'])} | {two(row['settled_step_p99_x'])} | {over} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-step-ms", type=float, default=None)
    ap.add_argument(
        "--time-margin",
        type=float,
        default=0.99,
        help="the time budget's margin quantile (`time_margin`; default 0.99: a few slow steps move it); 0 for none",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=REPO / "target" / "vllm-real")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for one run")
    ap.add_argument("--only", default=None, help="comma-separated runs (vllm, plugin, plugin-time)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cost", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--hog",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=(5.0, 14.0),
        help="ON,OFF: the interference runs' CPU hog, seconds into generate (default 5,14); 'off' for none",
    )
    ap.add_argument("--hog-cpu", type=int, default=max(os.sched_getaffinity(0)), help="the core the hog runs on")
    argv = sys.argv[1:]
    if "--hog" in argv and argv[argv.index("--hog") + 1 :][:1] == ["off"]:
        i = argv.index("--hog")
        argv = argv[:i] + argv[i + 2 :]
        args = ap.parse_args(argv)
        args.hog = None
    else:
        args = ap.parse_args(argv)
    if args.hog and not (len(args.hog) == 2 and 0 <= args.hog[0] < args.hog[1] <= args.timeout):
        # (NaN fails every comparison.) A hog's own loop ends at OFF even if its run is killed,
        # so OFF is bounded by a run's timeout.
        ap.error(f"--hog: ON,OFF seconds with 0 <= ON < OFF <= --timeout ({args.timeout:g}), got {args.hog}")
    if args.time_margin is not None and not 0 <= args.time_margin <= 1:
        ap.error(f"--time-margin: a quantile from 0 (none) to 1, got {args.time_margin}")
    if args.time_margin == 0:
        args.time_margin = None
    if args.child:
        args.kind = args.child
        return child(args)
    if not (args.model / "config.json").is_file():
        print(f"real_engine: --model {args.model}: no config.json (python/scripts/gguf-to-hf.py writes it)", file=sys.stderr)
        return 1
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(args.model)
    prompts_file = args.work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    import vllm

    runs: dict[str, dict] = {}
    runs["vllm"] = run_child(args, "vllm", prompts_file, None)
    runs["plugin"] = run_child(args, "plugin", prompts_file, None)
    cost = fit_cost(runs["vllm"])
    max_step_ms = args.max_step_ms
    if max_step_ms is None:
        max_step_ms = round(cost[0] + cost[1] * args.budget / 2, 1)
    runs["plugin-time"] = run_child(args, "plugin-time", prompts_file, max_step_ms, cost)
    if args.hog:
        # Interference: vLLM's own scheduler and the time budget again, each with the hog on
        # one of the engine's cores from the same second to the same second of its `generate`.
        runs["vllm-hog"] = run_child(args, "vllm-hog", prompts_file, None)
        runs["plugin-time-hog"] = run_child(args, "plugin-time-hog", prompts_file, max_step_ms, cost)
    for r in runs.values():
        r["vllm_version"] = vllm.__version__
        r["hog_s"] = args.hog
        r["time_margin"] = args.time_margin
        r["max_num_seqs"] = args.max_num_seqs
    figs = {kind: step_figures(r, max_step_ms, kind.startswith("plugin-time")) for kind, r in runs.items()}
    bad = check(runs, prompts)
    text = report(runs, figs, prompts, max_step_ms, cost, bad)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        interference = (
            phase_figures(runs["vllm-hog"], runs["plugin-time-hog"], max_step_ms) if "plugin-time-hog" in runs else None
        )
        args.json.write_text(json.dumps({"figures": figs, "max_step_ms": max_step_ms, "failures": bad,
                                         "interference": interference,
                                         "runs": {k: {x: r[x] for x in ("scheduler", "async", "steps", "load_s", "generate_s")}
                                                  for k, r in runs.items()}}, indent=1))
    if bad:
        print(f"real_engine: {len(bad)} checks failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
