"""The cookbook's `scripts/`, each through its own `main`, against the stack: copy_checkpoint,
get_access_token, merge_tinker_adapter_to_hf_model, save_audit_log, test_tool_calling_e2e, and the
Inkling samplers (which cannot run here, for a package the registry lacks: asserted with its error).

Replaced: the scripts' built-in addresses and model lists, which name the hosted service and its
models (get_access_token's `BASE_URL`, test_tool_calling_e2e's `MODEL_CONFIGS`), by Quilt's and the
tiny base; get_access_token's credential command by `echo` of a tenant's key.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from datetime import UTC, datetime

import httpx
import pytest
import tinker
import torch
from recipes import CHAT, RENDERER, TINY
from tinker_cookbook import renderers
from tinker_cookbook.supervised.common import datum_from_model_input_weights
from tinker_cookbook.tokenizer_utils import get_tokenizer


def _trained_state(base_url: str, key: str) -> str:
    """A training checkpoint one step away from the base: enough for a copy or a merge to tell apart."""
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(TINY))
    data = [datum_from_model_input_weights(*renderer.build_supervised_example(chat)) for chat in CHAT[:4]]
    with tinker.ServiceClient(base_url=base_url, api_key=key) as service:
        trainer = service.create_lora_training_client(base_model=TINY, rank=8)
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
        return trainer.save_state("scripts").result().path


def _run_main(monkeypatch, module, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    module.main()


def test_copy_checkpoint_copies_into_the_callers_account_and_across_tenants(cookbook, stack, monkeypatch, capsys):
    from tinker_cookbook.scripts import copy_checkpoint

    owner = stack.create_tenant("copy-owner")
    state = _trained_state(cookbook, owner.key)
    # The script's first use: a copy into the account that owns the checkpoint.
    monkeypatch.setenv("TINKER_API_KEY", owner.key)
    _run_main(monkeypatch, copy_checkpoint, "--source-path", state, "--output-kind", "training")
    own = re.search(r"training_path: (\S+)", capsys.readouterr().out).group(1)
    # Its cross-account use: another tenant copies with a weights access token the owner made.
    token = httpx.post(f"{cookbook}/api/v1/quilt/weights_access_tokens", json={"tinker_path": state},
                       headers={"X-API-Key": owner.key}, timeout=30).json()["token"]
    other = stack.create_tenant("copy-other")
    monkeypatch.setenv("TINKER_API_KEY", other.key)
    _run_main(monkeypatch, copy_checkpoint, "--source-path", state, "--source-access-token", token)
    sampler = re.search(r"sampler_path:\s+(\S+)", capsys.readouterr().out).group(1)
    print(f"copy_checkpoint: own copy {own}, cross-tenant sampler copy {sampler}")
    assert own != state and sampler.split("/")[2] != state.split("/")[2]

    tokens = renderers.get_renderer(RENDERER, get_tokenizer(TINY)).build_supervised_example(CHAT[0])[0].to_ints()
    with tinker.ServiceClient(base_url=cookbook, api_key=other.key) as service:
        copied = service.create_sampling_client(model_path=sampler).compute_logprobs(
            tinker.ModelInput.from_ints(tokens)).result()
    with tinker.ServiceClient(base_url=cookbook, api_key=owner.key) as service:
        trained = service.create_training_client_from_state(own)
        original = trained.save_weights_and_get_sampling_client("own").compute_logprobs(
            tinker.ModelInput.from_ints(tokens)).result()
    assert max(abs(a - b) for a, b in zip(copied[1:], original[1:], strict=True)) < 1e-4
    # Without the token the other tenant cannot read the checkpoint: the script fails.
    with pytest.raises(tinker.NotFoundError):
        _run_main(monkeypatch, copy_checkpoint, "--source-path", state)


def test_get_access_token_exchanges_a_key_for_a_token_the_api_takes(cookbook, stack, tmp_path, monkeypatch, capsys):
    """The credential command is `echo <key>`; the exchange needs QUILT_SDK_JWT_AUTH, which the
    session stack leaves off, so the script talks to a second API process with it on."""
    from stackutil import second_api
    from tinker_cookbook.scripts import get_access_token

    tenant = stack.create_tenant("token")
    with second_api(stack, tmp_path, QUILT_SDK_JWT_AUTH="1") as url:
        monkeypatch.setattr(get_access_token, "BASE_URL", url)
        monkeypatch.setenv("TINKER_CREDENTIAL_CMD", f"echo {tenant.key}")
        get_access_token.main()
    # The SDK reads the same variable: the token is used as a plain key from here on.
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD")
    line = capsys.readouterr().out.strip()
    jwt = line.removeprefix("export TINKER_API_KEY=")
    assert line.startswith("export TINKER_API_KEY=eyJ") and tenant.key not in jwt
    # The training client is awaited before anything else: tinker 0.38 creates it on its event-loop
    # thread, which takes the ServiceClient's lifecycle lock for `holder`, while
    # `ServiceClient.create_rest_client()` holds that lock on the caller's thread and waits on the
    # same loop for the server's client config: a deadlock against any server, whichever wins the
    # race (this test hung there once). The runs are listed with `RestClient`, as the SDK advises.
    with tinker.ServiceClient(base_url=cookbook, api_key=jwt) as service:
        trainer = service.create_lora_training_client(base_model=TINY, rank=8).result()
        runs = tinker.RestClient(base_url=cookbook, api_key=jwt).list_training_runs().result().training_runs
    assert trainer.model_id in [run.training_run_id for run in runs]


def test_merge_tinker_adapter_script_merges_what_quilt_samples(cookbook, tiny_path, tmp_path, monkeypatch):
    from tinker_cookbook import weights
    from tinker_cookbook.scripts import merge_tinker_adapter_to_hf_model as merge
    from transformers import AutoModelForCausalLM

    state = _trained_state(cookbook, os.environ["TINKER_API_KEY"])
    adapter = weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter"))
    _run_main(monkeypatch, merge, "--hf-model", tiny_path, "--tinker-adapter-path", adapter,
              "--output-path", str(tmp_path / "merged"))

    tokens = renderers.get_renderer(RENDERER, get_tokenizer(TINY)).build_supervised_example(CHAT[1])[0].to_ints()
    with tinker.ServiceClient(base_url=cookbook) as service:
        trained = service.create_training_client_from_state(state)
        quilt = torch.tensor(trained.save_weights_and_get_sampling_client("merge").compute_logprobs(
            tinker.ModelInput.from_ints(tokens)).result()[1:])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        logits = merged(torch.tensor([tokens])).logits[0, :-1].float()
    local = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    gap = (local - quilt).abs().max().item()
    print(f"merge_tinker_adapter_to_hf_model: merged model vs Quilt's sampler {gap:.1e} over {len(tokens) - 1} tokens")
    assert gap < 1e-3


def test_save_audit_log_writes_the_days_entries(cookbook, stack, tmp_path, monkeypatch):
    import json

    from tinker_cookbook.scripts import save_audit_log

    tenant = stack.create_tenant("audit")
    state = _trained_state(cookbook, tenant.key)
    httpx.post(f"{cookbook}/api/v1/quilt/weights_access_tokens", json={"tinker_path": state},
               headers={"X-API-Key": tenant.key}, timeout=30).raise_for_status()
    # In its own process, as it is run: tinker keeps one REST client per process for the key it read
    # from the environment first, so in this one the script would ask with an earlier test's key.
    subprocess.run([sys.executable, "-m", save_audit_log.__name__, "--once", "--output-dir", str(tmp_path),
                    "--backfill-days", "1"], env={**os.environ, "TINKER_API_KEY": tenant.key, "TINKER_BASE_URL": cookbook},
                   check=True, timeout=300)
    today = datetime.now(UTC).date()
    files = sorted(p.name for p in tmp_path.iterdir())
    entries = [json.loads(line) for line in (tmp_path / f"audit_log_{today.isoformat()}.jsonl").read_text().splitlines()]
    print(f"save_audit_log: files {files}, today's events {[e['event'] for e in entries]}")
    assert len(files) == 2  # today and the day before (empty)
    (made,) = [e for e in entries if e["event"] == "checkpoint_token_created"]
    assert made["tinker_path"] == state and made["model_id"] == state.split("/")[2]


def test_tool_calling_e2e_script_runs_on_the_tiny_base(cookbook, monkeypatch, capsys):
    """Protocol only: the random tiny model does not call tools, so the script reports 0/1; what is
    asserted is that the whole round (tools rendered, sampled at temperature 0, parsed) ran."""
    from tinker_cookbook.scripts import test_tool_calling_e2e as e2e

    monkeypatch.setattr(e2e, "MODEL_CONFIGS", [{"model_name": TINY, "renderer_name": "qwen3"}])
    monkeypatch.setattr(sys, "argv", ["test_tool_calling_e2e"])
    asyncio.run(e2e.main())
    out = capsys.readouterr().out
    print(out[-400:])
    assert "Error -" not in out and re.search(r"Passed: [01]/1", out)
    assert "Raw response" in out


@pytest.mark.parametrize("script", ["sample_reasoning", "sample_vision", "sample_audio"])
def test_inkling_scripts_need_tml_renderers(tmp_path, script):
    """Outside Quilt: the Inkling samplers render with `tml_renderers` >= 0.4.1, which the package
    registry here does not have (0.2.1 only). The script's own main, on its own default model, stops
    at that import (before it reaches any server); the error is the one docs/sdk/cookbook.md quotes."""
    import importlib

    from PIL import Image

    module = importlib.import_module(f"tinker_cookbook.scripts.inkling.{script}")
    image = tmp_path / "i.png"
    Image.new("RGB", (8, 8)).save(image)
    wav = tmp_path / "a.wav"
    import wave

    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(b"\0\0" * 1600)
    extra = {"sample_reasoning": {"prompt": "2+2?", "efforts": [0.0], "max_tokens": 8},
             "sample_vision": {"image_path": str(image), "max_tokens": 8},
             "sample_audio": {"audio_path": str(wav), "max_tokens": 8}}[script]
    with pytest.raises(ModuleNotFoundError, match="tml_renderers"):
        module.cli_main(module.Config(base_url="http://127.0.0.1:9", **extra))
