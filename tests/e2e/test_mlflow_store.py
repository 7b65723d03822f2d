"""``logger=mlflow`` with a store the run cannot log into: one line before the run writes
anything (its folder holds the failed summary alone), never MLflow's minutes of retries.
The stores are real: a closed port, a socket that never answers, a web server that answers
404, a read-only folder for SQLite, MLflow's refused file store."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import ROOT, TINY_FAKE, compose_config, free_port
from omegaconf import OmegaConf

pytest.importorskip("mlflow", reason="the mlflow extra: pip install 'gradmod[mlflow]'")

from gradmod.app.config_store import validate  # noqa: E402
from gradmod.app.sweep_callback import SweepReport  # noqa: E402
from gradmod.reporting.mlflow_store import PROBE_SECONDS  # noqa: E402
from gradmod.run import runner  # noqa: E402


def _refused(out: Path, *overrides: str) -> str:
    """Run with ``overrides`` into ``out``; the ending must be a one-line failure found before
    the run wrote anything but its summary."""
    out.mkdir(exist_ok=True)  # as Hydra makes it
    cfg = compose_config(*TINY_FAKE, "logger=mlflow", *overrides)
    ending = runner.execute(lambda: validate(cfg), out)
    summary = json.loads((out / "summary.json").read_text())
    assert ending.status == summary["status"] == "failed"
    assert summary["error"].startswith("ValueError: ") and "\n" not in summary["error"]
    assert sorted(p.name for p in out.iterdir() if p.name != ".gradmod") == ["summary.json"]
    assert not (out / ".gradmod" / "mlflow.json").exists()  # no MLflow run was started
    assert summary["seconds"] < 10
    return summary["error"].removeprefix("ValueError: ")


class _Answers404(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self):
        type(self).requests.append(self.path)
        self.send_error(404)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def web_404():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers404)
    _Answers404.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", _Answers404.requests
    server.shutdown()
    server.server_close()


def test_an_unreachable_server_is_one_line(tmp_path):
    port = free_port()  # nothing listens there
    error = _refused(tmp_path, f"logger.tracking_uri=http://127.0.0.1:{port}")
    assert error == (
        f"logger.tracking_uri=http://127.0.0.1:{port}: nothing answers there (connection refused); "
        "start the server (mlflow server ...) or give another"
    )


def test_a_server_that_never_answers_is_asked_once_and_waited_for_briefly(tmp_path):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts connections, answers nothing
        error = _refused(tmp_path, f"logger.tracking_uri=http://127.0.0.1:{silent.getsockname()[1]}")
        silent.setblocking(False)
        accepted = 0
        while True:
            try:
                silent.accept()[0].close()
                accepted += 1
            except BlockingIOError:
                break
    assert error.endswith(f"no answer within {PROBE_SECONDS} s; check the address and that the server runs")
    assert accepted == 1  # one request, no retries


def test_a_web_server_that_is_not_mlflow_is_one_line(tmp_path, web_404):
    uri, requests = web_404
    error = _refused(tmp_path, f"logger.tracking_uri={uri}")
    assert error.startswith(f"logger.tracking_uri={uri}: it answered HTTP 404 to MLflow's API")
    assert requests == ["/api/2.0/mlflow/experiments/get-by-name?experiment_name=gradmod"]


def _read_only_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in: a chmod 555 folder, or (root passes
    permission bits) sysfs, which refuses new files to everyone."""
    mine = tmp_path / "read_only"
    mine.mkdir()
    mine.chmod(0o555)
    for folder in (mine, Path("/sys")):
        try:
            (folder / "probe").touch()
        except OSError:
            return folder
        (folder / "probe").unlink()
    pytest.skip("no folder here refuses this process a new file")


def test_sqlite_in_a_read_only_folder_is_one_line(tmp_path):
    folder = _read_only_folder(tmp_path)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    error = _refused(tmp_path / "run", f"logger.tracking_uri={uri}")
    assert error.startswith(f"logger.tracking_uri={uri}: cannot write the folder {folder} (")
    assert not (folder / "mlflow.db").exists()


def test_sqlite_at_a_folder_is_one_line(tmp_path):
    error = _refused(tmp_path / "run", f"logger.tracking_uri=sqlite:///{tmp_path}")
    assert error.endswith(f"{tmp_path} is a folder; name a database file, e.g. sqlite:///{tmp_path / 'mlflow.db'}")


@pytest.mark.parametrize(
    "override, words",
    [
        ("logger.tracking_uri=bogus://host", "logger.tracking_uri=bogus://host: MLflow has no store for this address"),
        ("logger.tracking_uri=file:///nowhere/mlruns", "MLflow refuses its file store (in maintenance mode)"),
        ("logger.experiment=''", "logger.experiment='': an MLflow experiment needs a name"),
    ],
)
def test_a_store_mlflow_refuses_is_one_line(tmp_path, monkeypatch, override, words):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'unused' / 'mlflow.db'}")
    assert words in _refused(tmp_path / "run", override)
    assert not (tmp_path / "unused").exists()  # refused before MLflow opened a store


def test_a_sweep_with_an_unreachable_server_is_one_line_and_writes_nothing(tmp_path, capsys):
    port = free_port()
    sweep = tmp_path / "sweep"
    cfg = OmegaConf.create(
        {
            "hydra": {"sweep": {"dir": str(sweep)}},
            "logger": {"name": "mlflow", "tracking_uri": f"http://127.0.0.1:{port}"},
        }
    )
    with pytest.raises(SystemExit) as ended:
        SweepReport().on_multirun_start(cfg)
    assert ended.value.code == 2 and not sweep.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"error: logger.tracking_uri=http://127.0.0.1:{port}: nothing answers there (connection refused); "
        "start the server (mlflow server ...) or give another"
    ]


@pytest.mark.slow  # train.py in a process of its own
def test_from_the_command_line_an_unreachable_server_is_one_line_and_exit_2(tmp_path):
    port = free_port()
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}", *TINY_FAKE, "logger=mlflow"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*cmd, f"logger.tracking_uri=http://127.0.0.1:{port}"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        f"error: logger.tracking_uri=http://127.0.0.1:{port}: nothing answers there (connection refused); "
        "start the server (mlflow server ...) or give another"
    ]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert not (tmp_path / "hook_plan.json").exists()
