"""§9 (§2–§3 on the real model): greedy speculative decoding of SmolLM2-135M-Instruct, drafted by its own
first layers (labkit.early_exit), gives Hugging Face's greedy tokens on real text
(up to a near-tie of HF's logits, labkit.testing.assert_greedy_within)."""

import pytest

from labkit.early_exit import early_exit
from labkit.testing import REAL_MARGIN, assert_hf_greedy, real_hf, real_ids, real_labkit

pytestmark = pytest.mark.real
NEW_TOKENS = 12


# Prompts cut from REAL_TEXT mid-prose and mid-code. The draft is the 24-layer exit (shallower exits of
# an untrained model agree with it on a few percent of tokens, too seldom to exercise acceptance); k=1
# and k=4 so that rounds end on full acceptance and on rejections alike.
@pytest.mark.parametrize(("layers", "k", "length"), [(24, 1, 41), (24, 4, 93)])
def test_greedy_speculative_with_early_exit_draft_gives_hf_greedy_on_real_text(impl, layers, k, length):
    m = impl("stage06_speculative.speculative")
    prompt = real_ids(length).tolist()
    got, stats = m.greedy_speculative(real_labkit(), early_exit(real_labkit(), layers), prompt, NEW_TOKENS, k=k)
    where = f"SmolLM2 on the first {length} tokens of REAL_TEXT, draft = first {layers} layers, k={k}"
    assert_hf_greedy(got, real_hf(), prompt, NEW_TOKENS, REAL_MARGIN, f"{where}: speculative tokens")
    assert stats.generated == NEW_TOKENS, f"{where}: stats.generated={stats.generated}, expected {NEW_TOKENS}"
    assert stats.target_forwards < NEW_TOKENS, (
        f"{where}: {stats.target_forwards} target forwards for {NEW_TOKENS} tokens; the drafts the target "
        "agrees with should save forwards"
    )
