"""The cookbook's capture pipeline (`tinker_cookbook.capture`) against the stack: its in-process
capture (`capture_to_store` around the cookbook's RL loop) and its chat proxy
(`capture.proxy.serve`'s main, in a process of its own) with an external harness in front of it.

Replaced: the external agent harness (Claude Code, opencode) by the `openai` and `anthropic` client
libraries, driven by the test. Nothing else: the capture store daemon is the cookbook's own, spawned
by the cookbook, on a directory of the test's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from recipes import INSTRUCTION, RENDERER, TINY, BandDatasetBuilder, metrics, series

from stack.ephemeral import free_port


def _store(data_dir: Path) -> str:
    return json.loads((data_dir / "daemon.json").read_text())["base_url"]


def _stop_store(data_dir: Path) -> None:
    """The daemon is detached from its spawner (it outlives it by design): stop it by its pid."""
    info = data_dir / "daemon.json"
    if info.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(json.loads(info.read_text())["pid"], signal.SIGTERM)


def _rows(store: str, run_id: str) -> list[dict]:
    return httpx.get(f"{store}/runs/{run_id}/rows", timeout=30).json()["rows"]


@pytest.mark.extended
def test_capture_to_store_records_every_sample_and_train_op_of_an_rl_run(cookbook, tmp_path):
    from tinker_cookbook.capture.store import capture_to_store
    from tinker_cookbook.rl import train

    batches, groups, group_size, answer = 2, 2, 2, 8
    config = train.Config(
        model_name=TINY, recipe_name="quilt_capture", renderer_name=RENDERER, log_path=str(tmp_path / "run"),
        dataset_builder=BandDatasetBuilder(batches=batches, groups=groups, group_size=group_size, answer_tokens=answer),
        learning_rate=1e-2, max_tokens=answer, lora_rank=8, eval_every=0, save_every=0, base_url=cookbook)
    data_dir = tmp_path / "store"
    try:
        with capture_to_store("quilt-rl", data_dir=data_dir, idle_shutdown_minutes=5) as session:
            asyncio.run(train.main(config))
        rows = _rows(session.base_url, "quilt-rl")
        notes = httpx.get(f"{session.base_url}/runs/quilt-rl/annotations", timeout=30).json()["annotations"]
        dropped = session.exporter.dropped
    finally:
        _stop_store(data_dir)

    ops = [n["payload"]["op"] for n in notes if n["kind"] == "train_op"]
    print(f"capture_to_store: {len(rows)} sampled sequences, train ops {sorted(set(ops))}, dropped {dropped}, "
          f"sampling sessions {sorted({str(row['sampling_session_id']) for row in rows})}, "
          f"policy versions {sorted({str(row['policy_version']) for row in rows})}")
    assert len(rows) == batches * groups * group_size
    assert len(series(metrics(tmp_path / "run"), "env/all/reward/total")) == batches
    for row in rows:
        assert row["run_id"] == "quilt-rl" and row["prompt_tokens"] == INSTRUCTION
        assert len(row["sampled_tokens"]) == answer == len(row["logprobs"])
        assert all(lp <= 0 for lp in row["logprobs"])
    # Two policies sampled: the base, then the weights after the first step, each through the sampling
    # session its `save_weights_and_get_sampling_client` made. The capture's `policy_version` column
    # is the sampling client's `model_path`, which tinker 0.38's SamplingClient does not carry (it
    # knows its session, not the path), so that column is empty against any server.
    sessions = {row["sampling_session_id"] for row in rows}
    assert None not in sessions and len(sessions) == batches
    assert {row["policy_version"] for row in rows} == {None}
    assert ops.count("forward_backward") >= batches and ops.count("optim_step") == batches


@contextlib.contextmanager
def _proxy(tiny_path: str, data_dir: Path, log: Path) -> Iterator[str]:
    """The proxy's own `main`, in its own process, as a user starts it; the only line before it is the
    cookbook's hook that names the tiny base's tokenizer (it is not on the hub)."""
    port = free_port()
    launcher = ("import sys; from transformers import AutoTokenizer; from tinker_cookbook import tokenizer_utils; "
                "tok = AutoTokenizer.from_pretrained(sys.argv[1]); "
                f"tokenizer_utils.register_tokenizer({TINY!r}, lambda: tok); "
                "from tinker_cookbook.capture.proxy import serve; raise SystemExit(serve.main(sys.argv[2:]))")
    args = ["--base-model", TINY, "--renderer-name", RENDERER, "--port", str(port), "--store-data-dir", str(data_dir),
            "--default-max-tokens", "16", "--flush-interval-sec", "0.2"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", launcher, tiny_path, *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # aiohttp's graceful stop: the proxy drains its exporter
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        _stop_store(data_dir)


@pytest.mark.extended
def test_capture_proxy_serves_an_openai_and_an_anthropic_harness_from_quilt(cookbook, tiny_path, tmp_path):
    import anthropic
    import openai
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    data_dir = tmp_path / "store"
    chat = [{"role": "user", "content": "Say amber twice."}]
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(TINY))
    with _proxy(tiny_path, data_dir, tmp_path / "proxy.log") as url:
        oa = openai.OpenAI(base_url=f"{url}/r/run/harness/iter/2/traj/0/v1", api_key="unused")
        reply = oa.chat.completions.create(model=TINY, messages=chat, max_tokens=12, temperature=1.0, seed=3)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in oa.chat.completions.create(
            model=TINY, messages=chat, max_tokens=12, stream=True) if chunk.choices)
        an = anthropic.Anthropic(base_url=f"{url}/r/run/harness/iter/2/traj/1", api_key="unused")
        message = an.messages.create(model=TINY, max_tokens=12, messages=chat)
        refused = httpx.post(f"{url}/v1/chat/completions", json={"model": TINY, "messages": chat, "n": 2}, timeout=30)
        time.sleep(1.0)  # the exporter flushes every 0.2 s
        rows = _rows(_store(data_dir), "harness")

    print(f"capture proxy: openai {reply.choices[0].message.content!r} ({reply.usage.completion_tokens} tokens), "
          f"streamed {streamed!r}, anthropic {message.content[0].text if message.content else ''!r}; "
          f"{len(rows)} captured rows")
    assert reply.usage.completion_tokens >= 1 and message.usage.output_tokens >= 1
    assert refused.status_code == 400
    assert len(rows) == 3
    prompt = renderer.build_generation_prompt(chat).to_ints()
    assert all(row["prompt_tokens"] == prompt and row["iteration"] == 2 for row in rows)
    assert sorted(row["traj_idx"] for row in rows) == [0, 0, 1]
    assert all(len(row["sampled_tokens"]) == len(row["logprobs"]) <= 12 for row in rows)
    # The harness got back what Quilt sampled: the captured tokens of the non-streamed reply decode to it.
    first = min(rows, key=lambda r: r["cursor"])
    parsed, _ = renderer.parse_response(first["sampled_tokens"])
    assert renderers.get_text_content(parsed) == reply.choices[0].message.content
