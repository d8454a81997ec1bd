"""The suffix-speculation switch as tables (gen_pool.speculation)."""

import pytest

from gen_pool.speculation import speculating, speculative_config, threshold_batch


@pytest.mark.parametrize("running, target, below, on", [
    (1, 32, 0.25, True), (8, 32, 0.25, True), (9, 32, 0.25, False), (32, 32, 0.25, False),
    (1, 2, 0.25, True), (2, 2, 0.25, False),  # at least one sequence speculates
    (64, 64, 1.0, True),
])
def test_speculate_below_the_threshold_only(running, target, below, on):
    assert speculating(running, target, below) is on


def test_the_engine_gets_the_same_switch_as_its_batch_size_schedule():
    cfg = speculative_config(32, 0.25, 8)
    assert cfg["method"] == "suffix" and cfg["num_speculative_tokens"] == 8
    assert cfg["num_speculative_tokens_per_batch_size"] == [(1, 8, 8), (9, 32, 0)]
    for running in range(1, 33):
        (k,) = [k for lo, hi, k in cfg["num_speculative_tokens_per_batch_size"] if lo <= running <= hi]
        assert (k > 0) is speculating(running, 32, 0.25)
    # Speculating up to the whole target: one range, no "off" range to add.
    assert speculative_config(16, 1.0, 4)["num_speculative_tokens_per_batch_size"] == [(1, 16, 4)]
    assert threshold_batch(3, 0.1) == 1


def test_drafts_come_from_the_requests_own_text_unless_caches_are_shared():
    """Suffix decoding's global tree of past responses would let one tenant's speed tell what
    others sampled: off (0 cached requests) unless QUILT_GEN_SHARE_CACHES_ACROSS_TENANTS."""
    assert speculative_config(32, 0.25, 8)["suffix_decoding_max_cached_requests"] == 0
    assert "suffix_decoding_max_cached_requests" not in speculative_config(32, 0.25, 8, shared=True)
