"""ChunkRange(start, end, total, stride), as documented, and the stride the scheduler gives."""

import pickle

from mstar_chunking import ChunkingPolicy, ChunkRange, SubmoduleCaps

from conftest import run_all


def test_is_a_named_tuple_with_four_fields_by_name_and_index():
    r = ChunkRange(0, 512, 1000, 512)
    assert isinstance(r, tuple)
    assert ChunkRange._fields == ("start", "end", "total", "stride")
    assert (r.start, r.end, r.total, r.stride) == (r[0], r[1], r[2], r[3]) == (0, 512, 1000, 512)
    start, end, total, stride = r
    assert (start, end, total, stride) == (0, 512, 1000, 512)
    assert r._replace(end=1000) == ChunkRange(0, 1000, 1000, 512)
    assert pickle.loads(pickle.dumps(r)) == r


def test_equality_and_hashing_like_a_named_tuple():
    a, b = ChunkRange(1, 2, 3, 2), ChunkRange(1, 2, 3, 2)
    assert a == b and hash(a) == hash(b)
    assert a == (1, 2, 3, 2) and hash(a) == hash((1, 2, 3, 2))
    assert a != ChunkRange(1, 2, 3, 1)
    assert len({a, b, (1, 2, 3, 2)}) == 1


def test_is_final_when_the_chunk_ends_the_total():
    assert ChunkRange(512, 1000, 1000, 488).is_final
    assert not ChunkRange(0, 512, 1000, 512).is_final


def test_stride_is_end_for_a_first_chunk_and_end_minus_start_after():
    first = ChunkRange.cut(True, 300, 512, 1000)  # a 300-token cached prefix
    later = ChunkRange.cut(False, 512, 1000, 1000)
    assert first.stride == 512 and first.tokens == 212
    assert later.stride == 488
    assert first.stride + later.stride == 1000


def test_the_stride_of_a_prefix_cached_first_chunk_from_the_scheduler(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill"])})
    cm.set_policies({("llm", "prefill"): ChunkingPolicy(256)})
    cm.admit(1, "llm", "prefill", list(range(1000)), cached=300)
    ranges = [b.rows[0].range for b in run_all(cm, "llm", "prefill")]
    assert all(isinstance(r, ChunkRange) for r in ranges)
    # The Loop starts at 0 although the cached prefix moved start on to 300.
    assert ranges[0] == ChunkRange(300, 556, 1000, 556)
    assert ranges[1] == ChunkRange(556, 812, 1000, 256)
    assert ranges[-1].is_final and not any(r.is_final for r in ranges[:-1])
    assert sum(r.stride for r in ranges) == 1000


def test_a_whole_cache_hit_still_runs_the_last_token(make_cm):
    cm = make_cm({"llm": SubmoduleCaps(["prefill"])})
    cm.set_policies({("llm", "prefill"): ChunkingPolicy(256)})
    cm.admit(1, "llm", "prefill", [7] * 100, cached=100)
    (b,) = run_all(cm, "llm", "prefill")
    assert b.rows[0].range == ChunkRange(99, 100, 100, 100)
