"""A trainer gang: one trainer shard as N ranks on torch.distributed, for bases bigger than one GPU.

The ranks are started together by `torch.distributed.run` (`quilt up --trainer-ranks N`, or a pod
of N GPUs); each loads only its part of the base through transformers' own parallel plans
(`DistributedConfig`: the tensor-parallel plan the architecture ships, or the experts split over
the ranks with each MoE block's tokens dispatched to them, `batcher.engine.dispatch`, or FSDP2),
and its share of every LoRA layer (`batcher.engine.grouped.Split`, laid out as vLLM
lays LoRA out under tensor parallelism).

Rank 0 runs today's trainer loop (stream, fair share, futures, snapshots, settle). Its backend has
a `Leader` as its mirror: every call that changes tensors (a pass, a step, a create, a load, an
export), marked `@collective()` where the backend defines it (`batcher.engine.collective`), is
first handed to the other ranks, which make the same call on their own backend (`follow`), so all
ranks run the same collectives in the same order. A rank with no work of its own still joins every
pass (an FSDP gang's ranks each compute their share of its rows: `batcher.engine.data_parallel`).
A rank that dies takes the gang with it: `torch.distributed.run` stops the others and starts
the gang again (its `--max-restarts`), and rank 0 restores and replays as a single trainer does.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from batcher.engine import expert_lora
from batcher.engine.collective import Mirrored, collective_calls
from batcher.engine.grouped import Split, tp_mesh
from core import faults
from core.errors import QuiltError

log = logging.getLogger("quilt.trainer.gang")

Parallel = Literal["tp", "ep", "fsdp"]

# A follower waits on rank 0 for as long as the trainer idles; only a dead rank should end the wait
# (torch.distributed.run notices that and restarts the gang), never a quiet hour.
_IDLE_TIMEOUT = datetime.timedelta(days=7)

# The tensor-parallel styles (transformers' plan names) whose LoRA splits, and how. The other
# styles a plan may give a LoRA-targeted layer gather the output ("colwise_gather_output" on
# lm_head): such a layer's LoRA is whole on every rank.
_SPLIT_OF_STYLE = {"colwise": "out", "rowwise": "in"}
_WHOLE_STYLES = frozenset({"colwise_gather_output", "colwise_rep", "rowwise_rep", "embedding_rowwise"})


@dataclass(frozen=True)
class GangShape:
    """How many ranks, and how they split the base: "tp" (tensor parallel over all ranks), "ep"
    (MoE: experts split over the ranks, each block's tokens dispatched to them; attention whole on
    every rank), "fsdp" (every weight sharded,
    gathered layer by layer; each rank computes its share of a pass's rows,
    `batcher.engine.data_parallel`)."""

    ranks: int = 1
    parallel: Parallel = "tp"

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"trainer ranks must be at least 1, not {self.ranks}")
        if self.parallel not in ("tp", "ep", "fsdp"):
            raise ValueError(f"trainer parallel must be tp, ep or fsdp, not {self.parallel!r}")


# The tensor-parallel style an "ep" gang gives its attention: whole on every rank, no collective.
REPLICATED = "quilt_replicated"


def expert_plan(path: str) -> dict[str, str]:
    """The tensor-parallel plan overrides an "ep" gang loads the base at `path` with: each MoE block's
    experts split over the ranks, whole (the "grouped_gemm" rules of the architecture's own
    expert-parallel plan, applied over the tensor-parallel group), run by Quilt's token dispatch
    (`expert_lora.dispatch_tokens`) inside transformers' `moe_tp_experts` style (which sums the ranks'
    outputs, and their input's and routing weights' gradients); the router left as it is, choosing
    among all the experts; attention whole on every rank (its rules made `REPLICATED`: its KV heads
    need not divide by the ranks). Its rules go in the tensor-parallel plan, not the expert-parallel
    one: transformers applies an expert-parallel plan only in its masked form (the router masked
    to each rank's experts) or its own dispatch (which knows no tenants)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

    if REPLICATED not in ALL_PARALLEL_STYLES:
        ALL_PARALLEL_STYLES[REPLICATED] = TensorParallelLayer()  # (its every hook does nothing)
    auto: Any = AutoModelForCausalLM  # (untyped)
    with torch.device("meta"):
        model = auto.from_config(AutoConfig.from_pretrained(path))
    plan = {key: REPLICATED for key in model.tp_plan if ".self_attn." in key}
    weights = {key: style for key, style in model.ep_plan.items() if style == "grouped_gemm"}
    blocks = {key.rpartition(".")[0] for key in weights}
    return {**plan, **weights, **{block: "moe_tp_experts" for block in blocks}}


def load_base(path: str, shape: GangShape, device: str, **kw: Any) -> Any:
    """This rank's part of the base.

    "tp" loads through transformers' `DistributedConfig` with the tensor-parallel plan the
    architecture ships. "ep" splits the experts over the ranks and keeps attention whole on every
    rank (`expert_plan`; the rest of the plan, the unembedding's, splits as under "tp"),
    and dispatches each MoE block's tokens to their experts' ranks (`batcher.engine.dispatch`).
    "fsdp" is torch's `fully_shard` on each decoder layer and on the decoder (the trainer calls the
    decoder and the unembedding apart, so transformers' own FSDP plan, whose root is the whole causal
    LM, does not fit); the unembedding stays whole per rank. Returns the transformers causal LM."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if shape.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model: Any = AutoModelForCausalLM.from_pretrained(path, **kw)  # (a transformers causal LM)
        mesh = init_device_mesh(torch.device(device).type, (shape.ranks,), mesh_dim_names=("fsdp",))
        decoder = model.get_decoder()
        for layer in decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(decoder, mesh=mesh)
        return model.to(device)
    if shape.parallel == "ep":
        config = DistributedConfig(tp_size=shape.ranks, tp_plan=expert_plan(path))
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, **kw)
        expert_lora.dispatch_tokens(model)
        return model
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=shape.ranks), **kw)


def check_shape(shape: GangShape, config: dict[str, Any]) -> list[str]:
    """What makes a gang of this shape unable to split this base (an empty list: it can)."""
    if shape.ranks == 1:
        return []
    text = config.get("text_config", config)
    problems = []
    if "vision_config" in config:
        # load_base builds the causal LM alone (no vision tower) and its expert plan names the text model's layers
        problems.append(f"trainer_ranks={shape.ranks}: a vision base trains in one process (trainer_ranks 1)")
    # "tp" splits heads and MLP widths over the ranks, "ep" only the dense MLP's (its attention is
    # whole on every rank, its experts whole on theirs); both split the vocabulary (the unembedding's
    # plan splits it and gathers the logits)
    keys = {"tp": ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                   "vocab_size"), "ep": ("intermediate_size", "vocab_size")}.get(shape.parallel, ())
    for key in keys:
        value = text.get(key)
        if value and value % shape.ranks:
            problems.append(f"{key}={value} is not divisible by {shape.ranks} tensor-parallel ranks")
    if shape.parallel == "ep":
        experts = text.get("num_experts") or text.get("n_routed_experts") or text.get("num_local_experts")
        if not experts:
            problems.append("expert parallel needs a mixture-of-experts base")
        elif experts % shape.ranks:
            problems.append(f"{experts} experts are not divisible by {shape.ranks} expert-parallel ranks")
    return problems


@dataclass(frozen=True)
class Member:
    """This process's place in its gang."""

    rank: int
    size: int
    shape: GangShape
    control: dist.ProcessGroup | None  # a gloo group for rank 0's calls (on GPUs the passes' collectives use NCCL)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def join(shape: GangShape, device: str) -> Member:
    """Join the gang `torch.distributed.run` started this process in (its RANK, WORLD_SIZE and
    MASTER_* variables); on GPUs each rank takes the GPU of its LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != shape.ranks:
        raise SystemExit(f"QUILT_TRAINER_RANKS={shape.ranks} but this process was started as one of {world} ranks; "
                         "start the trainer with torch.distributed.run --nproc-per-node "
                         f"{shape.ranks} (quilt up --trainer-ranks {shape.ranks} does)")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        rank = int(os.environ["RANK"])
        # torch.distributed.run keeps one store for all of a gang's restarts, and a restarted gang's
        # gloo groups would read the dead attempt's addresses from it: each attempt gets its own keys.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=not agent and rank == 0, timeout=datetime.timedelta(minutes=5))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=_IDLE_TIMEOUT,
                                store=dist.PrefixStore(f"quilt/attempt-{attempt}", store), rank=rank,
                                world_size=world)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return Member(dist.get_rank(), dist.get_world_size(), shape, control)


def rank_device(device: str) -> str:
    """A gang rank's compute device: its own GPU on a GPU machine."""
    if device.startswith("cuda") and dist.is_initialized():
        return f"cuda:{torch.cuda.current_device()}"
    return device


def splits(model: nn.Module, targets: tuple[str, ...]) -> dict[str, Split]:
    """Each LoRA-targeted Linear's share under the base's tensor-parallel plan, by module path, and
    each experts module's share of the experts where "experts" is a target (expert parallel).

    A layer the plan does not split (or only FSDP shards) has no entry: its LoRA is whole on every
    rank. A plan style this module does not know for a targeted layer is refused rather than guessed."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard

    plan = getattr(model, "tp_plan", None) or {}
    out = {}
    for path, module in model.named_modules():
        if "experts" in targets and hasattr(module, "gate_up_proj"):
            split = expert_lora.split_of(module)
            if split is not None:
                out[path] = split
            continue
        if not isinstance(module, nn.Linear) or path.rsplit(".", 1)[-1] not in targets:
            continue
        weight = module.weight
        names = weight.device_mesh.mesh_dim_names if isinstance(weight, DTensor) else None
        if not isinstance(weight, DTensor) or names is None or "tp" not in names:
            continue
        mesh = weight.device_mesh
        tp = names.index("tp")
        if mesh.size(tp) == 1:
            continue  # (a tensor-parallel axis of one: nothing is split)
        style = plan.get(replace_layer_number_by_wildcard(path))
        if style in _WHOLE_STYLES:
            continue
        if style not in _SPLIT_OF_STYLE:
            raise ValueError(f"{path}: tensor-parallel style {style!r} has no LoRA layout here "
                             f"(known: {sorted(_SPLIT_OF_STYLE)} split, {sorted(_WHOLE_STYLES)} whole)")
        out[path] = Split(_SPLIT_OF_STYLE[style], mesh.get_local_rank(tp), mesh.size(tp), mesh.get_group(tp),
                          tp_mesh(mesh))
    return out


# ---------------------------------------------------------------------- rank 0 and the others


class GangBroken(BaseException):
    """A call failed on rank 0 for a reason of the server's (a rank died in a collective, a device
    fault): the ranks may have parted mid-call, and only a restart of the whole gang, which restores
    and replays, brings them back into step. A BaseException, so that no handler of one request's
    failure catches it: it ends the process, and torch.distributed.run restarts the gang."""


class Leader:
    """Rank 0's mirror (`batcher.engine.collective.Mirror`): each collective call of its backend is
    handed to the other ranks first (`torch.distributed.broadcast_object_list` on the control group),
    then made here; a collective call made inside another is part of it."""

    def __init__(self, member: Member, send: Callable[[object], None] | None = None):
        """`send`: how a call reaches the other ranks (a broadcast on the gang's control group)."""
        self.member = member
        self._send = send or self._broadcast
        self._inside = False  # a marked call is running: the calls it makes are its own

    def call(self, name: str, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._inside:
            return run(*args, **kwargs)
        args, kwargs = _decided(name, args, kwargs)
        self._inside = True
        try:
            self._send((name, args, kwargs))
            return run(*args, **kwargs)
        except QuiltError:
            raise  # the caller's mistake, met alike by every rank: the gang is still in step
        except Exception as exc:
            raise GangBroken(f"{name} failed on rank 0: {type(exc).__name__}: {exc}") from exc
        finally:
            self._inside = False

    def _broadcast(self, message: object) -> None:
        dist.broadcast_object_list([message], src=0, group=self.member.control)

    def close(self) -> None:
        """Tell the other ranks the trainer is stopping (they return from `follow`)."""
        self._send(None)


def _decided(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Make the choices a call would leave to each rank (a random seed, the clock) on rank 0."""
    if name == "create":
        model_id, lora, *rest = args  # the rest (the optimizer family) as the caller gave it
        if lora.seed is None:
            lora = dataclasses.replace(lora, seed=int.from_bytes(os.urandom(4), "little"))
        return (model_id, lora, *rest), kwargs
    if name == "offload_idle" and kwargs.get("now") is None:
        kwargs = {**kwargs, "now": time.monotonic()}
    return args, kwargs


def lead(backend: Mirrored, member: Member) -> Leader:
    """Rank 0: its backend's collective calls are handed to the other ranks from now on."""
    leader = Leader(member)
    backend.mirror = leader
    return leader


def follow(backend: Mirrored, member: Member) -> None:
    """A rank other than 0: make rank 0's collective calls on this rank's backend until it stops.

    Writes are rank 0's: a save here is its `followers` call (`export`: only gathering the shares).
    A call that fails for the caller's reason fails alike on rank 0, where it is reported; any
    other failure ends this rank, and with it the gang (`GangBroken`)."""
    calls = collective_calls(type(backend))
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=member.control)
        if box[0] is None:
            return
        name, args, kwargs = box[0]
        if name == "run_pass":
            faults.crash_point("gang.rank_in_pass")  # rank 0 is in the pass already, waiting on this rank
        try:
            getattr(backend, calls[name])(*args, **kwargs)
        except QuiltError:
            log.info("rank %d: %s refused, as on rank 0", member.rank, name)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
