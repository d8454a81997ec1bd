"""Names checked by a pattern must match it whole: `^...$` with `re.match` lets a trailing newline
through (issue 14, cause 5)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.schemas import SaveWeightsForSamplerRequest, SaveWeightsRequest


@pytest.mark.parametrize("name", ["ck\n", "ck\x00", "a/b", ""])
def test_checkpoint_names_must_match_whole(name):
    with pytest.raises(ValidationError):
        SaveWeightsRequest(model_id="m", seq_id=1, path=name)
    with pytest.raises(ValidationError):
        SaveWeightsForSamplerRequest(model_id="m", seq_id=1, path=name)
