"""Exports encrypted to their owner: `save_weights_external(..., age_encryption_recipients=[...])`
(tinker-cookbook's `weights.download` of a training checkpoint goes this way) writes every file as
`<file>.age`, which the recipient's identity decrypts, as the cookbook does with pyrage, into the
same PEFT adapter a plain export holds; the server can neither merge nor read it."""

from __future__ import annotations

from pathlib import Path

import pyrage
import pytest
from stackutil import TINY, new_model
from test_checkpoint_downloads import _assert_peft_matches_trainer, _fetch, _train, _trainer_logprobs

tinker = pytest.importorskip("tinker")
from tinkerutil import ready, rest_client  # noqa: E402

pytestmark = pytest.mark.stack


def test_an_encrypted_export_decrypts_to_the_plain_one(stack, tmp_path):
    owner = stack.create_tenant("age")
    identity, other = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    with tinker.ServiceClient(base_url=stack.base_url, api_key=owner.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=8))
        _train(tc)
        sealed = tc.save_weights_external(
            "sealed", age_encryption_recipients=[str(identity.to_public()), str(other.to_public())]).result().path
        plain = tc.save_weights_external("plain").result().path
        expected = _trainer_logprobs(tc)
    rest = rest_client(stack, owner.key)
    sealed_urls = rest.get_external_weights_urls(sealed).result().urls
    plain_urls = rest.get_external_weights_urls(plain).result().urls
    assert sorted(sealed_urls) == sorted(f"{name}.age" for name in plain_urls)

    out = tmp_path / "adapter"
    out.mkdir()
    for name, url in sealed_urls.items():
        encrypted = tmp_path / name
        encrypted.write_bytes(_fetch(url))
        assert b"age-encryption.org/v1" in encrypted.read_bytes()[:40]  # no plain bytes leave the server
        pyrage.decrypt_file(str(encrypted), str(out / name.removesuffix(".age")), [other])  # any recipient
        assert (out / name.removesuffix(".age")).read_bytes() == _fetch(plain_urls[name.removesuffix(".age")])
    _assert_peft_matches_trainer(stack, out, expected)
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt(Path(tmp_path / "adapter_config.json.age").read_bytes(), [pyrage.x25519.Identity.generate()])

    with stack.http(owner.key) as http:
        merged = http.get(f"/training_runs/{tc.model_id}/checkpoints/external_weights/sealed/merged")
        assert merged.status_code == 400 and merged.json()["field"] == "checkpoint_id", merged.text


GOOD = "good"  # stands for a well-formed x25519 recipient in the table


@pytest.mark.parametrize(("recipients", "field"), [
    (["age1notakey"], "age_encryption_recipients[0]"),
    ([GOOD, "age1notakey"], "age_encryption_recipients[1]"),
    ([GOOD, "ssh-ed25519 AAAA"], "age_encryption_recipients[1]"),
    (["a" * 2000], "age_encryption_recipients[0]"),
    ([GOOD] * 11, "age_encryption_recipients"),
])
def test_a_malformed_recipient_is_refused_naming_it(stack, tenant, recipients, field):
    good = str(pyrage.x25519.Identity.generate().to_public())
    with stack.http(tenant.key) as http:
        model_id = new_model(http)
        r = http.post("/save_weights_external", json={
            "model_id": model_id, "seq_id": 1, "path": "x",
            "age_encryption_recipients": [good if x is GOOD else x for x in recipients]})
        assert r.status_code == 400, r.text
        assert r.json()["field"] == field, r.json()
