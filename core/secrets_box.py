"""Secrets the service must read back (webhook signing keys) are stored encrypted, with keys from settings.

Webhook secrets cannot be hashed like API tokens: the sender needs them to sign every message. They are sealed with
``cryptography``'s Fernet (AES-128-CBC + HMAC-SHA256, authenticated) under ``MultiFernet``: the first of
``secret_keys`` encrypts, every listed key decrypts, so a key is rotated by putting a new one first; an old key may be dropped once every
value sealed under it has been re-sealed (``reseal``; ``llmjobs reseal`` does it for every stored secret). Without configured keys the
embedded setup generates one into ``<var_dir>/secret.key`` (mode 0600) on first use; deployments with several API
hosts must set ``LLMJOBS_SECRET_KEYS`` on all of them.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from core.settings import Settings

PREFIX = "fernet:"
KEY_FILE = "secret.key"


def _key_file(var_dir: Path) -> str:
    path = var_dir / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(Fernet.generate_key().decode())
    return path.read_text().strip()


def keys(settings: Settings) -> list[str]:
    """The Fernet keys in force, newest first."""
    if settings.secret_keys:
        return list(settings.secret_keys)
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    return [_key_file(settings.var_dir)]


def _box(key_list: list[str]) -> MultiFernet:
    try:
        return MultiFernet([Fernet(k.encode()) for k in key_list])
    except (ValueError, TypeError) as err:
        raise ValueError("secret_keys: each must be a Fernet key (32 url-safe base64-encoded bytes)") from err


def is_sealed(stored: str) -> bool:
    return stored.startswith(PREFIX)


def seal(key_list: list[str], plaintext: str) -> str:
    return PREFIX + _box(key_list).encrypt(plaintext.encode()).decode()


def unseal(key_list: list[str], stored: str) -> str:
    """The plaintext of a sealed value; ``ValueError`` when no key in force opens it (or it is not sealed)."""
    if not is_sealed(stored):
        raise ValueError("stored secret is not encrypted (run the database migrations)")
    try:
        return _box(key_list).decrypt(stored.removeprefix(PREFIX).encode()).decode()
    except InvalidToken as err:
        raise ValueError("stored secret does not open with any of secret_keys (a key was dropped too early?)") from err


def reseal(key_list: list[str], stored: str) -> str:
    """The same secret under the newest key (for rotation); ``ValueError`` when no key in force opens it."""
    try:
        return PREFIX + _box(key_list).rotate(stored.removeprefix(PREFIX).encode()).decode()
    except InvalidToken as err:
        raise ValueError("stored secret does not open with any of secret_keys") from err
