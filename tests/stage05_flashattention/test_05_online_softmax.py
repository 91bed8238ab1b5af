"""§1–§2: the streaming (max, sum) update, merging partial states, and softmax built on them."""

import math

import pytest
import torch

MODULE = "stage05_flashattention.online_softmax"


def exact_state(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, Σ exp(x − max)) of each row, straight from the definition."""
    m = x.amax(dim=-1)
    return m, torch.exp(x - m[..., None]).sum(dim=-1)


def scores(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, n, generator=g) * 4  # wide spread: the max moves several times along a row


@pytest.mark.parametrize("seed,block", [(0, 1), (1, 7), (2, 16)])
def test_online_update_streams_max_and_sum(impl, seed, block):
    mod = impl(MODULE)
    x = scores(seed, 50)
    m, l = torch.full((3,), float("-inf")), torch.zeros(3)
    for start in range(0, 50, block):
        m, l = mod.online_update(m, l, x[:, start : start + block])
    m_ref, l_ref = exact_state(x)
    torch.testing.assert_close(m, m_ref, msg=f"running max after the last block differs (seed={seed}, block={block})")
    torch.testing.assert_close(l, l_ref, msg=f"running sum of exp(x - max) differs (seed={seed}, block={block})")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merge_states_equals_state_of_concatenation(impl, seed):
    mod = impl(MODULE)
    x = scores(seed, 40)
    cut = int(torch.randint(1, 39, (1,), generator=torch.Generator().manual_seed(seed)))
    a, b = exact_state(x[:, :cut]), exact_state(x[:, cut:])
    expected = exact_state(x)
    for name, merged in (("A then B", mod.merge_states(*a, *b)), ("B then A", mod.merge_states(*b, *a))):
        torch.testing.assert_close(merged[0], expected[0], msg=f"merged max wrong ({name}, cut={cut}, seed={seed})")
        torch.testing.assert_close(merged[1], expected[1], msg=f"merged sum wrong ({name}, cut={cut}, seed={seed})")


@pytest.mark.parametrize("seed,n,block", [(0, 50, 8), (1, 33, 32), (2, 10, 64)])
def test_online_softmax_matches_torch_softmax(impl, seed, n, block):
    x = scores(seed, n)
    got = impl(MODULE).online_softmax(x, block)
    torch.testing.assert_close(got, torch.softmax(x, dim=-1), msg=f"seed={seed}, N={n}, block={block}")


def test_online_softmax_is_stable_on_huge_scores(impl):
    x = scores(3, 40) * 100  # exp of these overflows float32: normalise with exp(x - m)
    got = impl(MODULE).online_softmax(x, 16)
    torch.testing.assert_close(got, torch.softmax(x, dim=-1), msg="seed=3: scores of order 1e2-1e3")


def test_online_softmax_reads_the_row_block_by_block(impl, monkeypatch):
    mod = impl(MODULE)
    blocks = []
    real_update = mod.online_update

    def counting_update(m, l, s):
        blocks.append(s.shape[-1])
        return real_update(m, l, s)

    monkeypatch.setattr(mod, "online_update", counting_update)
    x = scores(0, 50)
    got = mod.online_softmax(x, 16)
    assert blocks == [16, 16, 16, 2], f"expected online_update on blocks of 16, 16, 16, 2 columns, saw {blocks}"
    assert math.isclose(float(got.sum()), 3.0, rel_tol=1e-5), "each of the 3 rows must sum to 1"
