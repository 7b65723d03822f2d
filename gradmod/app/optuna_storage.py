"""A persistent Optuna study (``hydra.sweeper.storage=sqlite:///PATH``, or any database URL)
under the `sweeps` extra: hydra-optuna-sweeper 1.3 pins optuna < 3, and optuna 2.10's
database storage stamps its schema version on a connection that SQLAlchemy 2 (which
optuna 2.10 leaves unpinned, and MLflow needs) never commits, so opening the study stops
in a bare ``AssertionError``. The storage is opened here first, before the sweeper opens
it, with that stamp committed; optuna then finds a storage of its own version. A URL
that cannot be opened is one line."""

from __future__ import annotations

import logging
from typing import Any


class StorageError(ValueError):
    pass


def prepare(url: str) -> None:
    """Open the study storage at ``url`` once, its schema stamped and committed."""
    try:
        import optuna
        import sqlalchemy
    except ImportError:  # the sweeper itself reports its missing plugin
        return
    try:
        engine = sqlalchemy.create_engine(url)
        with engine.connect():
            pass
    except Exception as e:  # no driver, no such folder, no server
        raise StorageError(f"hydra.sweeper.storage={url} cannot be opened: {_first_line(e)}") from None
    if optuna.__version__.startswith("2."):
        try:
            _stamp(url, engine)
        except Exception as e:
            raise StorageError(f"hydra.sweeper.storage={url}: {_first_line(e)}") from None
    engine.dispose()


def _stamp(url: str, engine: Any) -> None:
    """optuna 2.10's own tables and version records, its alembic stamp in a committed
    transaction (2.10 is the last 2.x: these internals no longer change)."""
    import alembic.migration
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _VersionManager
    from optuna.version import __version__ as optuna_version
    from sqlalchemy import insert, select

    logging.getLogger("alembic").setLevel(logging.WARN)
    models.BaseModel.metadata.create_all(engine)
    manager = object.__new__(_VersionManager)  # its script only: its __init__ stamps uncommitted
    manager.url, manager.engine = url, engine
    versions = models.VersionInfoModel.__table__
    with engine.begin() as connection:  # one transaction for the version record and the stamp
        if connection.execute(select(versions)).first() is None:
            row = {"schema_version": models.SCHEMA_VERSION, "library_version": optuna_version}
            connection.execute(insert(versions).values(version_info_id=1, **row))
        context = alembic.migration.MigrationContext.configure(connection)
        if context.get_current_revision() is None:
            script = manager._create_alembic_script()
            context.stamp(script, script.get_current_head())


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split("\n")[0].split()) or type(e).__name__
    return text.split(" (Background on this error")[0]
