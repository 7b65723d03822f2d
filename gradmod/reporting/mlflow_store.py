"""Whether ``logger=mlflow``'s store can take the run, asked once before the run starts.

Left to itself MLflow waits minutes on a store it cannot use: a tracking server that does
not answer gets 7 retries with backoff and 120 s each (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
``MLFLOW_HTTP_REQUEST_TIMEOUT``), a SQLite file it cannot open 10 attempts over about 100 s.
``check_store`` asks with no retries and a timeout of ``PROBE_SECONDS``, and tries SQLite's
folder itself first, so a store the run could not log into is one line before the run writes
anything (a store that answers gets MLflow's own retries for the rest of the run).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sqlite3
import tempfile
from pathlib import Path
from typing import Iterator

from gradmod.reporting.mlflow_tracking import client, resolve_uri

PROBE_SECONDS = 5  # a tracking server that has not answered by then is reported, not waited for
_ONCE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(PROBE_SECONDS)}
STORES = "a server (http://host:5000), a database (sqlite:///path/mlflow.db, postgresql://...), or null"


def check_store(tracking_uri: str | None, experiment: str) -> None:
    """One ``ValueError`` line, within seconds, where the run could not log into the store:
    no experiment name, a scheme MLflow has no store for, its refused file store, a server
    that does not answer, or answers what an MLflow server would not, a SQLite file whose
    folder cannot be written."""
    if not isinstance(experiment, str) or not experiment.strip():
        raise ValueError(f"logger.experiment={experiment!r}: an MLflow experiment needs a name, e.g. gradmod")
    uri = resolve_uri(tracking_uri)
    where = _named(tracking_uri, uri)
    if uri.startswith("sqlite:"):
        _check_sqlite(uri, where)
    with _asked_once():
        try:
            client(uri).get_experiment_by_name(experiment)
        except ValueError:  # the mlflow package missing: client's own line
            raise
        except Exception as e:
            raise ValueError(f"{where}: {_why(e)}") from None


def _named(tracking_uri: str | None, uri: str) -> str:
    """The setting the store came from, as the user would change it."""
    if tracking_uri:
        return f"logger.tracking_uri={tracking_uri}"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return f"MLFLOW_TRACKING_URI={uri}"
    return f"logger.tracking_uri=null ({uri})"


@contextlib.contextmanager
def _asked_once() -> Iterator[None]:
    """MLflow's HTTP settings for one request with no retries (read by MLflow at each request)."""
    saved = {key: os.environ.get(key) for key in _ONCE}
    os.environ.update(_ONCE)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _check_sqlite(uri: str, where: str) -> None:
    """The database file opens for writing, or its folder (the nearest that exists: MLflow
    makes the rest) takes a new file; a probe file is removed at once."""
    name = uri.split("?", 1)[0].removeprefix("sqlite:").removeprefix("///")
    if name in ("", "//", ":memory:"):
        return  # an in-memory database
    path = Path(name).absolute()
    if path.is_dir():
        raise ValueError(f"{where}: {path} is a folder; name a database file, e.g. sqlite:///{path / 'mlflow.db'}")
    folder = next(p for p in path.parents if p.exists()) if not path.parent.exists() else path.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
        if path.exists():
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=PROBE_SECONDS)) as db:
                db.execute("BEGIN IMMEDIATE")  # takes the write lock: a read-only file refuses here
                db.rollback()
    except OSError as e:
        raise ValueError(
            f"{where}: cannot write the folder {folder} ({e.strerror}); give a writable place, "
            f"e.g. logger.tracking_uri=sqlite:///{Path.home() / 'mlflow.db'}"
        ) from None
    except sqlite3.Error as e:
        raise ValueError(f"{where}: {path} cannot be written as a database ({e})") from None


def _why(error: BaseException) -> str:
    """What MLflow's error means for the user, in a few words."""
    chain = _chain(error)
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        return "nothing answers there (connection refused); start the server (mlflow server ...) or give another"
    if any(isinstance(e, socket.gaierror) for e in chain):
        return "its host name does not resolve; check the address"
    if any(isinstance(e, TimeoutError) or "Timeout" in type(e).__name__ for e in chain):
        return f"no answer within {PROBE_SECONDS} s; check the address and that the server runs"
    message = str(error)
    status = re.search(r"error code (\d{3}) != 200", message)
    if status and status.group(1) in ("401", "403"):
        return (
            f"the server refused access (HTTP {status.group(1)}); set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
        )
    if status:
        return (
            f"it answered HTTP {status.group(1)} to MLflow's API (/api/2.0/mlflow/...), so it is not an "
            "MLflow tracking server, or the address lacks its path"
        )
    if "unsupported URI" in message:
        return f"MLflow has no store for this address; allowed: {STORES}"
    if "MLFLOW_ALLOW_FILE_STORE" in message:
        return (
            "MLflow refuses its file store (in maintenance mode); use sqlite:///path/mlflow.db, "
            "or set MLFLOW_ALLOW_FILE_STORE=true"
        )
    first = " ".join(message.split())[:300]
    return f"MLflow could not open the store ({type(error).__name__}: {first})"


def _chain(error: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while error is not None and error not in out:
        out.append(error)
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return out
