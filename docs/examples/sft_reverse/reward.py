"""The user's reward function of the worked example (docs/sft.md): `task.reward_fn=docs.examples.sft_reverse.reward:score`.

1.0 for the exact reversal; otherwise half the share of positions that are right (over the longer of the
two strings), so a nearly right answer scores above a wrong one and RL has something to climb.
"""


def score(prompt: str, completion: str, answer: str, meta: dict) -> float:
    got = completion.strip()
    if got == answer:
        return 1.0
    right = sum(a == b for a, b in zip(got, answer))
    return 0.5 * right / max(len(got), len(answer), 1)
