"""An FSDP gang's passes are data parallel (batcher.engine.data_parallel): which rows each rank
computes, as a table, and what that does to a rank's planned activations. The gang itself, against
one process in float64 on gloo, is tests/test_trainer_gang.py."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from bases import memory_plan
from batcher.engine import layout


@pytest.mark.parametrize("lengths, ranks, shares", [
    ([], 2, [(), ()]),
    ([5], 1, [(0,)]),
    ([5], 4, [(0,), (), (), ()]),  # fewer rows than ranks: the others run stand-ins
    ([3, 3], 2, [(0,), (1,)]),
    ([12, 7, 20, 16, 5, 9, 3], 2, [(2, 4, 5, 6), (0, 1, 3)]),  # the gang test's pass: 37 and 35 tokens
    ([100, 1, 1, 1, 1], 2, [(0,), (1, 2, 3, 4)]),  # one long row: it alone on a rank
    ([4, 4, 4, 4, 4, 4], 4, [(0, 4), (1, 5), (2,), (3,)]),
    ([8, 1, 8, 1], 2, [(0, 1), (2, 3)]),  # each rank's rows stay in the pass's order
])
def test_rows_are_split_so_each_rank_gets_a_similar_token_count(lengths, ranks, shares):
    assert layout.rank_shares(lengths, ranks) == shares


def test_every_row_goes_to_one_rank_and_no_rank_is_a_row_longer_than_another():
    rng = random.Random(7)
    for _ in range(200):
        lengths = [rng.randint(1, 4096) for _ in range(rng.randint(0, 40))]
        ranks = rng.randint(1, 9)
        shares = layout.rank_shares(lengths, ranks)
        assert sorted(itertools.chain(*shares)) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in s) for s in shares]
        assert max(loads) - min(loads) <= max(lengths, default=0)


def test_a_gang_needs_a_rank():
    with pytest.raises(ValueError):
        layout.rank_shares([1], 0)


@pytest.mark.parametrize("budget, ways, tokens", [(16384, 1, 16384), (16384, 8, 2048), (10, 3, 4), (1, 8, 1)])
def test_a_rank_computes_its_share_of_the_token_budget(budget, ways, tokens):
    assert memory_plan.rank_tokens(budget, ways) == tokens


LLAMA_70B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": False}


def test_an_fsdp_rank_plans_its_share_of_the_activations():
    inputs = memory_plan.PlanInputs(device_bytes=141 * memory_plan.GiB, shared_device=False, token_budget=8192,
                                    resident_adapters=8, trainer_ranks=8)
    tp = memory_plan.plan_memory(LLAMA_70B, inputs)
    fsdp = memory_plan.plan_memory(LLAMA_70B, dataclasses.replace(inputs, trainer_parallel="fsdp"))
    alone = memory_plan.plan_memory(LLAMA_70B, dataclasses.replace(inputs, trainer_ranks=1))
    # every width per token (not split as tensor parallel splits it), an eighth of the tokens
    assert fsdp.activation_bytes_per_token == alone.activation_bytes_per_token > tp.activation_bytes_per_token
    assert (fsdp.rank_tokens, tp.rank_tokens) == (1024, 8192)
    used = fsdp.trainer_bytes - fsdp.trainer_free_bytes
    not_split = dataclasses.replace(inputs, trainer_parallel="fsdp", token_budget=8192 * 8)
    assert used < memory_plan.plan_memory(LLAMA_70B, not_split).trainer_bytes - \
        memory_plan.plan_memory(LLAMA_70B, not_split).trainer_free_bytes
    # a derived budget is the gang's: R ranks' worth
    derived = memory_plan.plan_memory(LLAMA_70B, dataclasses.replace(inputs, trainer_parallel="fsdp", token_budget=None))
    assert derived.token_budget % 8 == 0 and derived.rank_tokens == derived.token_budget // 8
    assert any("1,024 per rank" in value for _, value in fsdp.rows())
