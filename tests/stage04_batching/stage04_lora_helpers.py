"""Helpers for the multi-LoRA tests: random LoRA adapters written by `peft` itself, and the references,
Hugging Face models with the adapter merged by `peft` (never the stage's solution)."""

import copy

import torch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Ranks, alphas, target modules and rsLoRA scaling vary as real adapters do.
ADAPTER_KINDS = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r4-rslora": dict(r=4, lora_alpha=6, target_modules=ALL_LINEAR, use_rslora=True),
    "kod-r2": dict(r=2, lora_alpha=5, target_modules=["k_proj", "o_proj", "down_proj"]),
    "mlp-r3": dict(r=3, lora_alpha=3, target_modules=["gate_proj", "up_proj"]),
}


def save_random_adapter(hf, folder, seed: int, std: float = 0.08, **lora_kw) -> None:
    """A LoRA adapter of `hf` with random A and B (peft starts B at zero), saved by peft's save_pretrained."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(lora_dropout=0.0, **lora_kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(folder)


def peft_merged(hf, folder):
    """The HF model with the adapter in `folder` loaded and merged into its weights by peft (float32, eval)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf), folder).merge_and_unload().float().eval()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """Logits (len(ids), vocab) float32 of one sequence."""
    return hf(torch.tensor([ids])).logits[0].float()
