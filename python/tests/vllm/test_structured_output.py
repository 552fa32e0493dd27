"""Structured output under the plugin. vLLM keeps a request with a grammar waiting until its
grammar has compiled (`WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`), skips it meanwhile and goes on
with the requests behind it, and finishes it with the compile error should compilation fail. The
plugin admits such a request to the component once its grammar is ready, not before (a plan for
it would only be handed back), so it starts in the step vLLM's own scheduler starts it; a
compile error finishes that request alone, with vLLM's own error.

The grammar is a stand-in (vLLM's own scheduler tests do the same): the harness has no tokenizer
to compile one, and the scheduler reads only whether it is ready, failed, or accepts tokens."""

from unittest.mock import Mock

import pytest
from harness import Driver, VllmScheduler, kv_all_free, make_request, make_scheduler
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar
from vllm.v1.structured_output.request import StructuredOutputRequest

from mstar_chunking.vllm import Scheduler

PENDING = 4  # steps the grammar takes to compile


class VllmRules(Scheduler):
    """The plugin with vLLM's chunk rules (no alignment, no floor): vLLM's exact chunks."""

    def chunking_settings(self):
        return {**super().chunking_settings(), "align": 1, "min_chunk_tokens": 1}


def structured(req_id, prompt, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    req = make_request(req_id, prompt, max_tokens)
    req.sampling_params = params
    req.structured_output_request = StructuredOutputRequest.from_sampling_params(params)
    req.structured_output_request.grammar = None  # compiling
    req.status = req.status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    return req


def run(cls, compiled, async_scheduling=False):
    """`g` (a grammar, compiled after PENDING steps into `compiled`) queued ahead of two plain
    prompts; what each step scheduled, the outputs and errors."""
    s = make_scheduler(cls, budget=256, async_scheduling=async_scheduling)
    d = Driver(s, async_depth=2 if async_scheduling else 1)
    g = structured("g", [3] * 5 + list(range(100, 400)), 6)
    s.add_request(g)
    d.add("p0", [4] * 5 + list(range(1000, 1200)), 5)
    d.add("p1", [5] * 5 + list(range(2000, 2100)), 5)
    admitted_early = False
    for _ in range(PENDING):
        d.step()
        admitted_early |= "g" in getattr(s, "_rid_of", {})
    g.structured_output_request.grammar = compiled
    run = d.drain(limit=200)
    assert run.outputs["p0"] == 5 and run.outputs["p1"] == 5 and not ({"p0", "p1"} & set(run.errors))
    assert kv_all_free(s, 10_000)
    if isinstance(s, Scheduler):
        assert not s._rid_of and len(s.chunking.prepared) == 0
    s.shutdown()
    return [sorted((c.req_id, c.start, c.tokens) for c in st) for st in run.steps], run, admitted_early


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_admitted_once_the_grammar_is_ready(async_scheduling):
    grammar = Mock(spec=StructuredOutputGrammar)
    grammar.accept_tokens.return_value = True
    grammar.is_terminated.return_value = False
    theirs, their_run, _ = run(VllmScheduler, grammar, async_scheduling)
    ours, our_run, early = run(VllmRules, grammar, async_scheduling)
    assert not early  # not admitted while its grammar compiled
    first = next(i for i, st in enumerate(ours) if any(r == "g" for r, *_ in st))
    assert first == PENDING  # in the first step after the grammar is ready
    if not async_scheduling:
        assert ours == theirs
    assert our_run.outputs["g"] == their_run.outputs["g"] == 6
    assert "g" not in our_run.errors


def test_a_compile_error_finishes_only_its_request():
    theirs, their_run, _ = run(VllmScheduler, RuntimeError("no such grammar"))
    ours, our_run, early = run(VllmRules, RuntimeError("no such grammar"))
    assert not early and ours == theirs
    assert our_run.finished["g"] == their_run.finished["g"] == "error" and our_run.outputs["g"] == 0
    ours_e, theirs_e = our_run.errors.get("g"), their_run.errors.get("g")
    assert (ours_e is None) == (theirs_e is None)  # vLLM 0.32's errors carry no message
    if ours_e is not None:
        assert (ours_e.code, ours_e.message) == (theirs_e.code, theirs_e.message)
        assert ours_e.message == "Invalid structured outputs: no such grammar"
