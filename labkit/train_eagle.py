"""Training SmolLM2's EAGLE head (labkit/eagle.py), and the study that says what its acceptance depends on.

    python -m labkit.train --only eagle                # answers (labkit.eagle_data), the shipped head, the study

Self-distillation: SmolLM2 answers prompts written in labkit.eagle_data through stage 04's engine (generated
once into EAGLE_DATA, outside the repository); fc and the head's one layer learn to predict its next feature
(smooth L1) and, through its LM head restricted to the EAGLE_VOCAB most frequent tokens, its next token
(cross-entropy), with the target frozen. Three recipes train on the same answers (VARIANTS):

- "eagle1": EAGLE-1 as published: the final normed feature in, regression + 0.1 x cross-entropy, noisy inputs;
- "eagle1+ttt": the same plus one step of EAGLE-3's training-time test (every position also runs once more
  reading the head's own prediction of its feature, as draft position 2 does at inference): the shipped head;
- "eagle3": EAGLE-3's input, the residual stream after a low, a middle and a high layer
  (labkit.eagle_data.FUSED_LAYERS) fused by a linear layer into the draft's feature slot, cross-entropy only
  (the draft's output need not be any feature of the target's), with the training-time test.

The study (`eagle_study`) reports held-out acceptance per draft position for each recipe on the first eighth of
the data, and for the shipped recipe on 1/32, 1/16, 1/8, 1/4, 1/2 and all of it (the learning curve), into the
shipped head's report.
"""

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import eagle, eagle_data
from .model import apply_rope, causal_mask, from_pretrained, grouped_attention

EAGLE_DATA = Path("~/.cache/llm-course/eagle-data").expanduser()  # SmolLM2's answers and features, not shipped
EAGLE_VOCAB = 8192  # the draft's LM head: the training data's tokens, most frequent first, then the lowest unseen
# ids (BPE's earliest merges, frequent in the tokenizer's own corpus): held-out subjects bring words the
# training answers never used (the report's vocab_coverage_heldout: the share of held-out tokens it covers)
EAGLE_LR = 2e-3  # peak; only fc and the layer train, the target is frozen
EAGLE_NOISE = 0.2  # uniform noise on the input features (EAGLE's augmentation), relative to their std
EAGLE_CE = 0.1  # weight of the token loss beside the feature regression (the EAGLE paper's)


def lr_at(step: int, steps: int, peak: float, warmup: int = 30) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)  # cosine decay to 10 % of the peak
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def eagle_rows(folder: Path, name: str, shards: int | None = None) -> list[tuple]:
    """(ids (L,), feats (L - 1, H) float32, where the answer starts, fused (L - 1, 3H) bfloat16) per answered prompt
    in the first `shards` (None: all) of folder/NAME-*.pt."""
    rows = []
    for shard in sorted(folder.glob(f"{name}-*.pt"))[:shards]:
        data = torch.load(shard)
        for ids, feats, fused in zip(data["ids"], data["feats"], data["fused"], strict=True):
            answer = max(i for i, t in enumerate(ids) if t == 1) + 4  # after "<|im_start|>assistant\n"
            rows.append((torch.tensor(ids), feats.float(), answer, fused))
    return rows


def data_report(folder: Path, shards: int | None, rows, heldout) -> dict:
    """The corpus the head saw: answers, tokens, and the seconds the engine's answers and the feature pass took."""
    seconds = [torch.load(s)["seconds"] for s in sorted(folder.glob("train-*.pt"))[:shards]]
    return {
        "train_answers": len(rows), "train_tokens": sum(len(r[0]) for r in rows), "heldout_answers": len(heldout),
        "generated_by": f"SmolLM2-135M-Instruct, greedy, stage 04's LLMEngine (kernels=cpp, "
        f"{eagle_data.ENGINE_CONCURRENCY} at once), labkit.eagle_data prompts",
        "answer_seconds": round(sum(s["answer"] for s in seconds)),
        "feature_seconds": round(sum(s["features"] for s in seconds)),
    }  # fmt: skip


def eagle_vocab(rows, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's EAGLE_VOCAB token ids (the rows' tokens by count, then unseen ids in BPE order), and each
    token's index among them (-100 outside)."""
    counts = torch.bincount(torch.cat([r[0] for r in rows]), minlength=vocab_size)
    vocab = counts.argsort(descending=True, stable=True)[:EAGLE_VOCAB]  # ties (count 0 included) by id
    index_of = torch.full((vocab_size,), -100)
    index_of[vocab] = torch.arange(len(vocab))
    return vocab, index_of


def eagle_batch(rows, picks: list[int], index_of: torch.Tensor, fused: bool = False):
    """Right-padded (inputs (B, T, H or 3H), next_ids (B, T), target feats (B, T, H), labels (B, T), real (B, T)
    bool), T = longest - 2; position i reads (input i, token i + 1) and should give f_{i+1} and token i + 2
    (label -100: padding, or a token outside the draft's vocabulary; real: not padding). The inputs are the final
    features, or with `fused` the three layers' residual streams (EAGLE-3)."""
    T = max(len(rows[i][0]) for i in picks) - 2
    H = rows[picks[0]][1].shape[1]
    inputs = torch.zeros(len(picks), T, 3 * H if fused else H)
    nxt, goal = torch.zeros(len(picks), T, dtype=torch.long), torch.zeros(len(picks), T, H)
    labels, real = torch.full((len(picks), T), -100), torch.zeros(len(picks), T, dtype=torch.bool)
    for b, i in enumerate(picks):
        ids, f, _, taps = rows[i]
        n = len(ids) - 2
        inputs[b, :n] = taps[:n].float() if fused else f[:n]
        nxt[b, :n], goal[b, :n], labels[b, :n] = ids[1 : n + 1], f[1 : n + 1], index_of[ids[2:]]
        real[b, :n] = True
    return inputs, nxt, goal, labels, real


@torch.no_grad()
def eagle_acceptance(head: eagle.EagleHead, rows, k: int = 4, stride: int = 8) -> dict:
    """Chain drafting of k tokens from every `stride`-th answer position of held-out rows, checked against
    the target's own greedy answer: how often draft j is right given drafts 1..j-1 were, and the mean
    accepted drafts per verification (+ 1 for the target's bonus token is tokens per verification)."""
    right, tried, accepted, rounds = [0] * k, [0] * k, 0, 0
    for ids, feats, answer, _ in rows:
        pred = head(feats[None], ids[None, 1:])[0]  # pred[t - 1] = f^_t from true features
        for t in range(len(ids) - k - 1, answer - 1, -stride):
            f, n = pred[t - 1], 0
            seen_feats, seen_ids = feats[:t], ids[1 : t + 1]  # true features before t, the tokens after them
            for j in range(k):
                token = int(head.vocab[(f @ head.lm_head_weight.T).argmax()])
                tried[j] += 1
                if token != int(ids[t + 1 + j]):
                    break
                right[j] += 1
                n += 1
                # the draft's next step reads its own feature: the whole prefix again (the head has no cache)
                seen_feats, seen_ids = torch.cat([seen_feats, f[None]]), torch.cat([seen_ids, torch.tensor([token])])
                f = head(seen_feats[None], seen_ids[None])[0, -1]
            accepted, rounds = accepted + n, rounds + 1
    return acceptance_report(right, tried, accepted, rounds)


@torch.no_grad()
def eagle_top1(head: eagle.EagleHead, rows) -> float:
    """How often the first draft (from the true feature) is the target's next answer token, teacher-forced:
    on training rows against held-out ones, the gap says whether the head overfits or underfits."""
    right = total = 0
    for ids, feats, answer, _ in rows:
        guess = head.vocab[(head(feats[None], ids[None, 1:])[0] @ head.lm_head_weight.T).argmax(-1)]
        right += int((guess[answer - 2 : -1] == ids[answer:]).sum())  # guess[i] is for token i + 2
        total += len(ids) - answer
    return round(right / max(total, 1), 4)


def eagle_second_step(head: eagle.EagleHead, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The draft's second step at every position at once (EAGLE-3's training-time test, one step deep).

    x1: (B, T, H) fc outputs of the teacher-forced pass (true features); x2: (B, T, H) fc outputs whose
    feature half is the draft's own prediction. Position j of x2 attends to x1's positions before j and to
    itself, as at inference, where the cache holds true features and only the newest input is predicted."""
    layer, c = head.layer, head.config
    B, T, _ = x1.shape
    cos, sin = head.target[0].rope(0, T)

    def qkv(h):
        a = layer.self_attn
        q = a.q_proj(h).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = a.norm_qk(q, k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    _, k1, v1 = qkv(layer.input_layernorm(x1))
    q2, k2, v2 = qkv(layer.input_layernorm(x2))
    earlier = torch.ones(T, T, dtype=torch.bool).tril(-1)
    mask = torch.cat([earlier, torch.eye(T, dtype=torch.bool)], dim=1)  # (T, 2T): true past, own input
    y = grouped_attention(q2, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), mask)
    x = x2 + layer.self_attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


VARIANTS = ("eagle1", "eagle1+ttt", "eagle3")
SHIPPED = "eagle1+ttt"
CURVE = (32, 16, 8, 4, 2, 1)  # the learning curve: the first 1/32, 1/16, ..., 1/2 and all of the training answers
RECIPES_PART = 8  # the recipes compare on the first eighth of the answers


def _frozen_target_and_answers(shards: int):
    """SmolLM2 frozen, its self-distilled answers (train shards, held out) and the head vocabulary they give."""
    from .checkpoint import require_real_model

    eagle_data.main([str(EAGLE_DATA), "--train", str(64 * shards), "--shards", str(shards)])  # only what is missing
    target = from_pretrained(require_real_model()).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    rows, heldout = eagle_rows(EAGLE_DATA, "train", shards), eagle_rows(EAGLE_DATA, "heldout")
    vocab, index_of = eagle_vocab(rows, target.config.vocab_size)
    return target, rows, heldout, vocab, index_of


def new_head(target, vocab: torch.Tensor, variant: str, seed: int) -> eagle.EagleHead:
    """A fresh head (eagle.attach); EAGLE-3's also has `fuse`, the three layers' streams (3H) -> its input (H),
    which starts as the final norm's weights on the high layer's stream, so that it starts near EAGLE-1's input."""
    head = eagle.attach(target, vocab, seed)
    if variant == "eagle3":
        H = head.config.hidden_size
        head.fuse = nn.Linear(3 * H, H, bias=False).to(target.lm_head.weight.dtype)
        with torch.no_grad():
            head.fuse.weight.zero_()
            head.fuse.weight[:, 2 * H :] = torch.diag(target.model.norm.weight)
    return head


def fused_input(head: eagle.EagleHead, taps: torch.Tensor) -> torch.Tensor:
    """taps (..., 3H): the three layers' residual streams, each RMS-normalized (their scales differ by orders of
    magnitude), fused by head.fuse -> (..., H), what an EAGLE-3 head reads where EAGLE-1 reads the final feature."""
    H = head.config.hidden_size
    return head.fuse(F.rms_norm(taps.float().unflatten(-1, (3, H)), (H,)).flatten(-2))


def head_inputs(head: eagle.EagleHead, rows) -> list[tuple]:
    """The rows as the head reads them: an EAGLE-3 head's feature slot holds fused_input(the three streams)."""
    if not hasattr(head, "fuse"):
        return rows
    with torch.no_grad():
        return [(ids, fused_input(head, taps), answer, taps) for ids, _, answer, taps in rows]


def train_head(target, rows, vocab, index_of, steps: int, variant: str, batch: int = 4, seed: int = 4):
    """Train one head by `variant`'s recipe (module docstring) on `rows`: (head in eval mode, loss log, seconds)."""
    fused, ttt = variant == "eagle3", variant != "eagle1"
    head = new_head(target, vocab, variant, seed).train()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=EAGLE_LR, weight_decay=0.0)
    scale = torch.cat([r[1] for r in rows[:32]]).std().item()  # the features' spread, for the noise
    gen = torch.Generator().manual_seed(seed)
    t0, log = time.time(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, EAGLE_LR, warmup=20)
        picks = torch.randint(0, len(rows), (batch,), generator=gen).tolist()
        inputs, nxt, goal, labels, real = eagle_batch(rows, picks, index_of, fused)
        if fused:
            feats = fused_input(head, inputs)
        else:
            feats = inputs + (torch.rand(inputs.shape, generator=gen) - 0.5) * 2 * EAGLE_NOISE * scale
        x1 = head.fc(torch.cat([feats, head.embed(nxt)], dim=-1))
        preds = [head.layer(x1, *head.target[0].rope(0, x1.shape[1]), causal_mask(0, x1.shape[1]))]
        if ttt:  # step 2 reads the step-1 prediction of its own feature (position 0 has none: it keeps the true one)
            own = torch.cat([feats[:, :1], preds[0][:, :-1].detach()], dim=1)
            preds.append(eagle_second_step(head, x1, head.fc(torch.cat([own, head.embed(nxt)], dim=-1))))
        regression = sum(F.smooth_l1_loss(p[real], goal[real]) for p in preds) / len(preds)
        ce = sum(F.cross_entropy((p @ head.lm_head_weight.T).flatten(0, 1), labels.flatten()) for p in preds)
        ce = ce / len(preds)
        loss = ce if fused else regression + EAGLE_CE * ce  # EAGLE-3's output is no feature of the target's
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            log.append({"step": step, "regression": round(regression.item(), 4), "ce": round(ce.item(), 4)})
            print(f"  {variant} step {step:4d}/{steps}  {log[-1]}  {time.time() - t0:6.0f}s", flush=True)
    return head.eval(), log, time.time() - t0


def head_report(head: eagle.EagleHead, rows, heldout) -> dict:
    """Teacher-forced first-draft accuracy (train, held out) and held-out chain acceptance at k = 4."""
    heldout = head_inputs(head, heldout)
    train = head_inputs(head, rows[:: max(1, len(rows) // 40)])
    return {"first_draft_top1": {"train": eagle_top1(head, train), "heldout": eagle_top1(head, heldout)},
            "heldout": eagle_acceptance(head, heldout)}  # fmt: skip


def train_eagle(steps: int, shards: int, batch: int = 4, seed: int = 4, study: bool = True, keep: bool = False) -> dict:
    """The shipped head (SHIPPED's recipe on every answer), saved to labkit.eagle.REAL_EAGLE with its report;
    then, with `study`, eagle_study's figures added to that report as each finishes. `keep`: the study keeps the
    points the shipped report already holds for the same recipe, tokens and steps instead of training them again."""
    kept = measured_points(eagle.REAL_EAGLE / "config.json") if keep else []
    target, rows, heldout, vocab, index_of = _frozen_target_and_answers(shards)
    n_tokens = sum(len(r[0]) for r in rows)
    print(f"eagle: {len(rows)} answers, {n_tokens} tokens, vocabulary {len(vocab)}, {steps} steps", flush=True)
    head, log, secs = train_head(target, rows, vocab, index_of, steps, SHIPPED, batch, seed)
    report = {
        "data": data_report(EAGLE_DATA, shards, rows, heldout), "recipe": SHIPPED, "vocab": len(vocab),
        "vocab_coverage_heldout": round(index_of[torch.cat([r[0] for r in heldout])].ne(-100).float().mean().item(), 4),
        "params": sum(p.numel() for p in head.parameters()),
        "steps": steps, "batch": batch, "train_seconds": round(secs), "loss_log": log,
        **head_report(head, rows, heldout),
    }  # fmt: skip
    eagle.save(head, eagle.REAL_EAGLE, report)
    if study:
        eagle_study(
            target, rows, heldout, steps, batch, seed, report, lambda: eagle.save(head, eagle.REAL_EAGLE, report), kept
        )
    return report


def measured_points(config: Path) -> list[dict]:
    """The study points a report already holds, each with its recipe (every point records its steps)."""
    if not config.is_file():
        return []
    report = json.loads(config.read_text())
    points = [{"recipe": report.get("recipe"), **p} for p in report.get("learning_curve", [])]
    return points + [{"recipe": name, **p} for name, p in report.get("recipes", {}).items()]


def eagle_study(target, rows, heldout, steps: int, batch: int, seed: int, report: dict, save, kept=()) -> None:
    """report["learning_curve"]: SHIPPED's recipe on the first 1/n of the answers for n in CURVE, its vocabulary
    from those alone; report["recipes"]: each VARIANT on the first 1/RECIPES_PART. A head on 1/n of the answers
    trains steps / n steps, as many passes over them as the shipped head makes over all (a fixed number of steps
    would overfit the small parts and underfit the large ones), so the shipped head is the curve's last point;
    report["all_answers_at_the_recipes_steps"]: all of the answers in the recipes' part's steps, which shows it. A
    point in `kept` with the same recipe, tokens and steps is copied, not trained again. Calls `save` after each
    head, so a stopped run keeps what it measured."""
    report["recipes"], report["learning_curve"] = {}, []
    todo = [(SHIPPED, n, steps // n) for n in CURVE]
    todo += [(v, RECIPES_PART, steps // RECIPES_PART) for v in VARIANTS if v != SHIPPED]
    todo += [(SHIPPED, 1, steps // RECIPES_PART)]  # all of the answers in the recipes' steps: data needs steps
    for variant, n, n_steps in todo:
        part = rows[: len(rows) // n]
        tokens = sum(len(r[0]) for r in part)
        same = [p for p in kept if (p["recipe"], p["train_tokens"], p["steps"]) == (variant, tokens, n_steps)]
        if n == 1 and variant == SHIPPED and n_steps == steps:
            result = {"train_tokens": tokens, "train_seconds": report["train_seconds"],
                      "first_draft_top1": report["first_draft_top1"], "heldout": report["heldout"]}  # fmt: skip
        elif same:
            result = {key: same[0][key] for key in ("train_tokens", "train_seconds", "first_draft_top1", "heldout")}
            result["kept_from_an_earlier_run"] = True
        else:
            vocab, index_of = eagle_vocab(part, target.config.vocab_size)
            head, _, secs = train_head(target, part, vocab, index_of, n_steps, variant, batch, seed)
            result = {"train_tokens": tokens, "train_seconds": round(secs), **head_report(head, part, heldout)}
        result = {"steps": n_steps, **result}
        if n_steps != steps // n:
            report["all_answers_at_the_recipes_steps"] = result
        elif variant == SHIPPED:
            report["learning_curve"].append({"fraction": f"1/{n}", **result})
        if n == RECIPES_PART:
            report["recipes"][variant] = result
        print(f"eagle study: {variant} on 1/{n}: {result['heldout']}", flush=True)
        save()


def acceptance_report(right: list[int], tried: list[int], accepted: int, rounds: int) -> dict:
    """The chain counts eagle_acceptance and medusa_chain_acceptance share: per draft position, how often
    it matched given that every earlier one did; drafts accepted per verification; verifications."""
    return {
        "k": len(tried),
        "acceptance_per_position": [round(r / max(t, 1), 4) for r, t in zip(right, tried, strict=True)],
        "accepted_per_verification": round(accepted / max(rounds, 1), 3),
        "verifications": rounds,
    }
