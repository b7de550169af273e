"""The `selfsup` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from flows.executors import EXECUTORS, Sharding
from flows.export import FORMATS as EXPORT_FORMATS
from flows.shutdown import RunStopped, stop_signals
from selfsup_model.config import DEFAULT_WORKDIR, CorpusFormat
from selfsup_model.errors import UserError
from selfsup_model.presets import PRESETS
from tasks.native_logs import native_startup_logs_held

EXIT_USER_ERROR = 2
_LAST = "as the workdir was last run, else"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus",
                   help="corpus folder (one sub-folder per label), table (.csv/.jsonl/.parquet) "
                        f"or 'pydocs' (the embedded default) [default: {_LAST} pydocs]")
    p.add_argument("--format", dest="corpus_format", choices=typing.get_args(CorpusFormat),
                   help=f"corpus kind [default: {_LAST} auto, from the path]")
    p.add_argument("--workdir", default=DEFAULT_WORKDIR,
                   help="where stage outputs go [default: %(default)s]")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="size preset: tiny (tests), demo (9-25 min on 2 CPU cores), base (GPU) "
                        f"[default: {_LAST} demo]")
    p.add_argument("--config", dest="config_file",
                   help="YAML file with config sections overriding the preset")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set dedup.threshold=0.85 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfsup", description=(
        "Raw text corpus -> deduplicated, leak-safe splits -> tokenizer -> self-supervised "
        "Transformer encoder -> fine-tuned classifier, compared against baselines. "
        "Tracked in MLflow, orchestrated by Prefect."))
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the pipeline (stages that are up to date are skipped)")
    _add_config_args(run)
    run.add_argument("--only", metavar="STAGE", help="run just this stage (its inputs must exist)")
    run.add_argument("--from", dest="from_stage", metavar="STAGE",
                     help="rerun this stage, then every later stage that is not up to date "
                          "(one whose inputs it changed)")
    run.add_argument("--to", dest="to_stage", metavar="STAGE",
                     help="stop after this stage (e.g. --to masks)")
    run.add_argument("--force", action="append", default=[], metavar="STAGE",
                     help="rerun this stage even if up to date; downstream reruns if its inputs "
                          "change (repeatable)")
    run.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")
    run.add_argument("--new-lineage", action="store_true",
                     help="treat the corpus as new: rebuild dedup and splits from scratch "
                          "instead of extending the workdir's last corpus version (a grown "
                          "corpus otherwise keeps every earlier document's split)")
    run.add_argument("--executor", choices=EXECUTORS, default="local",
                     help="where sharded stages (ingest, dedup, encode) run their shard tasks: "
                          "in this process, a thread pool, or Dask (a local cluster, or "
                          "--dask-address); never changes an output [default: %(default)s]")
    run.add_argument("--shards", type=int, metavar="N",
                     help="shards per sharded stage [default: 1 for local, else one per worker]")
    run.add_argument("--workers", type=int, metavar="N",
                     help="threads, or local Dask worker processes [default: one per core]")
    run.add_argument("--dask-address", metavar="tcp://HOST:PORT",
                     help="an existing Dask scheduler for --executor dask (its workers need the "
                          "same paths and PREFECT_API_URL)")

    stages = sub.add_parser("stages",
                            help="list the stages in order with their status for a workdir")
    _add_config_args(stages)

    report = sub.add_parser("report", help="print every stage's counts and metrics")
    report.add_argument("--workdir", default=DEFAULT_WORKDIR, help="[default: %(default)s]")
    report.add_argument("--json", action="store_true",
                        help="one JSON object (what scripts and tests read)")

    predict = sub.add_parser(
        "predict", help="classify new documents with a finished run's classifier",
        description="Classify new documents with the classifier a finished run handed over "
                    "(finetune/classifier.keras, chosen on validation). Text goes through the "
                    "training path: normalisation, the run's tokenizer, its windows (a "
                    "document's probabilities are the mean of its windows').")
    predict.add_argument("input", help="a folder of .txt files, a .csv/.jsonl/.parquet table, "
                                       "or - for one document per line on stdin")
    predict.add_argument("--workdir", default=DEFAULT_WORKDIR, help="[default: %(default)s]")
    predict.add_argument("--out", help="write every prediction to this .parquet/.jsonl/.csv "
                                       "file [default: a table of the first 50 on the terminal]")
    predict.add_argument("--text-column", help="table column holding the text "
                                               "[default: the run's ingest.text_column]")
    predict.add_argument("--id-column", help="table column holding the id "
                                             "[default: the run's ingest.id_column]")
    predict.add_argument("--rejects", metavar="FILE",
                         help="also write every rejected input with its reason to this "
                              ".csv/.jsonl/.parquet file")
    predict.add_argument("--batch-size", type=int, default=256, help="[default: %(default)s]")
    predict.add_argument("--engine", choices=("keras", "onnx"), default="keras",
                         help="keras: classifier.keras; onnx: the same classifier converted to "
                              "ONNX and scored by ONNX Runtime (the export extra) "
                              "[default: %(default)s]")

    export = sub.add_parser(
        "export", help="write a finished run's model in a format other tools read",
        description="--format hf: the pretrained encoder and its masked-LM head as a Hugging "
                    "Face transformers checkpoint directory (AutoModelForMaskedLM, "
                    "AutoTokenizer, pipeline('fill-mask')) with a model card. --format onnx: the "
                    "kept classifier (ids -> class probabilities) as an ONNX model, with its "
                    "spec (labels, encode settings) and tokenizer beside it. The run's files "
                    "are checked against their manifests first.")
    export.add_argument("--workdir", default=DEFAULT_WORKDIR, help="[default: %(default)s]")
    export.add_argument("--format", dest="export_format", choices=EXPORT_FORMATS,
                        required=True)
    export.add_argument("--out", required=True,
                        help="hf: a directory (new, empty, or an earlier export, which is "
                             "replaced); onnx: a .onnx file (X.onnx gets X.json and "
                             "X.tokenizer.json beside it)")

    fill = sub.add_parser(
        "fill-mask", help="show what a masked-LM run predicts for each [MASK] in a text",
        description="Top-k tokens and probabilities for each [MASK] in TEXT, from the run's "
                    "pretrain_model.keras (pretrain.objective=mlm) and its tokenizer.")
    fill.add_argument("text", help='e.g. "import the [MASK] module"')
    fill.add_argument("--workdir", default=DEFAULT_WORKDIR, help="[default: %(default)s]")
    fill.add_argument("--top-k", type=int, default=5, help="[default: %(default)s]")

    gen = sub.add_parser(
        "generate", help="continue a prompt with a causal-LM run",
        description="Sample a continuation of PROMPT from the run's pretrain_model.keras "
                    "(pretrain.objective=clm), one key/value-cached step per token, until "
                    "[EOS], --max-new-tokens or the model's context length.")
    gen.add_argument("prompt")
    gen.add_argument("--workdir", default=DEFAULT_WORKDIR, help="[default: %(default)s]")
    gen.add_argument("--max-new-tokens", type=int, default=50, help="[default: %(default)s]")
    gen.add_argument("--temperature", type=float, default=1.0,
                     help="0 = greedy [default: %(default)s]")
    gen.add_argument("--top-k", type=int, default=None,
                     help="sample among the k most likely tokens [default: all]")
    gen.add_argument("--seed", type=int, default=0, help="[default: %(default)s]")

    ui = sub.add_parser("ui", help="start the MLflow UI on 127.0.0.1 for a workdir's run store")
    ui.add_argument("--workdir", default=DEFAULT_WORKDIR, help="[default: %(default)s]")
    ui.add_argument("--port", type=int, default=5000, help="[default: %(default)s]")
    ui.add_argument("--workers", type=int, default=1,
                    help="server processes; one serves a person's browser, and starts in about "
                         "half the time of MLflow's default four [default: %(default)s]")
    return parser


def _settings(args: argparse.Namespace):
    from flows.settings import resolve_settings

    return resolve_settings(args.workdir, args.corpus, args.corpus_format, args.preset,
                            args.config_file, args.overrides)


def _cmd_run(args: argparse.Namespace) -> int:
    from selfsup_model.corpus.ingest import check_corpus
    from tasks.registry import STAGE_NAMES, select_stages

    # Everything a user can get wrong is checked here, in well under a second, before
    # TensorFlow, Prefect or a temporary Prefect server start.
    settings = _settings(args)
    sharding = Sharding(args.executor, args.shards, args.workers, args.dask_address)
    select_stages(args.only, args.from_stage, args.to_stage)  # a bad stage name answers now
    unknown = [f for f in args.force if f not in STAGE_NAMES]
    if unknown:
        raise UserError(f"unknown stage(s) for --force: {', '.join(unknown)}; "
                        f"stages are: {', '.join(STAGE_NAMES)}")
    if args.only in (None, "ingest") and args.from_stage in (None, "ingest"):
        check_corpus(settings.corpus, settings.corpus_format, settings.config.ingest)
    # Keras (and TensorFlow) load with the first stage that needs them (tasks.registry): a run
    # with none to run, such as one that stops before pretraining, never loads them.
    from flows.pipeline import pipeline_flow

    results = pipeline_flow(corpus=settings.corpus, corpus_format=settings.corpus_format,
                            workdir=args.workdir, preset=settings.preset, config=settings.config,
                            only=args.only, from_stage=args.from_stage, to_stage=args.to_stage,
                            force=args.force, tracking=not args.no_tracking,
                            executor=sharding.executor, shards=sharding.shards,
                            workers=sharding.workers, dask_address=sharding.dask_address,
                            new_lineage=args.new_lineage)
    for r in results:
        print(f"  {r['stage']:<10} {r['status']:<8} {r['duration_s']:7.1f}s  {r['reason']}")
    _print_comparison(Path(args.workdir) / "compare")
    print(f"Outputs: {args.workdir}/<stage>/   "
          f"Summary: selfsup report --workdir {args.workdir} --json")
    if not args.no_tracking:
        print(f"MLflow:  selfsup ui --workdir {args.workdir}")
    return 0


def _print_comparison(compare_dir: Path) -> None:
    """The comparison table and statements from report.md, and where the plots are."""
    report = compare_dir / "report.md"
    if not report.is_file():
        return
    body = (report.read_text("utf-8").split("## Context")[0]
            .replace("# selfsup comparison", "").strip())
    print(f"\n{body}\n")
    plots = sorted(p.name for p in compare_dir.glob("*.png"))
    if plots:
        print(f"Plots:   {compare_dir}/{{{','.join(plots)}}}")


def _cmd_stages(args: argparse.Namespace) -> int:
    from flows.versions import open_lineage
    from tasks.registry import PIPELINE
    from tasks.stage import RunContext, check_stage

    settings = _settings(args)
    lineage = open_lineage(Path(args.workdir), settings.config, settings.corpus,
                           settings.corpus_format, quiet=True)
    ctx = RunContext(workdir=Path(args.workdir), config=settings.config, corpus=settings.corpus,
                     corpus_format=settings.corpus_format, lineage=lineage.lineage,
                     previous=lineage.extends)
    for spec in PIPELINE:
        status, why = check_stage(spec, ctx)
        print(f"{spec.name:<10} {status:<10} {why}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from flows.summary import collect_report

    report = collect_report(args.workdir)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    for name, info in report["stages"].items():
        counts = ", ".join(f"{k}={v}" for k, v in (info.get("counts") or {}).items()
                           if not isinstance(v, dict))
        print(f"{name:<10} {info['status']:<9} {counts}")
    if report["accounting"]:
        a = report["accounting"]
        print(f"accounting: read {a['read']} = kept {a['kept']} + duplicates {a['duplicates']} "
              f"+ rejected {a['rejected']} ({'balanced' if a['balanced'] else 'NOT balanced'})")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from selfsup_model.serving.scoring import check_output_path

    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 (got {args.batch_size})")
    for path in (args.out, args.rejects):
        if path:
            check_output_path(path)
    with native_startup_logs_held():
        import keras  # noqa: F401

        from flows.predict import run_predict
        from selfsup_model.serving.scoring import format_table, write_predictions
    lines = sys.stdin.buffer if args.input == "-" else None
    outcome = run_predict(args.workdir, args.input, args.out, text_column=args.text_column,
                          id_column=args.id_column, batch_size=args.batch_size, lines=lines,
                          engine=args.engine)
    _report_rejects(outcome.rejects, outcome.read)
    if args.rejects:
        write_predictions(outcome.rejects, args.rejects)
    if outcome.out is None:
        print(format_table(outcome.predictions))
    else:
        print(f"{len(outcome.predictions)} predictions -> {outcome.out}", file=sys.stderr)
    return 0


def _pretrained_model(workdir: str):
    """The run's pretrain_model.keras and tokenizer, both verified against their manifests."""
    with native_startup_logs_held():
        from selfsup_model.serving.inference import load_run_pretrained
    run = load_run_pretrained(workdir)
    return run.model, run.tokenizer


def _cmd_fill_mask(args: argparse.Namespace) -> int:
    if args.top_k < 1:
        raise UserError(f"--top-k must be at least 1 (got {args.top_k})")
    model, tokenizer = _pretrained_model(args.workdir)
    from selfsup_model.serving.generation import fill_mask

    for n, candidates in enumerate(fill_mask(model, tokenizer, args.text, args.top_k), 1):
        shown = "  ".join(f"{tokenizer.decode([c.token_id]) or c.token} {c.probability:.3f}"
                          for c in candidates)
        print(f"[MASK] {n}: {shown}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    model, tokenizer = _pretrained_model(args.workdir)
    from selfsup_model.serving.generation import generate

    result = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                      args.top_k, args.seed)
    print(result.full_text)
    print(f"({len(result.token_ids)} new tokens; stopped: {result.stop_reason})",
          file=sys.stderr)
    return 0


def _report_rejects(rejects, read: int, shown: int = 20) -> None:
    """Every rejected input is accounted for on stderr: counts by reason and the first few."""
    if rejects.empty:
        return
    by_reason = rejects["reason"].value_counts().sort_index()
    print(f"rejected {len(rejects)} of {read} inputs: "
          + ", ".join(f"{reason}={n}" for reason, n in by_reason.items()), file=sys.stderr)
    for row in rejects.head(shown).itertuples(index=False):
        print(f"  {row.id}: {row.reason} ({row.detail})", file=sys.stderr)
    if len(rejects) > shown:
        print(f"  ... and {len(rejects) - shown} more (--rejects FILE lists them all)",
              file=sys.stderr)


def _cmd_ui(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1 (got {args.workers})")
    from mlflow.tracking import MlflowClient

    from flows.settings import read_settings
    from flows.tracking import default_tracking_uri, ui_url

    uri = default_tracking_uri(Path(args.workdir))
    base = f"http://127.0.0.1:{args.port}"
    print(f"MLflow UI for {uri} at {base}  (Ctrl-C to stop)", flush=True)
    settings = read_settings(args.workdir)
    experiment = MlflowClient(uri).get_experiment_by_name(
        settings.config.experiment if settings else "selfsup")
    if experiment is not None:
        # MLflow 3.17's UI opens an experiment on GenAI traces unless the link asks for runs.
        print(f"Runs:    {ui_url(base, experiment.experiment_id)}", flush=True)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
           "--host", "127.0.0.1", "--port", str(args.port), "--workers", str(args.workers)]
    return serve_mlflow(cmd, mlflow_server_environment(os.environ))


def serve_mlflow(cmd: list[str], env: dict[str, str], grace_s: float = 10.0) -> int:
    """Run an MLflow server until it exits or this process is stopped; either way nothing of it
    is left running.

    `mlflow ui` is a launcher: the server is its uvicorn child (and that one's workers). Killing
    the launcher alone, as `subprocess.call` does when interrupted, leaves the server answering
    on its port. So the server gets a session of its own (a Ctrl-C at the terminal reaches
    selfsup only), and its whole process group is sent SIGTERM on the way out, then SIGKILL
    after `grace_s` seconds for whatever is left."""
    import subprocess
    import time

    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return server.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):  # a group with no process left
            os.killpg(server.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                os.killpg(server.pid, 0)  # raises once the group is empty
                server.poll()  # reaps the launcher when it exits
                time.sleep(0.1)
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def mlflow_server_environment(environ) -> dict[str, str]:
    """The environment of an MLflow server we start: without MLflow's job runner unless the
    caller asks for it.

    MLflow 3's server starts a job runner and three job-queue consumers (GenAI scorers, trace
    roll-ups) beside the UI; this pipeline submits no jobs, and they cost eight more Python
    processes, about 0.7 GB and 3-4 s before the UI answers (docs/operations.md)."""
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **environ}


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is now (not the one at start-up), so redirections are
    honoured."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


class _HideUserErrorTracebacks(logging.Filter):
    """A user error is printed once, as one line, by main(); Prefect's copies with tracebacks are
    dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _mentions_user_error(record)


def _mentions_user_error(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, UserError):
        return True
    message = record.getMessage()
    return any(f"{cls.__name__}(" in message or f"{cls.__name__}:" in message
               for cls in (UserError, *UserError.__subclasses__()))


def _quiet_prefect_user_errors() -> None:
    """Filter on Prefect's run loggers themselves: Prefect rebuilds its handlers when it starts a
    temporary server, but logger-level filters survive that."""
    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.flow_engine",
                 "prefect.task_engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HideUserErrorTracebacks) for f in logger.filters):
            logger.addFilter(_HideUserErrorTracebacks())


def _cmd_export(args: argparse.Namespace) -> int:
    with native_startup_logs_held():
        import keras  # noqa: F401

        from flows.export import run_export
    summary = run_export(args.workdir, args.export_format, args.out)
    print(f"{summary['what']} -> {summary['out']} ({len(summary['files'])} files, "
          f"{summary['bytes'] / 1e6:.1f} MB, {summary['seconds']:.1f} s)")
    return 0


def _configure_logging() -> None:
    """selfsup's own progress lines on the terminal.

    Prefect sends the "selfsup" logger to its API (PREFECT_LOGGING_EXTRA_LOGGERS) without
    propagating it, so the console handler is attached to that logger itself, not to the root.
    """
    ours = logging.getLogger("selfsup")
    if not any(isinstance(h, _CurrentStderrHandler) for h in ours.handlers):
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s",
                                               datefmt="%H:%M:%S"))
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False  # the handler above prints it; the root would print it twice


COMMANDS = {"run": _cmd_run, "stages": _cmd_stages, "report": _cmd_report,
            "predict": _cmd_predict, "fill-mask": _cmd_fill_mask, "generate": _cmd_generate,
            "export": _cmd_export, "ui": _cmd_ui}


def main(argv: Sequence[str] | None = None) -> int:
    # TensorFlow's runtime C++ logging (INFO and WARNING) stays off unless the user asked for it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Without PREFECT_API_URL a run starts a temporary Prefect server; on a fresh machine its
    # first start builds the database, which can outlast Prefect's 20 s default on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    args = build_parser().parse_args(argv)
    _configure_logging()
    if not args.debug:
        _quiet_prefect_user_errors()
    for noisy in ("httpx", "httpcore", "alembic", "mlflow.store"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        # Only a pipeline run has stages to unwind to a safe point; `ui` stops MLflow's server,
        # the other commands just end.
        with stop_signals("stopping at a safe point" if args.command == "run" else "stopping"):
            return COMMANDS[args.command](args)
    except UserError as exc:
        if args.debug:
            raise
        print(f"selfsup: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (RunStopped, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, RunStopped) else signal.SIGINT
        kept = ("; completed stages are kept and a rerun goes on from there"
                if args.command == "run" else "")
        print(f"selfsup: stopped by {signal.Signals(signum).name}{kept}", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
