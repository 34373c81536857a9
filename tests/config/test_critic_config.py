"""algo.advantage.estimator=gae and algo.critic.*: bad values are refused before launch, naming the key."""
import warnings

import pytest

from megarl.algo.config import ObjectiveWarning
from megarl.config.load import ConfigError, load_config
from tests.helpers import REPO

DEMO = str(REPO / "configs" / "demo.yaml")
GAE = "algo.advantage.estimator=gae"


@pytest.mark.parametrize("override,message", [
    ("algo.advantage.estimator=ppo", "algo.advantage.estimator='ppo': must be one of grpo, drgrpo, rloo, gae"),
    (f"{GAE} algo.critic.target=retrace", "algo.critic.target='retrace': must be one of gae, vtrace"),
    (f"{GAE} algo.critic.gamma=1.5", "algo.critic.gamma=1.5: must be in [0, 1]"),
    (f"{GAE} algo.critic.lam=-0.1", "algo.critic.lam=-0.1: must be in [0, 1]"),
    (f"{GAE} algo.critic.lr=0", "algo.critic.lr=0.0: must be > 0"),
    (f"{GAE} algo.critic.target=vtrace algo.critic.c_bar=2", "algo.critic.c_bar=2.0: must be <= critic.rho_bar"),
    (f"{GAE} algo.critic.rho_bar=0", "algo.critic.rho_bar=0.0: must be > 0"),
    (f"{GAE} algo.critic.value_clip=0", "algo.critic.value_clip=0.0: must be > 0"),
    (f"{GAE} algo.critic.warmup_steps=-1", "algo.critic.warmup_steps=-1: must be >= 0"),
    (f"{GAE} algo.critic.grad_clip=0", "algo.critic.grad_clip=0.0: must be finite and > 0"),
    (f"{GAE} algo.advantage.filter_zero_variance=true", "algo.advantage.filter_zero_variance: drops groups"),
    (f"{GAE} algo.mode=sync algo.critic.warmup_steps=2", "algo.critic.warmup_steps: sync mode's samplers wait"),
    (f"{GAE} algo.critic.model=/nonexistent", "algo.critic.model: '/nonexistent' is not an HF model directory"),
])
def test_bad_critic_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_config(DEMO, override.split())


def test_gae_is_accepted_on_the_deepspeed_learner():
    cfg = load_config(DEMO, [GAE, "learner.backend=deepspeed", "algo.critic.warmup_steps=2"])
    assert cfg.learner.backend == "deepspeed" and cfg.algo.critic.warmup_steps == 2


def test_gamma_lambda_one_warns_what_gae_reduces_to():
    with pytest.warns(ObjectiveWarning, match=r"reduces to A_t = R - V\(s_t\)"):
        load_config(DEMO, [GAE, "algo.critic.lam=1.0"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ObjectiveWarning)
        cfg = load_config(DEMO, [GAE, "algo.critic.target=vtrace"])  # the defaults: lam 0.95, no warning
    assert cfg.algo.critic.target == "vtrace" and cfg.algo.critic.lam == 0.95
