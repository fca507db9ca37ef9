"""Tables of the tuning DB (SQLAlchemy 2 declarative ORM).

Names carry a `kilnx_` prefix because the same database also holds Optuna's own tables (one URL for
both, so `optuna-dashboard <url>` opens the studies that produced the results).

A tuned result is identified by (kernel name, kernel source hash, device key, bucket, triton version):
change any of them and the old row no longer answers the runtime's question. Rows are never rewritten
in place except to replace a result by a faster one for the same identity.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Bump when the tables change incompatibly. An older kilnx refuses a DB from a newer one instead of
# misreading it (see TuningDB._ensure_schema).
SCHEMA_VERSION = 1


class Base(DeclarativeBase):
    pass


class SchemaVersionRow(Base):
    __tablename__ = "kilnx_schema_version"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1: a single-row table
    version: Mapped[int] = mapped_column(Integer, nullable=False)


class DeviceRow(Base):
    __tablename__ = "kilnx_devices"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(255), unique=True, nullable=False)
    name: Mapped[str] = mapped_column(String(255), nullable=False)
    arch: Mapped[str] = mapped_column(String(32), nullable=False)
    info: Mapped[dict] = mapped_column(JSON, nullable=False)        # DeviceInfo.to_dict(), for export
    updated: Mapped[datetime] = mapped_column(DateTime, nullable=False)


class KernelRow(Base):
    __tablename__ = "kilnx_kernels"
    __table_args__ = (UniqueConstraint("name", "source_hash", name="uq_kilnx_kernels_name_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), nullable=False)
    source_hash: Mapped[str] = mapped_column(String(128), nullable=False)
    # The most recently (re)registered hash of a name is taken as the current source when no caller
    # says otherwise, so older hashes show as stale in `kilnx db show`.
    last_seen: Mapped[datetime] = mapped_column(DateTime, nullable=False)


class ResultRow(Base):
    __tablename__ = "kilnx_results"
    __table_args__ = (UniqueConstraint("kernel_id", "device_id", "bucket", "triton_version",
                                       name="uq_kilnx_results_identity"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kernel_id: Mapped[int] = mapped_column(ForeignKey("kilnx_kernels.id"), nullable=False)
    device_id: Mapped[int] = mapped_column(ForeignKey("kilnx_devices.id"), nullable=False)
    bucket: Mapped[str] = mapped_column(String(255), nullable=False)
    triton_version: Mapped[str] = mapped_column(String(64), nullable=False)
    torch_version: Mapped[str] = mapped_column(String(64), nullable=False)
    kilnx_version: Mapped[str] = mapped_column(String(64), nullable=False)
    config: Mapped[dict] = mapped_column(JSON, nullable=False)
    time_s: Mapped[float] = mapped_column(Float, nullable=False)
    default_time_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    peer_time_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    trials: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    created: Mapped[datetime] = mapped_column(DateTime, nullable=False)

    kernel: Mapped[KernelRow] = relationship()
    device: Mapped[DeviceRow] = relationship()
