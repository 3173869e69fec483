"""Command line: ``ftrun [run] [flags] script.py [script args]`` and ``ftrun store``.

Flags keep torchrun's names (dashes or underscores) so job files move over unchanged, abbreviated as torchrun's
argparse allows (a unique prefix of a torchrun flag; ftrun's own flags are written out). Every flag can also be
set in ``--config FILE.yaml``; flags given on the command line win. Errors in the input are one line on
stderr and exit code 2; nothing is started then.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from typing import Optional

import typer
from typer.exceptions import TyperException

from ftrun.errors import USAGE_EXIT_CODE, UsageError, error_line, stopped_while_starting

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Fault-tolerant launcher for PyTorch training (drop-in torchrun).",
                  context_settings={"help_option_names": ["-h", "--help"]})  # -h as torchrun's

SUBCOMMANDS = ("run", "store", "inspect", "export", "status", "sbatch-template", "clean")
# torchrun's long options (torch 2.13's torch/distributed/run.py; tests/test_torchrun_flags.py compares them): its
# argparse takes a unique prefix of one of them for it, so job files written for torchrun abbreviate them
TORCHRUN_OPTIONS = (
    "--duplicate-stderr-filters", "--duplicate-stdout-filters", "--duplicate_stderr_filters",
    "--duplicate_stdout_filters", "--event-log-handler", "--event_log_handler", "--help", "--local-addr",
    "--local-ranks-filter", "--local_addr", "--local_ranks_filter", "--log-dir", "--log_dir", "--logs-specs",
    "--logs_specs", "--master-addr", "--master-port", "--master_addr", "--master_port", "--max-restarts",
    "--max_restarts", "--module", "--monitor-interval", "--monitor_interval", "--nnodes", "--no-python",
    "--no_python", "--node-rank", "--node_rank", "--nproc-per-node", "--nproc_per_node", "--numa-binding",
    "--numa_binding", "--rdzv-backend", "--rdzv-conf", "--rdzv-endpoint", "--rdzv-id", "--rdzv_backend",
    "--rdzv_conf", "--rdzv_endpoint", "--rdzv_id", "--redirects", "--role", "--run-path", "--run_path",
    "--shutdown-timeout", "--shutdown_timeout", "--signals-to-handle", "--signals_to_handle", "--standalone",
    "--start-method", "--start_method", "--tee", "--virtual-local-rank", "--virtual_local_rank")


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    script: str = typer.Argument(..., help="Training script, or a directory or zip file with a __main__.py, as "
                                           "python runs them (or module with -m, or executable with --no-python)."),
    script_args: Optional[list[str]] = typer.Argument(None, help="Arguments of the script."),
    config: Optional[str] = typer.Option(None, "--config", help="YAML file with settings; flags override it."),
    nnodes: Optional[str] = typer.Option(None, "--nnodes",
                                         envvar="PET_NNODES",
                                         help="Number of nodes, or torchrun's MIN:MAX: the job runs MAX nodes (ftrun "
                                              "replaces a lost node, it never runs with fewer), MIN is checked and "
                                              "kept."),
    nproc_per_node: Optional[str] = typer.Option(None, "--nproc-per-node", "--nproc_per_node",
                                                 envvar="PET_NPROC_PER_NODE",
                                                 help="Trainers per node: a number, or auto, cpu, gpu, xpu (the "
                                                      "devices of this host, as torchrun counts them)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", "--node_rank",
                                            envvar="PET_NODE_RANK",
                                            help="This node's rank (multi-node mode; without it, --rdzv-endpoint "
                                                 "and --nnodes > 1 agree it through the control store)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", "--master_addr",
                                              envvar="PET_MASTER_ADDR",
                                              help="With --node-rank and no --rdzv-endpoint: host of node 0, which "
                                                   "hosts the control store (torchrun's static rendezvous; "
                                                   "127.0.0.1)."),
    master_port: Optional[int] = typer.Option(None, "--master-port", "--master_port",
                                              envvar="PET_MASTER_PORT",
                                              help="With --node-rank: port of the control store on --master-addr "
                                                   "(29500); local mode: port of the local control store."),
    local_addr: Optional[str] = typer.Option(None, "--local-addr", "--local_addr",
                                             envvar="PET_LOCAL_ADDR",
                                             help="Multi-node: this node's address as the other nodes reach it (its "
                                                  "trainer store and keeper); also where they listen, unless "
                                                  "--rdzv-bind says."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", "--rdzv_endpoint",
                                                envvar="PET_RDZV_ENDPOINT",
                                                help="HOST:PORT of the control store."),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", "--rdzv_id", envvar="PET_RDZV_ID",
                                          help="Job id (names store keys, files)."),
    rdzv_timeout: Optional[float] = typer.Option(None, "--rdzv-timeout", "--rdzv_timeout",
                                                 help="Seconds to wait for the store and for nodes to join."),
    rdzv_bind: Optional[str] = typer.Option(None, "--rdzv-bind", "--rdzv_bind",
                                            help="Multi-node: address the stores listen on (default: the "
                                                 "interface that reaches the endpoint; 0.0.0.0: all)."),
    rdzv_backend: Optional[str] = typer.Option(None, "--rdzv-backend", "--rdzv_backend",
                                               envvar="PET_RDZV_BACKEND",
                                               help="Control store: c10d (a TCPStore; default) or etcd (a cluster "
                                                    "with no single point of failure: --rdzv-endpoint h1:2379,...)."),
    rdzv_conf: Optional[str] = typer.Option(None, "--rdzv-conf", "--rdzv_conf",
                                            envvar="PET_RDZV_CONF",
                                            help="KEY=VALUE,... etcd: protocol=https, cacert, cert, key, user, "
                                                 "password. c10d/static (torchrun's keys): join_timeout (or "
                                                 "timeout) sets --rdzv-timeout; keep_alive_interval x "
                                                 "keep_alive_max_attempt sets --node-timeout; store_type=tcp; "
                                                 "is_host (node 0 hosts); read_timeout, last_call_timeout, "
                                                 "close_timeout, heartbeat_timeout, use_libuv: accepted, no effect "
                                                 "(ftrun runs no torchelastic rendezvous)."),
    spares: Optional[int] = typer.Option(None, "--spares",
                                         help="Local mode: hot spare nodes kept ready to take a lost node's rank."),
    standby: Optional[bool] = typer.Option(None, "--standby",
                                           help="Join the job at --rdzv-endpoint as a hot spare (no node rank)."),
    max_restarts: Optional[int] = typer.Option(None, "--max-restarts", "--max_restarts",
                                               envvar="PET_MAX_RESTARTS",
                                               help="Restarts allowed before the job fails."),
    standalone: Optional[bool] = typer.Option(None, "--standalone", envvar="PET_STANDALONE",
                                              help="Single node, local control store."),
    module: Optional[bool] = typer.Option(None, "-m", "--module", envvar="PET_MODULE",
                                          help="Run the script as a Python module."),
    no_python: Optional[bool] = typer.Option(None, "--no-python", "--no_python",
                                             envvar="PET_NO_PYTHON",
                                             help="Run the script as an executable, not with Python."),
    run_path: Optional[bool] = typer.Option(None, "--run-path", "--run_path",
                                            envvar="PET_RUN_PATH",
                                            help="As torchrun: run the script with runpy.run_path in a Python "
                                                 "interpreter (what the zygote does anyway); over -m/--no-python."),
    role: Optional[str] = typer.Option(None, "--role", envvar="PET_ROLE", help="The trainers' ROLE_NAME (default)."),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", "--log_dir",
                                          envvar="PET_LOG_DIR",
                                          help="Directory for events.jsonl and, per generation and rank, "
                                               "gen<G>/rank<R>/: error.json, and stdout.log/stderr.log with "
                                               "--redirects/--tee."),
    redirects: Optional[str] = typer.Option(None, "-r", "--redirects",
                                            envvar="PET_REDIRECTS",
                                            help="Trainer output to gen<G>/rank<R>/stdout.log, stderr.log under "
                                                 "--log-dir (a temporary one without it) instead of the console: "
                                                 "1 stdout, 2 stderr, 3 both, or per local rank 0:3,1:2."),
    tee: Optional[str] = typer.Option(None, "-t", "--tee",
                                      envvar="PET_TEE",
                                      help="As --redirects, and to the console too, lines prefixed "
                                           "[<role><local rank>]:."),
    local_ranks_filter: Optional[str] = typer.Option(None, "--local-ranks-filter", "--local_ranks_filter",
                                                     envvar="PET_LOCAL_RANKS_FILTER",
                                                     help="Console shows only these local ranks' output (e.g. "
                                                          "0,1); files keep everything."),
    duplicate_stdout_filters: Optional[str] = typer.Option(
        None, "--duplicate-stdout-filters", "--duplicate_stdout_filters",
        envvar="PET_DUPLICATE_STDOUT_FILTERS",
        help="Teed stdout lines containing any of these (comma-separated; ,, is a comma) also go to "
             "gen<G>/node<N>/filtered_stdout.log."),
    duplicate_stderr_filters: Optional[str] = typer.Option(
        None, "--duplicate-stderr-filters", "--duplicate_stderr_filters",
        envvar="PET_DUPLICATE_STDERR_FILTERS",
        help="As --duplicate-stdout-filters, for stderr (filtered_stderr.log)."),
    label_output: Optional[bool] = typer.Option(None, "--label-output",
                                                help="Prefix every console line of a trainer with [rank N] (its "
                                                     "global rank)."),
    monitor_interval: Optional[float] = typer.Option(None, "--monitor-interval", "--monitor_interval",
                                                     envvar="PET_MONITOR_INTERVAL",
                                                     help="Seconds between two looks of a supervisor at its "
                                                          "trainers (0.02)."),
    start_method: Optional[str] = typer.Option(None, "--start-method", "--start_method",
                                               envvar="PET_START_METHOD",
                                               help="spawn: trainers start as new processes (--no-zygote); fork, "
                                                    "forkserver: forked by the zygote (the default)."),
    event_log_handler: Optional[str] = typer.Option(None, "--event-log-handler", "--event_log_handler",
                                                    envvar="PET_EVENT_LOG_HANDLER",
                                                    help="null, console or dynamic_rendezvous: accepted; ftrun "
                                                         "reports its events on the console and in "
                                                         "--log-dir/events.jsonl whichever is given."),
    signals_to_handle: Optional[str] = typer.Option(None, "--signals-to-handle", "--signals_to_handle",
                                                    envvar="PET_SIGNALS_TO_HANDLE",
                                                    help="Signals that stop the job gracefully as SIGTERM does "
                                                         "(SIGTERM,SIGINT,SIGHUP,SIGQUIT); SIGUSR1 and SIGUSR2 "
                                                         "listed here are passed on to every trainer instead "
                                                         "(not listed, ftrun ignores them)."),
    virtual_local_rank: Optional[bool] = typer.Option(None, "--virtual-local-rank", "--virtual_local_rank",
                                                      envvar="PET_VIRTUAL_LOCAL_RANK",
                                                      help="Every trainer gets LOCAL_RANK 0 and "
                                                           "CUDA_VISIBLE_DEVICES of its own device."),
    logs_specs: Optional[str] = typer.Option(None, "--logs-specs", "--logs_specs",
                                             help="Not supported (torchrun's LogsSpecs plugins): ftrun writes its "
                                                  "own per-rank files; use --log-dir with --redirects/--tee."),
    numa_binding: Optional[str] = typer.Option(None, "--numa-binding", "--numa_binding",
                                               help="Not supported: bind in the script (os.sched_setaffinity), or "
                                                    "wrap it with numactl and --no-python."),
    hang_timeout: Optional[float] = typer.Option(None, "--hang-timeout",
                                                 help="Seconds without a heartbeat before a trainer is hung "
                                                      "(floor of the adaptive step timeout)."),
    hang_timeout_initial: Optional[float] = typer.Option(None, "--hang-timeout-initial",
                                                         help="Seconds allowed until a trainer's first heartbeat."),
    node_timeout: Optional[float] = typer.Option(None, "--node-timeout",
                                                 help="Seconds without supervisor beats before a node is lost."),
    stop_grace: Optional[float] = typer.Option(None, "--stop-grace", "--shutdown-timeout", "--shutdown_timeout",
                                               envvar="PET_SHUTDOWN_TIMEOUT",
                                               help="Seconds between SIGTERM and SIGKILL when stopping trainers "
                                                    "(3; torchrun's --shutdown-timeout)."),
    zygote: Optional[bool] = typer.Option(None, "--zygote/--no-zygote",
                                          help="Fork trainers from a process that imported torch."),
    tui: Optional[bool] = typer.Option(None, "--tui", help="Show the live status view instead of event lines."),
    ec_group: Optional[int] = typer.Option(None, "--ec-group",
                                           help="Nodes per erasure-coding group (default: up to 4)."),
    ec_parity: Optional[int] = typer.Option(None, "--ec-parity",
                                            help="Parity per group: lost nodes it survives from RAM (default 1 "
                                                 "with 2+ nodes; 0: off)."),
    ec_backend: Optional[str] = typer.Option(None, "--ec-backend", help="pyeclib backend (isa_l_rs_vand)."),
    secret_file: Optional[str] = typer.Option(None, "--secret-file",
                                              help="Multi-node: file the job secret is derived from "
                                                   "(~/.ftrun/secret)."),
    ckpt_dir: Optional[str] = typer.Option(None, "--ckpt-dir", help="Directory to persist snapshots to."),
    persist_every: Optional[int] = typer.Option(None, "--persist-every",
                                                help="Persist every N globally committed snapshots (10)."),
    keep: Optional[int] = typer.Option(None, "--keep", help="Complete persisted steps kept (2)."),
    ckpt_format: Optional[str] = typer.Option(None, "--ckpt-format",
                                              help="ftrun (default), or dcp: each persisted step is also "
                                                   "written as a torch.distributed.checkpoint (step-N/dcp)."),
    resume: Optional[bool] = typer.Option(None, "--resume/--no-resume",
                                          help="Resume from --ckpt-dir when it holds steps of this job (on)."),
    persist_grace: Optional[float] = typer.Option(None, "--persist-grace",
                                                  help="Seconds allowed for the final persist when stopping (60)."),
    inject: Optional[list[str]] = typer.Option(None, "--inject",
                                               help="Inject a fault: crash@rank=R,step=S | hang@rank=R,step=S | "
                                                    "node-loss@node=N,step=S | ... (with gen=G); repeatable."),
) -> None:
    """Run SCRIPT on every trainer of the job, restarting all of them in place when anything fails."""
    from ftrun.launch.config import build_config
    from ftrun.launch.output import split_filters

    if logs_specs is not None:
        raise UsageError(f"--logs-specs {logs_specs}: torchrun's LogsSpecs plugins do not apply, ftrun writes its "
                         "own per-rank files: use --log-dir with --redirects/--tee (and --local-ranks-filter)")
    if numa_binding is not None:
        raise UsageError(f"--numa-binding {numa_binding}: ftrun does not bind trainers to CPUs; bind in the script "
                         "(os.sched_setaffinity for LOCAL_RANK's device) or wrap it: --no-python numactl ... python "
                         "script.py")
    cfg = build_config(config, {
        "master_addr": master_addr, "master_port": master_port, "local_addr": local_addr, "run_path": run_path,
        "role": role, "redirects": redirects, "tee": tee, "local_ranks_filter": local_ranks_filter,
        "duplicate_stdout_filters": None if duplicate_stdout_filters is None else split_filters(
            duplicate_stdout_filters),
        "duplicate_stderr_filters": None if duplicate_stderr_filters is None else split_filters(
            duplicate_stderr_filters),
        "label_output": label_output, "monitor_interval": monitor_interval, "start_method": start_method,
        "event_log_handler": event_log_handler, "signals_to_handle": signals_to_handle,
        "virtual_local_rank": virtual_local_rank,
    } | {
        "nnodes": nnodes, "nproc_per_node": nproc_per_node, "node_rank": node_rank,
        "rdzv_endpoint": rdzv_endpoint, "rdzv_id": rdzv_id, "rdzv_timeout": rdzv_timeout, "rdzv_bind": rdzv_bind,
        "rdzv_backend": rdzv_backend, "rdzv_conf": rdzv_conf, "spares": spares, "standby": standby,
        "max_restarts": max_restarts, "standalone": standalone, "module": module, "no_python": no_python,
        "log_dir": log_dir, "hang_timeout": hang_timeout, "hang_timeout_initial": hang_timeout_initial,
        "node_timeout": node_timeout, "stop_grace": stop_grace, "zygote": zygote, "tui": tui,
        "ec_group": ec_group, "ec_parity": ec_parity, "ec_backend": ec_backend,
        "secret_file": secret_file, "ckpt_dir": ckpt_dir, "persist_every": persist_every, "keep": keep,
        "ckpt_format": ckpt_format,
        "resume": resume, "persist_grace": persist_grace, "inject": inject or None,
    })
    from ftrun.launch.clean import planted_files, running_here
    from ftrun.launch.handoff import begin, exec_launcher

    # checks what needs no torch, then this process becomes the launcher (see ftrun.launch.handoff)
    begun = begin(cfg, script)
    nodes = range(cfg.nnodes) if cfg.local_mode else [cfg.node_rank] if cfg.node_rank is not None else []
    problem = running_here(begun.job_id, nodes, cfg.local_mode)
    if problem:
        raise UsageError(f"{problem}: stop it first, or choose another --rdzv-id")
    problem = planted_files(begun.job_id)
    if problem:
        raise UsageError(problem)
    args = list(script_args or [])
    exec_launcher(cfg, begun, args[1:] if args[:1] == ["--"] else args)  # as torchrun: a first "--" is ftrun's


@app.command()
def store(
    host: Optional[str] = typer.Option(None, "--host", "--rdzv-bind",
                                       help="Address to listen on (default: the address of this host's name; "
                                            "0.0.0.0: every interface)."),
    port: int = typer.Option(29400, "--port", help="Port to listen on."),
) -> None:
    """Run a standalone control store that outlives every node of the jobs using it. Jobs sign and check their
    own values with their secrets; the store itself needs none."""
    import socket

    from ftrun.control.store import check_bind_address, host_store

    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be a port (0-65535; 0: any free one), got {port}")
    if host is not None and not host.strip():
        raise UsageError("--host must not be empty (0.0.0.0: every interface)")
    bind = check_bind_address(host if host is not None else socket.gethostname(), "--host")
    server = host_store(port, "control store", bind=bind, flag="--port")
    print(f"ftrun store listening on {bind}:{server.port} (Ctrl-C to stop)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass


@app.command()
def inspect(
    directory: str = typer.Argument(..., metavar="DIR", help="Checkpoint directory (--ckpt-dir of a job)."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Read every rank file and check its CRC-32."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of a table."),
) -> None:
    """List the checkpoint steps of every job in DIR: complete or partial, ranks, size, time and checksum status;
    exit code 1 when a step fails verification."""
    from ftrun.snapshot.export import failed, inventory, inventory_json, print_inventory

    rows = inventory(directory, verify)
    if as_json:
        print(inventory_json(directory, rows))
    else:
        print_inventory(rows)
    bad = failed(rows)
    if bad:
        print(f"ftrun: {len(bad)} step(s) fail verification: "
              + ", ".join(f"{row.job or 'unknown job'} step {row.step}" for row in bad), file=sys.stderr)
        raise typer.Exit(1)


@app.command()
def export(
    directory: str = typer.Argument(..., metavar="DIR", help="Checkpoint directory (--ckpt-dir of a job)."),
    out: str = typer.Argument(..., metavar="OUT", help="Directory for the exported files (created 0700)."),
    fmt: str = typer.Option(..., "--format", help="torch (rank-R.pt), safetensors (rank-R.safetensors) or dcp "
                            "(one torch.distributed.checkpoint of the whole job, DTensors assembled)."),
    step: Optional[int] = typer.Option(None, "--step", help="Step to export (default: the newest complete one)."),
    job: Optional[str] = typer.Option(None, "--job", help="Job whose step to export (needed when DIR has several)."),
) -> None:
    """Write a checkpoint step in a standard format that loads without ftrun: a torch or safetensors file per
    rank, or one DCP checkpoint."""
    from ftrun.snapshot.export import export_step

    for path in export_step(directory, out, fmt, step, job):
        print(path, flush=True)


@app.command("sbatch-template", context_settings={"allow_interspersed_args": False})
def sbatch_template(
    ftrun_args: Optional[list[str]] = typer.Argument(None, metavar="-- FTRUN_ARGS...",
                                                     help="The ftrun command line (flags, script and its arguments)."),
    nodes: int = typer.Option(..., "--nodes", help="Training nodes per step (ftrun's --nnodes under srun)."),
    spares: int = typer.Option(1, "--spares", help="Spare nodes in the allocation that replace lost ones."),
    attempts: int = typer.Option(5, "--attempts", help="srun steps to try before giving up."),
) -> None:
    """Print a batch script for sbatch that runs ftrun in srun steps, spares replacing lost nodes, until the
    training finished or failed for good."""
    from ftrun.launch.sbatch import render

    args = list(ftrun_args or [])
    if args:
        check_batch_args(args, nodes)
    print(render(nodes, spares, attempts, args, script_at=script_index(args)), end="")


def check_batch_args(args: list[str], nodes: int) -> None:
    """The ftrun command line a batch script embeds parses as ``ftrun run`` parses it (flags, their types, a
    script) and leaves the nodes' ranks to srun; its values are checked on the nodes, where they apply."""
    try:
        params = _run_command().make_context("ftrun", args[1:] if args[:1] == ["run"] else list(args)).params  # it pops
    except TyperException as err:
        raise UsageError(f"the ftrun arguments after --: {err.format_message()}") from None
    if params["node_rank"] is not None:
        raise UsageError("the ftrun arguments after -- give --node-rank: srun gives each node its rank, drop it")
    if params["nnodes"] is not None and params["nnodes"].split(":")[-1] != str(nodes):
        raise UsageError(f"the ftrun arguments after -- give --nnodes {params['nnodes']}, but each step runs "
                         f"--nodes {nodes}: drop --nnodes")


def _run_command() -> typer.core.TyperCommand:
    return typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined,return-value]


def _run_options() -> tuple[set[str], set[str]]:
    """Every option string of ``ftrun run``, and those of them that take a value."""
    names, takes_value = {"-h", "--help"}, set()
    for param in _run_command().params:
        if isinstance(param, typer.core.TyperOption):
            names.update(param.opts, param.secondary_opts)
            if not param.is_flag:
                takes_value.update(param.opts)
    return names, takes_value


def written_out(args: list[str]) -> list[str]:
    """``args`` of ``ftrun run`` with each abbreviated torchrun flag before the script written out, as torchrun's
    argparse reads it: a prefix of exactly one of :data:`TORCHRUN_OPTIONS` (``--nnode``, ``--nproc_per=2``) is that
    option; a prefix of several is a UsageError, as argparse's "ambiguous option" (``--max`` could be
    ``--max-restarts`` or ``--max_restarts``). Any other unknown flag is left for the parser to refuse: ftrun's own
    flags are not abbreviated, so a mistyped one is an error, not another flag."""
    names, takes_value = _run_options()
    args = list(args)
    index = 1 if args[:1] == ["run"] else 0
    while index < len(args):
        arg = args[index]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            break
        name, equals, value = arg.partition("=")
        if name.startswith("--") and name not in names:
            matches = [option for option in TORCHRUN_OPTIONS if option.startswith(name)]
            if len(matches) > 1:
                raise UsageError(f"ambiguous option: {name} could match {', '.join(matches)}")
            if matches:
                name = matches[0]
                args[index] = name + equals + value
        index += 2 if name in takes_value and not equals else 1
    return args


def script_index(args: list[str]) -> int:
    """Where the script starts in the arguments of ``ftrun [run]`` (``len(args)``: no script): after the options,
    the values of those that take one, and a ``--``."""
    takes_value = {name for param in _run_command().params if isinstance(param, typer.core.TyperOption)
                   and not param.is_flag for name in param.opts}
    index = 1 if args[:1] == ["run"] else 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            return index + 1
        if not arg.startswith("-") or arg == "-":
            return index
        index += 2 if arg in takes_value else 1
    return len(args)


@app.command()
def status(
    endpoint: Optional[str] = typer.Option(None, "--endpoint",
                                           help="HOST:PORT of the job's control store (default: find the job's "
                                                "launcher on this host)."),
    job: Optional[str] = typer.Option(None, "--job", help="Job id (needed with --endpoint or with several jobs; "
                                      "inside a SLURM job, its slurm-$SLURM_JOB_ID when that runs on this host)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON documents (one line each) instead of tables."),
    once: bool = typer.Option(False, "--once", help="Print the status once and exit."),
    wait: bool = typer.Option(False, "--wait", help="Wait for the job to appear instead of failing."),
    secret_file: Optional[str] = typer.Option(None, "--secret-file",
                                              help="With --endpoint: the job's --secret-file (~/.ftrun/secret)."),
    rdzv_backend: str = typer.Option("c10d", "--rdzv-backend",
                                     help="With --endpoint: c10d, or etcd (--endpoint h1:2379,h2:2379,...)."),
) -> None:
    """Show a running job's nodes, ranks, snapshot tiers and failures, refreshed live until it ends."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch loads: no C++ warning when the store goes
    from ftrun.launch.slurm import own_run_id
    from ftrun.ui.live import status_command

    if rdzv_backend not in ("c10d", "etcd"):
        raise UsageError(f"--rdzv-backend must be c10d or etcd, got {rdzv_backend!r}")
    # inside a SLURM job (`srun --overlap --jobid J ftrun status`, its batch script): that job's ftrun job
    raise typer.Exit(status_command(endpoint, job, as_json, once, wait, secret_file, rdzv_backend,
                                    own_run_id(os.environ)))


@app.command()
def clean(
    job: Optional[str] = typer.Option(None, "--job", help="Only this job's files (refused while it runs)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the files; remove nothing."),
) -> None:
    """Remove the shared-memory files (snapshots, parity, heartbeats, announce, secret and claim files) of the jobs
    that no longer run on this host, as `kill -9` of ftrun leaves them; a running job's files are left alone."""
    from ftrun.control.spec import shm_dir
    from ftrun.launch.clean import job_files, remove

    entries = job_files(job)
    running = [entry for entry in entries if entry.live]
    if job is not None and running:
        raise UsageError(f"job {job} is running ({', '.join(running[0].live[:4])}): not removing its files; stop "
                         "it first (ftrun's exit removes them)")
    if not entries:
        print(f"ftrun clean: no files of {'job ' + job if job else 'any job'} in {shm_dir()}")
    failed: list[str] = []
    for entry in entries:
        what = f"{len(entry.paths)} file(s), {entry.nbytes / (1 << 20):.1f} MiB"
        if entry.live:
            print(f"ftrun clean: job {entry.job}: running ({', '.join(entry.live[:4])}): left alone")
        elif dry_run:
            print(f"ftrun clean: job {entry.job}: {what} would be removed: " + " ".join(entry.paths))
        else:
            failed += remove(entry)
            print(f"ftrun clean: job {entry.job}: removed {what}")
    if failed:
        print(f"ftrun: error: {len(failed)} file(s) not removed: {'; '.join(failed[:3])}", file=sys.stderr)
        raise typer.Exit(1)


def from_environment(message: str, args: list[str]) -> str:
    """`` (--flag from PET_FLAG=value)`` for each ``run`` flag the error names that came from its torchrun
    variable (Kubeflow and TorchX set them; the command line shows nothing), else ``""``."""
    if args[:1] != ["run"] or "env var:" in message:
        return ""
    given = {arg.partition("=")[0] for arg in args}
    named = {flag.replace("_", "-") for flag in re.findall(r"--[a-z][a-z0-9_-]*", message)}
    sources = []
    for param in typer.main.get_command(app).commands["run"].params:  # type: ignore[attr-defined]
        flag = next((opt for opt in param.opts if opt.startswith("--")), "")
        variable = param.envvar if isinstance(param.envvar, str) else None
        if flag in named and variable is not None and variable in os.environ and given.isdisjoint(param.opts):
            sources.append(f"{flag} from {variable}={os.environ[variable]!r}")
    return f" ({'; '.join(sources)})" if sources else ""


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``ftrun`` console script: runs the app with one-line errors."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        args = ["--help"]
    elif args[0] not in SUBCOMMANDS and args[0] not in ("--help", "-h"):
        args.insert(0, "run")
    # run: until the launcher's exec holds it, Ctrl-C ends the start in one line (typer makes it a silent 130)
    previous = signal.signal(signal.SIGINT, stopped_while_starting) if args[0] == "run" else None
    try:
        if args[0] == "run":
            args = written_out(args)
        code = app(args=args, prog_name="ftrun", standalone_mode=False)
    except typer.Exit as done:
        code = done.exit_code
    except typer.Abort:
        code = 130
    except (TyperException, UsageError) as err:
        message = err.format_message() if isinstance(err, TyperException) else str(err)
        print(error_line(message + from_environment(message, args), [*args, *os.environ.values()]), file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    sys.exit(code if isinstance(code, int) else 0)
