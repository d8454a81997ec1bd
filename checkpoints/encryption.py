"""Exports encrypted to their owner (save_weights_external with age_encryption_recipients): each
file of the export is encrypted with age (the pyrage bindings, as tinker-cookbook uses) to the
recipients the client named, written as `<file>.age` in place of the plain file, which is removed
before the export is published. The server keeps no identity: only the recipients can decrypt,
so an encrypted export cannot be merged or sampled here.

Files are encrypted file to file by pyrage's streaming writer, so an export of any size never sits
whole in memory.
"""

from __future__ import annotations

from pathlib import Path

import pyrage

from checkpoints.layout import ENCRYPTED_SUFFIX
from core.errors import InvalidInput

MAX_RECIPIENT_CHARS = 1024  # an ssh-rsa public key is ~750 characters; x25519 ones are 62


def recipient(text: str, field: str):
    """The age recipient `text` names (x25519 `age1...`, or an ssh public key), or a 400 naming `field`."""
    if len(text) > MAX_RECIPIENT_CHARS:
        raise InvalidInput(f"{field} is {len(text)} characters; a recipient has at most {MAX_RECIPIENT_CHARS}",
                           field=field)
    for kind in (pyrage.x25519.Recipient, pyrage.ssh.Recipient):
        try:
            return kind.from_str(text.strip())
        except (pyrage.RecipientError, ValueError):
            continue
    raise InvalidInput(f"{field} is not an age recipient (an x25519 key 'age1...' or an ssh public key)",
                       field=field)


def check_recipients(texts: list[str], field: str = "age_encryption_recipients") -> tuple[str, ...]:
    """The recipients as the trainer will use them; a 400 naming the first malformed one."""
    for i, text in enumerate(texts):
        recipient(text, f"{field}[{i}]")
    return tuple(t.strip() for t in texts)


def encrypt_directory(directory: Path, recipients: tuple[str, ...]) -> int:
    """Replace every plain file of `directory` by `<file>.age`, encrypted to `recipients`; returns
    the bytes the directory then holds."""
    parsed = [recipient(text, "age_encryption_recipients") for text in recipients]
    for path in sorted(p for p in directory.iterdir() if p.is_file() and not p.name.endswith(ENCRYPTED_SUFFIX)):
        pyrage.encrypt_file(str(path), str(path) + ENCRYPTED_SUFFIX, parsed)
        path.unlink()
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def is_encrypted(files: list[Path]) -> bool:
    """Whether an export's files (checkpoints.layout.adapter_files) are encrypted to their owner."""
    return bool(files) and all(p.name.endswith(ENCRYPTED_SUFFIX) for p in files)
