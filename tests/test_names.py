"""Names checked by a pattern must match it whole: `^...$` with `re.match` lets a trailing newline
through (issue 14, cause 5)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.schemas import SaveWeightsForSamplerRequest, SaveWeightsRequest


@pytest.mark.parametrize("name", ["ck\n", "ck\x00", "a/b", "", ".", "..", ".hidden", "-x", "a?b", "a b", "x" * 129])
def test_checkpoint_names_must_match_whole(name):
    with pytest.raises(ValidationError):
        SaveWeightsRequest(model_id="m", seq_id=1, path=name)
    with pytest.raises(ValidationError):
        SaveWeightsForSamplerRequest(model_id="m", seq_id=1, path=name)


@pytest.mark.parametrize("name", ["final", "step_000020", "v1.2-rc", "A" * 128])
def test_ordinary_checkpoint_names_pass(name):
    assert SaveWeightsRequest(model_id="m", seq_id=1, path=name).path == name


@pytest.mark.parametrize("name", ["victim/suspend?x=", "..", "a b", "", "t" * 129, "<b>"])
def test_a_tenant_name_outside_the_pattern_is_refused_on_every_path(name):
    from core.errors import InvalidInput
    from tenancy.tenants import _create_params

    with pytest.raises(InvalidInput) as err:
        _create_params(name, "tenant", 1.0)
    assert err.value.field == "tenant" and "starting with a letter or a digit" in err.value.message
