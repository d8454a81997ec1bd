"""`recipes.code_rl` (DeepCoder) through its own `train.cli_main`, against the stack.

Replaced: the hub's DeepCoder-Preview-Dataset by local problems (the recipe's `load_dataset` call
answers rows made here, in the dataset's columns), and the SandboxFusion Docker container by
`local_sandboxfusion`: SandboxFusion's `/run_code` API served from the test, running the submitted
program with the given files in a temporary directory, as the recipe's own sandbox config
(`sandbox_config/local.yaml`, `isolation: none`) runs it. The recipe's client finds it through
`SANDBOX_URL`, its own setting."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from recipes import RENDERER, TINY, metrics, series

PROBLEMS = [("Read two integers a and b on one line and print a + b.", [("2 3\n", "5\n"), ("10 -4\n", "6\n")]),
            ("Read an integer n and print n * n.", [("7\n", "49\n"), ("-3\n", "9\n")]),
            ("Read a word and print it reversed.", [("abc\n", "cba\n"), ("quilt\n", "tliuq\n")]),
            ("Read an integer n and print the sum 1 + 2 + ... + n.", [("4\n", "10\n"), ("1\n", "1\n")])]


def _run_code(body: dict) -> dict:
    with tempfile.TemporaryDirectory() as work:
        for name, content in body.get("files", {}).items():
            (Path(work) / name).write_bytes(base64.b64decode(content))
        (Path(work) / "main.py").write_text(body["code"])
        try:
            done = subprocess.run([sys.executable, "main.py"], cwd=work, capture_output=True, text=True,
                                  timeout=body.get("run_timeout", 10))
        except subprocess.TimeoutExpired:
            return {"status": "Failed", "message": "", "run_result": {"status": "TimeLimitExceeded"}}
    result = {"status": "Finished", "return_code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    return {"status": "Success" if done.returncode == 0 else "Failed", "message": "", "run_result": result}


class _SandboxHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = json.dumps(_run_code(body)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def local_sandboxfusion(monkeypatch) -> Iterator[str]:
    from tinker_cookbook.recipes.code_rl import code_grading

    server = ThreadingHTTPServer(("127.0.0.1", 0), _SandboxHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
    monkeypatch.setenv("SANDBOX_URL", url)
    monkeypatch.setattr(code_grading, "_sandboxfusion_client", None)  # the recipe's client reads the URL once
    yield url
    server.shutdown()
    server.server_close()


def _rows() -> list[dict]:
    return [{"question": q, "starter_code": "", "metadata": "{}",
             "tests": json.dumps([{"input": i, "output": o, "testtype": "stdin_stdout"} for i, o in cases])}
            for q, cases in PROBLEMS]


@pytest.mark.extended
def test_code_rl_runs_the_protocol_with_a_local_sandbox(cookbook, tmp_path, monkeypatch, local_sandboxfusion):
    """The random tiny model writes no code block, so every episode earns the recipe's format
    penalty: this runs the protocol to the end (steps done, kl_sample_train small). That the
    recipe's grading path reaches the sandbox and tells right from wrong is checked first, with the
    recipe's own `sandbox_check_correctness` on a correct and a wrong program."""
    from datasets import Dataset
    from tinker_cookbook.recipes.code_rl import code_env, code_grading
    from tinker_cookbook.recipes.code_rl import train as code_rl

    async def grade(*programs: str) -> list[bool]:
        tests = json.loads(_rows()[0]["tests"])
        passed = [(await code_grading.sandbox_check_correctness(tests, p))[0] for p in programs]
        await code_grading._get_sandboxfusion_client().close()
        return passed

    assert asyncio.run(grade("a, b = map(int, input().split())\nprint(a + b)", "print(5)")) == [True, False]
    monkeypatch.setattr(code_grading, "_sandboxfusion_client", None)  # its lock belongs to the loop just closed

    monkeypatch.setattr(code_env, "load_dataset", lambda path, name, split: Dataset.from_list(_rows()))
    asyncio.run(code_rl.cli_main(code_rl.CLIConfig(
        model_name=TINY, renderer_name=RENDERER, lora_rank=8, group_size=2, groups_per_batch=2, learning_rate=1e-3,
        max_tokens=16, eval_every=0, save_every=0, log_path=str(tmp_path / "run"), base_url=cookbook, max_steps=2)))
    rows = metrics(tmp_path / "run")
    rewards = series(rows, "env/all/reward/total")
    kl = max(abs(v) for v in series(rows, "optim/kl_sample_train_v1"))
    print(f"code_rl: {len(rewards)} steps, reward {rewards}, kl_sample_train_v1 {kl:.1e}")
    assert len(rewards) == 2
    assert kl < 1e-3
