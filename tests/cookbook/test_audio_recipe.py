"""`recipes/audio` (asr, emotion, medical_asr) cannot run here: no base in Quilt takes audio. The
recipes train Inkling (rendered with `tml_renderers` >= 0.4.1, which the package registry here lacks
too), which Quilt does not serve, and Quilt refuses an audio (`DmelChunk`) input on every base by name.

Nothing is replaced: the recipe's own entry point runs on its own default model and stops at the
training client Quilt cannot make; the SDK sends the tiny base an audio chunk and Quilt answers the
400. docs/sdk/cookbook.md quotes both errors.
"""

from __future__ import annotations

import pytest
import tinker
from recipes import TINY


def test_audio_asr_recipe_stops_at_its_renderer_and_quilt_refuses_audio(cookbook, tmp_path):
    from tinker_cookbook.recipes.audio.asr import sl_train

    config = sl_train.Config(log_path=str(tmp_path / "run"), base_url=cookbook, behavior_if_log_dir_exists="delete",
                             n_train=2, n_eval=0, batch_size=2, max_steps=1, audio_cache_dir=str(tmp_path / "wav"))
    # The recipe asks for its training client first: Quilt serves no Inkling, the recipes' audio base.
    with pytest.raises(tinker.NotFoundError, match="'thinkingmachines/Inkling' is not served here") as missing:
        sl_train.cli_main(config)
    print(f"audio recipe: {missing.value}")

    # 4 frames of 80 mel bins, int8: a well-formed TensorContainer header the SDK reads the length from.
    audio = tinker.DmelChunk(dmel=bytes([1, 2, 4, 80]) + bytes(4 * 80))
    prompt = tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=[11, 87]), audio])
    with tinker.ServiceClient(base_url=cookbook) as service:
        sampler = service.create_sampling_client(base_model=TINY)
        with pytest.raises(tinker.BadRequestError) as refused:
            sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=4)).result()
    print(f"audio: {refused.value}")
    assert "no base model here takes audio" in str(refused.value)
