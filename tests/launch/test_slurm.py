"""The SLURM sbatch scripts, executed for real: always against stand-ins for srun/scontrol/torchrun that
record what the scripts would launch (tests/launch/fake_slurm.py), and under a real local SLURM
(slurmctld + two slurmd on this machine, with munge) when Debian's slurm-wlm is installed."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, save_tokenizer, train_metrics

CONFIG = "configs/demo.yaml"
FAKE = Path(__file__).with_name("fake_slurm.py")


@pytest.fixture
def fake_model_dir(tmp_path) -> Path:
    """An HF-format directory that passes megarl's start-up checks (nothing loads it: torchrun is a stand-in)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    (model / "model.safetensors").write_bytes(b"")
    save_tokenizer(model)
    return model


def fake_slurm(tmp_path: Path, nodes: int) -> tuple[dict, Path]:
    """The environment of a batch job on `nodes` fake nodes, and the log the stand-ins write."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol", "torchrun", "hostname"):
        wrapper = bin_dir / tool
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} {tool} "$@"\n')
        wrapper.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "NODE_", "RDZV_", "NNODES"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHONPATH=str(REPO), FAKE_SLURM_LOG=str(log),
               SLURM_JOB_ID=f"fake{os.getpid()}", SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_JOB_NODELIST=",".join(f"node{i}" for i in range(nodes)), SLURM_SUBMIT_DIR=str(REPO))
    return env, log


def run_batch(script: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / script), *args], env=env, capture_output=True, text=True,
                          timeout=180, cwd="/")


def calls(log: Path, tool: str) -> list[dict]:
    return [c for c in map(json.loads, log.read_text().splitlines()) if c["tool"] == tool] if log.exists() else []


def test_single_node_script_checks_stages_the_model_and_runs_srun_torchrun(tmp_path, fake_model_dir):
    env, log = fake_slurm(tmp_path, nodes=1)
    proc = run_batch("slurm_single_node.sbatch", env, CONFIG, f"model.path={fake_model_dir}", "run.steps=3",
                     f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megarl: dry run, would launch: torchrun" in proc.stdout  # `megarl train --dry-run` checked everything first
    scratch = f"/tmp/megarl-{env['SLURM_JOB_ID']}"
    [torchrun] = calls(log, "torchrun")
    assert torchrun["argv"] == ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--shutdown-timeout", "30",
                                "-m", "megarl.roles.worker", CONFIG,
                                f"model.path={fake_model_dir}", "run.steps=3", f"run.dir={tmp_path / 'run'}",
                                f"model.path={scratch}/model"]
    assert torchrun["model_staged"] and torchrun["env"]["HF_HOME"] == f"{scratch}/hf"
    assert calls(log, "srun")[1]["argv"][:3] == ["--nodes=1", "--ntasks=1", "torchrun"]
    assert not os.path.exists(scratch)  # node-local scratch is removed when the job ends


def test_multi_node_script_starts_one_c10d_agent_per_node_with_its_own_address(tmp_path, fake_model_dir):
    env, log = fake_slurm(tmp_path, nodes=2)
    proc = run_batch("slurm_multi_node.sbatch", env, CONFIG, f"model.path={fake_model_dir}", "run.steps=3",
                     f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    scratch = f"/tmp/megarl-{env['SLURM_JOB_ID']}"
    agents = calls(log, "torchrun")
    assert [a["node"] for a in agents] == ["0", "1"]
    for a in agents:
        addr = f"10.9.0.{int(a['node']) + 1}"  # what `hostname -I` says on that node
        assert a["argv"] == ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", "addr-of-node0:29500", "--rdzv-id", env["SLURM_JOB_ID"],
                             "--local-addr", addr, "-m", "megarl.roles.worker", CONFIG, f"queue.host={addr}",
                             f"model.path={fake_model_dir}", "run.steps=3", f"run.dir={tmp_path / 'run'}",
                                f"model.path={scratch}/model"]
        assert a["model_staged"] and a["env"]["TORCH_EXTENSIONS_DIR"] == f"{scratch}/torch_extensions"
    assert proc.stderr.count("megarl placement: node 0 (torchrun group rank 0): rank 0 = learner 0") == 1


@pytest.mark.parametrize("script, override, message", [
    ("slurm_single_node.sbatch", "learner.tp=0", "learner.tp: must be > 0"),
    ("slurm_multi_node.sbatch", "sampler.num_engines=2", "make the world size a multiple of the node count"),
])
def test_a_bad_config_stops_the_job_before_any_worker_starts(script, override, message, tmp_path, fake_model_dir):
    env, log = fake_slurm(tmp_path, nodes=2 if "multi" in script else 1)
    proc = run_batch(script, env, CONFIG, f"model.path={fake_model_dir}", override, f"run.dir={tmp_path / 'run'}")
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert calls(log, "torchrun") == []


def test_a_stop_signal_to_the_batch_script_stops_the_run_at_a_step_boundary(tmp_path, embedded_model_dir):
    """What `scancel --batch`, `sbatch --signal=B:TERM@120` or a preemption sends: SIGTERM to the batch shell
    only. The script passes it to srun (which forwards signals to its tasks, as the stand-in does), the real
    torchrun to every worker: the run saves a checkpoint (fault.checkpoint_on_signal) and every process ends."""
    from tests.roles.fault_runs import leftovers

    env, log = fake_slurm(tmp_path, nodes=1)
    env["FAKE_SLURM_REAL_TORCHRUN"] = "1"
    run_dir = tmp_path / "run"
    job = subprocess.Popen(["bash", str(REPO / "launch" / "slurm_single_node.sbatch"), CONFIG, f"run.dir={run_dir}",
                            f"model.path={embedded_model_dir}", "run.steps=100000", "algo.prompts_per_step=4",
                            "observe.trackers=[]", "fault.checkpoint_on_signal=true"],
                           env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(train_metrics(run_dir)) < 2:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    try:
        out, err = job.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        job.kill()
        raise AssertionError("the job did not stop within 90s of SIGTERM")
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    steps = len(train_metrics(run_dir))
    assert f"megarl: stopped by SIGTERM after {steps} steps" in out
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
    assert not leftovers(run_dir) and not os.path.exists(f"/tmp/megarl-{env['SLURM_JOB_ID']}")


# ------------------------------------------------------------------------------------- real SLURM

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory):
    """munged, slurmctld and two slurmd ("nodes" n0 and n1, both this machine on loopback), stopped afterwards."""
    tools = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} not found; `apt-get install slurm-wlm munge` "
                    f"provides them): the sbatch scripts are covered by the stand-in tests only")
    if os.geteuid() != 0:
        pytest.skip("the local SLURM runs its daemons as root (SlurmUser=root) and this test is not root: "
                    "the sbatch scripts are covered by the stand-in tests only")
    d = tmp_path_factory.mktemp("slurm")
    d.chmod(0o755)
    (d / "munge.key").write_bytes(os.urandom(1024))
    (d / "munge.key").chmod(0o400)
    for sub in ("state", "log", "spool/n0", "spool/n1"):
        (d / sub).mkdir(parents=True)
    host = socket.gethostname().split(".")[0]
    ctld, n0, n1 = free_port(), free_port(), free_port()
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=megarltest
SlurmctldHost={host}
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=n0 NodeHostname={host} NodeAddr=127.0.0.1 Port={n0} CPUs=2 State=UNKNOWN
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n0,n1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    start = [["munged", "--force", f"--socket={d}/munge.sock", f"--key-file={d}/munge.key",
              f"--log-file={d}/log/munged.log", f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed"],
             ["slurmctld", "-f", str(conf)], ["slurmd", "-f", str(conf), "-N", "n0"], ["slurmd", "-f", str(conf), "-N", "n1"]]
    pid_files = [d / "munged.pid", d / "slurmctld.pid", d / "slurmd-n0.pid", d / "slurmd-n1.pid"]
    try:
        for cmd in start:
            subprocess.run(cmd, env=env, check=True, timeout=30)  # each daemonizes and writes its pid file
        deadline = time.monotonic() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "local SLURM did not come up: " + (d / "log/slurmctld.log").read_text()[-2000:]
            time.sleep(0.5)
        yield env
    finally:
        pids = [int(f.read_text()) for f in pid_files if f.exists()]  # before shutdown removes the files
        subprocess.run(["scontrol", "shutdown"], env=env, timeout=30, capture_output=True)
        for pid in pids:  # the daemons this fixture started, by pid: SIGTERM, SIGKILL after 5 s
            stop(pid)


def stop(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


RUN = ["run.steps=2", "algo.prompts_per_step=4", "algo.group_size=4", "sampling.max_new_tokens=8",
       "learner.micro_batch_size=16", "observe.trackers=[]"]


@pytest.mark.slurm
@pytest.mark.parametrize("script, nodes", [("slurm_single_node.sbatch", 1), ("slurm_multi_node.sbatch", 2)])
def test_sbatch_scripts_train_under_a_real_slurm(script, nodes, local_slurm, embedded_model_dir, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    # Both "nodes" are this machine: the learner binds the loopback address, not the node's interface.
    env = {**local_slurm, "NODE_ADDR": "127.0.0.1", "MEGARL_RDZV_PORT": str(free_port())}
    proc = subprocess.run(["sbatch", "--wait", f"--nodes={nodes}", f"--output={out}", f"launch/{script}", CONFIG,
                           f"run.dir={run_dir}", f"model.path={embedded_model_dir}", *RUN],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    log = out.read_text() if out.exists() else ""
    assert proc.returncode == 0, proc.stderr + log[-4000:]
    assert len(train_metrics(run_dir)) == 2
    assert "step 2/2" in log


def test_adding_samplers_to_a_run_on_loopback_from_another_machine_is_refused(tmp_path, fake_model_dir):
    """A single-node run's store (torchrun --standalone: localhost) and queue (127.0.0.1) answer on its own machine
    only: a job on other nodes is refused before any sampler starts, naming the machine it must run on."""
    env, log = fake_slurm(tmp_path, nodes=1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(json.dumps({  # a run's saved config, as far as the script reads it
        "fault": {"on_failure": "replace"}, "queue": {"host": "127.0.0.1"},
        "model": {"path": str(fake_model_dir), "cache_dir": str(tmp_path / "cache")}}))
    (run_dir / ".megarl.contact").write_text(json.dumps({"store": ["localhost", 29500], "host": "runhost", "pid": 1}))
    (run_dir / ".megarl.contact").chmod(0o600)
    proc = run_batch("slurm_add_samplers.sbatch", env, str(run_dir))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (f"megarl: the run in {run_dir} listens on loopback only (a single-node launch: its store or queue.host "
            f"is local), so samplers join it from its own machine, runhost, only; this job also runs on: node0"
            in proc.stderr), proc.stderr[-3000:]
    assert not [c for c in calls(log, "srun") if "samplers" in c["argv"] or "stage" in c["argv"]]  # nothing started


def test_adding_samplers_to_a_run_not_under_replace_fails_the_job_with_megarls_line(tmp_path):
    env, log = fake_slurm(tmp_path, nodes=1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(json.dumps({"fault": {"on_failure": "stop"}}))  # as far as it is read
    proc = run_batch("slurm_add_samplers.sbatch", env, str(run_dir))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (f"megarl samplers add: the run in {run_dir} runs with fault.on_failure=stop: samplers join and leave only "
            f"under fault.on_failure=replace" in proc.stdout), proc.stdout[-3000:] + proc.stderr[-3000:]
    srun = [c["argv"] for c in calls(log, "srun")]
    assert [a for a in srun if "stage" in a] == [] and [a for a in srun if "samplers" in a]  # the command said no


def submit(env: dict, node: str, out: Path, script: str, *args: str) -> str:
    """The job id of `sbatch --nodelist=NODE launch/SCRIPT ARGS` (not waited for)."""
    proc = subprocess.run(["sbatch", "--parsable", f"--nodelist={node}", f"--output={out}", f"launch/{script}", *args],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.strip().split(";")[0]


def job_state(env: dict, job: str) -> dict:
    """JobState, ExitCode, ... of a job slurmctld still knows (finished ones for MinJobAge, 300 s by default)."""
    for _ in range(30):  # a busy slurmctld may not answer at once
        line = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True,
                              timeout=30).stdout
        state = dict(field.split("=", 1) for field in line.split() if "=" in field)
        if "JobState" in state:
            return state
        time.sleep(1)
    raise AssertionError(f"slurmctld does not know job {job}")


UNFINISHED = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


def wait_for_end(env: dict, job: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while (state := job_state(env, job))["JobState"] in UNFINISHED:
        assert time.monotonic() < deadline, f"job {job} still {state.get('JobState')} after {timeout:.0f}s"
        time.sleep(1)
    return state


# eval.sets=[]: `samplers add` refuses a run that splits evaluations over a fixed set of engines. The long waits: A's
# learner is held (SIGSTOP) while job B starts, and its sampler and publishes wait through that.
ADD_RUN = ["fault.on_failure=replace", "run.log_rollouts=true", "eval.sets=[]", "run.steps=60", "queue.timeout_s=900",
           "publish.timeout_s=600", *RUN[1:]]


class HeldLearner:
    """A's learner (its contact's pid) held with SIGSTOP from an action of the test until that action's record
    appears in the run's store: the run cannot go past its next step before job B has done its part, however slow
    B's start on a loaded machine. The store (torchrun's agent) and the run's sampler go on meanwhile."""

    def __init__(self, run_dir: Path):
        from megarl.distributed.run_contact import read_contact

        self.contact = read_contact(run_dir)
        self.pid, self.store = int(self.contact["pid"]), None

    def hold(self, action, key: str, timeout: float, check) -> None:
        """SIGSTOP, `action()`, wait for `key` (calling `check()` while waiting), SIGCONT."""
        from megarl.roles.sampler_control import connect

        os.kill(self.pid, signal.SIGSTOP)
        try:
            self.store = self.store or connect(self.contact)  # held first: a short run could end meanwhile
            action()
            deadline = time.monotonic() + timeout
            while not self.store.check([key]):
                check()
                assert time.monotonic() < deadline, f"no {key} in the run's store within {timeout:.0f}s"
                time.sleep(0.5)
        finally:
            os.kill(self.pid, signal.SIGCONT)


@pytest.mark.slurm
def test_a_second_job_adds_a_sampler_to_a_running_one_and_scancel_drains_it(local_slurm, embedded_model_dir,
                                                                             tmp_path):
    """Job A (one node: learner + sampler 0) runs under fault.on_failure=replace; job B, on the other node,
    `launch/slurm_add_samplers.sbatch RUN_DIR` adds sampler 1 (rank 2), whose groups A trains; `scancel` of B drains
    it, and A goes on to its last step and ends normally."""
    from megarl.distributed.membership import join_key, remove_key
    from tests.roles.fault_runs import leftovers

    run_dir, out_a, out_b = tmp_path / "run", tmp_path / "a.out", tmp_path / "b.out"
    log = lambda out: out.read_text()[-3000:] if out.exists() else "no log"  # noqa: E731
    jobs = []
    running = lambda i: job_state(local_slurm, jobs[i])["JobState"] in UNFINISHED  # noqa: E731
    try:
        jobs.append(submit(local_slurm, "n0", out_a, "slurm_single_node.sbatch", CONFIG, f"run.dir={run_dir}",
                           f"model.path={embedded_model_dir}", *ADD_RUN))
        deadline = time.monotonic() + 300
        while not (run_dir / ".megarl.contact").exists():  # its learner has started
            assert time.monotonic() < deadline and running(0), log(out_a)
            time.sleep(0.5)
        learner = HeldLearner(run_dir)

        def b_running() -> None:
            assert running(1), log(out_b)
        learner.hold(lambda: jobs.append(submit(local_slurm, "n1", out_b, "slurm_add_samplers.sbatch", str(run_dir))),
                     join_key(2), 600, b_running)  # until B's sampler asks to join: its engine is ready
        rollouts = run_dir / "rollouts.jsonl"
        while not (rollouts.exists() and '"sampler_rank": 2' in rollouts.read_text()):  # a group of B's trained
            assert running(0), "run A ended before it trained a group of the added sampler: " + log(out_a)
            time.sleep(0.2)
        learner.hold(lambda: subprocess.run(["scancel", jobs[1]], env=local_slurm, check=True, timeout=30),
                     remove_key(2), 180, lambda: None)  # until B's sampler asked to leave
        added = wait_for_end(local_slurm, jobs[1], timeout=180)
        a = wait_for_end(local_slurm, jobs[0], timeout=600)
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], env=local_slurm, timeout=30, capture_output=True)
        for job in jobs:
            wait_for_end(local_slurm, job, timeout=120)
    log_a, log_b = out_a.read_text(), out_b.read_text()
    assert (a["JobState"], a["ExitCode"]) == ("COMPLETED", "0:0"), log_a[-3000:]
    assert added["JobState"] == "CANCELLED", log_b[-3000:]
    assert f"megarl: sampler 1 (rank 2) added to the run in {run_dir}" in log_b, log_b[-3000:]
    assert "SIGTERM received: removing this sampler from the run" in log_b, log_b[-3000:]
    assert "megarl: sampler 1 (rank 2) removed (megarl samplers remove): incarnation 1 stopped, no replacement" \
        in log_b, log_b[-3000:]  # drained, not killed
    assert "megarl: sampler 1 (rank 2) removed (megarl samplers remove)" in log_a, log_a[-3000:]
    metrics = train_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(60))  # every step once, to the last
    alive = [m["samplers/alive"] for m in metrics]
    first, last = alive.index(2.0), len(alive) - 1 - alive[::-1].index(2.0)
    assert set(alive[:first]) == {1.0} and set(alive[first:last + 1]) == {2.0} and set(alive[last + 1:]) == {1.0}
    assert last < len(alive) - 1  # the run went on after the added sampler left
    assert not leftovers(run_dir)


@pytest.mark.slurm
def test_adding_samplers_to_a_run_dir_without_a_running_job_fails_the_job_with_megarls_line(local_slurm, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    run_dir.mkdir()
    proc = subprocess.run(["sbatch", "--wait", f"--output={out}", "launch/slurm_add_samplers.sbatch", str(run_dir)],
                          env=local_slurm, cwd=REPO, capture_output=True, text=True, timeout=300)
    log = out.read_text()
    assert proc.returncode == 1, log[-3000:]
    assert f"megarl samplers add: no running job in {run_dir}: .megarl.contact is absent" in log, log[-3000:]
