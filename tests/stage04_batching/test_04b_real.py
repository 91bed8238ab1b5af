"""§6 of lab2.ipynb (§1–§5 on the real model): constrained decoding on SmolLM2-135M-Instruct's 49,152-token
vocabulary. References: the checkpoint's own tokenizer decodes every candidate token (its Rust byte-level
decoder, not the learner's token_bytes), a matcher written here says which texts can still become a
match, and `json` with a hand check of the schema reads the JSON answer."""

import json
import string

import pytest
import torch

from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.testing import real_labkit

pytestmark = [pytest.mark.real, pytest.mark.slow]  # loading SmolLM2 alone takes seconds

HEADS = ("yes, because ", "no, because ")
LETTERS = set(string.ascii_lowercase + " ")
REASON = r"(yes|no), because [a-z ]{1,40}\."  # what the matcher below accepts, as the regex the engine gets


def reason_state(text: str) -> str:
    """'dead', 'live' (a prefix of some match of REASON) or 'done' (a full match), by hand."""
    for head in HEADS:
        if head.startswith(text):
            return "live"
        if text.startswith(head):
            rest = text[len(head) :]
            body = rest[:-1] if rest.endswith(".") else rest
            if len(body) > 40 or not set(body) <= LETTERS:
                return "dead"
            if rest.endswith("."):
                return "done" if body else "dead"
            return "live"
    return "dead"


def ask(question: str) -> str:
    """A one-turn chat in SmolLM2's template, as the server renders it."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


def record_masks(impl, monkeypatch) -> list[torch.Tensor]:
    """Patch the engine's mask_logits (the learner's) to keep each call's allowed tokens, (B, V) bool."""
    engine_mod = impl("stage04_batching.engine")
    masks, mask_logits = [], engine_mod.mask_logits

    def recorded(logits, guides):
        out = mask_logits(logits, guides)
        masks.append(torch.isfinite(out))
        return out

    monkeypatch.setattr(engine_mod, "mask_logits", recorded)
    return masks


@pytest.fixture(scope="module")
def engine(impl):
    folder = require_real_model()
    return impl("stage04_batching.engine").LLMEngine(real_labkit(), load_tokenizer(folder), num_blocks=32)


def test_regex_mask_on_the_real_vocabulary_allows_exactly_the_tokens_that_keep_a_match_possible(
    impl, engine, monkeypatch
):
    sequence = impl("stage04_batching.sequence")
    masks = record_masks(impl, monkeypatch)
    prompt = ask("Is Paris the capital of France? Answer yes or no, then say why.")
    params = sequence.SamplingParams(max_tokens=40, temperature=0, guided_regex=REASON)
    out = engine.generate([prompt], [params])[0]
    assert reason_state(out.text) == "done", f"seed=0: SmolLM2 under {REASON!r} wrote {out.text!r}, not a match"
    assert out.finish_reason == "stop", f"seed=0: a complete match ends the request, got {out.finish_reason!r}"
    tok, vocab = engine.tokenizer, engine.model.config.vocab_size
    eos = engine.model.config.eos_token_id
    assert len(masks) == len(out.token_ids), f"seed=0: {len(masks)} mask_logits calls for {len(out.token_ids)} tokens"
    for step, (mask, token) in enumerate(zip(masks, out.token_ids, strict=True)):
        done = out.token_ids[:step]
        texts = tok.decode_batch([[*done, t] for t in range(vocab)], skip_special_tokens=False)
        want = torch.tensor([reason_state(t) != "dead" for t in texts])
        want[eos] = reason_state(tok.decode(done)) == "done"  # EOS: allowed exactly when the text is a match
        got = mask[0]
        wrong = (got != want).nonzero().flatten().tolist()
        assert not wrong, (
            f"seed=0: step {step} after {tok.decode(done)!r}: the mask is wrong for {len(wrong)} of {vocab} tokens, "
            f"e.g. {[(t, tok.id_to_token(t), 'allowed' if got[t] else 'masked') for t in wrong[:5]]}"
        )
        assert got[token], f"seed=0: step {step}: token {token} was sampled but the mask forbids it"


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
}


def test_json_schema_answer_from_smollm2_parses_and_matches(impl, engine, monkeypatch):
    sequence, structured = impl("stage04_batching.sequence"), impl("stage04_batching.structured")
    masks = record_masks(impl, monkeypatch)
    prompt = ask("What is the capital of France? Answer in JSON with the keys city, country and is_capital.")
    params = sequence.SamplingParams(max_tokens=60, temperature=0, guided_regex=structured.schema_to_regex(SCHEMA))
    out = engine.generate([prompt], [params])[0]
    assert out.finish_reason == "stop", f"seed=0: the JSON should be complete within 60 tokens: {out.text!r}"
    try:
        answer = json.loads(out.text)
    except ValueError as e:
        raise AssertionError(f"seed=0: SmolLM2's constrained answer {out.text!r} is not JSON: {e}") from None
    assert isinstance(answer, dict) and list(answer) == list(SCHEMA["properties"]), f"seed=0: keys of {answer}"
    assert all(isinstance(answer[k], str) and len(answer[k]) <= 24 for k in ("city", "country")), f"seed=0: {answer}"
    assert isinstance(answer["is_capital"], bool), f"seed=0: is_capital must be a boolean: {answer}"
    assert len(masks) == len(out.token_ids), f"seed=0: {len(masks)} mask_logits calls for {len(out.token_ids)} tokens"
    for step, (mask, token) in enumerate(zip(masks, out.token_ids, strict=True)):
        assert mask[0, token], f"seed=0: step {step}: token {token} was sampled but the mask forbids it"
