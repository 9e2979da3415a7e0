"""``AuditSettings``: retention and ingestion limits, from ``KCACHE_AUDIT_*`` variables.

Kept apart from the server's :class:`~kcache_server.settings.Settings` so auditing
can be configured (and tested) without touching the resolve path's options.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["AuditSettings"]


class AuditSettings(BaseSettings):
    """Each field is ``KCACHE_AUDIT_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="KCACHE_AUDIT_", extra="ignore")

    retention_days: float = Field(
        default=30.0,
        ge=0,
        description="raw events older than this are rolled up into hourly counts; 0 keeps all",
    )
    rollup_interval_s: float = Field(default=3600.0, gt=0, description="how often the roll-up runs")
    max_events_per_batch: int = Field(
        default=10_000, ge=1, description="events per POST /v1/events"
    )
    max_clock_skew_s: float = Field(
        default=86_400.0, ge=0, description="client event times further in the future are refused"
    )
