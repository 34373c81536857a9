"""A user reward whose module takes a second to import (as one importing a large library does): referred to as
"tests.rollout.slow_import_reward:exact"."""
import time

time.sleep(1.0)


def exact(prompt, completion, answer, meta):
    return float(completion.strip() == answer)
