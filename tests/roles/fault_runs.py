"""Real training runs for the fault tests (tests/roles/test_faults.py, test_replace.py, and the vLLM and SLURM tests
that kill or add samplers): starting a `megarl train` whose output goes to files, waiting for its steps, finding its
processes, and making sure none of them outlives its test."""
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megarl.observe.sinks import train_records

from tests.helpers import REPO

# The arithmetic demo: the task the embedded think model (embedded_think_model_dir) was built for.
DEMO = str(REPO / "configs" / "arithmetic.yaml")


def worker_processes(run_dir) -> list[tuple[int, dict[bytes, bytes]]]:
    """(pid, environment) of each live megarl worker process of this run (found by its command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"megarl.roles.worker" in args and str(run_dir).encode() in b" ".join(args):
            found.append((int(proc.name), env))
    return found


def worker_pids(run_dir) -> dict[int, int]:
    """RANK -> pid of the live megarl worker processes of this run."""
    return {int(env[b"RANK"]): pid for pid, env in worker_processes(run_dir) if b"RANK" in env}


def leftovers(run_dir) -> list[int]:
    """Any process (workers, torchrun, its agent) still holding this run's directory on its command line."""
    me = os.getpid()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int(proc.name) != me and str(run_dir).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


class Logged(subprocess.Popen):
    """A process whose stdout and stderr go to files beside its run dir, not to pipes: a pipe the test does not read
    while the run goes on fills (64 KiB: a killed sampler's peers print tracebacks) and blocks whichever process
    writes next, which stalls the run. communicate() waits as Popen's does and returns the two files' text. Every
    one started is in `started` until the test ends (end_started_runs)."""

    started: list["Logged"] = []

    def __init__(self, args, log_stem: Path, merge_stderr: bool = False):
        self.run_dir = log_stem.with_suffix("")
        Logged.started.append(self)
        self.out_path, self.err_path = log_stem.with_suffix(".stdout"), log_stem.with_suffix(".stderr")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            super().__init__(args, stdout=out, stderr=subprocess.STDOUT if merge_stderr else err, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)

    def communicate(self, input=None, timeout=None):
        self.wait(timeout)
        return self.out_path.read_text(errors="replace"), self.err_path.read_text(errors="replace")

    def stderr_tail(self, chars: int = 3000) -> str:
        return self.err_path.read_text(errors="replace")[-chars:]


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process descended from it."""
    children = collections.defaultdict(list)
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                children[int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])].append(int(proc.name))
        except OSError:
            continue
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children[tree[-1]]
    return tree


def end_started_runs() -> None:
    """Every run started through `Logged` ends: every process of each run's tree, and any other still holding its run
    directory (a sampler whose keeper is gone), is SIGKILLed. The workers sit in sessions of their own (torchrun, the
    keepers), out of reach of a process-group kill; a failed replace run left alone would go on loading the machine
    under the tests after it. (tests/roles/conftest.py calls it after each test, however the test ended.)"""
    while Logged.started:
        proc = Logged.started.pop()
        for pid in process_tree(proc.pid) + leftovers(proc.run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # ended meanwhile
        proc.wait()


def start_run(run_dir, model_dir, *overrides) -> Logged:
    return Logged([sys.executable, "-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", f"model.path={model_dir}",
                    "run.steps=100000", "algo.prompts_per_step=4", *overrides], Path(f"{run_dir}.console"))


def wait_for_steps(run_dir, steps: int, proc: Logged, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    metrics = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and len(train_records([json.loads(line) for line in metrics.read_text().splitlines()])) >= steps:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    raise AssertionError(f"the run did not reach {steps} steps within {timeout}s; its stderr ends:\n"
                         f"{proc.stderr_tail()}")


def finish(proc: Logged, timeout: float) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the run did not stop within {timeout}s")
    return out, err, time.monotonic() - start


# A sampler killed while a publish's broadcast waits on it costs up to publish.timeout_s before the learner drops it,
# and the next membership epoch's group forms within 2 x publish.timeout_s (docs/faults.md): the default 120 s would
# make that 6 minutes, so the built-in engine's runs bound a broadcast by 20 s. A tiny model's takes milliseconds,
# but at load 60-70 on 2 cores a live survivor's receive has run past 8 s; a publish that times out with no sampler
# gone then stalls the run until queue.timeout_s (docs/faults.md, "Known limits"), which is not what these tests test.
REPLACE_PUBLISH_TIMEOUT_S = 20

def samplers_command(*args, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli", "samplers", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)


def remove_added(run_dir, added, sampler: int, timeout: float = 180) -> str:
    """`megarl samplers remove RUN_DIR --sampler N` of the sampler the `megarl samplers add` process `added` keeps:
    both exit 0 (the add command's keeper leaves once its sampler is removed); the add command's output."""
    removed = samplers_command("remove", str(run_dir), "--sampler", str(sampler))
    assert removed.returncode == 0, removed.stdout + removed.stderr
    added_out, _ = added.communicate(timeout=timeout)
    assert added.returncode == 0, added_out[-3000:]
    return added_out
