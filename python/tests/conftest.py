import pytest

from mstar_chunking import ChunkingManagement, ChunkingPolicy, SubmoduleCaps


@pytest.fixture
def make_cm():
    """Builds ChunkingManagement instances and closes them after the test."""
    made = []

    def make(submodules=None, **kw):
        if submodules is None:
            submodules = {"llm": SubmoduleCaps(["prefill", "mixed"], True)}
        cm = ChunkingManagement(submodules, **kw)
        made.append(cm)
        return cm

    yield make
    for cm in made:
        cm.close()


@pytest.fixture
def documented_example(make_cm):
    """The documentation's example: a node `llm` that can cap member walks inside `mixed`."""
    cm = make_cm({"llm": SubmoduleCaps(["prefill", "mixed"], True)})
    cm.set_policies({("llm", "mixed"): ChunkingPolicy(2048, align=16)})
    return cm


def run_all(cm, node, walk, limit=1000):
    """Assembles and completes steps of node/walk until one has no rows; answers the batches."""
    batches = []
    for _ in range(limit):
        b = cm.assemble(node, walk)
        if len(b) == 0:
            cm.abandon(b.step)
            return batches
        cm.complete(b.step, b.planned())
        batches.append(b)
    raise AssertionError("steps did not drain")
