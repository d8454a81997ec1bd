"""What the official-SDK tests need to run unchanged on every tinker release they cover."""

from __future__ import annotations

import tinker
from tinker import types
from tinker.lib.public_interfaces.rest_client import RestClient


def rest_client(stack, key: str) -> RestClient:
    """`tinker.RestClient` (0.38), or a ServiceClient's, the only way in 0.34."""
    if hasattr(tinker, "RestClient"):
        return tinker.RestClient(base_url=stack.base_url, api_key=key)
    return tinker.ServiceClient(base_url=stack.base_url, api_key=key).create_rest_client()


def ready(made):
    """A client from a creation call: 0.38 returns a future of it, 0.34 the client itself."""
    return made.result() if hasattr(made, "result") else made


def sft_row(start: int) -> types.Datum:
    """A 16-token row of consecutive ids from `start`, every target weighted."""
    toks = list(range(start, start + 17))
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16})


def sft_data() -> list[types.Datum]:
    """Four 16-token rows of consecutive ids: a task the tiny base learns in a few steps."""
    return [sft_row(start) for start in (40, 80, 120, 160)]


def sampler_mismatch(tc, prompt: list[int] | types.ModelInput, *, n: int = 2, max_tokens: int = 8, seed: int = 5) -> dict:
    """Save `tc`'s weights for sampling, sample `n` completions of `prompt` (token ids, or a
    ModelInput with image chunks), and score the sampled tokens with the trainer: the
    `importance_sampling` metrics (`mismatch_kl:mean`, `logprob_diff_abs:mean`) say how far trainer
    and sampler disagree on them."""
    model_input = prompt if isinstance(prompt, types.ModelInput) else types.ModelInput.from_ints(prompt)
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.sample(model_input, n,
                         types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])).result()
    pad = [0.0] * (model_input.length - 1)
    # the prompt's own targets carry no weight (advantage 0): an image's positions get token 0
    prompt_targets = list(prompt[1:]) if isinstance(prompt, list) else [0] * (model_input.length - 1)
    rows = []
    for seq in out.sequences:
        assert len(seq.tokens) == max_tokens and len(seq.logprobs) == max_tokens
        chunks = [*model_input.chunks, types.EncodedTextChunk(tokens=list(seq.tokens[:-1]))]
        rows.append(types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={
            "target_tokens": prompt_targets + list(seq.tokens), "logprobs": pad + list(seq.logprobs),
            "advantages": pad + [1.0] * max_tokens}))
    return tc.forward(rows, "importance_sampling").result().metrics
