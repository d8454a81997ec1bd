"""A LoRA adapter merged into its base, as a Hugging Face model directory, streamed file by file.

W' = W + scaling * (B @ A) for every weight the adapter wraps (scaling = lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA, per module where PEFT's rank/alpha patterns say so), computed in
float32 (float64 for a float64 base) and stored in the base's dtype. A PEFT `target_parameters`
LoRA on a 3-D experts weight (gpt-oss) merges each expert's B @ A into its [E, in, out] slice.
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


def _merged_shard(path: Path, deltas: dict[str, Factors], data_start: int, header: dict) -> Iterator[bytes]:
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
    deltas = lora_factors(adapter_dir)
    files = sorted(p for p in base_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    shards = [p for p in files if p.suffix == ".safetensors"]
    if not shards:
        raise ValueError(f"base model {base_dir} has no .safetensors weights; only those can be merged")
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
