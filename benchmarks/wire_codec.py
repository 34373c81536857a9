"""Cost of the sample queue's wire format (megarl.distributed.wire) against the pickle it replaced: encode +
decode of one group, best of 5 repeats.

    python benchmarks/wire_codec.py

Groups: a demo-sized one (configs/demo.yaml: 8 samples, the count task's ~6-token prompts and ~12-token
completions) and a long one (8 samples of 64 + 1984 tokens). Numbers in docs/security.md.
"""
import pickle
import random
import timeit

from megarl.distributed.wire import decode_group, encode_group
from megarl.protocols import Sample

KEY, SESSION = b"k" * 64, b"s" * 8
STATS = {f"stat{i}": float(i) for i in range(11)}  # as many counters as a sampler sends


def group(prompt_len: int, completion_len: int) -> list[Sample]:
    r = random.Random(0)
    return [Sample(group_id="s0-g17", prompt="d-k=", completion="defghijk",
                   prompt_ids=[r.randrange(64) for _ in range(prompt_len)],
                   token_ids=[r.randrange(64) for _ in range(completion_len)],
                   logprobs=[-r.random() for _ in range(completion_len)],
                   versions=[r.randrange(5) for _ in range(completion_len)], reward=float(i % 2),
                   finish_reason="stop", sampler_rank=1) for i in range(8)]


def main() -> None:
    for name, g, n in (("demo group (8 x 6+12 tokens)", group(6, 12), 2000),
                       ("long group (8 x 64+1984 tokens)", group(64, 1984), 50)):
        message = encode_group(g, STATS, SESSION, 1, 0, KEY)
        pickled = pickle.dumps((g, STATS), protocol=pickle.HIGHEST_PROTOCOL)
        wire = min(timeit.repeat(lambda: decode_group(encode_group(g, STATS, SESSION, 1, 0, KEY), KEY),
                                 number=n, repeat=5)) / n * 1e6
        pick = min(timeit.repeat(lambda: pickle.loads(pickle.dumps((g, STATS), protocol=pickle.HIGHEST_PROTOCOL)),
                                 number=n, repeat=5)) / n * 1e6
        print(f"{name}: wire {wire:.0f} us/group ({len(message)} bytes), pickle {pick:.0f} us/group "
              f"({len(pickled)} bytes)")


if __name__ == "__main__":
    main()
