"""A LoRA adapter merged into its base, as a Hugging Face model directory, streamed file by file.

W' = W + scaling * (B @ A) for every weight the adapter wraps (scaling = lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA, per module where PEFT's rank/alpha patterns say so), computed in
float32 (float64 for a float64 base) and stored in the base's dtype. A PEFT `target_parameters`
LoRA on a 3-D experts weight (gpt-oss) merges each expert's B @ A into its [E, in, out] slice, and
per-expert LoRA (the trainer's export) onto a base that fuses its experts (Qwen3-VL-MoE's
`experts.gate_up_proj`) merges into each expert's rows of the fused weight (`fused_experts`).
Everything else of the base (config, tokenizer, generation config, the safetensors index) is sent
as it is.

Why not PEFT's `merge_and_unload`: it needs the whole base in memory, and then a second copy to
save it. Here only the adapter's low-rank factors stay in memory; each weight's dense delta is
computed when that weight is written and dropped after it (bench/merge_memory.py measures the
peak). A merged weight has the shape and dtype of the base's, so every merged .safetensors file
has the same header and the same size as the base's: it is written tensor by tensor in one pass,
one tensor in memory at a time, and its size is known before the first byte (a tar member, or a
Content-Length). The API streams it as a download (api.routes.downloads); `quilt export --merge`
unpacks that download into a directory.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoints.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS

CHUNK = 1 << 20
MERGEABLE_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Member:
    """One file of the merged directory: its name, exact size, and a reader of its bytes."""

    name: str
    size: int
    chunks: Callable[[], Iterator[bytes]]


def _scaling(config: dict, module: str) -> float:
    def pattern(key: str, default):
        # PEFT matches pattern keys against the module's name or its tail.
        for k, v in (config.get(key) or {}).items():
            if module == k or module.endswith("." + k):
                return v
        return default

    r = pattern("rank_pattern", config["r"])
    alpha = pattern("alpha_pattern", config.get("lora_alpha", r))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


@dataclass(frozen=True)
class Factors:
    """The low-rank factors of one wrapped weight's delta: scaling * B @ A. Kept as they are (a few
    MB for a whole adapter) until that weight is written, so a merge holds one dense delta at a
    time: all of them at once are an fp32 copy of every wrapped weight (about 30 GB for an 8B base)."""

    b: Any  # torch.Tensor (out, r); a 3-D experts weight's: (out, r * E), expert-minor as PEFT keeps it
    a: Any  # torch.Tensor (r, in); a 3-D experts weight's: (E * r, in)
    scaling: float
    experts: int = 0  # a PEFT target parameter's [E, in, out] experts weight (gpt-oss): its E

    @property
    def shape(self) -> tuple[int, ...]:
        if self.experts:
            return self.experts, self.a.shape[1], self.b.shape[0]
        return self.b.shape[0], self.a.shape[1]

    def delta(self, dtype: Any = None, device: Any = None):
        """The dense delta, computed now in `dtype` (float32 unless given), on `device` (the factors' unless given)."""
        import torch

        a, b = (t.to(device=device, dtype=dtype or torch.float32) for t in (self.a, self.b))
        if self.experts:  # each expert's B @ A, stored [in, out] as the weight is
            e = self.experts
            a, b = a.reshape(e, -1, a.shape[1]), b.reshape(b.shape[0], -1, e).permute(2, 0, 1)
            return (b @ a).transpose(1, 2) * self.scaling
        return (b @ a) * self.scaling


# One expert's projection as the trainer exports it (batcher.engine.expert_lora; vLLM and published
# per-expert MoE checkpoints name them so).
_EXPERT = re.compile(r"(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class ExpertFactors:
    """Every expert's LoRA on one fused experts weight [E, out, in] (gate_up_proj: gate rows, then up
    rows; down_proj): per block of its rows (the gate half, the up half; all of down_proj) the first
    row, the experts' A [E, r, in] and B [E, rows, r] stacked (zeros for an expert the adapter
    leaves out, or past a lower rank) and their scalings [E]. `transposed`: the weight is stored
    [E, in, out] (as published Qwen3-VL-MoE checkpoints are), and so is the delta."""

    out_in: tuple[int, int, int]  # [E, out, in]
    blocks: tuple[tuple[int, Any, Any, Any], ...]
    transposed: bool = False

    @property
    def shape(self) -> tuple[int, int, int]:
        e, rows, cols = self.out_in
        return (e, cols, rows) if self.transposed else self.out_in

    def delta(self, dtype: Any = None, device: Any = None) -> Any:
        """The dense delta in the weight's layout, computed now in `dtype` (float32 unless given) on `device`."""
        import torch

        dtype = dtype or torch.float32
        out = torch.zeros(self.out_in, dtype=dtype, device=device)
        for row, *factors in self.blocks:
            a, b, scaling = (t.to(device=device, dtype=dtype) for t in factors)
            out[:, row:row + b.shape[1]] = (b @ a) * scaling[:, None, None]
        return out.transpose(1, 2) if self.transposed else out


Delta = Factors | ExpertFactors


def fused_experts(factors: dict[str, Factors], shapes: dict[str, tuple[int, ...]], *,
                  stored: bool = False) -> dict[str, Delta]:
    """An adapter's factors by the weights of the model (`shapes`: name -> shape): each expert's
    projection gathered onto the fused experts weight it changes, where the model fuses them (a 3-D
    `….experts.gate_up_proj` / `down_proj`), the rest as they are (a weight the model lacks too:
    the caller names it). In memory (transformers) a fused weight is [E, out, in]; `stored`: the
    shapes are a checkpoint's, which may hold it [E, in, out] (told apart by the factors' shapes; a
    square one is read [E, out, in], as transformers loads it). ValueError where an expert's
    factors do not fit."""
    out: dict[str, Delta] = {}
    experts: dict[str, dict[tuple[int, int], dict[int, Factors]]] = {}  # weight -> (row, rows) -> expert -> factors
    for name, f in factors.items():
        m = _EXPERT.fullmatch(name)
        fused = "" if m is None else f"{m['block']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"
        if m is None or name in shapes or len(shapes.get(fused, ())) != 3:
            out[name] = f
            continue
        rows = f.shape[0]
        block = (rows if m["proj"] == "up_proj" else 0, rows)
        experts.setdefault(fused, {}).setdefault(block, {})[int(m["expert"])] = f
    for fused, blocks in experts.items():
        rows = next(iter(blocks))[1] * (1 if fused.endswith("down_proj") else 2)  # gate_up: gate rows, up rows
        width = next(iter(next(iter(blocks.values())).values())).shape[1]
        shape = shapes[fused]
        transposed = stored and tuple(shape[1:]) != (rows, width) and tuple(shape[1:]) == (width, rows)
        out_in = (shape[0], rows, width) if transposed else (shape[0], shape[1], shape[2])
        out[fused] = ExpertFactors(out_in, tuple(_stacked(fused, out_in, row, n, per)
                                                 for (row, n), per in sorted(blocks.items())), transposed)
    return out


def _stacked(name: str, shape: tuple[int, int, int], row: int, rows: int, per: dict[int, Factors]) -> tuple[int, Any, Any, Any]:
    """One row block's (first row, A [E, r, in], B [E, rows, r], scalings [E])."""
    import torch

    count, height, width = shape
    for e, f in per.items():
        if e >= count or tuple(f.shape) != (rows, width) or row + rows > height:
            raise ValueError(f"expert {e}'s LoRA {tuple(f.shape)} does not fit {name!r} {tuple(shape)} "
                             f"({count} experts of {height} x {width})")
    rank = max(f.a.shape[0] for f in per.values())
    dtype = next(iter(per.values())).a.dtype
    a, b = torch.zeros(count, rank, width, dtype=dtype), torch.zeros(count, rows, rank, dtype=dtype)
    scaling = torch.zeros(count, dtype=torch.float64)
    for e, f in per.items():
        r = f.a.shape[0]
        a[e, :r], b[e, :, :r], scaling[e] = f.a, f.b, f.scaling
    return row, a, b, scaling


def lora_factors(adapter_dir: Path) -> dict[str, Factors]:
    """Base weight name -> the factors of the delta the adapter adds to it."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir} holds a {config.get('peft_type')} adapter; only LoRA can be merged")
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    factors: dict[str, Factors] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise ValueError(f"adapter tensor {key!r} is not a LoRA A/B matrix; it cannot be merged")
            continue
        module = key.removesuffix(".lora_A.weight").removeprefix(_PEFT_PREFIX)
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None or b.ndim != 2 or a.ndim != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"adapter tensor {key!r} has no matching lora_B of rank {a.shape[0]}")
        param = _target_parameter(config, module)
        if param is None:
            factors[module + ".weight"] = Factors(b, a, _scaling(config, module))
        else:
            owner = module.split(".base_layer")[0]
            rank = int(_scaling_rank(config, owner))
            if a.shape[0] % rank:
                raise ValueError(f"adapter tensor {key!r} of {a.shape[0]} rows is not experts of rank {rank}")
            factors[f"{owner}.{param}"] = Factors(b, a, _scaling(config, owner), experts=a.shape[0] // rank)
    return factors


def _scaling_rank(config: dict, module: str) -> int:
    for k, v in (config.get("rank_pattern") or {}).items():
        if module == k or module.endswith("." + k):
            return int(v)
    return int(config["r"])


def _target_parameter(config: dict, module: str) -> str | None:
    """The parameter a PEFT `target_parameters` wrapper at `module` adapts, or None for a module's
    own weight. Several parameters of one module nest their wrappers, the first listed innermost:
    the wrapper reached through k `.base_layer` steps adapts the (n - 1 - k)-th of its n."""
    owner = module.split(".base_layer")[0]
    mine = [t.rpartition(".")[2] for t in config.get("target_parameters") or ()
            if owner == t.rpartition(".")[0] or owner.endswith("." + t.rpartition(".")[0])]
    if not mine:
        return None
    depth = module.count(".base_layer")
    if depth >= len(mine):
        raise ValueError(f"adapter module {module!r} nests deeper than its {len(mine)} target parameters")
    return mine[len(mine) - 1 - depth]


def _header(path: Path) -> tuple[int, dict]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _merged_shard(path: Path, deltas: dict[str, Delta], data_start: int, header: dict) -> Iterator[bytes]:
    """The base shard's bytes with each wrapped weight replaced by its merged value, same layout;
    one weight's dense delta in memory at a time."""
    import torch

    order = sorted(((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items()
                    if k != "__metadata__"))
    # Read with plain reads, not safetensors' mmap: a mapped shard's pages would stay resident (and
    # count against the API pod's memory) until the whole shard is sent.
    with path.open("rb") as raw:
        yield raw.read(data_start)
        at = 0
        for start, end, name in order:
            if start != at:
                raise ValueError(f"{path.name}: tensor data is not contiguous at {name!r}; cannot stream a merge")
            if name in deltas:
                raw.seek(data_start + start)
                dtype = getattr(torch, MERGEABLE_DTYPES[header[name]["dtype"]])
                weight = torch.frombuffer(bytearray(raw.read(end - start)), dtype=dtype).view(header[name]["shape"])
                wide = torch.promote_types(dtype, torch.float32)  # a float64 base merges in float64
                merged = weight.to(wide).add_(deltas[name].delta(wide)).to(dtype).contiguous()
                del weight
                data = merged.view(torch.uint8).numpy().tobytes() if merged.numel() else b""
                del merged
                if len(data) != end - start:
                    raise ValueError(f"{path.name}: merged {name!r} has {len(data)} bytes, expected {end - start}")
                raw.seek(data_start + end)
                yield data
            else:
                raw.seek(data_start + start)
                remaining = end - start
                while remaining:
                    chunk = raw.read(min(CHUNK, remaining))
                    if not chunk:
                        raise OSError(f"{path} ended inside tensor {name!r}")
                    remaining -= len(chunk)
                    yield chunk
            at = end


def _file_chunks(path: Path) -> Callable[[], Iterator[bytes]]:
    def read() -> Iterator[bytes]:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk
    return read


def merged_members(base_dir: Path, adapter_dir: Path) -> list[Member]:
    """The merged model's files. Checked before anything is sent: every wrapped weight exists in
    the base with the delta's shape, so a download never stops halfway over a mismatch."""
    files = sorted(p for p in base_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    shards = [p for p in files if p.suffix == ".safetensors"]
    if not shards:
        raise ValueError(f"base model {base_dir} has no .safetensors weights; only those can be merged")
    shapes = {k: tuple(v["shape"]) for p in shards for k, v in _header(p)[1].items() if k != "__metadata__"}
    deltas = fused_experts(lora_factors(adapter_dir), shapes, stored=True)
    members: list[Member] = []
    found: set[str] = set()
    for p in files:
        if p.suffix in (".bin", ".pt", ".pth") or p.name.endswith(".bin.index.json"):
            continue  # pickled copies of the weights: the merged safetensors replace them
        if p.suffix != ".safetensors":
            members.append(Member(p.name, os.stat(p).st_size, _file_chunks(p)))
            continue
        data_start, header = _header(p)
        mine = {k: deltas[k] for k in header if k in deltas}
        for k, d in mine.items():
            if tuple(header[k]["shape"]) != tuple(d.shape):
                raise ValueError(f"adapter delta for {k!r} has shape {tuple(d.shape)}, the base's weight "
                                 f"{tuple(header[k]['shape'])}")
            if header[k]["dtype"] not in MERGEABLE_DTYPES:
                raise ValueError(f"the base's weight {k!r} is {header[k]['dtype']}; only floating weights "
                                 f"({', '.join(MERGEABLE_DTYPES)}) can be merged")
        found |= mine.keys()
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        members.append(Member(p.name, data_start + end,
                              functools.partial(_merged_shard, p, mine, data_start, header)))
    missing = sorted(deltas.keys() - found)
    if missing:
        raise ValueError(f"the adapter wraps weights the base does not have: {missing[:5]}")
    return members


def write_merged(base_dir: Path, adapter_dir: Path, out_dir: Path) -> list[str]:
    """Write the merged model into `out_dir` (created); returns the file names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for m in merged_members(base_dir, adapter_dir):
        with (out_dir / m.name).open("wb") as f:
            for chunk in m.chunks():
                f.write(chunk)
        names.append(m.name)
    return names
