"""Token dispatch in an expert-parallel gang (`batcher.engine.gang`, "ep"): each MoE block sends each
(token, chosen expert) pair to the rank that holds the expert, and the experts' outputs come back.

Every rank of an "ep" gang holds every token of a pass (attention is replicated), so each rank
dispatches only its share of the tokens (`share`: contiguous, as even as can be). The pairs of that
share are sorted by the rank holding their expert (`plan`, a pure function over the routing); the
counts go first (`exchange_counts`), then the rows with one all-to-all whose backward is the reverse
all-to-all (`exchange`), and beside them, as plain integers, what the receiving rank needs to compute
them: each row's expert (local to that rank) and its tags (`batcher.engine.expert_lora`: each LoRA
rank class's member index of the row's adapter). The receiving rank runs its experts on what it
received; a second all-to-all brings the outputs back, where they are put back in pair order
(`Dispatch.restore`) and combined with the routing weights. A rank's block output is its share's
rows and zero elsewhere: the experts module's own output all-reduce (transformers'
`moe_tp_experts`) sums the shares into every token's output on every rank, and its backward hook
sums the input's gradient, which each rank holds for its share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

# The receiving rank's computation: (rows, each row's local expert, each row's tags) -> each row's output.
Local = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def share(tokens: int, rank: int, ranks: int) -> tuple[int, int]:
    """The tokens [start, end) this rank dispatches: contiguous, the first `tokens % ranks` ranks
    one more than the others (a rank may have none)."""
    base, extra = divmod(tokens, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class Dispatch:
    """Where one rank's share of a block's (token, expert) pairs go. A pair's position is its place
    in the share's pairs, token-major (token t's k-th choice at (t - start) * top_k + k)."""

    start: int
    end: int
    order: torch.Tensor  # pair positions in send order: by destination rank, stably
    send: list[int]  # how many pairs go to each rank
    token: torch.Tensor  # each sent pair's token (a pass-wide index), in send order
    expert: torch.Tensor  # each sent pair's expert, local to its destination rank, in send order

    def restore(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows in send order back in pair order (the inverse permutation of `order`)."""
        return rows.new_empty(rows.shape).index_copy(0, self.order, rows)


def plan(top_k_index: torch.Tensor, rank: int, ranks: int, experts_per_rank: int) -> Dispatch:
    """This rank's dispatch of a block whose router chose `top_k_index` [tokens, top_k] (global
    expert ids; rank r holds experts [r * experts_per_rank, (r + 1) * experts_per_rank))."""
    tokens, top_k = top_k_index.shape
    start, end = share(tokens, rank, ranks)
    chosen = top_k_index[start:end].reshape(-1)
    dest = torch.div(chosen, experts_per_rank, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=ranks).tolist()  # (the block's one read by the host; bincount refuses
    if len(send) > ranks:                                   # a negative id, and counts past `ranks` show here)
        raise ValueError(f"an expert id past the {ranks * experts_per_rank} experts was routed to")
    token = torch.arange(start, end, device=top_k_index.device).repeat_interleave(top_k)
    return Dispatch(start, end, order, send, token.index_select(0, order),
                    (chosen - dest * experts_per_rank).index_select(0, order))


# ---------------------------------------------------------------------- the collectives (thin)


def exchange_counts(send: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """How many rows each rank sends this one, given how many this one sends each."""
    out = torch.empty(len(send), dtype=torch.int64, device=device)
    dist.all_to_all_single(out, torch.tensor(send, dtype=torch.int64, device=device), group=group)
    return [int(n) for n in out.tolist()]


def exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """`rows` (send[r] of them for rank r, in rank order) out, what the others send this rank in;
    autograd sends the gradient back the other way. With grad enabled the result always carries a
    gradient, so that every rank's backward makes the reverse all-to-all, whatever it sent."""
    if torch.is_grad_enabled() and not rows.requires_grad:
        rows = rows.detach().requires_grad_()
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    received: torch.Tensor = all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return received


def exchange_plain(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """`exchange` for what carries no gradient (expert ids, tags)."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


def run(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, tags: torch.Tensor,
        local: Local, *, rank: int, ranks: int, experts_per_rank: int, group: dist.ProcessGroup | None
        ) -> torch.Tensor:
    """The block's experts output on this rank: its share's tokens' rows, zero elsewhere (see the
    module's docstring). `tags` [tokens, C] (int64): what travels with each token to its experts."""
    d = plan(top_k_index, rank, ranks, experts_per_rank)
    recv = exchange_counts(d.send, group, hidden.device)
    x = exchange(hidden.index_select(0, d.token), d.send, recv, group)
    meta = exchange_plain(torch.cat([d.expert.unsqueeze(1), tags.index_select(0, d.token)], dim=1), d.send, recv, group)
    # (+ an empty sum: the output depends on the received rows even where there are none or no
    # expert ran, so the backward reaches the first all-to-all on every rank)
    out = local(x, meta[:, 0], meta[:, 1:]) + x[:0].sum()
    back = d.restore(exchange(out, recv, d.send, group))
    (tokens, top_k), width = top_k_index.shape, back.shape[1]
    mine = (back * top_k_weights[d.start:d.end].reshape(-1, 1).to(back.dtype)).view(d.end - d.start, top_k, width).sum(1)
    return torch.cat([mine.new_zeros((d.start, width)), mine, mine.new_zeros((tokens - d.end, width))]).to(hidden.dtype)
