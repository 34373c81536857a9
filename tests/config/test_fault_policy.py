"""fault.on_failure=auto (the default): replace wherever membership epochs cover the topology, stop elsewhere, the
resolved policy in the loaded (and saved) config, and the line `megarl train` prints for it."""
import pytest

from megarl.config import fault_policy
from megarl.config.load import ConfigError, load_config, to_dict
from tests.helpers import REPO

DEMO = REPO / "configs" / "demo.yaml"


@pytest.mark.parametrize("config", ["demo.yaml", "multiturn_demo.yaml", "arithmetic.yaml"])
def test_the_demo_configs_run_with_replace_by_default(config):
    cfg = load_config(REPO / "configs" / config, check_files=False)
    assert cfg.fault.on_failure == "replace"
    assert to_dict(cfg)["fault"]["on_failure"] == "replace"  # what config.yaml saves: the policy in force
    assert fault_policy.describe(cfg).startswith("sampler faults: replace (a dead or hung sampler is replaced while "
                                                 "the learner trains on, at most 6 times per sampler per hour")


@pytest.mark.parametrize("overrides, line", [
    (["sampler.tp=2", "learner.tp=2", "eval.sets=[]"], "sampler faults: stop (replace does not support sampler.tp=2)"),
    (["algo.mode=sync", "eval.sets=[]"], "sampler faults: stop (replace does not support algo.mode=sync)"),
    (["learner.pp=2", "eval.sets=[]"], "sampler faults: stop (replace does not support learner.pp=2)"),
    (["learner.dp=2", "publish.senders=2", "algo.mode=sync", "eval.sets=[]"],
     "sampler faults: stop (replace does not support publish.senders=2, algo.mode=sync)"),
    (["fault.max_sampler_restarts_per_hour=0"],
     "sampler faults: stop (fault.max_sampler_restarts_per_hour=0 allows no replacement)"),
])
def test_auto_is_stop_where_replace_does_not_reach_and_says_why(overrides, line):
    cfg = load_config(DEMO, overrides, check_files=False)
    assert cfg.fault.on_failure == "stop"
    assert fault_policy.describe(cfg) == line


def test_an_explicit_policy_stands_and_replace_is_refused_where_it_does_not_reach():
    stop = load_config(DEMO, ["fault.on_failure=stop"], check_files=False)
    assert stop.fault.on_failure == "stop"
    assert fault_policy.describe(stop) == "sampler faults: stop (fault.on_failure=stop)"
    restart = load_config(DEMO, ["fault.on_failure=restart", "checkpoint.every_steps=10"], check_files=False)
    assert fault_policy.describe(restart) == ("sampler faults: restart (every process restarts from the last "
                                              "checkpoint, at most 3 times)")
    with pytest.raises(ConfigError, match=r"sampler.tp: fault.on_failure=replace replaces samplers only with "
                                          r"sampler.tp=1 \(fault.on_failure=auto chooses stop here\)"):
        load_config(DEMO, ["fault.on_failure=replace", "sampler.tp=2", "learner.tp=2", "eval.sets=[]"],
                    check_files=False)
