"""The speedup math of speculative decoding (Leviathan, Kalman, Matias 2023, §3).

alpha: the chance the target accepts one drafted token (assumed the same at every position).
k:     tokens the draft proposes per round (the paper's γ).
c:     time of one draft step / time of one target step.
"""


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected number of tokens one round emits per target forward (lab.ipynb §1 derives it).

    Counts the accepted drafts and the target's own token at the end of the round, so it lies in
    [1, k + 1]; exactly k + 1 when alpha == 1 (mind a closed form that divides by 1 - alpha).
    """
    raise NotImplementedError("stage06: expected_tokens_per_step — see lab.ipynb §1")


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Expected wall-clock speedup over plain target decoding, for rounds of k drafts.

    Time is measured in target steps: a round runs k draft steps and one target forward (which
    scores k + 1 positions as fast as one, the memory-bound assumption). k = 0 gives 1.0.
    """
    raise NotImplementedError("stage06: expected_speedup — see lab.ipynb §1")


def optimal_k(alpha: float, c: float, k_max: int = 16) -> int:
    """The k in 0..k_max with the largest expected_speedup (0 means: do not speculate)."""
    raise NotImplementedError("stage06: optimal_k — see lab.ipynb §1")
