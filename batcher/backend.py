"""The tensors behind the trainer loop: one frozen base, one LoRA adapter and one AdamW per
training model, and a fused forward/backward over many adapters.

The loop (batcher.worker) owns queues and storage; this class owns tensors, behind a few methods
that each return one result or one error per request, so one tenant's bad request fails only that
request.

Fusing uses the grouped multi-LoRA layer of `batcher.multilora` (rows ordered by adapter, one slice
per adapter). It was picked over PEFT's mixed-adapter forward by `bench/trainer_fusion.py`, which
measures both side by side. Checkpoints are PEFT-format adapter directories.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bases import architectures
from batcher import losses
from batcher.multilora import MultiLoraModel
from checkpoints.layout import ADAPTER_WEIGHTS, OPTIMIZER_FILE, TrainerMeta
from core.errors import Conflict, InvalidInput, QuiltError, ServerError, UserError
from core.loss_spec import INT_INPUTS, WIDE_INPUTS, LossConfig
from core.work import AdamParams, LoraShape, PassWork

log = logging.getLogger("quilt.trainer.backend")

LORA_ALPHA = 32  # Tinker sends no alpha; a fixed alpha keeps the effective step size comparable across ranks


@dataclass
class Adapter:
    """One training model's trainable state."""

    model_id: str
    name: str  # the PEFT adapter name (a slot label; model ids contain characters PEFT keys cannot)
    lora_config: dict
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0  # optimizer steps taken: the model's policy version
    last_used: float = field(default_factory=time.monotonic)
    resident: bool = True  # on the compute device (False: parked on the offload device)


@dataclass(frozen=True)
class PassStats:
    """What one fused pass did, for observability."""

    models: int
    rows: int
    tokens: int  # real model-input tokens
    padded_tokens: int  # tokens computed including right padding
    micro_batches: int
    seconds: float

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0


@dataclass(frozen=True)
class PassRequest:
    """One forward/forward_backward request's slice of a fused pass."""

    request_id: str
    model_id: str
    work: PassWork
    forward_only: bool


@dataclass(frozen=True)
class _Row:
    request_index: int
    datum_index: int
    tokens: tuple[int, ...]
    inputs: Mapping[str, tuple]
    adapter: str
    policy_version: int | None  # the version this datum was sampled with, if it says
    width: int = 1  # targets per position (top-K distillation: K)


class LoraBackend:
    def __init__(self, base_path: str | Path, *, device: str = "cpu", max_tokens_per_pass: int = 16384,
                 offload_device: str = "cpu", dtype: torch.dtype = torch.float32, max_resident: int = 0):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.offload_device = torch.device(offload_device)
        self.max_tokens_per_pass = max_tokens_per_pass
        self.max_resident = max_resident  # adapters on the compute device at once; 0 = no limit
        self.last_pass: PassStats | None = None
        # Which modules can carry LoRA is the architecture's (bases.architectures); a model's own
        # lora_config picks among them. Adapters and their AdamW state are float32 on any base dtype.
        self.config = json.loads((Path(base_path) / "config.json").read_text())
        arch = architectures.of_config(self.config)
        kw = {}
        if arch.moe and dtype == torch.float64:
            kw["experts_implementation"] = "eager"  # grouped_mm has no float64 kernel (float64 is for tests)
        base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=dtype, **kw)
        base.requires_grad_(False)
        self.base_path = str(base_path)
        self.base = base.to(self.device).eval()
        self.lora = MultiLoraModel(self.base, arch.targets(tied=architectures.is_tied(self.config)))
        self.adapters: dict[str, Adapter] = {}
        self._next_slot = 0

    # ------------------------------------------------------------------ adapters

    def has(self, model_id: str) -> bool:
        return model_id in self.adapters

    def create(self, model_id: str, lora: LoraShape) -> None:
        if model_id in self.adapters:
            self.delete(model_id)
        name = f"slot{self._next_slot}"
        self._next_slot += 1
        lora_config = lora.to_json()
        params = self.lora.add_adapter(
            name, rank=lora.rank, alpha=LORA_ALPHA, targets=architectures.lora_targets(self.config, lora_config),
            seed=lora.seed if lora.seed is not None else int.from_bytes(os.urandom(4), "little"),
        )
        self.adapters[model_id] = Adapter(model_id, name, lora_config, params, torch.optim.AdamW(params))

    def delete(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        if adapter is not None:
            self.lora.remove_adapter(adapter.name)

    # ------------------------------------------------------------------ residency

    def _move(self, adapter: Adapter, device: torch.device) -> None:
        """Move an adapter's weights, gradients and optimizer moments together."""
        for p in adapter.params:
            p.data = p.data.to(device)
            if p.grad is not None:
                p.grad = p.grad.to(device)
        for state in adapter.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    state[key] = value.to(device)

    def ensure_resident(self, model_ids) -> None:
        """Bring these models' adapters to the compute device; when that makes more resident than
        `max_resident` (from the memory plan), park the least recently used others first."""
        wanted = set(model_ids)
        now = time.monotonic()
        for model_id in wanted:
            self.adapters[model_id].last_used = now
        if self.max_resident:
            others = sorted((a for a in self.adapters.values() if a.resident and a.model_id not in wanted),
                            key=lambda a: a.last_used)
            for adapter in others[:max(0, len(others) + len(wanted) - self.max_resident)]:
                self._move(adapter, self.offload_device)
                adapter.resident = False
        for model_id in wanted:
            adapter = self.adapters[model_id]
            if not adapter.resident:
                self._move(adapter, self.device)
                adapter.resident = True

    def offload_idle(self, idle_s: float, *, now: float | None = None) -> int:
        """Park adapters unused for `idle_s` on the offload device; returns how many moved.
        On a CPU-only worker both devices are the CPU: only the bookkeeping changes."""
        now = time.monotonic() if now is None else now
        moved = 0
        for adapter in self.adapters.values():
            if adapter.resident and now - adapter.last_used >= idle_s:
                self._move(adapter, self.offload_device)
                adapter.resident = False
                moved += 1
        return moved

    def residency(self) -> dict[str, int]:
        resident = sum(a.resident for a in self.adapters.values())
        return {"resident": resident, "offloaded": len(self.adapters) - resident}

    def adapter_state(self, model_id: str) -> dict[str, torch.Tensor]:
        """The adapter's weights under PEFT's saved key names."""
        return self.lora.state_dict(self.adapters[model_id].name)

    # ------------------------------------------------------------------ fused pass

    def run_pass(self, requests: list[PassRequest]) -> list[dict | QuiltError]:
        """Run many models' forward/forward_backward requests through one pass over the base.

        Returns one result (Tinker ForwardBackwardOutput JSON) or one error per request, in order.
        """
        outcomes: list[dict | QuiltError | None] = [None] * len(requests)
        configs: dict[int, LossConfig] = {}
        rows: list[_Row] = []
        for i, req in enumerate(requests):
            if req.model_id not in self.adapters:
                outcomes[i] = ServerError(f"model {req.model_id!r} is not loaded on this trainer")
                continue
            adapter = self.adapters[req.model_id]
            # The trainer's policy version is the model's optimizer step count.
            configs[i] = dataclasses.replace(req.work.loss_config, current_policy_version=adapter.steps)
            rows += [_Row(i, j, d.tokens, d.inputs, adapter.name, d.policy_version, d.width)
                     for j, d in enumerate(req.work.data)]
        self.ensure_resident({requests[i].model_id for i in configs})
        started = time.perf_counter()
        chunks = self._micro_batches(rows)

        # Rows run sorted by length; results are keyed by datum so each request gets them in its own order.
        per_datum: dict[int, dict[int, losses.DatumLoss]] = {i: {} for i in configs}
        not_finite: dict[int, list[int]] = {}  # request -> datums whose loss overflowed (no gradient)
        backpropagated: set[int] = set()  # requests with gradients already accumulated
        try:
            for chunk in chunks:
                self._run_chunk(chunk, requests, configs, per_datum, not_finite, backpropagated)
        except Exception as exc:
            log.exception("fused pass failed")
            for i in configs:
                outcomes[i] = ServerError(f"trainer pass failed: {type(exc).__name__}: {exc}")
            return outcomes

        for i in configs:
            if i in not_finite:
                outcomes[i] = self._not_finite(requests[i], sorted(not_finite[i]), i in backpropagated)
            else:
                outcomes[i] = _forward_backward_output([per_datum[i][j] for j in sorted(per_datum[i])])
        self.last_pass = PassStats(
            models=len({requests[i].model_id for i in configs}), rows=len(rows),
            tokens=sum(len(r.tokens) for r in rows),
            padded_tokens=sum(len(c) * max(len(r.tokens) for r in c) for c in chunks),
            micro_batches=len(chunks), seconds=time.perf_counter() - started,
        )
        return outcomes

    def _micro_batches(self, rows: list[_Row]) -> list[list[_Row]]:
        """Split rows so each pass holds at most `max_tokens_per_pass` padded tokens; gradients of
        successive chunks accumulate, so the split changes nothing numerically beyond rounding."""
        chunks: list[list[_Row]] = []
        current: list[_Row] = []
        longest = 0
        for row in sorted(rows, key=lambda r: len(r.tokens)):
            longest_if_added = max(longest, len(row.tokens))
            if current and longest_if_added * (len(current) + 1) > self.max_tokens_per_pass:
                chunks.append(current)
                current, longest_if_added = [], len(row.tokens)
            current.append(row)
            longest = longest_if_added
        if current:
            chunks.append(current)
        return chunks

    def _not_finite(self, req: PassRequest, datums: list[int], backpropagated: bool) -> UserError:
        """A request whose loss overflowed: it fails, and none of its gradient is kept."""
        where = ", ".join(f"data[{j}]" for j in datums[:8]) + (" ..." if len(datums) > 8 else "")
        msg = (f"the loss of {where} is not finite (it overflowed float32): make the weights or advantages "
               "smaller")
        if backpropagated:
            # Its other datums ran in an earlier micro-batch: that partial gradient cannot be told
            # apart from the model's earlier ones, so all accumulated gradients go.
            for p in self.adapters[req.model_id].params:
                p.grad = None
            msg += "; the model's gradients accumulated since its last optim_step were discarded, send those " \
                   "forward_backward calls again"
        elif not req.forward_only:
            msg += "; no gradient of this request was accumulated"
        return UserError(msg, field="forward_backward_input.data")

    def _run_chunk(self, chunk: list[_Row], requests, configs, per_datum, not_finite, backpropagated) -> None:
        needs_grad = any(not requests[r.request_index].forward_only for r in chunk)
        chunk = sorted(chunk, key=lambda r: r.adapter)  # each adapter's rows contiguous: one slice each
        segments: list[tuple[str, int, int]] = []
        for b, row in enumerate(chunk):
            if segments and segments[-1][0] == row.adapter:
                segments[-1] = (row.adapter, segments[-1][1], b + 1)
            else:
                segments.append((row.adapter, b, b + 1))
        T = max(len(r.tokens) for r in chunk)
        K = max(r.width for r in chunk)
        input_ids_B_T = torch.zeros((len(chunk), T), dtype=torch.long)
        targets_B_T_K = torch.zeros((len(chunk), T, K), dtype=torch.long)
        for b, row in enumerate(chunk):
            n = len(row.tokens)
            input_ids_B_T[b, :n] = torch.tensor(row.tokens)
            targets_B_T_K[b, :n, :row.width] = torch.tensor(row.inputs["target_tokens"], dtype=torch.long).view(n, -1)
        input_ids_B_T = input_ids_B_T.to(self.device)
        targets_B_T_K = targets_B_T_K.to(self.device)
        # Right padding needs no attention mask: causal attention never lets a real position see a later pad.
        with torch.set_grad_enabled(needs_grad):
            logits_B_T_V = self.lora.forward(input_ids_B_T, segments)
            if logits_B_T_V.dtype in (torch.float16, torch.bfloat16):  # log-softmax in at least float32
                logits_B_T_V = logits_B_T_V.float()
            if K == 1:
                logprobs_B_T_K = -F.cross_entropy(
                    logits_B_T_V.flatten(0, 1), targets_B_T_K.flatten(), reduction="none"
                ).view(len(chunk), T, 1)
            else:  # top-K targets: K logits per position, never a (B, T, V) log-softmax
                logprobs_B_T_K = (logits_B_T_V.gather(-1, targets_B_T_K)
                                  - torch.logsumexp(logits_B_T_V, dim=-1, keepdim=True))
            chunk_losses = []
            for b, row in enumerate(chunk):
                req = requests[row.request_index]
                n = len(row.tokens)
                inputs = {k: _input_tensor(k, v, n, row.width) for k, v in row.inputs.items()}
                config = configs[row.request_index]
                sampled_at = row.policy_version if row.policy_version is not None else config.policy_version
                lp = logprobs_B_T_K[b, :n, :row.width] if row.width > 1 else logprobs_B_T_K[b, :n, 0]
                datum = losses.compute_loss(req.work.loss_fn, lp, inputs, config, policy_version=sampled_at)
                per_datum[row.request_index][row.datum_index] = datum
                chunk_losses.append(datum.loss)
            # One host sync per micro-batch: a datum whose loss overflowed adds no gradient.
            finite = torch.isfinite(torch.stack([loss.detach() for loss in chunk_losses])).tolist()
            for row, ok in zip(chunk, finite):
                if not ok:
                    not_finite.setdefault(row.request_index, []).append(row.datum_index)
            # A request with any overflowed datum keeps none of its gradient from here on.
            kept = [(row, loss) for row, loss in zip(chunk, chunk_losses)
                    if row.request_index not in not_finite and not requests[row.request_index].forward_only]
            if needs_grad and kept:
                sum(loss for _, loss in kept).backward()
                backpropagated.update(row.request_index for row, _ in kept)

    # ------------------------------------------------------------------ barriers

    def optim_step(self, model_id: str, adam: AdamParams) -> dict:
        """AdamW on one model's accumulated gradients (per-model clipping), then clear them."""
        self.ensure_resident([model_id])
        adapter = self.adapters[model_id]
        if not any(p.grad is not None for p in adapter.params):
            return {"metrics": {"skipped:sum": 1.0}}
        for group in adapter.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        clip = adam.grad_clip_norm
        norm = torch.nn.utils.clip_grad_norm_(adapter.params, max_norm=clip if clip > 0 else math.inf)
        if not math.isfinite(float(norm)):
            # Finite losses can still give gradients past float32; a step would make the weights NaN.
            adapter.optimizer.zero_grad(set_to_none=True)
            raise UserError("the accumulated gradients are not finite (they overflowed float32): make the "
                            "weights or advantages smaller; the gradients were discarded and the weights are "
                            "unchanged", field="adam_params")
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return {"metrics": {"grad_norm:mean": float(norm), "learning_rate:mean": adam.learning_rate,
                            "step:max": float(adapter.steps)}}

    def policy_version(self, model_id: str) -> int:
        """The model's policy version: how many optimizer steps its weights have taken."""
        return self.adapters[model_id].steps

    def save(self, model_id: str, directory: str, *, overwrite: bool, with_optimizer: bool = True) -> int:
        """Write the adapter in PEFT format (what vLLM loads), plus optimizer state for training
        checkpoints; returns bytes written. Atomic: written beside the target, then renamed."""
        return self.export(model_id, directory, overwrite=overwrite, with_optimizer=with_optimizer)()

    def export(self, model_id: str, directory: str, *, overwrite: bool, with_optimizer: bool = True) -> Callable[[], int]:
        """`save`, in two halves: this call takes what will be written (references, no copy) and
        checks the target; the function it returns writes it, from any thread. Until that has
        returned, nothing may change the adapter's weights or optimizer state in place: no
        optim_step and no load of this model (batcher.exports keeps to that)."""
        from safetensors.torch import save_file

        self.ensure_resident([model_id])
        adapter = self.adapters[model_id]
        dest = Path(directory)
        if dest.exists() and not overwrite:
            raise Conflict(f"checkpoint {dest.name!r} already exists; pass overwrite=True to replace it", field="path")
        # detach(): tensors of their own over today's storage, whatever later rebinds the parameters (parking).
        state = {k: v.detach() for k, v in self.adapter_state(model_id).items()}
        config = self._peft_config(adapter)
        optimizer = adapter.optimizer.state_dict() if with_optimizer else None
        meta = TrainerMeta(dict(adapter.lora_config), adapter.steps)

        def write() -> int:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
            try:
                save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(tmp / ADAPTER_WEIGHTS))
                config.save_pretrained(str(tmp))
                if optimizer is not None:
                    torch.save(optimizer, tmp / OPTIMIZER_FILE)
                meta.write(tmp)
                if dest.exists():
                    shutil.rmtree(dest)
                tmp.rename(dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return sum(f.stat().st_size for f in dest.iterdir())

        return write

    def load(self, model_id: str, directory: str, *, optimizer: bool) -> None:
        """Load a checkpoint into an existing model with the same LoRA shape; clears gradients.
        Without `optimizer`, the optimizer starts fresh (Tinker's load_state semantics)."""
        from safetensors.torch import load_file

        self.ensure_resident([model_id])
        adapter = self.adapters[model_id]
        src = Path(directory)
        meta = TrainerMeta.read(src)
        saved, ours = meta.lora_config, adapter.lora_config
        for key in ("rank", "train_attn", "train_mlp", "train_unembed"):
            if saved.get(key, True) != ours.get(key, True):
                raise InvalidInput(
                    f"checkpoint has lora_config.{key}={saved.get(key)!r} but this model has {ours.get(key)!r}",
                    field="path",
                )
        state = load_file(str(src / ADAPTER_WEIGHTS), device=str(self.device))
        try:
            self.lora.load_state_dict(adapter.name, state)
        except ValueError as exc:
            raise InvalidInput(f"checkpoint does not fit this model: {exc}", field="path") from None
        for p in adapter.params:
            p.grad = None
        adapter.optimizer = torch.optim.AdamW(adapter.params)
        if optimizer:
            adapter.optimizer.load_state_dict(torch.load(src / OPTIMIZER_FILE, weights_only=True))
        adapter.steps = meta.steps

    def _peft_config(self, adapter: Adapter):
        """The adapter_config.json that PEFT and vLLM read."""
        from peft import LoraConfig

        return LoraConfig(r=int(adapter.lora_config["rank"]), lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                          target_modules=architectures.lora_targets(self.config, adapter.lora_config), bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=self.base_path)


def _input_tensor(key: str, values: tuple, n: int, width: int) -> torch.Tensor:
    """A datum's loss input as the loss reads it: (n,), or (n, K) for top-K targets and weights."""
    t = torch.tensor(values, dtype=torch.long if key in INT_INPUTS else torch.float32)
    return t.view(n, width) if width > 1 and key in WIDE_INPUTS else t


def _forward_backward_output(per_datum: list[losses.DatumLoss]) -> dict:
    outputs = []
    for d in per_datum:
        outputs.append({
            key: {"data": t.detach().float().cpu().flatten().tolist(), "dtype": "float32", "shape": list(t.shape)}
            for key, t in d.outputs.items()
        })
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs,
            "metrics": losses.reduce_metrics(per_datum)}
