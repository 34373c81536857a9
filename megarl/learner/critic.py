"""The learned critic of `algo.advantage.estimator=gae`: a separate value model on the learner ranks, its own
optimizer, and the step's per-token GAE advantages and value targets (the math: megarl.algo.values).

Why a separate model, not a value head on the policy trunk: the critic keeps its own optimizer, lr and
warm-up without touching the policy's (a shared trunk would move the policy during critic warm-up and mix two
losses' gradients in one megatron optimizer), and it is independent of the policy's megatron layout. The value
model is an HF trunk (`AutoModel`, by default the policy's own model directory, i.e. the standard PPO setup of
initialising the critic from the policy) with a zero-initialised linear value head, in plain torch:

* **Replicated** on every learner rank (no TP/PP sharding): fine for the small critics megarl runs on CPU; a
  critic too large for one rank is not supported yet (docs/algorithms.md#ppo-with-a-critic).
* Every DP rank trains it on its own rows; its gradients are summed over the DP group (each rank's loss is its
  share of the batch's token mean), so the replicas stay identical. The TP/PP ranks of one DP coordinate
  compute the same values and updates on the same rows.

One step (`MegatronLearner.train_step`): `prepare` computes V(s_t) with the critic as it is (no grad), the GAE
advantages (whitened over the batch's model tokens when `whiten`) that replace the micro-batches' `advantages`,
and the value targets (`gae` returns, or `vtrace` targets from the learner's log-probs at step start against
each token's behaviour log-prob); `train` takes one optimizer step of the critic on the clipped value loss and
returns its metrics (critic/*, by lag).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megarl.algo import metrics as algo_metrics
from megarl.algo import values
from megarl.algo.config import CriticConfig
from megarl.models import convert


class ValueModel(torch.nn.Module):
    """An HF trunk plus a linear value head: V(s_t) for every token t of input_ids."""

    def __init__(self, model_dir: str):
        super().__init__()
        from transformers import AutoConfig, AutoModel

        # Built from its config and loaded here (not from_pretrained): the same safetensors reader as the learner's,
        # and no progress bar on the run's console.
        self.trunk = AutoModel.from_config(AutoConfig.from_pretrained(model_dir)).float()
        prefix = self.trunk.base_model_prefix + "."
        weights = {k[len(prefix):]: v for k, v in convert.load_pretrained(model_dir)[1].items() if k.startswith(prefix)}
        missing, _ = self.trunk.load_state_dict(weights, strict=False)  # (the LM head is not the trunk's)
        if missing:
            raise RuntimeError(f"algo.critic.model {model_dir}: weights missing for the value model's trunk: {missing}")
        self.head = torch.nn.Linear(self.trunk.config.hidden_size, 1)
        # Zero head: V = 0 everywhere at the start, so the first advantages are the plain (whitened) returns.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] values aligned like the per-token log-probs: column t is V(s_t), from the hidden state at t-1
        (column 0 is 0). Right padding needs no attention mask: a causal model's earlier positions never see it."""
        hidden = self.trunk(input_ids=input_ids).last_hidden_state
        v = self.head(hidden).squeeze(-1)
        return torch.nn.functional.pad(v[:, :-1], (1, 0))


class Critic:
    def __init__(self, model_dir: str, cfg: CriticConfig, device: torch.device, dp_group=None, dp: int = 1,
                 policy_vocab_size: int | None = None):
        self.cfg, self.device, self.dp_group, self.dp = cfg, device, dp_group, dp
        self.model = ValueModel(model_dir).to(device)
        vocab = self.model.trunk.config.vocab_size
        if policy_vocab_size is not None and vocab < policy_vocab_size:
            # (the critic reads the policy's token ids: a smaller embedding would index out of range mid-run)
            raise ValueError(f"algo.critic.model {model_dir}: vocab_size {vocab} < the policy's {policy_vocab_size}; "
                             f"the critic must share the policy's tokenizer")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.steps = 0  # optimizer steps taken (the warm-up counts these)

    @property
    def warming_up(self) -> bool:
        """True while the policy must not be updated: the first `warmup_steps` steps train only the critic."""
        return self.steps < self.cfg.warmup_steps

    @property
    def needs_policy_logprobs(self) -> bool:
        """V-trace weighs each token by pi/mu: the learner's log-probs at step start (`proximal_logprobs`)."""
        return self.cfg.target == "vtrace"

    @torch.no_grad()
    def prepare(self, micro: list[dict[str, torch.Tensor]]) -> None:
        """Per micro-batch (whole rows each): `old_values`, `value_targets`, and `advantages` replaced by GAE's."""
        self.model.eval()
        cfg = self.cfg
        for mb in micro:
            mask = mb["mask"]
            old = self.model(mb["input_ids"].to(self.device)).float().cpu()
            adv, returns = values.gae(mb["rewards"], old, mask, cfg.gamma, cfg.lam)
            if cfg.target == "vtrace":
                log_ratio = torch.where(mask > 0, mb["proximal_logprobs"] - mb["behaviour_logprobs"], 0.0)
                returns = values.vtrace_targets(mb["rewards"], old, mask, log_ratio, cfg.gamma, cfg.lam,
                                                cfg.c_bar, cfg.rho_bar)
            mb["old_values"], mb["value_targets"], mb["advantages"] = old, returns, adv
        if cfg.whiten:
            self._whiten(micro)

    def _whiten(self, micro: list[dict[str, torch.Tensor]]) -> None:
        """Advantages to mean 0, std 1 over the model tokens of the whole batch (every DP rank's rows)."""
        sums = torch.zeros(3, dtype=torch.float64)
        for mb in micro:
            a = mb["advantages"].double()[mb["mask"] > 0]
            sums += torch.stack([torch.tensor(float(a.numel()), dtype=torch.float64), a.sum(), a.square().sum()])
        if self.dp > 1:
            dist.all_reduce(sums, group=self.dp_group)
        n, total, total_sq = sums.tolist()
        if n <= 0:
            return
        mean = total / n
        std = math.sqrt(max(total_sq / n - mean * mean, 0.0))
        for mb in micro:
            mb["advantages"] = torch.where(mb["mask"] > 0, (mb["advantages"] - mean) / (std + 1e-8), 0.0)

    def train(self, micro: list[dict[str, torch.Tensor]], total_tokens: float, learner_version: int,
              max_lag_bucket: int) -> dict[str, float]:
        """One optimizer step of the critic on the batch's value loss; the step's critic metrics."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        partials, loss_sum = [], 0.0
        for mb in micro:
            mask = mb["mask"].to(self.device)
            v = self.model(mb["input_ids"].to(self.device))
            targets = mb["value_targets"].to(self.device)
            loss = values.value_loss(v, mb["old_values"].to(self.device), targets, mask, self.cfg.value_clip,
                                     total_tokens)
            loss.backward()
            loss_sum += float(loss.detach())
            lag = algo_metrics.token_lag(mb["versions"], learner_version, mb["mask"])
            partials.append(values.value_partials(v.detach().cpu(), mb["value_targets"], mb["mask"], lag,
                                                  max_lag_bucket))
        merged = algo_metrics.merge_partials(partials)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        stats = torch.tensor([loss_sum] + [float(x) for x in merged.values()], dtype=torch.float64)
        if self.dp > 1:  # each rank's loss is its share of the batch mean: sum the grads and the statistics
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
            dist.all_reduce(stats, group=self.dp_group)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        skipped = not (math.isfinite(grad_norm) and math.isfinite(float(stats[0])))
        if not skipped:
            self.optimizer.step()
            self.steps += 1
        out = values.value_metrics(dict(zip(merged.keys(), stats[1:].tolist())))
        out.update({"critic/value_loss": float(stats[0]), "critic/grad_norm": grad_norm, "critic/lr": self.cfg.lr,
                    "critic/skipped_nonfinite": float(skipped)})
        return out

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Weights, Adam moments and step count from a checkpoint; lr and weight decay stay this run's config."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:
            group.update(lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.steps = int(state["steps"])
