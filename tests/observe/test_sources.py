"""Data sources in the metrics (megarl.observe.sources): per-source rewards under tag-safe names, bounded in number."""
from megarl.observe.sources import SourceNames, source_rewards
from megarl.protocols import Sample


def test_each_data_source_s_mean_reward_is_reported_under_a_tag_safe_name_and_late_ones_fold_into_other():
    def scored(source, reward):
        return Sample(group_id="g", prompt="p", completion="c", prompt_ids=[1], token_ids=[2], logprobs=[-0.1],
                      versions=[0], reward=reward, finish_reason="stop", source=source)

    names = SourceNames()
    batch = [scored("gsm8k", 1.0), scored("gsm8k", 0.0), scored("math/level 5", 1.0), scored("", 0.5)]
    assert source_rewards(batch, names) == {"reward/source/gsm8k": 0.5, "reward/source/math_level_5": 1.0}
    assert source_rewards([scored("", 1.0)], names) == {}  # no sources: no metrics
    for i in range(SourceNames.MAX_SOURCES - 2):
        names(f"s{i}")
    assert names("one too many") == names("and another") == "other" and names("gsm8k") == "gsm8k"
