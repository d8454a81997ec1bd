"""What a generation engine keeps per adapter version, as tables (gen_pool.adapters.versions_to_forget,
newest, AdapterIds; gen_pool.scheduler.adapters_named). The real engine through many more versions
than its host cache holds: tests/test_gen_engine.py."""

import pytest

from core.work import AdapterRef, SamplingSpec
from gen_pool.adapters import IDENTITY_ID, AdapterIds, newest, versions_to_forget
from gen_pool.scheduler import Group, adapters_named

# Versions by the use count of their last load: v1 oldest.
USES = {"v1": 1, "v2": 2, "v3": 3, "v4": 4, "v5": 5}


@pytest.mark.parametrize("held, in_use, asked_at, forgotten", [
    # vLLM's host cache holds the newest two; nothing queued: the rest go.
    ({"v4", "v5"}, set(), 10, {"v1", "v2", "v3"}),
    # A group queued behind newer versions keeps its own, evicted or not.
    ({"v4", "v5"}, {"v1"}, 10, {"v2", "v3"}),
    ({"v4", "v5"}, {"v1", "v2", "v3"}, 10, set()),
    # What vLLM holds stays, however old (its LRU is touched by running sequences too).
    ({"v1", "v5"}, set(), 10, {"v2", "v3", "v4"}),
    # Loaded at or after the question was asked: maybe held although the answer predates it.
    ({"v1"}, set(), 4, {"v2", "v3"}),
    ({"v1"}, set(), 1, set()),
    # Everything held, or everything in use: nothing goes.
    ({"v1", "v2", "v3", "v4", "v5"}, set(), 10, set()),
    (set(), set(USES), 10, set()),
    # A key held or in use that is not tracked is no reason to keep or drop anything else.
    ({"gone"}, {"other"}, 10, set(USES)),
])
def test_versions_to_forget(held, in_use, asked_at, forgotten):
    assert versions_to_forget(USES, held=held, in_use=in_use, asked_at=asked_at) == forgotten


def test_nothing_tracked_nothing_forgotten():
    assert versions_to_forget({}, held=set(), in_use=set(), asked_at=0) == frozenset()


@pytest.mark.parametrize("n, expected", [
    (0, set()), (-1, set()), (1, {"v5"}), (2, {"v4", "v5"}), (5, set(USES)), (50, set(USES)),
])
def test_newest_is_what_an_lru_cache_of_n_holds(n, expected):
    assert newest(USES, n) == expected


def test_lru_cache_with_queued_groups_keeps_its_size_plus_theirs():
    """The trainer-side sampler's rule (gen_pool.hf_engine): the newest `cap` and those in use."""
    uses = {f"v{i}": i for i in range(100)}
    gone = versions_to_forget(uses, held=newest(uses, 4), in_use={"v3", "v50"}, asked_at=len(uses))
    assert set(uses) - gone == {"v96", "v97", "v98", "v99", "v3", "v50"}


def test_adapter_ids_are_never_reused_and_never_the_identity_adapters():
    ids = AdapterIds()
    drawn = [ids.new() for _ in range(1000)]
    assert len(set(drawn)) == 1000 and IDENTITY_ID not in drawn
    assert drawn == sorted(drawn)


def _group(request_id: str, adapter: str | None, *, done: bool = False) -> Group:
    ref = AdapterRef(key=adapter, path=adapter, model_id="m") if adapter else None
    g = Group(request_id, "t", (1, 2), SamplingSpec(max_tokens=1), 1, adapter=ref)
    g.done = done
    return g


@pytest.mark.parametrize("groups, expected", [
    ([], set()),
    ([_group("r1", None)], set()),
    ([_group("r1", "/a/1"), _group("r2", "/a/1"), _group("r3", "/b/7")], {"/a/1", "/b/7"}),
    ([_group("r1", "/a/1", done=True), _group("r2", "/a/2")], {"/a/2"}),
])
def test_adapters_named_by_unfinished_groups(groups, expected):
    assert adapters_named(groups) == expected
