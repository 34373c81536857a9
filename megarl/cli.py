"""`megarl` command line: `megarl train CONFIG [key=value ...]`.

`train` checks the whole configuration (keys, types, topology) and prepares the model before any
worker starts, then launches one torchrun holding every role and waits for it.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from megarl.config.load import ConfigError, load_config, world_size_for


def torchrun_command(config: str, overrides: list[str], nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "megarl.roles.worker", config, *overrides]


def train(args: argparse.Namespace) -> int:
    from megarl.models.tiny import resolve_model_path

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"megarl: model.path: {exc}", file=sys.stderr)
        return 2
    cmd = torchrun_command(args.config, args.overrides, world_size_for(cfg))
    print(f"megarl: model {model_dir}; run dir {cfg.run.dir}")
    print("megarl: launching: torchrun " + shlex.join(cmd[3:]), flush=True)
    if args.dry_run:
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megarl", description="Asynchronous Pipeline RL post-training")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train with a YAML config and key=value overrides")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. run.steps=20 sampler.num_engines=2")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and print the torchrun command (give it before CONFIG)")
    p.set_defaults(func=train)
    args = parser.parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
