"""The ecosystems' environments through quilt.rl, each a small environment written here for its
framework (no hub downloads), scored by its own reward code: Gymnasium, SkyRL-Gym (its GSM8K
environment and a multi-turn one), OpenEnv, verifiers and tinker-cookbook. The sampler answers
scripted text through the tiny base's real tokenizer, so each test knows what the reward must be."""

from __future__ import annotations

import asyncio
import functools
import re
import time

import pytest
import quilt
from quilt import rl
from quilt.rl import adapters

PARAMS = quilt.SamplingParams(max_tokens=16)


@functools.cache
def tokenizer():
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from stack.tiny_model import build_tiny_model

    path = build_tiny_model(Path(tempfile.mkdtemp(prefix="quilt-adapters-")) / "tiny").path
    return AutoTokenizer.from_pretrained(path)


def codec() -> adapters.ChatCodec:
    return adapters.ChatCodec(tokenizer())


class ScriptedSampler:
    """Answers the i-th sequence of a request with ``replies[i % len]`` (through the tokenizer), but
    a conversation that already holds one of the replies gets that one again (each member keeps its
    part once the turns diverge); records the prompts it was asked, decoded."""

    policy_version = 0

    def __init__(self, replies: list[str]) -> None:
        self.replies = replies
        self.prompts: list[str] = []
        self.stops: list = []

    async def sample_async(self, prompt, n, params, deadline_s=None):
        text = tokenizer().decode(prompt)
        self.prompts.append(text)
        self.stops.append(params.stop)
        said = [r for r in self.replies if f"assistant: {r}\n" in text]

        async def result():
            encoded = [tokenizer().encode(said[-1] if said else self.replies[i % len(self.replies)],
                                          add_special_tokens=False) for i in range(n)]
            return quilt.SampleResponse(sequences=[
                quilt.SampledSequence(tokens=ids, logprobs=[-1.0] * len(ids), stop_reason="stop", model_id="m",
                                      policy_version=0) for ids in encoded])
        return result()


def rollout(builder, index, n, replies, budget=rl.EpisodeBudget(), *, executor=None, fork=True):  # noqa: B008
    async def main():
        ex = executor or rl.InProcess()
        group = await ex.start_group(builder, index, n, budget, fork=fork)
        sampler = ScriptedSampler(replies)
        return await rl.rollout_group(index, sampler, group, PARAMS, budget), sampler
    return asyncio.run(main())


# -- the codec ----------------------------------------------------------------------------


def test_the_codec_lays_out_a_conversation_and_decodes_replies():
    plain = codec()
    ids = plain.prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tokenizer().decode(ids) == "system: Be brief.\nuser: Hi\nassistant: "
    assert plain.text(tokenizer().encode("four", add_special_tokens=False)) == "four"
    templated = adapters.ChatCodec(tokenizer(), use_template=False)
    assert templated.prompt([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]) == \
        plain.prompt([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="chat_template"):
        adapters.ChatCodec(tokenizer(), use_template=True)


def test_numeric_keeps_finite_numbers_only():
    assert adapters.numeric({"a": 1, "b": True, "c": "x", "d": float("nan"), "e": [1], "f": 2.5}) == \
        {"a": 1.0, "b": 1.0, "f": 2.5}


# -- Gymnasium ----------------------------------------------------------------------------


class GuessEnv:
    """A Gymnasium text environment: guess the number (0-9, from the seed) within three tries."""

    metadata: dict = {}

    def __init__(self):
        import gymnasium
        from gymnasium import spaces

        self.__class__ = type("GuessEnvGym", (GuessEnv, gymnasium.Env), {})
        self.observation_space = spaces.Text(200)
        self.action_space = spaces.Text(200)
        self.target, self.tries = 0, 0

    def reset(self, *, seed=None, options=None):
        import random

        self.target, self.tries = random.Random(seed).randrange(10), 0
        return "Guess my number, 0 to 9.", {}

    def step(self, action):
        self.tries += 1
        digits = re.findall(r"\d", action)
        guess = int(digits[0]) if digits else -1
        if guess == self.target:
            return "Right!", 1.0, True, False, {"tries": self.tries}
        hint = "higher" if guess < self.target else "lower"
        return f"No, {hint}.", 0.0, False, self.tries >= 3, {"tries": self.tries}


def guess_group(forkable: bool):
    return adapters.gymnasium_group_builder(lambda i: GuessEnv(), codec, forkable=forkable)


def test_a_gymnasium_text_environment_runs_multi_turn_with_its_own_reward():
    import random

    target = random.Random(5).randrange(10)
    wrong = (target + 1) % 10
    group, sampler = rollout(guess_group(False), 5, 2, [str(target), str(wrong)], rl.EpisodeBudget(max_turns=5))
    right, missed = group.episodes
    assert (right.reward, right.outcome, len(right.turns)) == (1.0, "success", 1)
    # The other keeps guessing wrong: truncated after three tries, a model failure.
    assert (missed.reward, missed.outcome, len(missed.turns)) == (0.0, "model_failure", 3)
    assert "user: No, " in sampler.prompts[-1] and f"assistant: {wrong}" in sampler.prompts[-1]


def test_a_gymnasium_environment_forks_by_copy():
    forked = asyncio.run(rl.start_group(guess_group(True), 5, 4, rl.EpisodeBudget()))
    assert (forked.cold, forked.forks) == (1, 3)
    assert len({id(m.env.env) for m in forked.members}) == 4  # each fork has its own copy
    assert len({m.env.env.target for m in forked.members}) == 1  # of one reset state
    cold = asyncio.run(rl.start_group(guess_group(False), 5, 4, rl.EpisodeBudget()))
    assert (cold.cold, cold.forks) == (4, 0)


# -- SkyRL-Gym ----------------------------------------------------------------------------


def test_skyrl_gyms_own_gsm8k_environment_scores_replies():
    rows = [{"prompt": [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. "
                                                    "How many in all?"}],
             "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": "72"}}]
    builder = adapters.skyrl_group_builder(rows, codec)
    group, sampler = rollout(builder, 0, 3, ["She sold 72. #### 72", "#### 71", "seventy-two"])
    assert [e.reward for e in group.episodes] == [1.0, 0.0, 0.0]
    assert [e.outcome for e in group.episodes] == ["success", "model_failure", "model_failure"]
    assert sampler.prompts[0].startswith("user: Natalia sold 48 clips")


class Countdown:
    """A multi-turn SkyRL-Gym environment written for SkyRL: say the numbers 3, 2, 1 in turn."""

    def __new__(cls, env_config=None, extras=None):
        from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

        class _Countdown(BaseTextEnv):
            def __init__(self):
                super().__init__()
                self.next = 3

            def step(self, action):
                said = re.findall(r"\d", action)
                ok = bool(said) and int(said[0]) == self.next
                self.next -= 1
                done = not ok or self.next == 0
                obs = [] if done else [{"role": "user", "content": "Next."}]
                return BaseTextEnvStepOutput(observations=obs, reward=1.0 if ok else 0.0, done=done,
                                             metadata={"count": 3 - self.next})

        return _Countdown()


def test_a_multi_turn_skyrl_environment():
    rows = [{"prompt": [{"role": "user", "content": "Count down from 3."}]}]
    builder = adapters.skyrl_group_builder(rows, codec, env_class=Countdown)

    class Counting(ScriptedSampler):
        async def sample_async(self, prompt, n, params, deadline_s=None):
            turn = tokenizer().decode(prompt).count("assistant:")  # 1 on the first turn
            self.replies = [str(4 - turn), "9"]
            return await super().sample_async(prompt, n, params, deadline_s)

    async def main():
        group = await rl.start_group(builder, 0, 2, rl.EpisodeBudget(max_turns=5))
        return await rl.rollout_group(0, Counting([]), group, PARAMS, rl.EpisodeBudget(max_turns=5))

    group = asyncio.run(main())
    counted, wrong = group.episodes
    assert (counted.reward, len(counted.turns), counted.outcome) == (3.0, 3, "success")
    assert (wrong.reward, len(wrong.turns), wrong.outcome) == (0.0, 1, "model_failure")


# -- OpenEnv ------------------------------------------------------------------------------


def _openenv_classes():
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class SayAction(Action):
        message: str

    class HeardObservation(Observation):
        heard: str = ""
        prompt: str = ""

    class ShoutEnv(Environment):
        """An OpenEnv environment whose rubric rewards replies in capitals, over two turns."""

        SUPPORTS_CONCURRENT_SESSIONS = True  # no state shared between instances

        def __init__(self):
            super().__init__()
            self._state = State(episode_id="e", step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs):
            self._state = State(episode_id=episode_id or "e", step_count=0)
            return HeardObservation(prompt="Shout something.", done=False, reward=None)

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            letters = [c for c in action.message if c.isalpha()]
            reward = sum(c.isupper() for c in letters) / len(letters) if letters else 0.0
            done = self._state.step_count >= 2
            return HeardObservation(heard=action.message, prompt="Louder!", done=done, reward=reward,
                                    metadata={"letters": len(letters)})

        @property
        def state(self):
            return self._state

    return SayAction, ShoutEnv, HeardObservation


def test_an_openenv_environment_with_its_rubric():
    say, shout, _ = _openenv_classes()
    builder = adapters.openenv_group_builder(lambda i: shout(), codec, action=lambda text: say(message=text),
                                             render=lambda obs: obs.prompt)
    group, sampler = rollout(builder, 0, 2, ["HEY THERE", "hey there"], rl.EpisodeBudget(max_turns=4))
    loud, quiet = group.episodes
    assert (loud.reward, len(loud.turns), loud.outcome) == (2.0, 2, "success")
    assert (quiet.reward, quiet.outcome) == (0.0, "model_failure")
    assert loud.metrics["letters"] == 16 and "user: Louder!" in sampler.prompts[-1]


def test_an_openenv_environment_served_over_its_websocket_protocol():
    """The same environment behind OpenEnv's own server (as in a container or a Space), each episode
    a GenericEnvClient session: actions and observations cross as JSON."""
    import socket
    import threading

    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.generic_client import GenericEnvClient

    say, shout, heard = _openenv_classes()
    app = create_fastapi_app(shout, say, heard, max_concurrent_envs=8)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        builder = adapters.openenv_group_builder(lambda i: GenericEnvClient(base_url=f"http://127.0.0.1:{port}"),
                                                 codec, action=lambda text: {"message": text},
                                                 render=lambda obs: obs["prompt"])
        group, sampler = rollout(builder, 0, 2, ["HEY THERE", "hey there"], rl.EpisodeBudget(max_turns=4))
        loud, quiet = group.episodes
        assert (loud.reward, len(loud.turns), loud.outcome) == (2.0, 2, "success")
        assert (quiet.reward, quiet.outcome) == (0.0, "model_failure")
        assert "user: Louder!" in sampler.prompts[-1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# -- verifiers ----------------------------------------------------------------------------


def _vf_envs():
    import verifiers as vf
    from datasets import Dataset

    def exact(completion, answer, **kwargs) -> float:
        text = completion[-1]["content"] if completion else ""
        return 1.0 if text.strip() == answer else 0.0

    rows = [{"question": "Say blue.", "answer": "blue"}, {"question": "Say red.", "answer": "red"}]
    single = vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[exact], weights=[1.0]))

    class TwoTries(vf.MultiTurnEnv):
        """Two tries: a wrong first answer gets "Try again." and a second turn; a right one ends it."""

        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Try again."}]

        @vf.stop
        async def answered(self, state) -> bool:
            steps = state["trajectory"]
            return bool(steps) and steps[-1]["completion"][-1]["content"].strip() == state["answer"]

    def last_right(completion, answer, **kwargs) -> float:
        replies = [m["content"] for m in completion if m["role"] == "assistant"]
        return 1.0 if replies and replies[-1].strip() == answer else 0.0

    multi = TwoTries(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[last_right], weights=[1.0]),
                     max_turns=2)
    return single, multi


def test_a_verifiers_single_turn_environment_scored_by_its_rubric():
    single, _ = _vf_envs()
    builder = adapters.verifiers_group_builder(lambda: single, codec)
    group, sampler = rollout(builder, 1, 2, ["red", "blue"])  # row 1 asks for red
    assert [e.reward for e in group.episodes] == [1.0, 0.0]
    assert [e.outcome for e in group.episodes] == ["success", "model_failure"]
    assert "user: Say red." in sampler.prompts[0] and group.episodes[0].metrics["exact"] == 1.0


def test_a_verifiers_multi_turn_environment_takes_its_own_turns():
    _, multi = _vf_envs()
    builder = adapters.verifiers_group_builder(lambda: multi, codec)
    group, sampler = rollout(builder, 0, 2, ["blue", "green"], rl.EpisodeBudget(max_turns=4))
    right, wrong = group.episodes
    assert (len(right.turns), right.reward, right.outcome) == (1, 1.0, "success")  # its stop condition
    # "green" twice: "Try again." once, then the environment's max_turns=2 ends it.
    assert (len(wrong.turns), wrong.reward, wrong.outcome) == (2, 0.0, "model_failure")
    assert "user: Try again." in sampler.prompts[-1]


# -- tinker-cookbook ----------------------------------------------------------------------


def test_a_cookbook_environment_and_group_builder():
    import tinker
    from tinker_cookbook.rl.types import Env, EnvGroupBuilder, StepResult

    class Echo(Env):
        """Token ids in and out: the reward is the share of sampled ids equal to the prompt's last."""

        def __init__(self, token: int):
            self.token = token

        async def initial_observation(self):
            return tinker.ModelInput.from_ints([1, 2, self.token]), [0]

        async def step(self, action, *, extra=None):
            share = sum(t == self.token for t in action) / max(1, len(action))
            return StepResult(reward=share, episode_done=True, next_observation=tinker.ModelInput.from_ints([]),
                              next_stop_condition=[0], metrics={"share": share})

    class Builder(EnvGroupBuilder):
        def __init__(self, token):
            self.token = token

        async def make_envs(self):
            return [Echo(self.token) for _ in range(2)]

    token = tokenizer().encode("x", add_special_tokens=False)[0]
    builder = adapters.cookbook_group_builder([Builder(token)])
    group, sampler = rollout(builder, 0, 2, ["x", "yy"])
    assert [e.reward for e in group.episodes] == [1.0, 0.0]
    assert group.episodes[0].turns[0].prompt == [1, 2, token]
    assert sampler.stops == [[0]]  # the environment's stop condition, as the cookbook applies it
    with pytest.raises(ValueError, match="group_size is 3"):
        asyncio.run(rl.start_group(builder, 0, 3, rl.EpisodeBudget()))


# -- on other workers ---------------------------------------------------------------------


@pytest.mark.stack  # other processes: not in the fast tier
def test_adapters_run_on_process_workers():
    """The builders carry how to make the tokenizer and the environment; both are made on the worker."""
    rows = [{"prompt": [{"role": "user", "content": "What is 6 times 7?"}], "env_class": "gsm8k",
             "reward_spec": {"method": "rule", "ground_truth": "42"}}]

    async def main():
        pool = rl.ProcessPool(workers=1)
        try:
            group = await pool.start_group(adapters.skyrl_group_builder(rows, codec), 0, 2, rl.EpisodeBudget())
            return await rl.rollout_group(0, ScriptedSampler(["#### 42", "#### 41"]), group, PARAMS)
        finally:
            await pool.aclose()

    group = asyncio.run(main())
    assert [e.reward for e in group.episodes] == [1.0, 0.0]
