"""§7 of lab3.ipynb (§2–§4 on the real model): LoRA adapters of SmolLM2-135M-Instruct, made here from a seed by
`peft` and saved as PEFT folders, served by the learner's LoRAEngine beside the base model. Reference:
`peft`'s PeftModel over Hugging Face's model, reading the same folders."""

import copy

import pytest
import torch

from labkit.checkpoint import load_tokenizer, require_real_model
from labkit.testing import assert_greedy_within, hf_greedy, real_hf, real_labkit, relative_error

pytestmark = [pytest.mark.real, pytest.mark.slow]  # loading SmolLM2 alone takes seconds

NEW_TOKENS = 8
# Rank 8 on two modules each, as small real adapters are; std 0.08 moves the greedy answer, keeps it English.
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "od": dict(r=8, lora_alpha=8, target_modules=["o_proj", "down_proj"]),
}
STD = 0.08


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """{name: folder} of two seeded random adapters (peft starts B at zero; here B is random too)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("smollm2-lora")
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        peft_model = get_peft_model(copy.deepcopy(real_hf()), LoraConfig(lora_dropout=0.0, **kw))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for key, p in peft_model.named_parameters():
                if "lora_" in key:
                    p.copy_(torch.randn(p.shape, generator=g) * STD)
        peft_model.save_pretrained(root / name)
        del peft_model
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def peft_reference(adapters):
    """One PeftModel holding both adapters (set_adapter picks one), on its own copy of the HF model."""
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(copy.deepcopy(real_hf()), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.no_grad()
def reference(peft_model, name: str | None, prompt: list[int], tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """peft's greedy tokens for `prompt` with adapter `name` (None: the base model), and its logits at the
    positions that predicted `tokens`, (len(tokens), vocab)."""
    if name is None:
        model = real_hf()
    else:
        peft_model.set_adapter(name)
        model = peft_model
    ids = torch.tensor([prompt + tokens[:-1]])
    return hf_greedy(model, prompt, NEW_TOKENS), model(ids).logits[0, len(prompt) - 1 :]


def serve(impl, adapters, monkeypatch, prompts: list[list[int]], loras: list[str | None]):
    """The learner's LoRAEngine on a copy of SmolLM2 (it wraps the model's layers in place), greedy:
    the outputs, and the logits each request sampled from."""
    engine_mod, sequence = impl("stage04_batching.engine"), impl("stage04_batching.sequence")
    rows: dict[int, list[torch.Tensor]] = {}

    def greedy(logits, params, generator=None):
        rows.setdefault(id(params), []).append(logits.detach().clone())
        return int(logits.argmax())

    monkeypatch.setattr(engine_mod, "sample", greedy)
    model = copy.deepcopy(real_labkit())
    registry = impl("stage04_batching.lora").AdapterRegistry(model.config, adapters, max_loras=len(adapters))
    engine = impl("stage04_batching.lora_engine").LoRAEngine(model, load_tokenizer(require_real_model()), registry,
                                                             num_blocks=32, max_num_seqs=4)  # fmt: skip
    params = [sequence.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, lora=name) for name in loras]
    outs = engine.generate(prompts, params)
    return outs, [torch.stack(rows[id(p)]) for p in params]


def chat(question: str) -> list[int]:
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return load_tokenizer(require_real_model()).encode(text).ids


def check(name, prompt, out, logits, peft_reference, what: str) -> list[int]:
    want_tokens, want_logits = reference(peft_reference, name, prompt, out.token_ids)
    err = relative_error(logits, want_logits)
    assert err < 1e-4, f"seed=0: {what}, adapter {name}: logits differ from peft's (relative error {err:.2e})"
    # logits within 1e-4 of peft's largest part from peft's greedy tokens only at a near-tie of peft's logits
    margin = 2e-4 * want_logits.abs().max().item()
    assert_greedy_within(out.token_ids, want_tokens, want_logits, margin, f"seed=0: {what}, adapter {name}: peft")
    return want_tokens


def test_a_random_lora_on_smollm2_gives_peft_logits_and_tokens(impl, adapters, peft_reference, monkeypatch):
    prompt = chat("Write a haiku about the sea.")
    (out,), (logits,) = serve(impl, {"qv": adapters["qv"]}, monkeypatch, [prompt], ["qv"])
    check("qv", prompt, out, logits, peft_reference, "alone")
    base = hf_greedy(real_hf(), prompt, NEW_TOKENS)
    assert out.token_ids != base, f"seed=0: the adapter should change SmolLM2's greedy answer; both gave {base}"


def test_two_adapters_and_the_base_in_one_batch_each_equal_their_own_peft_model(
    impl, adapters, peft_reference, monkeypatch
):
    prompts = [chat("Write a haiku about the sea."), chat("Name three primary colors."), chat("What is 12 times 7?")]
    loras = ["qv", "od", None]
    outs, logits = serve(impl, adapters, monkeypatch, prompts, loras)
    for name, prompt, out, rows in zip(loras, prompts, outs, logits, strict=True):
        check(name, prompt, out, rows, peft_reference, "mixed batch of qv, od and the base model")
