"""The token dispatch of an expert-parallel gang (batcher.engine.dispatch): its bookkeeping as a table
(which rank dispatches which tokens, where each (token, expert) pair goes, the counts, the way back),
every rank's plan put together as the all-to-all would deliver them, and the collectives on two
real gloo processes (forward and backward against the same computation in one process)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from batcher.engine import dispatch


@pytest.mark.parametrize("tokens,ranks,shares", [
    (10, 2, [(0, 5), (5, 10)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]),
    (1, 2, [(0, 1), (1, 1)]),  # fewer tokens than ranks: the last has none
    (0, 2, [(0, 0), (0, 0)]),
])
def test_each_rank_dispatches_a_contiguous_share_of_the_tokens(tokens, ranks, shares):
    assert [dispatch.share(tokens, r, ranks) for r in range(ranks)] == shares


@pytest.mark.parametrize("index,rank,ranks,per_rank,order,send,token,expert", [
    # 3 tokens, top 2, experts 0-1 on rank 0 and 2-3 on rank 1; rank 0 dispatches tokens 0 and 1
    ([[0, 3], [2, 1], [3, 2]], 0, 2, 2, [0, 3, 1, 2], [2, 2], [0, 1, 0, 1], [0, 1, 1, 0]),
    ([[0, 3], [2, 1], [3, 2]], 1, 2, 2, [0, 1], [0, 2], [2, 2], [1, 0]),
    # every token chose rank 0's experts: rank 1 receives nothing
    ([[0, 1], [1, 0]], 0, 2, 2, [0, 1], [2, 0], [0, 0], [0, 1]),
    ([[0, 1], [1, 0]], 1, 2, 2, [0, 1], [2, 0], [1, 1], [1, 0]),
    # four ranks of one expert each; nobody chose expert 2, so rank 2 is sent nothing
    ([[3, 0], [1, 3], [0, 1], [3, 1]], 0, 4, 1, [1, 0], [1, 0, 0, 1], [0, 0], [0, 0]),
    ([[3, 0], [1, 3], [0, 1], [3, 1]], 1, 4, 1, [0, 1], [0, 1, 0, 1], [1, 1], [0, 0]),
    # a rank with no tokens of its own sends nothing
    ([[1, 0]], 1, 2, 1, [], [0, 0], [], []),
])
def test_a_ranks_dispatch_as_a_table(index, rank, ranks, per_rank, order, send, token, expert):
    d = dispatch.plan(torch.tensor(index), rank, ranks, per_rank)
    assert (d.order.tolist(), d.send, d.token.tolist(), d.expert.tolist()) == (order, send, token, expert)
    pairs = torch.arange(len(order), dtype=torch.float64).unsqueeze(1) * 10  # each pair's own value
    assert torch.equal(d.restore(pairs.index_select(0, d.order)), pairs)  # the way back is the inverse


def test_every_pair_reaches_its_experts_rank_once():
    """The ranks' plans put together as the all-to-all delivers them (rank r's rows from rank s are
    s's send[r] rows in order): each rank receives exactly the pairs whose expert it holds, with
    that expert's local index, and its counts are what the others said they send."""
    g = torch.Generator().manual_seed(1)
    ranks, per_rank, top_k, tokens = 4, 3, 2, 23
    index = torch.stack([torch.randperm(ranks * per_rank, generator=g)[:top_k] for _ in range(tokens)])
    index[index == 7] = 6  # expert 7 (rank 2's second) is nobody's choice
    plans = [dispatch.plan(index, r, ranks, per_rank) for r in range(ranks)]
    assert sum(p.end - p.start for p in plans) == tokens
    for r in range(ranks):
        got = []
        for p in plans:
            first = sum(p.send[:r])
            got += [(int(t), r * per_rank + int(e)) for t, e in zip(p.token[first:first + p.send[r]],
                                                                    p.expert[first:first + p.send[r]], strict=True)]
        want = [(t, int(e)) for t in range(tokens) for e in index[t] if e // per_rank == r]
        assert sorted(got) == sorted(want)
        assert 7 not in {e for _, e in got}


def test_an_expert_id_past_the_experts_is_refused():
    with pytest.raises(ValueError, match="past the 4 experts"):
        dispatch.plan(torch.tensor([[0, 4]]), 0, 2, 2)
    with pytest.raises(RuntimeError):
        dispatch.plan(torch.tensor([[0, -1]]), 0, 2, 2)


# ---------------------------------------------------------------------- on two gloo processes


def _experts(x: torch.Tensor, expert: torch.Tensor, tags: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A toy experts computation: each row times its expert's matrix, plus its tag."""
    return torch.tanh(torch.einsum("ri,rio->ro", x, weights.index_select(0, expert))) + tags[:, :1].to(x.dtype)


def _problem(tokens: int):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(tokens, 6, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
    index[:, 0] = torch.where(index[:, 0] >= 2, 0, index[:, 0])  # rank 1's experts chosen less
    weights = torch.rand(tokens, 2, generator=g, dtype=torch.float64)
    tags = torch.randint(0, 3, (tokens, 2), generator=g)
    experts = torch.randn(4, 6, 6, generator=g, dtype=torch.float64)
    return hidden, index, weights, tags, experts


def _reference(tokens: int) -> tuple[torch.Tensor, ...]:
    hidden, index, weights, tags, experts = _problem(tokens)
    hidden.requires_grad_(), weights.requires_grad_(), experts.requires_grad_()
    token = torch.arange(tokens).repeat_interleave(2)
    rows = _experts(hidden.index_select(0, token), index.reshape(-1), tags.index_select(0, token), experts)
    out = (rows * weights.reshape(-1, 1)).view(tokens, 2, -1).sum(1)
    out.pow(2).sum().backward()
    return out.detach(), hidden.grad, weights.grad, experts.grad


def _rank(rank: int, port: int, tokens: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        hidden, index, weights, tags, experts = _problem(tokens)
        mine = experts[2 * rank:2 * rank + 2].clone().requires_grad_()  # this rank's two experts
        hidden.requires_grad_(), weights.requires_grad_()
        out = dispatch.run(hidden, index, weights, tags, lambda x, e, t: _experts(x, e, t, mine), rank=rank, ranks=2,
                           experts_per_rank=2, group=None)
        whole = out.detach().clone()
        dist.all_reduce(whole)  # (what the experts module's own all-reduce does)
        # every rank's loss on the whole output; the gradient of its own share's rows is its part
        out.backward(2 * whole)
        queue.put((rank, whole, hidden.grad, weights.grad, mine.grad))
    finally:
        dist.destroy_process_group()


@pytest.mark.stack  # several real processes
@pytest.mark.parametrize("tokens", [9, 1])  # 1: rank 1 dispatches nothing, and receives little
def test_dispatch_on_two_processes_equals_one_process_forward_and_backward(tokens):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_rank, args=(r, port, tokens, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((item[0], item[1:]) for item in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    out, hidden_grad, weights_grad, experts_grad = _reference(tokens)
    for rank in (0, 1):
        whole, h, w, e = got[rank]
        torch.testing.assert_close(whole, out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(e, experts_grad[2 * rank:2 * rank + 2], rtol=1e-12, atol=1e-12)
    # each rank holds its share's input and weight gradients (the experts module sums them over the ranks)
    torch.testing.assert_close(got[0][1] + got[1][1], hidden_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0][2] + got[1][2], weights_grad, rtol=1e-12, atol=1e-12)
