"""Nothing lost, nothing stale, nothing silent: a run never writes, moves or deletes outside
its own folder whatever links the folder holds; from the moment a run owns its folder
``summary.json`` says ``running`` (a killed run then reads as ``killed``); a failed write
names its file, a lost run record or a dead rank says so; a stopped sweep still reports,
an unreadable job record is reported; default run folders do not collide and an empty
one is refused; the interrupt line says how to continue, and Ctrl-C at start-up is one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CONF, KEEP, RESUMABLE, ROOT, compose_config, free_port, run_train

from gradmod.app.cli import run
from gradmod.app.config_store import validate
from gradmod.reporting import run_summary, sweep_jobs
from gradmod.reporting import sweep_report as sweep
from gradmod.run import runner
from gradmod.run.folder import checkpoint_file as ckpt
from gradmod.training.callbacks import Callback, check_order

ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file under ``out`` (through no link) but the lock, which names its last holder."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.relative_to(out) != Path(".gradmod/lock")
    }


def raw_summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# --- 1. links that lead out of the folder -------------------------------------------------


def _link_checkpoints(mine: Path, other: Path) -> None:
    shutil.rmtree(mine / "checkpoints")
    (mine / "checkpoints").symlink_to(other / "checkpoints")


def _link_metrics(mine: Path, other: Path) -> None:
    (mine / "metrics.jsonl").unlink()
    (mine / "metrics.jsonl").symlink_to(other / "metrics.jsonl")


def _link_timeline(mine: Path, other: Path) -> None:
    (mine / "checkpoints" / "abandoned-1").symlink_to(other / "checkpoints")


def _link_meta(mine: Path, other: Path) -> None:
    shutil.rmtree(mine / ".gradmod")
    (mine / ".gradmod").symlink_to(other / ".gradmod")


@pytest.mark.parametrize("link", [_link_checkpoints, _link_metrics, _link_timeline, _link_meta])
@pytest.mark.parametrize("how", [["trainer.start_over=true"], ["trainer.resume=auto"], []])
def test_a_link_out_of_the_folder_is_refused_and_nothing_outside_changes(mine, other, link, how):
    link(mine, other)
    theirs, before = snapshot(other), snapshot(mine)
    with pytest.raises(ValueError, match=r"is a link to .*outside the folder; a run writes, moves and deletes") as e:
        run(compose_config(*KEEP, *how), mine)
    assert "\n" not in str(e.value)
    assert snapshot(other) == theirs and snapshot(mine) == before
    assert ckpt.checkpoints(other / "checkpoints")  # the other run's step checkpoints are all there


def test_a_link_that_stays_inside_the_folder_is_the_folders_own(mine):
    (mine / "checkpoints").rename(mine / "kept")
    (mine / "checkpoints").symlink_to("kept")  # relative, inside: the run's own files
    summary = run(compose_config(*KEEP, "trainer.start_over=true", "trainer.epochs=1"), mine)
    assert summary["status"] == "ok" and [ckpt.step_of(p) for p in ckpt.checkpoints(mine / "kept")] == [4, 6]


# --- 2. running, and a killed run read as killed ------------------------------------------


def test_from_the_moment_a_run_owns_its_folder_it_says_running(mine, tmp_path):
    seen = []
    first = runner.train(
        validate(compose_config(*KEEP, "trainer.epochs=1")),
        tmp_path / "new",
        on_owned=lambda out: seen.append(raw_summary(out)),
    )
    assert seen[0]["status"] == "running" and seen[0]["pid"] == os.getpid() and "previous" not in seen[0]
    assert seen[0]["run"] == first["run"]
    ended = raw_summary(mine)
    again = runner.train(
        validate(compose_config(*KEEP, "trainer.epochs=3", "trainer.resume=auto")),
        mine,
        on_owned=lambda out: seen.append(raw_summary(out)),
    )
    assert seen[1]["status"] == "running" and seen[1]["previous"] == ended  # the earlier ending, kept
    assert again["status"] == "ok" and again["previous"] == ended and again["steps"] == 18


@pytest.mark.slow
def test_a_killed_continuation_reads_as_killed_and_resume_auto_continues_it(mine):
    ended = raw_summary(mine)
    proc = run_train(
        mine, *KEEP, "trainer.epochs=3", "trainer.resume=auto", check=False, env={"GRADMOD_KILL_AT": "step:17"}
    )
    assert proc.returncode == -9, proc.stderr
    raw = raw_summary(mine)
    assert raw["status"] == "running" and raw["previous"] == ended  # not the stale "ok, 12 steps"
    assert run_summary.read(mine)["status"] == "killed"
    assert sweep.read_job(mine, mine.parent)["status"] == "killed"  # the report reads it so too
    summary = run(compose_config(*KEEP, "trainer.epochs=3", "trainer.resume=auto"), mine)
    assert summary["status"] == "ok" and summary["steps"] == 18
    assert summary["resumed_from"].endswith("step-000000016.pt") and summary["previous"]["status"] == "killed"


def test_a_running_summary_reads_as_running_while_its_run_holds_the_folder(tmp_path):
    from gradmod.run.folder.claim import RunFolder

    holder = RunFolder(tmp_path)
    claim = holder.claim(resume=None, start_over=False)
    holder.commit(claim)
    try:
        assert run_summary.read(tmp_path)["status"] == "running"
    finally:
        holder.release()
    assert run_summary.read(tmp_path)["status"] == "killed"


# --- 4. messages that say where -----------------------------------------------------------


@pytest.mark.parametrize("damage, says", [("remove", "is missing"), ("corrupt", "cannot be read as a run record")])
def test_auto_without_the_run_record_says_so_and_how_to_continue(mine, damage, says):
    record = mine / ".gradmod" / "run.json"
    run_id = json.loads(record.read_text())["run_id"]
    if damage == "remove":
        record.unlink()
    else:
        record.write_text('{"run_id": "')
    before = snapshot(mine)
    with pytest.raises(ValueError) as e:
        run(compose_config(*KEEP, "trainer.resume=auto"), mine)
    assert f"{record} {says}" in str(e.value) and "so it is unknown which run this folder continues" in str(e.value)
    assert f"its checkpoints are run {run_id}'s" in str(e.value) and "\n" not in str(e.value)
    assert snapshot(mine) == before
    record.write_text(json.dumps({"run_id": run_id}))  # as the line says
    assert run(compose_config(*KEEP, "trainer.resume=auto", "trainer.epochs=3"), mine)["steps"] == 18


@pytest.mark.slow
def test_a_full_disk_at_the_end_of_a_run_names_the_file(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a mount namespace (unshare -rm) for a small tmpfs")
    args = [
        f"hydra.run.dir={full}",
        *(a for a in RESUMABLE if not a.startswith("+hooks")),
        "trainer.checkpoint_every_steps=0",
        "trainer.checkpoint_every=0",
        "trainer.epochs=1",
    ]
    script = f"mount -t tmpfs -o size=96k tmpfs {full} && exec {sys.executable} {ROOT / 'train.py'} " + " ".join(
        f"'{a}'" for a in args
    )
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: cannot write {full / 'model.pt'}: No space left on device"]


@pytest.mark.slow
def test_a_rank_killed_under_ddp_is_named_in_the_summary(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port",
        str(free_port()),
        str(ROOT / "tests" / "support" / "kill_driver.py"),
        f"hydra.run.dir={run_dir}",
        "trainer.strategy=ddp",
        *RESUMABLE,
        "trainer.epochs=3",
    ]
    env = {**ENV, "GRADMOD_KILL_AT": "step:3", "GRADMOD_KILL_RANK": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode != 0
    summary = raw_summary(run_dir)
    assert summary["status"] == "failed", summary
    assert summary["error"].startswith("RankLost: rank 1 (pid ") and "ended during the run" in summary["error"]


# --- 5. sweeps ----------------------------------------------------------------------------


def _record(sweep_dir: Path, num: int, **fields) -> None:
    record = {
        "num": num,
        "job": str(num),
        "dir": str(sweep_dir / str(num)),
        "overrides": [f"seed={num}"],
        "status": "ok",
        "test_accuracy": 0.5,
        "test_loss": 1.0,
        "started": 0.0,
        **fields,
    }
    (sweep_dir / ".gradmod" / "jobs").mkdir(parents=True, exist_ok=True)
    (sweep_dir / ".gradmod" / "jobs" / f"{num}.json").write_text(json.dumps(record))


def test_a_truncated_job_record_is_reported_unreadable_not_dropped(tmp_path):
    _record(tmp_path, 0)
    _record(tmp_path, 1)
    cut = tmp_path / ".gradmod" / "jobs" / "1.json"
    cut.write_text(cut.read_text()[:20])
    rows = sweep.collect(tmp_path, ended=True)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "unreadable")]
    assert str(cut) in rows[1]["error"] and "cannot be read" in rows[1]["error"]
    sweep.write_report(tmp_path, ended=True)
    assert "2 jobs: 1 ok, 1 unreadable." in (tmp_path / "sweep.md").read_text()


def test_planned_jobs_without_a_record_are_not_run_once_the_sweep_ended(tmp_path):
    sweep_jobs.plan(tmp_path, [["seed=0"], ["seed=1"], ["seed=2"]])
    _record(tmp_path, 0)
    assert [r["status"] for r in sweep.collect(tmp_path, ended=False)] == ["ok"]
    rows = sweep.collect(tmp_path, ended=True)
    assert [(r["job"], r["status"], r["overrides"]) for r in rows] == [
        ("0", "ok", ["seed=0"]),
        ("1", "not_run", ["seed=1"]),
        ("2", "not_run", ["seed=2"]),
    ]


@pytest.mark.slow
def test_sigterm_to_a_sweep_writes_the_report_and_names_what_did_not_run(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        f"hydra.sweep.dir={tmp_path}",
        *[a for a in RESUMABLE if not a.startswith("trainer.epochs")],
        "trainer.epochs=3",
        "seed=0,1,2",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = tmp_path / "1" / "metrics.jsonl"  # job 1 is training
    deadline = time.monotonic() + 500
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    table = {r["job"]: r for r in sweep.collect(tmp_path, ended=True)}
    assert [table[j]["status"] for j in "012"] == ["ok", "interrupted", "not_run"]
    assert "not run: job 2 (seed=2)" in err and str(tmp_path / "sweep.md") in err
    assert "3 jobs: 1 ok, 1 interrupted, 1 not_run." in (tmp_path / "sweep.md").read_text()


# --- 6. run folders -----------------------------------------------------------------------


def test_default_run_folders_are_unique_below_the_second():
    dirs = [compose_config_with_hydra().hydra.run.dir for _ in range(2)]
    assert dirs[0] != dirs[1] and all(d.startswith("outputs/") for d in dirs)
    sweeps = [compose_config_with_hydra().hydra.sweep.dir for _ in range(2)]
    assert sweeps[0] != sweeps[1]


def compose_config_with_hydra():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name="config", return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.slow
def test_two_runs_started_together_get_a_folder_each(tmp_path):
    args = [a for a in RESUMABLE if not a.startswith(("trainer.epochs", "+hooks"))]
    cmd = [sys.executable, str(ROOT / "train.py"), *args, "trainer.epochs=1", f"data_dir={tmp_path / 'data'}"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()
    summaries = sorted(tmp_path.glob("outputs/*/*/summary.json"))
    assert len(summaries) == 2 and all(raw_summary(s.parent)["status"] == "ok" for s in summaries)


@pytest.mark.slow
def test_an_empty_run_folder_is_refused(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "hydra.run.dir=''", *RESUMABLE],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: hydra.run.dir is empty; a run needs a folder of its own: "
        "give hydra.run.dir=PATH, or leave it out for a new folder under "
        "outputs/"
    ]
    assert list(tmp_path.iterdir()) == []


# --- 7. start-up ----------------------------------------------------------------------------


def _torch_loading(pid: int) -> bool:
    """Whether the process has begun loading torch's native library (train.py's first lines ran)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


ENTRIES = {  # python train.py, and what the console script gradmod runs
    "train.py": [sys.executable, str(ROOT / "train.py")],
    "gradmod": [sys.executable, "-c", "from gradmod.app.cli import main; main()"],
}


@pytest.mark.slow
@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("after", ["torch", "claimed"])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, after, entry):
    """Ctrl-C while torch is imported (as soon as it starts loading) or later in the start-up
    (the run folder claimed, the data and model still to come): one line, exit 130."""
    proc = subprocess.Popen(
        [*ENTRIES[entry], f"hydra.run.dir={tmp_path / 'run'}", *RESUMABLE],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not _torch_loading(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    while after == "claimed" and not (tmp_path / "run" / ".gradmod").exists() and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted by SIGINT before training started"]


# --- one way out -----------------------------------------------------------------------------


def test_a_run_ends_in_one_value_written_once(tmp_path):
    ending = runner.execute(lambda: validate(compose_config(*KEEP, "trainer.epochs=-1")), tmp_path)
    assert ending.status == "failed" and isinstance(ending.error, ValueError) and ending.exit_code == 2
    assert raw_summary(tmp_path) == json.loads(json.dumps(ending.summary))  # what was written is what returned
    assert not hasattr(ending.error, "gradmod_summary")  # nothing rides on the error
    with pytest.raises(ValueError, match="trainer.epochs"):
        ending.result()
    ok = runner.execute(lambda: validate(compose_config(*KEEP, "trainer.epochs=1")), tmp_path / "ok")
    assert ok.error is None and ok.exit_code == 0 and ok.result() == ok.summary and ok.status == "ok"


# --- callback order, as data ----------------------------------------------------------------


class _Saver(Callback):
    key = "Checkpointer"


class _Early(Callback):
    key = "early"
    before = {"Checkpointer": "its state goes into the checkpoint"}


class _Again(_Early):
    key = "again"


class _Last(Callback):
    key = "last"
    last = True


def test_callback_order_is_checked_where_a_trainer_gets_its_callbacks():
    check_order([_Early(), _Saver(), Callback(), _Last()])
    with pytest.raises(ValueError, match=r"callback early must run before Checkpointer \(its state goes into"):
        check_order([_Saver(), _Early()])
    with pytest.raises(ValueError, match="callback Callback comes after last, which runs last"):
        check_order([_Last(), Callback()])
    with pytest.raises(ValueError, match="two callbacks have the state key 'early'"):
        check_order([_Early(), _Early()])


def test_the_trainer_refuses_callbacks_out_of_order():
    import torch

    from gradmod.training.trainer import Trainer

    model = torch.nn.Linear(2, 2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[_Early(), _Saver()])
    with pytest.raises(ValueError, match="must run before Checkpointer"):
        trainer.add_callbacks([_Again()])
    with pytest.raises(ValueError, match="must run before"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[_Saver(), _Early()])
    assert [cb.key for cb in trainer.callbacks] == ["early", "Checkpointer"]  # the refused one was not added
