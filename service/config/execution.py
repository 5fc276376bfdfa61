"""Where items are executed: the ledger's own queue (database) or a broker's (rabbitmq).
Read by Settings (service/config/settings.py) as its execution fields; docs/configuration.md
and docs/architecture.md ("Execution on a broker") say when to choose which."""

from __future__ import annotations

from enum import StrEnum
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings

from service.config.regions import region_problem


class Execution(StrEnum):
    DATABASE = "database"  # workers claim from the ledger (FOR UPDATE SKIP LOCKED)
    RABBITMQ = "rabbitmq"  # the ledger's batches go to quorum queues; workers consume them


class ExecutionSettings(BaseSettings):
    """The execution fields of Settings (same prefix and rules; see Settings)."""

    execution: Execution = Field(
        default=Execution.DATABASE,
        description="where workers take items from: database or rabbitmq")
    broker_url: SecretStr | None = Field(
        default=None, description="amqp:// or amqps:// URL of RabbitMQ (execution rabbitmq)")
    broker_prefetch: int = Field(
        default=16, ge=1, le=1_000,
        description="messages a worker holds unsettled at once (execution rabbitmq)")

    region: str | None = Field(
        default=None, description=(
            "the region this process serves (one the policies file's [regions] declares): "
            "its workers take only that region's tenants' items; unset, only the items of "
            "tenants pinned to no region"))

    @field_validator("region")
    @classmethod
    def _region_name(cls, value: str | None) -> str | None:
        if value is not None and (problem := region_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @field_validator("broker_url")
    @classmethod
    def _amqp_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        try:
            parts = urlsplit(value.get_secret_value())
            parts.port  # noqa: B018 - raises on a port out of range
        except ValueError:
            raise ValueError("not a URL like amqp://user:password@host:5672/vhost") from None
        if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
            raise ValueError("not a URL like amqp://user:password@host:5672/vhost")
        return value

    def _execution_problems(self) -> list[str]:
        if self.execution is Execution.RABBITMQ and self.broker_url is None:
            return ["SWEEPER_EXECUTION=rabbitmq needs SWEEPER_BROKER_URL"]
        return []
