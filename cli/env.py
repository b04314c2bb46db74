"""Settings for a command that runs part of the service, and the database migrated to head before it starts."""

from __future__ import annotations

from core.settings import Settings, clear_settings, get_settings


def load_settings() -> Settings:
    """Fresh settings from the environment (a command may have just set LLMJOBS_* variables)."""
    clear_settings()
    return get_settings()


def prepare(settings: Settings) -> None:
    """Create the var directories and apply the migrations."""
    from core.db import upgrade_head
    from core.secrets_box import keys

    settings.ensure_dirs()
    upgrade_head(settings.database_url, keys(settings))
