"""Stand-ins for srun, scontrol, torchrun and `hostname` so a test can execute the sbatch scripts for real on
a machine without SLURM. Every call is recorded as a JSON line in $FAKE_SLURM_LOG (tool, argv, node, the
launch-related environment). srun runs its command once per node, as SLURM does, with SLURM_NODEID set,
and passes SIGTERM/SIGINT/SIGHUP on to it, as srun forwards signals to its tasks; torchrun only records
(and whether the model it is given exists), or with FAKE_SLURM_REAL_TORCHRUN=1 then runs the real one;
`hostname -I` answers 10.9.0.<node + 1>.

    python fake_slurm.py TOOL [args...]    (the test puts one wrapper per TOOL on PATH)
"""
import json
import os
import signal
import subprocess
import sys

ENV_PREFIXES = ("SLURM_", "HF_HOME", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "NNODES",
                "RDZV_", "NODE_")


def record(tool: str, argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    # Was the model the workers are told to load really there when torchrun started?
    models = [a.split("=", 1)[1] for a in argv if a.startswith("model.path=")]
    staged = bool(models) and os.path.isfile(os.path.join(models[-1], "config.json"))
    with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
        f.write(json.dumps({"tool": tool, "argv": argv, "node": os.environ.get("SLURM_NODEID"), "env": env,
                            "model_staged": staged}) + "\n")


def srun(argv: list[str]) -> int:
    nodes, i = int(os.environ["SLURM_JOB_NUM_NODES"]), 0
    while i < len(argv) and argv[i].startswith("--"):  # srun's own options; the command follows
        name, _, value = argv[i].partition("=")
        if name == "--nodes":
            nodes = int(value)
        i += 1
    names = os.environ["SLURM_JOB_NODELIST"].split(",")
    for node in range(nodes):
        env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURMD_NODENAME": names[node]}
        task = subprocess.Popen(argv[i:], env=env)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: task.send_signal(signum))
        rc = task.wait()
        if rc:
            return 128 - rc if rc < 0 else rc
    return 0


def torchrun(argv: list[str]) -> int:
    if os.environ.get("FAKE_SLURM_REAL_TORCHRUN") == "1":
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])
    return 0


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(argv[2].split(",")))
    elif argv[:2] == ["show", "node"]:
        print(f"NodeName={argv[2]} Arch=x86_64 NodeAddr=addr-of-{argv[2]} NodeHostName={argv[2]}")
    return 0


def hostname(argv: list[str]) -> int:
    node = int(os.environ.get("SLURM_NODEID", "0"))
    print(f"10.9.0.{node + 1} fd00::{node + 1}" if argv == ["-I"] else f"node{node}")
    return 0


if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    record(tool, args)
    sys.exit({"srun": srun, "scontrol": scontrol, "hostname": hostname, "torchrun": torchrun}.get(tool, lambda a: 0)(args))
