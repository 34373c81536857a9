"""Draw a run's rollouts coloured by policy version: the picture of Pipeline RL's in-flight updates.

    python benchmarks/plot_rollouts.py RUN_DIR [OUT.png] [--steps N] [--rows R] [--at STEP]

One row per trained rollout (from RUN_DIR/rollouts.jsonl), one cell per completion token, in the
colour of the policy version that generated it; a black tick marks where a publish landed while the
rollout was being generated (its next token came from the new weights). The rows are every rollout
trained in N consecutive learner steps from STEP (default: the middle of the run), evenly thinned to at
most R rows and sorted by the version of their first token, then by length, so each band of colour is
the rollouts one version started. The title gives the run's shares over every trained rollout.
A multi-turn episode's environment tokens (tool results, user turns: version -1, not trained) are grey.
With a lag bound (loss.max_token_lag in RUN_DIR/config.yaml; algo.stale=mask_tokens sets it to algo.max_lag) the
tokens older than it when trained, which got no policy gradient, are drawn pale.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import LineCollection  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

PALETTE = plt.get_cmap("tab10").colors  # version v is drawn in PALETTE[v % 10]: neighbours always differ
ENV_COLOUR = "#d0d0d0"  # environment tokens (version -1)


def version_changes(versions) -> list[int]:
    """Token positions whose version differs from the previous model token's (environment tokens skipped)."""
    changes, last = [], None
    for j, v in enumerate(versions):
        if v < 0:
            continue
        if last is not None and v != last:
            changes.append(j)
        last = v
    return changes


def lag_bound(run_dir: str | Path) -> int | None:
    """The run's loss.max_token_lag (None: no bound, or no config.yaml): older tokens got no policy gradient."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    return ((yaml.safe_load(path.read_text()).get("algo") or {}).get("loss") or {}).get("max_token_lag")


def no_gradient(rollout: dict, bound: int) -> list[bool]:
    """Per completion token: a model token more than `bound` versions older than the step that trained it."""
    return [v >= 0 and rollout["trained_at_step"] - v > bound for v in rollout["versions"]]


def load_rollouts(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "rollouts.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} not found: plot_rollouts needs a run with run.log_rollouts=true")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def select_rows(rollouts: list[dict], at: int | None, steps: int, rows: int) -> tuple[list[dict], int]:
    """The rollouts trained at steps [at, at + steps), thinned evenly to at most `rows`, sorted by
    (first token's version, length); and the first step."""
    trained = sorted({r["trained_at_step"] for r in rollouts})
    start = trained[len(trained) // 2] if at is None else at
    window = [r for r in rollouts if start <= r["trained_at_step"] < start + steps and r["versions"]]
    if not window:
        raise SystemExit(f"no rollouts trained at steps {start}..{start + steps - 1} (the run trained steps "
                         f"{trained[0]}..{trained[-1]})")
    stride = max(1, -(-len(window) // rows))  # ceil: at most `rows` rows, spread over the whole window
    return sorted(window[::stride], key=lambda r: (max(r["versions"][0], 0), len(r["versions"]))), start


def version_shares(rollouts: list[dict]) -> tuple[float, float]:
    counts = [len({v for v in r["versions"] if v >= 0}) for r in rollouts]
    return sum(c >= 2 for c in counts) / len(counts), sum(c >= 3 for c in counts) / len(counts)


def render(run_dir: str | Path, out_png: str | Path, at: int | None = None, steps: int = 4, rows: int = 120) -> Path:
    rollouts = load_rollouts(run_dir)
    picked, start = select_rows(rollouts, at, steps, rows)
    width = max(len(r["versions"]) for r in picked)
    grid = np.full((len(picked), width), np.nan)
    ticks = []  # one short black segment at every in-flight version change
    for i, r in enumerate(picked):
        v = np.asarray(r["versions"])
        grid[i, :len(v)] = np.where(v >= 0, v % len(PALETTE), len(PALETTE))
        for j in version_changes(r["versions"]):
            ticks.append([(j, i - 0.5), (j, i + 0.5)])
    two, three = version_shares(rollouts)
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.045 * len(picked) + 1.6)))
    extent = (0, width, len(picked) - 0.5, -0.5)
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(list(PALETTE) + [ENV_COLOUR]),
              vmin=-0.5, vmax=len(PALETTE) + 0.5, extent=extent)
    bound, masked_note = lag_bound(run_dir), ""
    if bound is not None:  # a white veil over the tokens the lag bound kept from the gradient
        veil = np.zeros((len(picked), width, 4))
        for i, r in enumerate(picked):
            veil[i, :len(r["versions"]), 3] = np.where(no_gradient(r, bound), 0.7, 0.0)
        veil[..., :3] = 1.0
        ax.imshow(veil, aspect="auto", interpolation="nearest", extent=extent)
        masked = sum(sum(no_gradient(r, bound)) for r in rollouts)
        total = sum(sum(v >= 0 for v in r["versions"]) for r in rollouts)
        masked_note = (f"\npale: more than loss.max_token_lag = {bound} versions old when trained, no policy gradient "
                       f"({masked / total:.0%} of the run's tokens)")
    ax.add_collection(LineCollection(ticks, colors="black", linewidths=1.6))
    versions = sorted({v for r in picked for v in r["versions"] if v >= 0})
    handles = [Patch(color=PALETTE[v % len(PALETTE)], label=f"π{v}") for v in versions[:20]]
    if any(v < 0 for r in picked for v in r["versions"]):
        handles.append(Patch(color=ENV_COLOUR, label="environment\n(not trained)"))
    if bound is not None:
        handles.append(Patch(facecolor="white", edgecolor="grey", label=f"pale: lag > {bound},\nno gradient"))
    ax.legend(handles=handles,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="generated by", title_fontsize=8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("completion token")
    ax.set_ylabel(f"rollout ({len(picked)} rows)")
    ax.set_title(f"{Path(run_dir).name}: rollouts trained at steps {start}-{start + steps - 1}, coloured by the "
                 f"policy version of each token; black tick = a publish landed mid-rollout\n"
                 f"whole run: {len(rollouts)} rollouts, {two:.0%} hold >= 2 versions, {three:.0%} hold >= 3{masked_note}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("out", nargs="?", help="default: RUN_DIR/rollouts.png")
    parser.add_argument("--at", type=int, help="first learner step drawn (default: the middle of the run)")
    parser.add_argument("--steps", type=int, default=4, help="consecutive learner steps drawn")
    parser.add_argument("--rows", type=int, default=120, help="at most this many rollouts")
    args = parser.parse_args()
    out = render(args.run_dir, args.out or Path(args.run_dir) / "rollouts.png", args.at, args.steps, args.rows)
    print(out)


if __name__ == "__main__":
    main()
