"""Kill at any moment, nothing lost: `selfsup run` SIGKILLed at seeded random moments in every
stage, rerun after each kill, ends where an uninterrupted run ends.

The kill moments: a stage that takes a second or more in the reference run is killed a
seeded uniform fraction of its reference duration after it starts (`SELFSUP_FAULT_KILL_AFTER`),
wherever the run is by then: in the stage, between stages, or in a later stage when this run
was faster. A stage shorter than a second (where a timer would mostly land after it), or one
such a kill missed, is then killed at its worst moment: outputs written, manifest not
(`SELFSUP_FAULT_KILL`; `--force` if the late kill let it finish). Pretraining is also killed
right after its first checkpoint, and must resume from it. Each kill is followed by a rerun
with the next kill armed, so every stage is hit, and the last rerun runs to the end.

What must hold: the final workdir's files are byte-identical to the uninterrupted run's, but
for the manifests, MLflow's own store, and what a run measures of itself (durations, speeds,
wall-clock times: `_MEASURED`); the stage in flight at each kill left no manifest (or, killed
after writing it while MLflow recorded the stage's end, one that vouches for every output); and
the MLflow store holds exactly one finished parent run, which accounts for every stage (ran in a
child run, or skipped as up to date), while each killed run's parent was closed as FAILED.

The runs use the tiny preset without the sentence-embedding baseline (its own tests cover it;
it is a third of the run's time), fine-tuning on one label fraction without staged unfreezing.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import numpy as np

from selfsup_model.artifacts import MANIFEST_NAME, read_manifest, verify_outputs
from selfsup_model.pretraining.callbacks import read_checkpoint
from tasks.registry import PIPELINE
from tests.reliability.test_faults import _cli

STAGES = [spec.name for spec in PIPELINE]
# A checkpoint every 3 of the tiny preset's 12 steps leaves time to kill pretraining after one.
# One label fraction and no staged fine-tuning: a third of the stage's time, the same code paths
# for a kill (fine-tuning keeps no checkpoint; a killed one starts over).
SETTINGS = ("--set", "baseline.sentence_embeddings=off", "--set", "pretrain.checkpoint_every=3",
            "--set", "finetune.fractions=[1.0]", "--set", "finetune.modes=[probe, full]")
SEED = 38
# Files that record measurements of the run itself, compared with those fields masked. Anything
# else that differs fails the test.
_MEASURED = {"pretrain/history.json", "pretrain/checkpoints/latest.json",
             "finetune/results.json", "baseline/results.json", "compare/report.json",
             "compare/report.md", "versions/lineage.json"}
_MEASURED_KEY = re.compile(r"(time_s|_per_s|seconds|_at|wall time)$|^timed_")  # timed_*: the
# steps a speed was measured over (a resumed run leaves out its first step again, as warm-up)
# Not artifacts: the lock, MLflow's store, and the MLflow run ids each reported step went to.
_NOT_ARTIFACTS = re.compile(r"^(\.selfsup\.lock|mlflow\.db|mlartifacts/.*|"
                            r"(versions/[^/]+/v\d+/)?pretrain/checkpoints/reported_steps\.txt)$")


def _masked_json(node):
    if isinstance(node, dict):
        return {k: "<measured>" if _MEASURED_KEY.search(k) else _masked_json(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_masked_json(v) for v in node]
    return node


def _masked_markdown(text: str) -> list[str]:
    """Lines of a report with its measured cells blanked: table columns whose header names a
    time, and the stage wall-time line."""
    out, timed = [], set()
    for line in text.splitlines():
        if line.startswith("- **stage wall time**"):
            out.append("- **stage wall time**: <measured>")
            continue
        if line.startswith("|"):
            cells = line.strip("|").split("|")
            if not set(line) <= set("|-: "):  # a header row names its time columns
                if any("time" in c for c in cells) and not timed:
                    timed = {i for i, c in enumerate(cells) if "time" in c}
                else:
                    cells = ["<measured>" if i in timed else c for i, c in enumerate(cells)]
            out.append("|".join(cells))
        else:
            timed = set()
            out.append(line)
    return out


def _content(path: Path, rel: str):
    measured = rel.split("/v0001/", 1)[-1] if rel.startswith("versions/") else rel
    if measured in _MEASURED:
        if path.suffix == ".json":
            return _masked_json(json.loads(path.read_text()))
        return _masked_markdown(path.read_text())
    return path.read_bytes()


def _artifacts(workdir: Path) -> dict[str, Path]:
    return {rel: p for p in sorted(workdir.rglob("*")) if p.is_file()
            and not _NOT_ARTIFACTS.match(rel := p.relative_to(workdir).as_posix())
            and p.name != MANIFEST_NAME}


def _in_flight(stderr: str) -> str | None:
    """The stage that was running when the process died (its start logged, its end not)."""
    running = None
    for line in stderr.splitlines():
        if m := re.search(r"selfsup\.stage (\w+): running", line):
            running = m.group(1)
        elif (m := re.search(r"selfsup\.stage (\w+): done in", line)) and m.group(1) == running:
            running = None
    return running


def _redoes(run, owed: set[str]) -> None:
    """Each stage in `owed` was hit by a kill that left it without a manifest: the first run to
    reach it afterwards must redo it for that reason (a skip would trust a half-written stage).
    A stage this run never reached (it was killed earlier) stays owed to the next run: a timed
    kill can land in the stage after the one it was armed for, and the forced run that follows
    is killed before getting there."""
    for stage in sorted(owed):
        if f"selfsup.stage {stage}: " in run.stderr:
            assert f"selfsup.stage {stage}: running (no valid manifest)" in run.stderr, (
                stage, run.stderr[-3000:])
            owed.discard(stage)


def test_killed_at_random_moments_reruns_end_byte_identical_with_one_finished_run(
        tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # each workdir's own store
    reference, wd = tmp_path / "reference", tmp_path / "wd"
    first = _cli(reference, *SETTINGS, tmp=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    took = {stage: read_manifest(reference / stage).duration_s for stage in STAGES}

    rng = np.random.default_rng(SEED)
    kills, resumable = [], []
    owed: set[str] = set()  # stages a kill hit, not yet seen redone

    def killed(run, armed: str, how: str, timer: bool = False) -> str:
        """Record a kill and what it hit: a stage (which must have left no manifest), a stage
        "after its manifest", "between stages", or "finished" (a timer that fired after the
        run's end)."""
        if timer and run.returncode == 0:
            hit = "finished"
        else:
            assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
            hit = _in_flight(run.stderr) or "between stages"
        if hit in STAGES and (manifest := read_manifest(wd / hit)) is not None:
            # Killed after the manifest, while MLflow recorded the stage's end: the stage is
            # done on disk, and its manifest must vouch for every output.
            assert not verify_outputs(wd / hit, manifest), hit
            hit = f"{hit}, after its manifest"
        elif hit in STAGES:
            assert not (wd / hit / MANIFEST_NAME).exists()  # what it wrote is never trusted
        kills.append((armed, how, hit))
        if hit in STAGES:
            owed.add(hit)
        if hit == "pretrain":
            checkpoint = read_checkpoint(wd / "pretrain" / "checkpoints")
            resumable.append(checkpoint["step"] if checkpoint else 0)
        return hit

    for stage in STAGES:
        if stage == "pretrain":  # once right after its first checkpoint: it must resume there
            run = _cli(wd, *SETTINGS, wait=False, tmp=tmp_path)
            ckpts, deadline = wd / "pretrain" / "checkpoints", time.monotonic() + 300
            while (read_checkpoint(ckpts) is None and run.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            run.kill()
            run.finish()
            _redoes(run, owed)
            assert killed(run, stage, "after its first checkpoint") == "pretrain"
        if took[stage] >= 1.0:  # a seeded moment within it, by its duration in the reference
            after = f"{stage}:{rng.uniform(0.05, 0.9) * took[stage]:.3f}"
            run = _cli(wd, *SETTINGS, env={"SELFSUP_FAULT_KILL_AFTER": after}, tmp=tmp_path)
            _redoes(run, owed)
            if killed(run, stage, after, timer=True) == stage:
                continue
        # A short stage, or one that ran faster than in the reference this time (the kill
        # landed later): its worst moment, outputs written and manifest not (forced to run
        # again if a late kill let it finish).
        run = _cli(wd, *SETTINGS, "--force", stage, env={"SELFSUP_FAULT_KILL": stage},
                   tmp=tmp_path)
        _redoes(run, owed)
        assert killed(run, stage, "outputs written, manifest not") == stage
    print("kills (armed for, how, stage in flight):", kills, "; checkpoint step at the kills "
          "in pretraining:", resumable)
    assert set(STAGES) <= {hit for _, _, hit in kills}, kills  # every stage hit
    assert resumable[0] > 0  # the kill after a checkpoint

    last = _cli(wd, *SETTINGS, tmp=tmp_path)
    assert last.returncode == 0, last.stderr[-3000:]
    _redoes(last, owed)
    assert not owed, owed  # the finished run reached every stage
    ours, theirs = _artifacts(wd), _artifacts(reference)
    assert sorted(ours) == sorted(theirs)
    differ = [rel for rel in ours if _content(ours[rel], rel) != _content(theirs[rel], rel)]
    assert not differ, differ
    if resumable and resumable[-1]:  # the last kill in pretraining followed a checkpoint
        assert read_manifest(wd / "pretrain").counts["resumed_from_step"] == resumable[-1]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("selfsup").experiment_id],
                              max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    finished = [r for r in parents if r.info.status == "FINISHED"]
    assert len(finished) == 1, [(r.info.run_name, r.info.status) for r in parents]
    closed = [r for r in parents if r is not finished[0]]
    assert len(closed) == sum(hit != "finished" for _, _, hit in kills)
    assert all(r.info.status == "FAILED" and r.data.tags.get("selfsup.ended_by")
               for r in closed)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    parent = finished[0]
    children = {r.info.run_name.split(":")[0]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    for stage in STAGES:
        if stage in children:
            assert children[stage].info.status == "FINISHED", stage
        else:
            assert parent.data.tags[f"stage.{stage}"] == "skipped (up to date)", stage
