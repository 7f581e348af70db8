"""`roll-backend`: run, validate, submit (Ray Jobs) and plot a pipeline config from the command line.

    roll-backend validate configs/grpo_tiny_cpu.yaml max_steps=5     # resolved YAML, or every problem (exit 2)
    roll-backend run configs/grpo_tiny_cpu.yaml max_steps=5          # local Ray (or the job's cluster)
    roll-backend submit --address http://127.0.0.1:8265 configs/grpo_tiny_cpu.yaml max_steps=5
    roll-backend plot runs/grpo_tiny_cpu                             # -> runs/grpo_tiny_cpu/reward_curve.png

Overrides are `key=value` with dotted keys (`actor_train.strategy.tp=2`). Heavy modules (Ray, the pipeline)
are imported inside the commands that need them, so `validate` starts no Ray.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

# Never uploaded with a job's working_dir (gitignore-style patterns; Ray also honours .gitignore files).
JOB_EXCLUDES = [
    ".venv",
    "venv",
    ".git",
    "runs",
    "outputs",
    "build",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".hypothesis",
    ".ruff_cache",
    ".mypy_cache",
]
JOB_TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class CliError(Exception):
    """A user-facing problem: printed to stderr, exit code 2."""


def _load(config_path: str, overrides: list[str], recipe_check: bool = False):
    """The typed, validated config with its prompt data checked: every problem found here, before Ray starts.
    `recipe_check` (validate): a model folder holding only config.json passes, and its prompts go unread (see
    roll_backend.config.model_folders.skipped_checks)."""
    config = _typed(config_path, overrides, recipe_check)
    _check_rules(config_path, config, recipe_check)
    _check_data(config_path, config, recipe_check)
    return config


def _typed(config_path: str, overrides: list[str], recipe_check: bool = False):
    """The typed config, its cross-field rules not run (`_check_rules` runs them): fast, and imports no torch."""
    from roll_backend.config.loader import load_config
    from roll_backend.config.typed import ConfigError

    try:
        return load_config(config_path, overrides, recipe_check, cross_field=False)
    except ConfigError as exc:
        raise CliError(f"{config_path}: {exc}") from exc


def _check_rules(config_path: str, config, recipe_check: bool = False) -> None:
    """The cross-field rules of a typed config (layouts, batch splits, algorithm names, the memory plan)."""
    from roll_backend.config.loader import check_config
    from roll_backend.config.typed import ConfigError

    try:
        check_config(config, recipe_check)
    except ConfigError as exc:
        raise CliError(f"{config_path}: {exc}") from exc


def _check_data(config_path: str, config, recipe_check: bool = False) -> None:
    """The prompt data the config names, read with the run's tokenizer."""
    from roll_backend.config.model_folders import describes_only
    from roll_backend.pipelines.data.prompt_dataset import DataError, driver_tokenizer
    from roll_backend.pipelines.data.prompts import check_data, load_validation_prompts

    if recipe_check and describes_only(config.model_path):
        return  # transformers would build an empty tokenizer from config.json alone and refuse every prompt
    try:
        if check_data(config) is not None:
            load_validation_prompts(config, driver_tokenizer(config))
    except DataError as exc:
        raise CliError(f"{config_path}: invalid data: {exc}") from exc


def _check_resume(config_path: str, config) -> None:
    """Log the checkpoint `checkpoint.resume` will load (and those auto skips), or stop on an incomplete one, before
    Ray starts. Not in submit: the checkpoints are where the job runs, and its `run` checks them there."""
    from roll_backend.pipelines.services.checkpoint import CheckpointError, resume_checkpoint

    try:
        resume_checkpoint(config.checkpoint.resume, config.output_dir)
    except CheckpointError as exc:
        raise CliError(f"{config_path}: {exc}") from exc


# ---- validate -------------------------------------------------------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    """Checks the config, not this machine: a GPU recipe validates on a CPU machine, against a model folder that
    holds only its config.json; what that leaves unchecked is listed on stderr."""
    from roll_backend.config.loader import config_to_yaml
    from roll_backend.config.model_folders import skipped_checks
    from roll_backend.config.run_memory import summary

    config = _load(args.config, args.overrides, recipe_check=True)
    _check_resume(args.config, config)
    print(config_to_yaml(config), end="")
    for note in skipped_checks(config):
        print(f"roll-backend validate: not checked here: {note}", file=sys.stderr)
    for line in summary(config):
        print(f"roll-backend validate: {line}", file=sys.stderr)
    return EXIT_OK


# ---- plan -----------------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    """Each role's planned memory per rank and each device's by phase (roll_backend/config/run_memory.py); exit 2
    when it does not fit the declared device memory (`device_memory_gib`, or --device-memory-gib)."""
    from roll_backend.config.run_memory import render

    overrides = list(args.overrides)
    if args.device_memory_gib is not None:
        overrides.append(f"device_memory_gib={args.device_memory_gib}")
    config = _load(args.config, overrides, recipe_check=True)  # (a plan that does not fit is a CliError here)
    print(render(config))
    return EXIT_OK


# ---- run ------------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    # Every config problem is found before Ray starts; Ray's start (~4 s on 2 cores, mostly waiting) then overlaps
    # the prompt data's check (which imports transformers; a problem there stops Ray again before any rank starts),
    # the pipeline's imports and the tiny model.
    config = _typed(args.config, args.overrides)
    _check_rules(args.config, config)
    _check_resume(args.config, config)
    from roll_backend.distributed.orphans import kill_children_with_this_process
    from roll_backend.distributed.ray_env import start_local_ray

    kill_children_with_this_process(own_group=False)  # a SIGKILLed driver takes Ray's processes with it

    # (called in a process that already runs Ray, such as a driver script's, the run joins it and leaves it up)
    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    address = os.environ.get("RAY_ADDRESS")  # set by Ray inside a job: join that cluster
    if address:
        ray_started = start_local_ray(address=address)
    else:
        ray_started = start_local_ray(num_cpus=config.ray_num_cpus, cpu_ranks=not config.uses_gpus)
    import ray

    try:
        _check_data(args.config, config)
        from roll_backend.pipelines import run_with_restarts
        from roll_backend.pipelines.run import ensure_model

        ensure_model(config)
        ray_started.result()
        metrics = run_with_restarts(config)
    finally:
        concurrent.futures.wait([ray_started])  # (a failure above must not race the start it would shut down)
        if not ray_was_up:
            ray.shutdown()
    last = metrics[-1] if metrics else {}
    reward = last.get("reward/mean")
    summary = f"{config.exp_name}: {len(metrics)} steps"
    if reward is not None:
        summary += f", last reward/mean {reward:.4f}"
    print(f"{summary}; outputs in {Path(config.output_dir).resolve()}")
    return EXIT_OK


# ---- eval -----------------------------------------------------------------------------------------------
def eval_target(config_path: str, overrides: list[str]):
    """(config, checkpoint folder or None) for `eval`: `checkpoint=PATH` (or `auto`: the run's newest complete one)
    among the overrides picks the weights; the results go under output_dir/eval/<checkpoint or "model">, so the
    run's own metrics stay as they are."""
    import dataclasses

    from roll_backend.pipelines.services.checkpoint import CheckpointError, resume_checkpoint

    chosen = [item.split("=", 1)[1] for item in overrides if item.startswith("checkpoint=")]
    config = _load(config_path, [item for item in overrides if not item.startswith("checkpoint=")])
    if not config.data.has_validation():
        raise CliError(
            f"{config_path}: eval needs validation prompts: set data.val_path (a file or a list) or "
            "data.val_reasoning_gym"
        )
    try:
        checkpoint = resume_checkpoint(chosen[-1], config.output_dir) if chosen else None
    except CheckpointError as exc:
        raise CliError(f"{config_path}: {exc}") from exc
    if chosen and checkpoint is None:
        raise CliError(f"{config_path}: checkpoint={chosen[-1]}: no complete checkpoint under {config.output_dir}")
    out = Path(config.output_dir) / "eval" / (checkpoint.name if checkpoint else "model")
    resume = str(Path(checkpoint).resolve()) if checkpoint else None
    config = dataclasses.replace(
        config, output_dir=str(out), checkpoint=dataclasses.replace(config.checkpoint, resume=resume)
    )
    return config, checkpoint


def cmd_eval(args: argparse.Namespace) -> int:
    config, _ = eval_target(args.config, args.overrides)
    from roll_backend.distributed.ray_env import init_local_ray
    from roll_backend.pipelines import evaluate

    init_local_ray(num_cpus=config.ray_num_cpus, cpu_ranks=not config.uses_gpus)
    import ray

    try:
        metrics = evaluate(config)
    finally:
        ray.shutdown()
    print(json.dumps(metrics, indent=1))
    print(f"validation of step {metrics['step']}; samples in {Path(config.output_dir).resolve() / 'validation.jsonl'}")
    return EXIT_OK


# ---- submit ---------------------------------------------------------------------------------------------
def job_entrypoint(config_rel: str, overrides: list[str]) -> str:
    """The shell command a Ray job runs: this CLI's `run` on the uploaded copy of the working dir."""
    return shlex.join(["python", "-m", "roll_backend.cli", "run", config_rel, *overrides])


def job_runtime_env(working_dir: Path) -> dict:
    from roll_backend.distributed.ray_env import RAY_ENV_DEFAULTS

    # RAY_ADDRESS is set by Ray for the job's entrypoint; the rest must be in place before the job's Ray starts.
    return {"working_dir": str(working_dir), "excludes": list(JOB_EXCLUDES), "env_vars": dict(RAY_ENV_DEFAULTS)}


NO_AGENT = "No available agent to submit job"  # the Jobs API's answer when no node's dashboard agent responds


def no_agent_message(address: str) -> str:
    return (
        f"the cluster at {address} accepted the request but has no dashboard agent to run the job (Ray's "
        f"'{NO_AGENT}'). Either the cluster was started moments ago (wait ~10 s and submit again), or its agent "
        "could not bind its ports, typically because another Ray on the same machine already holds the "
        "defaults (52365 and others). Restart the cluster with free ports for the agent: `ray stop` it (or end "
        "its process group), then `ray start --head ... --dashboard-agent-listen-port=P1 "
        "--dashboard-agent-grpc-port=P2 --metrics-export-port=P3 --runtime-env-agent-port=P4` with unused ports; "
        "examples/submit_to_cluster.sh --start-cluster picks them for you. The agent's own log is "
        "<temp-dir>/session_latest/logs/dashboard_agent.log on the head."
    )


def _config_inside(config_path: str, working_dir: Path) -> str:
    resolved = Path(config_path).resolve()
    try:
        return resolved.relative_to(working_dir).as_posix()
    except ValueError:
        raise CliError(
            f"config {config_path!r} lies outside the job's working dir {str(working_dir)!r}, which is what gets "
            f"uploaded; copy it into the working dir or run submit from a folder that contains it"
        ) from None


def cmd_submit(args: argparse.Namespace) -> int:
    working_dir = Path.cwd().resolve()
    config_rel = _config_inside(args.config, working_dir)
    config = _load(args.config, args.overrides)  # fail here, not minutes later on the cluster
    if not Path(config.output_dir).is_absolute():
        print(
            f"note: output_dir={config.output_dir!r} is relative: the job writes it inside its copy of the working "
            f"dir on the cluster; pass output_dir=/shared/path to keep the results",
            file=sys.stderr,
        )
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(args.address)
    try:
        job_id = client.submit_job(
            entrypoint=job_entrypoint(config_rel, args.overrides),
            runtime_env=job_runtime_env(working_dir),
            metadata={"exp_name": config.exp_name, "config": config_rel},
        )
    except RuntimeError as exc:
        if NO_AGENT in str(exc):
            raise CliError(no_agent_message(args.address)) from exc
        raise
    print(f"submitted job {job_id} to {args.address}", file=sys.stderr, flush=True)
    if args.no_wait:
        print(job_id)
        return EXIT_OK
    try:
        status = follow_job(client, job_id, args.poll_s)
    except KeyboardInterrupt:
        print(
            f"\nstopped following; the job keeps running. Stop it with: ray job stop --address {args.address} {job_id}",
            file=sys.stderr,
        )
        return 130
    if status == "SUCCEEDED":
        print(f"job {job_id} SUCCEEDED", file=sys.stderr)
        return EXIT_OK
    message = client.get_job_info(job_id).message or ""
    print(f"job {job_id} ended {status}: {message}".rstrip(": "), file=sys.stderr)
    return EXIT_FAILED


def follow_job(client, job_id: str, poll_s: float = 1.0) -> str:
    """Print the job's log as it grows until the job ends; returns its final status name."""
    printed = 0
    while True:
        status = client.get_job_status(job_id)  # read before the logs: the last fetch then has every line
        logs = client.get_job_logs(job_id)
        if len(logs) > printed:
            sys.stdout.write(logs[printed:])
            sys.stdout.flush()
            printed = len(logs)
        name = str(getattr(status, "value", status))
        if name in JOB_TERMINAL:
            return name
        time.sleep(poll_s)


# ---- plot -----------------------------------------------------------------------------------------------
def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        raise CliError(f"{path} does not exist; pass the run's output_dir (where the pipeline writes metrics.jsonl)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CliError(
                    f"{path}:{number} is not JSON ({exc.msg}); each line must be one step's metrics"
                ) from None
    return rows


def cmd_plot(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    metric, val_metric = args.metric, args.val_metric
    train = [(row["step"], row[metric]) for row in rows if "step" in row and metric in row]
    if not train:
        known = sorted(
            {key for row in rows for key, value in row.items() if isinstance(value, (int, float))} - {"step"}
        )
        hint = f"; pass --metric with one of {', '.join(known[:40])}" if known else ""
        raise CliError(f"{run_dir / 'metrics.jsonl'} has no rows with both 'step' and {metric!r}{hint}")
    val = [(row["step"], row[val_metric]) for row in rows if "step" in row and val_metric in row]
    default_name = "reward_curve.png" if metric == "reward/mean" else metric.replace("/", "_") + ".png"
    out = Path(args.out) if args.out else run_dir / default_name

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(*zip(*train), marker="." if len(train) < 50 else None, label=f"{metric} (train)")
    if val:
        ax.plot(*zip(*val), marker="o", label=val_metric)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(run_dir.resolve().name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    print(out)
    return EXIT_OK


def cmd_ledger(args: argparse.Namespace) -> int:
    """The run's prompt ledger: what became of every prompt it admitted; exit 1 when one was trained twice or lost."""
    from roll_backend.pipelines.services.ledger import report

    summary, problems = report(args.run_dir)
    print(summary)
    for problem in problems[:50]:
        print(f"  problem: {problem}")
    if len(problems) > 50:
        print(f"  ... and {len(problems) - 50} more")
    return EXIT_FAILED if problems else EXIT_OK


def cmd_convert(args) -> int:
    """Write the converted config and its report (OUT.report.txt), then validate it as `validate` would."""
    import yaml

    from roll_backend.config.job_import import convert, not_a_job_of
    from roll_backend.config.job_reading import JobReadError, read_job

    if not Path(args.input).is_file():
        raise CliError(f"{args.input} does not exist; give a verl/ROLL YAML config or a run script")
    try:
        settings = read_job(args.input)
    except JobReadError as exc:
        raise CliError(str(exc)) from exc
    wrong = not_a_job_of(args.framework, settings)
    if wrong is not None:
        raise CliError(f"{args.input} is not a {args.framework} job: {wrong}")
    tree, report = convert(args.framework, settings)
    out = Path(args.out)
    out.write_text(yaml.safe_dump(tree, sort_keys=False))
    report_path = out.with_suffix(".report.txt")
    report_path.write_text(report.text())
    print(report.text())
    print(f"wrote {out} and {report_path}")
    _load(str(out), [], recipe_check=True)  # a CliError lists what is left to set; the files stay
    print(f"{out} validates")
    return EXIT_OK


# ---- entry ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roll-backend", description="RLHF pipelines (PPO/GRPO) on Ray.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("config", help="run config YAML (see configs/)")
        sub.add_argument(
            "overrides", nargs="*", metavar="key=value", help="overrides, e.g. max_steps=5 actor_train.strategy.tp=2"
        )

    run = commands.add_parser("run", help="run a pipeline on a local Ray (or the cluster of RAY_ADDRESS)")
    with_config(run)
    run.set_defaults(handler=cmd_run)

    validate = commands.add_parser("validate", help="print the resolved config, or every problem in it (exit 2)")
    with_config(validate)
    validate.set_defaults(handler=cmd_validate)

    plan = commands.add_parser("plan", help="print each rank's planned memory (model state, activations, KV cache)")
    plan.add_argument("--device-memory-gib", type=float, metavar="GIB", help="check it against devices of this size")
    with_config(plan)
    plan.set_defaults(handler=cmd_plan)

    evaluation = commands.add_parser(
        "eval", help="validate a model or checkpoint on data.val_path alone (add checkpoint=PATH or checkpoint=auto)"
    )
    with_config(evaluation)
    evaluation.set_defaults(handler=cmd_eval)

    submit = commands.add_parser(
        "submit",
        help="validate locally, then run on a Ray cluster through Ray Jobs and follow its log",
        description="Uploads the current directory as the job's working_dir; the config must lie inside it.",
    )
    submit.add_argument("--address", required=True, help="the cluster's dashboard URL, e.g. http://127.0.0.1:8265")
    submit.add_argument("--no-wait", action="store_true", help="print the job id and return without following the job")
    submit.add_argument("--poll-s", type=float, default=1.0, help="seconds between status/log polls (default 1)")
    with_config(submit)
    submit.set_defaults(handler=cmd_submit)

    convert = commands.add_parser(
        "convert",
        help="write a verl or ROLL job (YAML config or run script) as a config here, reporting every key",
    )
    convert.add_argument("framework", choices=["verl", "roll"])
    convert.add_argument("input", metavar="INPUT", help="the job's YAML config, or a run script's key=value overrides")
    convert.add_argument("-o", "--out", required=True, metavar="OUT.yaml", help="the config to write")
    convert.set_defaults(handler=cmd_convert)

    _add_run_folder_commands(commands)
    return parser


def _add_run_folder_commands(commands) -> None:
    """The commands that read a run's output_dir: plot, ledger."""
    plot = commands.add_parser(
        "plot", help="plot a metric of a run (the reward curve by default) from RUN_DIR/metrics.jsonl"
    )
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("--out", metavar="PNG", help="output file (default RUN_DIR/reward_curve.png, or <metric>.png)")
    plot.add_argument("--metric", default="reward/mean", help="the training metric to plot (e.g. actor/loss for sft)")
    plot.add_argument("--val-metric", default="val/reward", help="a validation metric drawn beside it, where logged")
    plot.set_defaults(handler=cmd_plot)

    ledger = commands.add_parser(
        "ledger", help="report what became of every prompt a run admitted (RUN_DIR/ledger.jsonl); exit 1 on a problem"
    )
    ledger.add_argument("run_dir", metavar="RUN_DIR")
    ledger.set_defaults(handler=cmd_ledger)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come on both sides of an option (`CONFIG a=1 --no-wait b=2`); argparse leaves the later
    # ones unparsed, and its intermixed mode does not work with subcommands.
    args, extra = parser.parse_known_args(argv)
    flags = [item for item in extra if item.startswith("-")]
    if flags or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(flags or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except CliError as exc:
        print(f"roll-backend {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
