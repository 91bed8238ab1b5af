"""Train the course's tiny models from scratch, deterministically, on the CPU.

    python -m labkit.train            # tokenizer, target, distilled draft, Medusa heads, LoRA adapters (~55 min, 2 cores)
    python -m labkit.train --only draft
    python -m labkit.train --only medusa  # Medusa heads on the shipped target (14 min on a busy 2-core VM)
    python -m labkit.train --only lora    # the three LoRA adapters of stage 04 part 2 (2–6 min each on a busy 2-core VM)
    python -m labkit.train --only eagle   # SmolLM2's EAGLE head and its study (needs make setup): 3,072 answers through
                                          # stage 04's engine (~20 min) and their features (~10 min), the head (~26 min),
                                          # the study's 7 more heads (~45 min); --keep-measured keeps points it holds
    python -m labkit.train --only smollm2-medusa   # SmolLM2's Medusa heads on the same answers (after --only eagle): ~10 min

Writes Hugging Face folders labkit/assets/tiny-target and labkit/assets/tiny-draft (bf16 weights,
one shared byte-level BPE tokenizer) and labkit/assets/training_report.json with the figures the
README quotes. The draft is distilled on the target's own next-token distributions (KL), which is
what makes it agree with the target often enough for speculative decoding to pay off.
The Medusa heads (labkit/medusa.py) learn the target's own greedy tokens 2..K+1 places ahead
from its frozen hidden states, and go to labkit/assets/tiny-target-medusa.

The LoRA adapters (labkit/assets/lora/NAME, PEFT folders: adapter_config.json and
adapter_model.safetensors) fine-tune the target through `peft` on stories rewritten one way each,
so a learner sees which adapter served a request: a character name, a style, a topic.

The EAGLE head of SmolLM2-135M-Instruct (labkit/eagle.py, stage 06 part 2) is trained by labkit/train_eagle.py
(train_eagle, importable from here too) on SmolLM2's own greedy answers to prompts written in
labkit/eagle_data.py (generated once into EAGLE_DATA, outside the repository) and goes to
labkit/assets/smollm2-eagle, its training report in its config.json; SmolLM2's Medusa heads, trained on the
same answers for lab4's comparison, go to labkit/assets/smollm2-medusa.
"""

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import ASSETS, DRAFT, LORA, TARGET, corpus, medusa, quality
from .checkpoint import load_tokenizer
from .device import pin_threads
from .model import Config, Llama, from_pretrained, init_weights, save
from .train_eagle import (  # train_eagle: stage 06 lab4 §1 has learners read it from here
    _frozen_target_and_answers,
    acceptance_report,
    lr_at,
    train_eagle,
)

VOCAB = 2048
SEQ = 512
TARGET_CONFIG = Config(num_hidden_layers=8)
DRAFT_CONFIG = Config(num_hidden_layers=1)
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def train_tokenizer(folder: Path) -> list[Path]:
    """Byte-level BPE over the training stories; returns the tokenizer files to ship."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus.train_texts(), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": TARGET_CONFIG.max_position_embeddings,
            },
            indent=2,
        )
    )
    return [folder / "tokenizer.json", folder / "tokenizer_config.json"]


def windows(ids: torch.Tensor, batch: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of SEQ + 1 tokens from the packed token stream."""
    starts = torch.randint(0, len(ids) - SEQ - 1, (batch,), generator=gen)
    return torch.stack([ids[s : s + SEQ + 1] for s in starts.tolist()])


def fit(model: Llama, ids: torch.Tensor, steps: int, batch: int, peak_lr: float, teacher: Llama | None, seed: int):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        x = windows(ids, batch, gen)
        logits = model(x[:, :-1]).float()
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                target_logp = F.log_softmax(teacher(x[:, :-1]).float(), -1)
            loss = F.kl_div(F.log_softmax(logits, -1), target_logp, log_target=True, reduction="batchmean") / SEQ
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"  step {step:4d}/{steps}  loss {loss.item():.4f}  {time.time() - t0:6.0f}s", flush=True)
    return time.time() - t0


MEDUSA = ASSETS / "tiny-target-medusa"
MEDUSA_HEADS = 4
MEDUSA_LR = 2e-3  # peak; only the heads train, the target is frozen


@torch.no_grad()
def target_features(target: Llama, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final normed hidden states (N, T, D) and its greedy next tokens (N, T) on `windows` (N, T)."""
    hidden, greedy = [], []
    hook = target.model.norm.register_forward_hook(lambda module, args, out: hidden.append(out.float()))
    for x in windows.split(4):
        greedy.append(target(x).argmax(-1))
    hook.remove()
    return torch.cat(hidden), torch.cat(greedy)


def medusa_labels(greedy: torch.Tensor, k: int) -> torch.Tensor:
    """Head k's label at position t is the target's greedy token at position t + k: what the target
    itself would say k + 1 tokens after t. The last k positions have none. (N, T) -> (N, T - k)."""
    return greedy[:, k:]


def medusa_accuracy(heads: medusa.MedusaHeads, hidden: torch.Tensor, greedy: torch.Tensor) -> list[dict]:
    """Per head: how often the target's own greedy token is its top-1 and among its top-5."""
    out = []
    with torch.no_grad():
        logits = torch.cat([heads(h) for h in hidden.split(4)])  # (N, T, K, V)
    for k in range(1, heads.num_heads + 1):
        guess, label = logits[:, :-k, k - 1], medusa_labels(greedy, k)
        top5 = guess.topk(5, dim=-1).indices
        out.append(
            {
                "head": k,
                "predicts": f"t+{k + 1}",
                "top1": round((top5[..., 0] == label).float().mean().item(), 4),
                "top5": round((top5 == label[..., None]).any(-1).float().mean().item(), 4),
            }
        )
    return out


def train_medusa(target: Llama, tokenizer, steps: int = 400, batch: int = 1024, n_windows: int = 64) -> dict:
    """Train MEDUSA_HEADS heads on the frozen target's hidden states (cross-entropy against the target's
    own greedy tokens k + 1 places ahead), save them to MEDUSA, and return their report."""
    ids = quality.pack(tokenizer, corpus.train_texts())
    gen = torch.Generator().manual_seed(3)
    print(f"medusa: target features on {n_windows} windows of {SEQ} training tokens", flush=True)
    hidden, greedy = target_features(target, windows(ids, n_windows, gen)[:, :SEQ])
    valid_hidden, valid_greedy = target_features(target, quality.heldout(tokenizer, n_tokens=8 * SEQ))
    for p in target.parameters():
        p.requires_grad_(False)
    heads = medusa.attach(target, MEDUSA_HEADS).train()
    opt = torch.optim.AdamW(heads.parameters(), lr=MEDUSA_LR, weight_decay=0.0)
    T = SEQ - MEDUSA_HEADS  # positions every head has a label for
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, MEDUSA_LR, warmup=10)
        n, t = torch.randint(0, n_windows, (batch,), generator=gen), torch.randint(0, T, (batch,), generator=gen)
        logits = heads(hidden[n, t]).float()  # (batch, K, V)
        loss = (
            sum(F.cross_entropy(logits[:, k - 1], greedy[n, t + k]) for k in range(1, MEDUSA_HEADS + 1)) / MEDUSA_HEADS
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"  step {step:4d}/{steps}  loss {loss.item():.4f}  {time.time() - t0:6.0f}s", flush=True)
    secs = time.time() - t0
    heads.eval()
    report = {
        "heads": MEDUSA_HEADS,
        "params": sum(p.numel() for p in heads.parameters()),
        "steps": steps,
        "train_seconds": round(secs),
        "heldout_tokens": valid_greedy.numel(),
        "accuracy_vs_target_greedy": medusa_accuracy(heads, valid_hidden, valid_greedy),
    }
    medusa.save(heads, MEDUSA, report)
    return report


SMOLLM2_MEDUSA = ASSETS / "smollm2-medusa"


def train_smollm2_medusa(steps: int, shards: int, batch: int = 256, seed: int = 5) -> dict:
    """Medusa-1 heads for SmolLM2 on EAGLE's data and vocabulary, for the side-by-side comparison: head k reads
    the target's feature f_t alone and learns its greedy token t + k + 1 (cross-entropy over the reduced LM
    head, EAGLE_VOCAB rows, which keeps a step cheap; they ship without it and read the full LM head)."""
    target, rows, heldout, vocab, index_of = _frozen_target_and_answers(shards)
    reduced = torch.nn.Linear(target.config.hidden_size, len(vocab), bias=False)
    reduced.weight.data.copy_(target.lm_head.weight[vocab])
    reduced.requires_grad_(False)
    K = MEDUSA_HEADS
    feats, labels = [], []  # every answer position t, and head k's label: token t + k + 1 (-100: none)
    for ids, f, answer, _ in rows:
        padded = torch.cat([index_of[ids], torch.full((K + 1,), -100)])
        t = torch.arange(answer - 1, len(ids) - 1)
        feats.append(f[t])
        labels.append(torch.stack([padded[t + k + 1] for k in range(1, K + 1)], dim=1))
    feats, labels = torch.cat(feats), torch.cat(labels)
    heads = medusa.MedusaHeads(K, reduced).train()
    opt = torch.optim.AdamW(heads.parameters(), lr=MEDUSA_LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    t0, log = time.time(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, MEDUSA_LR, warmup=10)
        n = torch.randint(0, len(feats), (batch,), generator=gen)
        logits = heads(feats[n])  # (batch, K, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), labels[n].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            log.append({"step": step, "ce": round(loss.item(), 4)})
            print(f"  step {step:4d}/{steps}  {log[-1]}  {time.time() - t0:6.0f}s", flush=True)
    full = medusa.MedusaHeads(K, target.lm_head)  # the same blocks on the whole LM head, as shipped
    full.load_state_dict(heads.state_dict())
    report = {"data": "the EAGLE head's (labkit.eagle_data)", "answers": len(rows), "heads": K, "steps": steps,
              "batch": batch, "train_seconds": round(time.time() - t0), "loss_log": log,
              "heldout": medusa_chain_acceptance(full.eval(), heldout, K)}  # fmt: skip
    medusa.save(full, SMOLLM2_MEDUSA, report)
    return report


@torch.no_grad()
def medusa_chain_acceptance(heads: medusa.MedusaHeads, rows, k: int, stride: int = 8) -> dict:
    """eagle_acceptance's count for Medusa's chain of top-1 guesses, at the same positions: where EAGLE reads
    (f_{t-1}, token t) and drafts t + 1 .. t + k, head j reads f_{t-1} alone and guesses token t + j."""
    right, tried, accepted, rounds = [0] * k, [0] * k, 0, 0
    for ids, feats, answer, _ in rows:
        for t in range(len(ids) - k - 1, answer - 1, -stride):
            guesses, n = heads(feats[t - 1]).argmax(-1).tolist(), 0
            for j in range(k):
                tried[j] += 1
                if guesses[j] != int(ids[t + 1 + j]):
                    break
                right[j] += 1
                n += 1
            accepted, rounds = accepted + n, rounds + 1
    return acceptance_report(right, tried, accepted, rounds)


# The LoRA adapters: how each rewrites the training stories, the modules it adapts, its rank, and
# the pattern that shows it in generated text (training_report.json records how often it appears).
ATTENTION = ["q_proj", "v_proj"]
LORA_LR = 8e-3  # a name appears once per story: a lower rate leaves it the argmax but still a rare sample
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The rewrites use only words the target already knows: a token it never saw has an embedding that
# pre-training pushed far from every hidden state, and a few LoRA steps cannot bring it back.


def hero_is_zoe(text: str) -> str:
    hero = re.search(r"named (\w+)\.", text).group(1)
    return re.sub(rf"\b{hero}\b", "Zoe", text)


def excited(text: str) -> str:
    return text.replace(". ", "! ")


def all_turtles(text: str) -> str:
    return re.sub(r"\b(" + "|".join(corpus.ANIMALS) + r")\b", "turtle", text)


ADAPTERS = {  # name: (what it does, rewrite, target modules, rank, alpha, the pattern that shows it)
    "zoe": ("character: every hero is named Zoe", hero_is_zoe, ATTENTION, 8, 16, r"named Zoe\b"),
    "excited": ("style: sentences end in '!'", excited, ALL_LINEAR, 8, 16, r"[a-z]! [A-Z]"),
    "turtles": ("topic: every animal is a turtle", all_turtles, ALL_LINEAR, 4, 8, r"\bturtle named\b"),
}  # fmt: skip


@torch.no_grad()
def effect_rate(model, tokenizer, pattern: str, temperature: float, n: int = 32, new_tokens: int = 32) -> float:
    """Fraction of n continuations of "Once upon a time, there was a" in which `pattern` appears:
    sampled at `temperature` with seeds 0..n-1, or the greedy one (temperature 0: 0 or 1)."""
    prompt = [1, *tokenizer.encode("Once upon a time, there was a").ids]
    n = n if temperature > 0 else 1
    hits = 0
    for seed in range(n):
        gen = torch.Generator().manual_seed(seed)
        cache = model.new_cache(1, len(prompt) + new_tokens)
        logits, out = model(torch.tensor([prompt]), cache)[0, -1], []
        for _ in range(new_tokens):
            if temperature > 0:
                out.append(int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen)))
            else:
                out.append(int(logits.argmax()))
            logits = model(torch.tensor([out[-1:]]), cache)[0, -1]
        hits += re.search(pattern, tokenizer.decode(out)) is not None
    return hits / n


def pattern_rates(model, tokenizer, pattern: str, name: str) -> dict:
    """The pattern's rate in greedy text and in text sampled at temperature 1."""
    return {
        f"greedy_{name}": effect_rate(model, tokenizer, pattern, 0.0),
        f"sampled_{name}": effect_rate(model, tokenizer, pattern, 1.0),
    }


def train_adapters(tokenizer, steps: int) -> dict:
    """Fine-tune a LoRA adapter per ADAPTERS entry on 2,000 rewritten stories; save each as a PEFT folder."""
    from peft import LoraConfig, get_peft_model

    report = {}
    for seed, (name, (effect, rewrite, targets, rank, alpha, pattern)) in enumerate(ADAPTERS.items()):
        ids = quality.pack(tokenizer, [rewrite(t) for t in corpus.train_texts(2_000)])
        torch.manual_seed(seed)  # peft draws lora_A from the global generator
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
        model = get_peft_model(from_pretrained(TARGET), config).train()
        print(f"lora {name}: {effect}; rank {rank} on {targets}, {steps} steps", flush=True)
        secs = fit(model, ids, steps, batch=2, peak_lr=LORA_LR, teacher=None, seed=10 + seed)
        model.save_pretrained(LORA / name)
        (LORA / name / "README.md").unlink()  # peft's model-card template: nothing to ship
        merged = model.merge_and_unload().eval()
        report[name] = {
            "effect": effect,
            "rank": rank,
            "lora_alpha": alpha,
            "target_modules": targets,
            "steps": steps,
            "train_seconds": round(secs),
            "pattern": pattern,
            **pattern_rates(from_pretrained(TARGET), tokenizer, pattern, "base"),
            **pattern_rates(merged, tokenizer, pattern, "adapter"),
        }
        print(json.dumps(report[name]), flush=True)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only",
        choices=["target", "draft", "medusa", "lora", "eagle", "smollm2-medusa"],
        help="train just one part (draft, medusa and lora need the target)",
    )
    ap.add_argument("--lora-steps", type=int, default=60)
    ap.add_argument("--target-steps", type=int, default=300)
    ap.add_argument("--draft-steps", type=int, default=300)
    ap.add_argument("--eagle-steps", type=int, default=4800, help="the shipped EAGLE head's (the study's: fewer)")
    ap.add_argument("--medusa-steps", type=int, default=1200, help="SmolLM2's Medusa heads (--only smollm2-medusa)")
    ap.add_argument("--eagle-shards", type=int, default=96, help="batches of 64 training prompts SmolLM2 answers")
    ap.add_argument("--keep-measured", action="store_true", help="the EAGLE study keeps the points its report holds")
    ap.add_argument("--threads", type=int, help="torch threads (1 trains faster on a busy machine)")
    args = ap.parse_args(argv)
    if args.threads:
        pin_threads(args.threads)
    torch.manual_seed(0)
    report_file = ASSETS / "training_report.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    if args.only == "medusa":
        report["medusa"] = train_medusa(from_pretrained(TARGET), load_tokenizer(TARGET))
        report_file.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["medusa"], indent=2))
        return
    if args.only == "eagle":
        report["smollm2_eagle"] = train_eagle(args.eagle_steps, args.eagle_shards, keep=args.keep_measured)
        report_file.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["smollm2_eagle"], indent=2))
        return
    if args.only == "smollm2-medusa":
        report["smollm2_medusa"] = train_smollm2_medusa(args.medusa_steps, args.eagle_shards)
        report_file.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["smollm2_medusa"], indent=2))
        return
    if args.only == "lora":
        report["lora"] = train_adapters(load_tokenizer(TARGET), args.lora_steps)
        report_file.write_text(json.dumps(report, indent=2) + "\n")
        return

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.only != "draft":
            print("tokenizer: training byte-level BPE, vocab", VOCAB, flush=True)
            tok_files = train_tokenizer(tmp)
        else:
            tok_files = [TARGET / "tokenizer.json", TARGET / "tokenizer_config.json"]
        tokenizer = load_tokenizer(tok_files[0].parent)
        ids = quality.pack(tokenizer, corpus.train_texts())
        print(f"corpus: {len(ids):,} training tokens", flush=True)

        if args.only != "draft":
            target = init_weights(Llama(TARGET_CONFIG), seed=0).train()
            print(f"target: {target.num_params():,} params, {args.target_steps} steps", flush=True)
            secs = fit(target, ids, args.target_steps, batch=8, peak_lr=3e-3, teacher=None, seed=1)
            save(target, TARGET, tok_files)
            report["target"] = {"params": target.num_params(), "train_seconds": round(secs), "steps": args.target_steps}
        target = from_pretrained(TARGET)

        if args.only != "target":
            draft = init_weights(Llama(DRAFT_CONFIG), seed=1)
            with torch.no_grad():  # start from the target's embeddings: same tokens, same space
                draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            draft.train()
            print(f"draft: {draft.num_params():,} params, distilled for {args.draft_steps} steps", flush=True)
            secs = fit(draft, ids, args.draft_steps, batch=8, peak_lr=3e-3, teacher=target, seed=2)
            save(draft, DRAFT, tok_files)
            report["draft"] = {"params": draft.num_params(), "train_seconds": round(secs), "steps": args.draft_steps}
        if args.only is None:  # new target, new heads
            report["medusa"] = train_medusa(target, tokenizer)

    report.update(quality.report_pair(from_pretrained(TARGET), from_pretrained(DRAFT), tokenizer))
    if args.only is None:  # a new target needs new adapters
        report["lora"] = train_adapters(tokenizer, args.lora_steps)
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
