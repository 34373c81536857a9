"""The learned critic of `algo.advantage.estimator=gae`: a separate value model on the learner ranks, its own
optimizer, the step's per-token GAE advantages and value targets (the math: megarl.algo.values), its checkpoint
files and its check before launch. Backend-independent: the megatron and the DeepSpeed learner use it alike.

Why a separate model, not a value head on the policy trunk: the critic keeps its own optimizer, lr and
warm-up without touching the policy's (a shared trunk would move the policy during critic warm-up and mix two
losses' gradients in one optimizer), and it is independent of the policy's megatron layout or ZeRO partitions.
The value model is transformers' `AutoModelForTokenClassification` with `num_labels=1` (the policy's trunk, by
default the policy's own model directory, i.e. the standard PPO setup of initialising the critic from the
policy, plus a zero-initialised linear `score` head), in plain torch with a plain torch AdamW:

* **Replicated** on every learner rank (no TP/PP sharding, no ZeRO): fine for the small critics megarl runs on
  CPU; a critic too large for one rank is not supported yet (docs/algorithms.md#ppo-with-a-critic).
* Every DP rank trains it on its own rows; its gradients are summed over the DP group (each rank's loss is its
  share of the batch's token mean), so the replicas stay identical. The TP/PP ranks of one DP coordinate
  compute the same values and updates on the same rows. The CP ranks of one (megatron learner, `learner.cp`)
  split each micro-batch's rows instead (`row_group`): each values and trains its share of whole rows, the values
  are gathered back per token into every rank's micro-batch, and gradients and statistics are summed over the
  CP group as over the DP group (the critic's activations are whole rows: they are not split by position).
* Why transformers' token-classification class: it is what the checkpoint and the export hold (`critic/`:
  config.json + model.safetensors), so `AutoModelForTokenClassification.from_pretrained` loads a trained critic
  with no megarl code (`logits[:, t, 0]` = the value of the prefix ending at token t), and `algo.critic.model`
  may name such a directory to start from a trained critic, head included.

One step (both learners' `train_step`): `prepare` computes V(s_t) with the critic as it is (no grad), the GAE
advantages (whitened over the batch's model tokens when `whiten`) that replace the micro-batches' `advantages`,
and the value targets (`gae` returns, or `vtrace` targets from the learner's log-probs at step start against
each token's behaviour log-prob); `train` takes one optimizer step of the critic on the clipped value loss and
returns its metrics (critic/*, by lag). While `warming_up` the learner applies no policy update.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.algo import metrics as algo_metrics
from megarl.algo import values
from megarl.algo.config import CriticConfig
from megarl.learner.context_parallel import row_share, rows_in_shares
from megarl.models import convert

KEY = "algo.critic.model"
CHECKPOINT_DIR = "critic"  # in a checkpoint step dir and in an export: the value model as an HF directory
OPTIMIZER_FILE = "optimizer.pt"  # in the checkpoint's critic/: Adam state and step count (not exported)


def value_config(model_dir: str | Path):
    """The value model's transformers config: the trunk's, with one label and no dropout before the head
    (transformers' token-classification default is 0.1; the critic is trained without, like the policy)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    config.classifier_dropout = 0.0  # (not a from_pretrained kwarg of every config class: set, so it is saved)
    return config


def check_critic(critic_dir: str | Path, policy_dir: str | Path) -> None:
    """ValueError naming algo.critic.model (and both directories) if the critic cannot value the policy's tokens:
    no config or weights, a model type transformers has no token-classification class for, or a vocabulary
    smaller than the policy's (the critic reads the policy's token ids)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    critic_dir, policy_dir = Path(critic_dir), Path(policy_dir)
    where = f"{KEY} ({critic_dir})"
    critic_cfg = convert.read_config(critic_dir, where)
    model_type = critic_cfg.get("model_type")
    if model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        raise ValueError(f"{where}: model_type {model_type!r} has no token-classification class in transformers "
                         f"(AutoModelForTokenClassification), which the value model is; set {KEY} to a model "
                         f"directory of a type that has one (e.g. qwen2, llama, mixtral)")
    if not convert.has_weights(critic_dir):
        raise ValueError(f"{where}: no weights (model.safetensors or model.safetensors.index.json)")
    vocab = critic_cfg.get("vocab_size")
    policy_vocab = json.loads((policy_dir / "config.json").read_text()).get("vocab_size")
    if not isinstance(vocab, int) or vocab < policy_vocab:
        raise ValueError(f"{where}: vocab_size {vocab!r} < the policy's ({policy_dir}: {policy_vocab}); the critic "
                         f"reads the policy's token ids, so it must share the policy's tokenizer")


class ValueModel(torch.nn.Module):
    """transformers' token-classification model with one label: V(s_t) for every token t of input_ids."""

    def __init__(self, model_dir: str | Path):
        super().__init__()
        from transformers import AutoModelForTokenClassification

        # Built from its config and loaded here (not from_pretrained): the same safetensors reader as the learner's,
        # and no progress bar on the run's console.
        self.net = AutoModelForTokenClassification.from_config(value_config(model_dir)).float()
        self.net.config.architectures = [type(self.net).__name__]
        prefix = self.net.base_model_prefix + "."
        own = self.net.state_dict()
        # A policy directory gives the trunk (its LM head is not the critic's); a critic directory (an export,
        # a checkpoint's critic/) gives the value head too.
        weights = {k: v for k, v in convert.load_pretrained(str(model_dir))[1].items()
                   if k.startswith(prefix) or (k in own and k.startswith("score.") and v.shape == own[k].shape)}
        missing, _ = self.net.load_state_dict(weights, strict=False)
        if [k for k in missing if not k.startswith("score.")]:
            raise RuntimeError(f"{KEY} {model_dir}: weights missing for the value model's trunk: {missing}")
        if missing:  # Zero head: V = 0 everywhere at the start, so the first advantages are the plain returns.
            torch.nn.init.zeros_(self.net.score.weight)
            torch.nn.init.zeros_(self.net.score.bias)

    @property
    def config(self):
        return self.net.config

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] values aligned like the per-token log-probs: column t is V(s_t), the token-classification output
        at t-1 (column 0 is 0). Right padding needs no attention mask: a causal model's earlier positions never
        see it."""
        v = self.net(input_ids=input_ids, use_cache=False).logits.squeeze(-1)
        return torch.nn.functional.pad(v[:, :-1], (1, 0))


class Critic:
    def __init__(self, cfg: CriticConfig, policy_dir: str, device: torch.device, dp_group=None, dp: int = 1,
                 row_group=None):
        """The value model of `cfg.model` (default: the policy's `policy_dir`), checked against the policy (again:
        a raw torchrun launch skipped `megarl train`'s check), replicated on this rank; `dp_group` (None = the
        default group) and `dp`: the learner's data-parallel group and size, over which gradients and whitening
        are summed; `row_group` (None: none): the ranks that hold the same rows and split them (module docstring)."""
        model_dir = cfg.model or policy_dir
        check_critic(model_dir, policy_dir)
        self.cfg, self.device, self.dp_group, self.dp = cfg, device, dp_group, dp
        self.row_group = row_group
        self.row_split = (1, 0) if row_group is None else (dist.get_world_size(row_group), dist.get_rank(row_group))
        self.model = ValueModel(model_dir).to(device)
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
            old = self._values(mb["input_ids"])
            adv, returns = values.gae(mb["rewards"], old, mask, cfg.gamma, cfg.lam)
            if cfg.target == "vtrace":
                log_ratio = torch.where(mask > 0, mb["proximal_logprobs"] - mb["behaviour_logprobs"], 0.0)
                returns = values.vtrace_targets(mb["rewards"], old, mask, log_ratio, cfg.gamma, cfg.lam,
                                                cfg.c_bar, cfg.rho_bar)
            mb["old_values"], mb["value_targets"], mb["advantages"] = old, returns, adv
        if cfg.whiten:
            self._whiten(micro)

    def _share(self, rows: int) -> slice:
        """This rank's rows of a micro-batch of `rows` (all of them without a row group)."""
        return row_share(rows, *self.row_split)

    def _values(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] fp32 CPU values of every row (no grad): this rank's share computed here, the others' gathered from
        the row group."""
        return rows_in_shares(lambda ids: self.model(ids).float(), input_ids, self.row_split, self.row_group,
                              self.device).cpu()

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
        """One optimizer step of the critic on the batch's value loss; the step's critic metrics (critic/warmup: 1
        when this was a warm-up step, i.e. the learner applied no policy update)."""
        warmup = self.warming_up
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        partials, loss_sum = [], 0.0
        for mb in micro:
            rows = {k: mb[k][self._share(mb["input_ids"].shape[0])]
                    for k in ("input_ids", "mask", "old_values", "value_targets", "versions")}
            v = rows["old_values"].new_zeros(rows["old_values"].shape)  # (a row group's rank with no row of it)
            if len(v):
                mask = rows["mask"].to(self.device)
                v = self.model(rows["input_ids"].to(self.device))
                targets = rows["value_targets"].to(self.device)
                loss = values.value_loss(v, rows["old_values"].to(self.device), targets, mask, self.cfg.value_clip,
                                         total_tokens)
                loss.backward()
                loss_sum += float(loss.detach())
            lag = algo_metrics.token_lag(rows["versions"], learner_version, rows["mask"])
            partials.append(values.value_partials(v.detach().cpu(), rows["value_targets"], rows["mask"], lag,
                                                  max_lag_bucket))
        merged = algo_metrics.merge_partials(partials)
        stats = torch.tensor([loss_sum] + [float(x) for x in merged.values()], dtype=torch.float64)
        groups = ([self.dp_group] if self.dp > 1 else []) + ([self.row_group] if self.row_group is not None else [])
        if groups:  # each rank's loss is its share of the batch mean: sum the grads and the statistics
            for param in self.model.parameters():  # (a row group's rank that ran no row has no gradient yet)
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            grads = [param.grad for param in self.model.parameters()]
            for group in groups:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=group)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
                dist.all_reduce(stats, group=group)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        skipped = not (math.isfinite(grad_norm) and math.isfinite(float(stats[0])))
        if not skipped:
            self.optimizer.step()
            self.steps += 1
        out = values.value_metrics(dict(zip(merged.keys(), stats[1:].tolist())))
        out.update({"critic/value_loss": float(stats[0]), "critic/grad_norm": grad_norm, "critic/lr": self.cfg.lr,
                    "critic/skipped_nonfinite": float(skipped), "critic/warmup": float(warmup)})
        return out

    # ------------------------------------------------------------------ checkpoint state

    def save(self, directory: Path, fsynced_write) -> None:
        """The critic under `directory`/critic/ (one rank writes it: every replica is the same): the value model as
        an HF directory (config.json, model.safetensors; what export copies) and its Adam state and step count
        (optimizer.pt). `fsynced_write(path, write)` is the checkpoint's durable file writer."""
        from safetensors.torch import save

        out = Path(directory) / CHECKPOINT_DIR
        out.mkdir()
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.model.net.state_dict().items()}
        fsynced_write(out / "model.safetensors", lambda f: f.write(save(tensors, metadata={"format": "pt"})))
        fsynced_write(out / "config.json", lambda f: f.write(self.model.config.to_json_string().encode()))
        fsynced_write(out / OPTIMIZER_FILE, lambda f: torch.save(
            {"optimizer": self.optimizer.state_dict(), "steps": self.steps}, f))

    def load(self, directory: Path) -> None:
        """Weights, Adam moments and step count from `save`; lr and weight decay stay this run's config."""
        from safetensors.torch import load_file

        source = Path(directory) / CHECKPOINT_DIR
        if not (source / OPTIMIZER_FILE).is_file():
            raise FileNotFoundError(f"{source}: no critic in this checkpoint (it was saved without "
                                    f"algo.advantage.estimator=gae)")
        self.model.net.load_state_dict(load_file(source / "model.safetensors"))
        state = torch.load(source / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:
            group.update(lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.steps = int(state["steps"])
