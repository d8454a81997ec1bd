"""`recipes.harbor_rl` through its own `train.cli_main`, against the stack.

Replaced: Modal's cloud containers built from each task's Dockerfile (the recipe's
`default_sandbox_factory`; here it fails with modal's `AuthError: Token missing`, see
docs/sdk/cookbook.md) by `LocalSandbox`, passed through the entry point's own `sandbox_factory`
argument: each sandbox is a private root directory in which commands run under `unshare` and
`chroot`, with the host's /usr, /etc and /dev bound read-only, so the recipe's absolute paths
(/tests, /logs/verifier, /root) land in the sandbox. The task's Dockerfile is not built: the host's
userland stands in for its image. The tasks are written by the test, in Harbor's layout."""

# ruff: noqa: ASYNC109 (the `timeout` parameters are the cookbook SandboxInterface's signature)
from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from recipes import RENDERER, TINY, metrics, series
from tinker_cookbook.sandbox import SandboxResult

_ENTER = ('R=$1; for d in usr etc dev; do mount --rbind /$d "$R/$d" && mount -o remount,bind,ro "$R/$d" || exit 97; '
          'done; exec chroot "$R" /bin/bash -c \'cd "$1" && eval "$2"\' bash "$2" "$3"')
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /root/answer.txt 2>/dev/null)" = "42" ]; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
"""


class LocalSandbox:
    """The cookbook's SandboxInterface over a private root directory (see the module docstring)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="harbor-"))
        self._id = uuid.uuid4().hex[:8]
        for d in ("usr", "etc", "dev", "root", "tmp"):
            (self.root / d).mkdir()
        for link in ("bin", "lib", "lib64", "sbin"):
            (self.root / link).symlink_to(f"usr/{link}")

    @property
    def sandbox_id(self) -> str:
        return self._id

    async def send_heartbeat(self, timeout: int = 30) -> None:
        pass

    async def run_command(self, command: str, workdir: str | None = None, timeout: int = 60,
                          max_output_bytes: int | None = None) -> SandboxResult:
        proc = await asyncio.create_subprocess_exec("unshare", "-rm", "sh", "-c", _ENTER, "sh", str(self.root),
                                                    workdir or "/root", command, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return SandboxResult(stdout="", stderr="timed out", exit_code=124)
        cap = max_output_bytes or 128 * 1024
        return SandboxResult(stdout=out[:cap].decode(errors="replace"), stderr=err[:cap].decode(errors="replace"),
                             exit_code=proc.returncode or 0)

    def _host(self, path: str) -> Path:
        host = (self.root / path.lstrip("/")).resolve()
        assert host.is_relative_to(self.root.resolve()), path
        return host

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60) -> SandboxResult:
        host = self._host(path)
        if not host.is_file():
            return SandboxResult(stdout="", stderr=f"{path}: no such file", exit_code=1)
        return SandboxResult(stdout=host.read_bytes()[:max_bytes].decode(errors="replace"), stderr="", exit_code=0)

    async def write_file(self, path: str, content: str | bytes, executable: bool = False,
                         timeout: int = 60) -> SandboxResult:
        host = self._host(path)
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(content.encode() if isinstance(content, str) else content)
        host.chmod(0o755 if executable else 0o644)
        return SandboxResult(stdout="", stderr="", exit_code=0)

    async def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


async def local_sandbox_factory(env_dir: Path, timeout: int) -> LocalSandbox:
    return LocalSandbox()


def _task(root: Path, name: str):
    from tinker_cookbook.recipes.harbor_rl.harbor_env import HarborTask

    task_dir = root / name
    (task_dir / "environment").mkdir(parents=True)
    (task_dir / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    (task_dir / "tests").mkdir()
    (task_dir / "tests" / "test.sh").write_text(TEST_SH)
    instruction = "Write the number 42 into /root/answer.txt."
    (task_dir / "instruction.md").write_text(instruction)
    return HarborTask(task_name=name, instruction=instruction, task_dir=task_dir, config={})


def _namespaces_allowed() -> bool:
    """Whether this machine lets the test make the user and mount namespaces its sandboxes need."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.extended
@pytest.mark.skipif(not _namespaces_allowed(), reason="the local sandbox needs `unshare -rm` (user and mount "
                    "namespaces), which this machine refuses")
def test_harbor_rl_runs_the_protocol_in_local_sandboxes(cookbook, tmp_path):
    """The random tiny model makes no well-formed bash call, so every episode is graded 0: this runs
    the protocol to the end (steps done, the recipe's grader run in each sandbox, kl_sample_train
    small). The recipe's own bash tool and grader are first checked on LocalSandbox: the task done
    through the tool grades 1, an untouched sandbox 0."""
    from tinker_cookbook.recipes.harbor_rl import train as harbor
    from tinker_cookbook.recipes.harbor_rl.harbor_tools import HarborBashTool, HarborReward
    from tinker_cookbook.tool_use.types import ToolInput

    tasks = [_task(tmp_path / "tasks", f"answer-{i}") for i in range(2)]

    async def grades() -> list[float]:
        done, untouched = LocalSandbox(), LocalSandbox()
        await HarborBashTool(done).bash.run(ToolInput(arguments={"command": "echo 42 > /root/answer.txt"}))
        rewards = [(await HarborReward(tasks[0].task_dir / "tests", sb)([]))[0] for sb in (done, untouched)]
        for sb in (done, untouched):
            await sb.cleanup()
        return rewards

    assert asyncio.run(grades()) == [1.0, 0.0]

    asyncio.run(harbor.cli_main(harbor.CLIConfig(
        model_name=TINY, renderer_name=RENDERER, lora_rank=8, max_tokens=16, max_turns=2, group_size=2,
        groups_per_batch=1, learning_rate=1e-3, eval_every=0, save_every=0, log_path=str(tmp_path / "run"),
        base_url=cookbook, max_steps=2, max_trajectory_tokens=1800), tasks, sandbox_factory=local_sandbox_factory))
    rows = metrics(tmp_path / "run")
    rewards = series(rows, "env/all/reward/total")
    kl = max(abs(v) for v in series(rows, "optim/kl_sample_train_v1"))
    print(f"harbor_rl: {len(rewards)} steps, reward {rewards}, kl_sample_train_v1 {kl:.1e}")
    assert len(rewards) == 2
    assert kl < 1e-3
