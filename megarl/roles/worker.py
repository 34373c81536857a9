"""The torchrun entry point of every megarl process: read the config, find this rank's role, run it.

    torchrun --standalone --nproc-per-node N -m megarl.roles.worker CONFIG [key=value ...]

`megarl train` runs exactly this command for you, started while it checks the run: each rank imports what its role
needs, then waits for the checks' verdict before it touches anything (megarl.distributed.launch_gate).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from megarl import run_lock
from megarl.config.load import load_config, save_config
from megarl.distributed import launch_gate
from megarl.distributed.lifetime import install_stop_handlers, run_then_exit
from megarl.distributed.membership import INCARNATION_ENV, SIGNALS_TO_KEEPER_ENV
from megarl.distributed.ranks import topology_from_env
from megarl.distributed.topology import connect_store
from megarl.embedded.registry import resolve_model_path
from megarl.observe import startup
from megarl.observe.quiet import silence_known_library_warnings


def main(argv: list[str] | None = None) -> None:
    startup.mark("python, imports")  # torch and megarl's config, topology, lifetime modules
    silence_known_library_warnings()  # megatron-core's import-time fallback notices (megarl.observe.quiet)
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: torchrun ... -m megarl.roles.worker CONFIG [key=value ...]")
    cfg = load_config(argv[0], argv[1:])
    topo = topology_from_env(cfg)
    startup.mark("config")
    store = connect_store(topo, cfg.dist.timeout_s)
    startup.mark("store (rendezvous)")
    run_role = role_entry(cfg, topo.role)
    startup.mark("role imports")
    if launch_gate.gated():  # `megarl train` may still be checking the run: act only once it lets the run go
        if not launch_gate.wait_for_go(store, cfg.dist.timeout_s, topo.rank):
            return  # refused: nothing was done
        startup.mark("launch gate (the CLI's checks)")
    if os.environ.get(SIGNALS_TO_KEEPER_ENV) != "1":  # an added sampler ignores them from its start (sampler_keeper)
        install_stop_handlers()  # SIGTERM/SIGINT/SIGHUP end the run at a step boundary (megarl.distributed.lifetime)
    if cfg.fault.on_failure == "replace" and topo.role == "sampler" and INCARNATION_ENV not in os.environ:
        from megarl.roles.sampler_keeper import keep_sampler

        keep_sampler(argv, cfg, topo, store)  # this rank keeps the sampler as a replaceable child process
        return
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    startup.mark("model path")
    if topo.rank == 0:  # the rank that writes run.dir holds it (a raw torchrun launch), or its launcher does
        try:
            run_lock.hold(cfg.run.dir)
        except run_lock.RunDirError as exc:
            sys.exit(f"megarl: {exc}")
        save_config(cfg, Path(cfg.run.dir) / "config.yaml")
    if torch.cuda.is_available() and (topo.role == "learner" or cfg.sampler.engine == "builtin"):
        # One GPU per learner rank and per built-in engine: the node-local rank's (SGLang samplers
        # leave theirs to the server they start, megarl.distributed.topology.sglang_gpu_slice).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    run_role(cfg, topo, store, model_dir)


def role_entry(cfg, role: str):
    """The function that runs `role` (run_learner / run_sampler), its modules and the libraries it will build
    from imported: no side effects, so a gated rank does it while `megarl train` checks the run."""
    if role == "learner":
        from megarl.learner import import_backend
        from megarl.roles.learner_main import run_learner

        import_backend(cfg.learner.backend)
        return run_learner
    from megarl.roles.sampler_main import import_engine, run_sampler

    import_engine(cfg.sampler.engine)
    return run_sampler


if __name__ == "__main__":
    run_then_exit(main)  # not a plain exit: see megarl.distributed.lifetime
