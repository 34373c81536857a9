"""Multi-node for real on one machine: launch/torchrun_multi_node.sh started twice, as two nodes of one c10d
rendezvous on loopback (one process each: node 0 gets the learner, node 1 the sampler), trains.

The two "nodes" get different loopback addresses (127.0.0.2, 127.0.0.3): c10d orders nodes by address,
so node 0 is group rank 0, and the learner must bind its queue to its node's address for the sampler
on the other "node" to reach it."""
import os
import socket
import subprocess

from tests.helpers import REPO, train_metrics

RUN = ["run.steps=5", "algo.prompts_per_step=4", "algo.group_size=4", "sampling.max_new_tokens=8",
       "learner.micro_batch_size=16", "observe.trackers=[]"]


def test_two_torchrun_agents_on_loopback_train_with_the_learner_and_sampler_on_different_nodes(
        embedded_model_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    agents = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(REPO), "NNODES": "2", "NODE_RANK": str(node),
               "NODE_ADDR": f"127.0.0.{node + 2}",
               "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_ID": f"test{os.getpid()}",
               "MEGARL_RUN_SECRET": "a secret both nodes of this test share"}
        cmd = ["bash", "launch/torchrun_multi_node.sh", "configs/demo.yaml", f"run.dir={run_dir}",
               f"model.path={embedded_model_dir}", *RUN]
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True))
    outputs = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=300)
            outputs.append(out + err)
    finally:
        for agent in agents:
            agent.kill()
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-4000:]
    # The learner (rank 0) prints the progress line: it ran on node 0 only.
    assert ["step 5/5" in output for output in outputs] == [True, False]
    assert "megarl placement: node 1 (torchrun group rank 1): rank 1 = sampler 0" in outputs[0]
    metrics = train_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(5))
    assert metrics[-1]["sampler1/tokens_decoded"] > 0 and metrics[-1]["version"] == 5
    assert "host: 127.0.0.2" in (run_dir / "config.yaml").read_text()  # the queue bound node 0's address
