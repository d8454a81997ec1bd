"""checkpoints.encryption: an export's files encrypted to its owner, file to file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyrage
import pytest

from checkpoints import encryption
from checkpoints.layout import adapter_files
from core.errors import InvalidInput

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_is_replaced_by_its_encryption_and_decrypts_back(tmp_path):
    me, you = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256)) * 1000}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    size = encryption.encrypt_directory(tmp_path, (str(me.to_public()), str(you.to_public())))
    found = adapter_files(tmp_path)
    assert sorted(p.name for p in found) == sorted(f"{n}.age" for n in files) and encryption.is_encrypted(found)
    assert size == sum(p.stat().st_size for p in found)
    for name, data in files.items():
        assert pyrage.decrypt((tmp_path / f"{name}.age").read_bytes(), [you]) == data


@pytest.mark.parametrize(("texts", "field"), [
    (["age1qqqq"], "age_encryption_recipients[0]"),
    ([str(pyrage.x25519.Identity.generate().to_public()), "ssh-rsa nope"], "age_encryption_recipients[1]"),
    (["x" * 5000], "age_encryption_recipients[0]"),
])
def test_malformed_recipients_are_named(texts, field):
    with pytest.raises(InvalidInput) as err:
        encryption.check_recipients(texts)
    assert err.value.field == field


def test_a_large_file_is_encrypted_without_being_held_in_memory(tmp_path):
    """64 MiB encrypted in a fresh process whose peak memory grows by far less than that."""
    code = f"""
import os, resource, sys
sys.path.insert(0, {str(ROOT)!r})
import pyrage
from pathlib import Path
from checkpoints import encryption
d = Path({str(tmp_path)!r})
with open(d / "adapter_model.safetensors", "wb") as f:
    for _ in range(64):
        f.write(os.urandom(1 << 20))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
encryption.encrypt_directory(d, (str(pyrage.x25519.Identity.generate().to_public()),))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) < 16  # MiB of growth while encrypting 64 MiB
