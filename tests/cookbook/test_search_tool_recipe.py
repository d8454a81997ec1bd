"""`recipes.search_tool` (Search-R1) through its own `train.cli_main`, against the stack.

Replaced: the hosted Wikipedia index by a local one, a Chroma server (`chroma run`, the chromadb
package's own) on local documents, found through the recipe's `chroma_host`/`chroma_port`; the
hosted Gemini embeddings by `local_embedding` (hashed bag of words), in place of the recipe's
`get_gemini_client`/`get_gemini_embedding`; and the hub's NQ/HotpotQA parquet by a local parquet in
its columns (the recipe's `hf_hub_download` answers its path). `offline_eval.py`, which fixes the
index's address in code (localhost:8000), is pointed at the local server's port."""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from recipes import RENDERER, TINY, metrics, series

FACTS = [("What is the capital of Norway?", "Oslo", "Oslo is the capital and largest city of Norway."),
         ("What is the capital of Peru?", "Lima", "Lima is the capital of Peru, on the Pacific coast."),
         ("Which river flows through Hanoi?", "Red River", "Hanoi lies on the banks of the Red River."),
         ("What is the capital of Latvia?", "Riga", "Riga, on the Gulf of Riga, is the capital of Latvia.")]
# The recipe's defaults, which offline_eval.py fixes in code.
DIM = 768
COLLECTION = "wiki_embeddings"


def local_embedding(texts: list[str]) -> list[list[float]]:
    """A unit vector per text from its hashed lower-case words: texts sharing words lie close."""
    vectors = []
    for text in texts:
        v = [0.0] * DIM
        for word in re.findall(r"[a-z]+", text.lower()):
            v[int(hashlib.sha1(word.encode()).hexdigest(), 16) % DIM] += 1.0
        norm = math.sqrt(sum(x * x for x in v)) or 1.0
        vectors.append([x / norm for x in v])
    return vectors


@pytest.fixture
def local_chroma(tmp_path) -> Iterator[int]:
    """A Chroma server on tmp_path holding FACTS' documents, embedded by local_embedding."""
    import chromadb
    from chromadb.config import Settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The `chroma` command's own code, run by this interpreter (not its script, whose first line
    # names the interpreter of whichever venv installed it).
    server = subprocess.Popen([sys.executable, "-c", "import sys; from chromadb.cli.cli import app; sys.argv[0] = 'chroma'; "
                               "sys.exit(app())", "run", "--path",
                               str(tmp_path / "chroma"), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://localhost:{port}/api/v2/heartbeat", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "chroma run did not start"
                time.sleep(0.3)
        client = chromadb.HttpClient(host="localhost", port=port, settings=Settings(anonymized_telemetry=False))
        docs = [doc for _, _, doc in FACTS]
        client.create_collection(COLLECTION).add(ids=[f"d{i}" for i in range(len(docs))], documents=docs,
                                                 embeddings=local_embedding(docs))
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.extended
def test_search_tool_runs_the_protocol_on_a_local_index(cookbook, tmp_path, monkeypatch, local_chroma, capsys):
    """The random tiny model makes no well-formed search call and never writes "Answer:", so this
    runs the protocol to the end (steps done, kl_sample_train small). The recipe's own search tool
    (`ChromaTool.build` with the recipe's settings) is first asked a question on the local index and
    must return the document that answers it. The recipe's offline_eval.py then scores the final
    weights on the same questions."""
    import pandas as pd
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.recipes.search_tool import offline_eval, search_env, tools
    from tinker_cookbook.recipes.search_tool import train as search
    from tinker_cookbook.tool_use.types import ToolInput

    async def embed(client, texts, model="", embedding_dim=DIM, task_type="", **_):
        assert embedding_dim == DIM
        return local_embedding(texts)

    monkeypatch.setattr(tools, "get_gemini_client", lambda: None)
    monkeypatch.setattr(tools, "get_gemini_embedding", embed)
    parquet = tmp_path / "train.parquet"
    pd.DataFrame([{"question": q, "golden_answers": [a], "data_source": "local"} for q, a, _ in FACTS] * 2).to_parquet(parquet)
    monkeypatch.setattr(search_env, "hf_hub_download", lambda **_: str(parquet))

    async def ask(question: str) -> str:
        tool = await tools.ChromaTool.build("localhost", local_chroma, COLLECTION, tools.RetrievalConfig(
            n_results=1, embedding_config=tools.EmbeddingConfig(embedding_dim=DIM)))
        result = await tool.search.run(ToolInput(arguments={"query_list": [question]}))
        return str(result.messages[0]["content"])

    assert FACTS[1][2] in asyncio.run(ask(FACTS[1][0]))

    asyncio.run(search.cli_main(search.CLIConfig(
        model_name=TINY, renderer_name=RENDERER, lora_rank=8, learning_rate=1e-3, batch_size=2, group_size=2,
        max_tokens=16, max_turns=2, max_trajectory_tokens=1800, chroma_port=local_chroma,
        chroma_collection_name=COLLECTION, n_results=1, embedding_dim=DIM, log_path=str(tmp_path / "run"),
        max_steps=2)))
    rows = metrics(tmp_path / "run")
    rewards = series(rows, "env/all/reward/total")
    kl = max(abs(v) for v in series(rows, "optim/kl_sample_train_v1"))
    print(f"search_tool: {len(rewards)} steps, reward {rewards}, kl_sample_train_v1 {kl:.1e}")
    assert len(rewards) == 2
    assert kl < 1e-3

    build = tools.ChromaTool.build
    monkeypatch.setattr(offline_eval.ChromaTool, "build",
                        lambda chroma_host, chroma_port, **kw: build(chroma_host, local_chroma, **kw))
    final = checkpoint_utils.load_checkpoints_file(str(tmp_path / "run"))[-1].sampler_path
    capsys.readouterr()
    asyncio.run(offline_eval.cli_main(offline_eval.CLIConfig(
        max_eval_samples=2, split="test", base_model=TINY, renderer_name=RENDERER, tinker_checkpoint_url=final,
        max_tokens=16, max_trajectory_tokens=1800)))
    report = capsys.readouterr().out
    print(report)
    assert "OVERALL" in report and "local" in report
