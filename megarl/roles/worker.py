"""The torchrun entry point of every megarl process: read the config, find this rank's role, run it.

    torchrun --standalone --nproc-per-node N -m megarl.roles.worker CONFIG [key=value ...]

`megarl train` runs exactly this command for you after checking the config.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from megarl import run_lock
from megarl.config.load import load_config, save_config
from megarl.distributed.lifetime import install_stop_handlers, run_then_exit
from megarl.distributed.topology import connect_store, topology_from_env
from megarl.models.embedded import resolve_model_path
from megarl.observe import startup
from megarl.observe.quiet import silence_known_library_warnings


def main(argv: list[str] | None = None) -> None:
    startup.mark("python, imports")  # torch and megarl's config, topology, lifetime modules
    silence_known_library_warnings()  # megatron-core's import-time fallback notices (megarl.observe.quiet)
    install_stop_handlers()  # SIGTERM/SIGINT/SIGHUP end the run at a step boundary (megarl.distributed.lifetime)
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: torchrun ... -m megarl.roles.worker CONFIG [key=value ...]")
    cfg = load_config(argv[0], argv[1:])
    topo = topology_from_env(cfg)
    startup.mark("config")
    store = connect_store(topo, cfg.dist.timeout_s)
    startup.mark("store (rendezvous)")
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
    if topo.role == "learner":
        from megarl.roles.learner_main import run_learner

        startup.mark("role imports")
        run_learner(cfg, topo, store, model_dir)
    else:
        from megarl.roles.sampler_main import run_sampler

        startup.mark("role imports")
        run_sampler(cfg, topo, store, model_dir)


if __name__ == "__main__":
    run_then_exit(main)  # not a plain exit: see megarl.distributed.lifetime
