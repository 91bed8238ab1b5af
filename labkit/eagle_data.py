"""Self-distillation data for the EAGLE draft: SmolLM2's own greedy answers to chat prompts written here.

EAGLE learns to continue the target's feature sequence, so its training text should be text the
target itself writes: the prompts below are filled from templates and subjects with fixed seeds,
the target answers each greedily (batched, left-padded), and every position keeps the target's
final normed hidden state (the LM head's input), the feature the draft regresses on. Held-out
prompts use subjects no training prompt names.

    python -m labkit.eagle_data OUT_DIR [--train 1536] [--heldout 40] [--shards N]   # one shard per 64 prompts

Training prompts are answered in blocks of BLOCK, sorted by length within a block (a batch of similar
lengths pads little), so asking for more prompts adds shards and never changes the ones already written.
"""

import argparse
import random
import time
from pathlib import Path

import torch

from .checkpoint import load_tokenizer, require_real_model
from .model import Llama, from_pretrained

TEMPLATES = [
    "Explain {s} in simple terms.",
    "What is {s}? Answer in a few sentences.",
    "Write a short poem about {s}.",
    "Give me three interesting facts about {s}.",
    "How would you explain {s} to a ten-year-old?",
    "Write a short story that involves {s}.",
    "What are the pros and cons of {s}?",
    "Summarize what people should know about {s}.",
    "List five questions a student might ask about {s}.",
    "Write a friendly email to a colleague about {s}.",
    "Why is {s} important?",
    "Describe {s} in one paragraph.",
    "What is a common misconception about {s}?",
    "Give me a step-by-step guide to learning about {s}.",
    "Compare {s} with {t}.",
    "What do {s} and {t} have in common?",
    "Write a tweet about {s}.",
    "Tell me a joke about {s}.",
    "What is the history of {s}?",
    "Write a haiku about {s}.",
]

TASKS = [
    "Write a Python function that {c}.",
    "How do I {h}?",
    "What are some tips to {h}?",
    "Can you help me {h}? Keep it short.",
]

SUBJECTS = (
    "photosynthesis, the water cycle, black holes, volcanoes, the moon, gravity, electricity, magnets, "
    "the human heart, vaccines, sleep, coffee, tea, chocolate, bread, rice, the ocean, rainforests, deserts, "
    "bees, dolphins, elephants, cats, dogs, owls, the Roman Empire, ancient Egypt, the printing press, "
    "the internet, computers, smartphones, robots, artificial intelligence, climate change, solar power, "
    "wind turbines, recycling, money, banks, inflation, democracy, music, the piano, jazz, painting, "
    "photography, football, chess, running, yoga, cooking, gardening, friendship, kindness, libraries, "
    "mathematics, prime numbers, fractions, the alphabet, poetry, trains, airplanes, bicycles, bridges, "
    "rain, snow, rainbows, stars, the sun, Mars, dinosaurs, fossils, DNA, cells, bacteria, the brain"
).split(", ")
HELDOUT_SUBJECTS = (
    "earthquakes, honey, whales, the Great Wall of China, telescopes, tides, glaciers, penguins, "
    "the violin, marathons, origami, lighthouses, coral reefs, the immune system, batteries, clouds"
).split(", ")
CODE = (
    "reverses a string, checks if a number is prime, sums a list, counts the vowels in a word, "
    "returns the largest of three numbers, converts Celsius to Fahrenheit, removes duplicates from a list"
).split(", ")
HELDOUT_CODE = ["sorts a list of names by length", "returns the factorial of n"]
HOWTO = (
    "learn a new language, save money, sleep better, start running, cook pasta, write a good essay, "
    "prepare for an exam, make new friends, grow tomatoes, stay focused while studying, plan a trip"
).split(", ")
HELDOUT_HOWTO = ["train a puppy", "bake bread at home"]


def chat(text: str) -> str:
    """A one-turn prompt in SmolLM2's chat template, ending where the assistant starts."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompts(n: int, heldout: bool = False, seed: int = 0) -> list[str]:
    """n distinct chat prompts; heldout ones name subjects, code tasks and how-tos no training prompt names."""
    rng = random.Random(seed + (1000 if heldout else 0))
    subjects, code, howto = (HELDOUT_SUBJECTS, HELDOUT_CODE, HELDOUT_HOWTO) if heldout else (SUBJECTS, CODE, HOWTO)
    out: dict[str, None] = {}
    while len(out) < n:
        if rng.random() < 0.8:
            s, t = rng.sample(subjects, 2)
            text = rng.choice(TEMPLATES).format(s=s, t=t)
        else:
            text = rng.choice(TASKS).format(c=rng.choice(code), h=rng.choice(howto))
        out[chat(text)] = None
    return list(out)


@torch.no_grad()
def answer(model: Llama, batch: list[list[int]], max_new: int, eos: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy answers to a batch of prompts (left-padded), and for each row the target's final normed
    hidden state at every position but the last: (prompt + answer tokens, features (len - 1, D))."""
    B, P = len(batch), max(len(p) for p in batch)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in batch])
    real = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in batch])  # (B, P) not padding
    cache = model.new_cache(B, P + max_new)
    feats, new, done = [], [], torch.zeros(B, dtype=torch.bool)
    x_ids, start = ids, 0
    for _ in range(max_new):
        T, S = x_ids.shape[1], start + x_ids.shape[1]
        q = torch.arange(start, S)[:, None]
        k = torch.arange(S)[None, :]
        # attend causally to real keys; a padding query sees itself, so no softmax row is empty
        mask = (k <= q) & (real[:, None, :S] | (k == q))[:, None]  # (B, 1, T, S)
        x, cos, sin, _ = model.layer_inputs(x_ids, start)
        for i, layer in enumerate(model.model.layers):
            x = layer(x, cos, sin, mask, cache, i)
        cache.length += T
        h = model.model.norm(x)
        feats.append(h.to(torch.bfloat16))
        token = model.lm_head(h[:, -1]).argmax(-1)
        token[done] = eos
        new.append(token)
        done |= token == eos
        if done.all():
            break
        real = torch.cat([real, torch.ones(B, 1, dtype=torch.bool)], 1)
        x_ids, start = token[:, None], S
    feats, new = torch.cat(feats, 1), torch.stack(new, 1)
    rows, row_feats = [], []
    for b, p in enumerate(batch):
        answer = new[b].tolist()
        answer = answer[: answer.index(eos) + 1] if eos in answer else answer
        rows.append(p + answer)
        row_feats.append(feats[b, P - len(p) : P - 1 + len(answer)].clone())
    return rows, row_feats


BLOCK = 768  # training prompts per block (12 shards)


def generate(out: Path, texts: list[str], name: str, shards: int | None = None, batch: int = 64, max_new: int = 128):
    """Answer `texts` in batches of similar length, shortest prompts first within each BLOCK; write the first
    `shards` (None: all) as out/NAME-NNN.pt ({ids, feats}), skipping those already there."""
    folder = require_real_model()
    tok, model = load_tokenizer(folder), from_pretrained(folder).eval()
    eos = model.config.eos_token_id
    encoded = [p for b in range(0, len(texts), BLOCK) for p in sorted((tok.encode(t).ids for t in texts[b : b + BLOCK]), key=len)]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    t0, n_tokens = time.time(), 0
    for shard, i in enumerate(range(0, len(encoded), batch)):
        if shards is not None and shard >= shards:
            break
        path = out / f"{name}-{shard:03d}.pt"
        if path.exists():
            continue
        ids, feats = answer(model, encoded[i : i + batch], max_new, eos)
        torch.save({"ids": ids, "feats": feats}, path)
        n_tokens += sum(len(r) for r in ids)
        print(f"{name} shard {shard}: {n_tokens} tokens, {time.time() - t0:.0f}s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=2 * BLOCK)
    ap.add_argument("--heldout", type=int, default=40)
    ap.add_argument("--shards", type=int, help="answer only the first SHARDS batches of training prompts")
    args = ap.parse_args(argv)
    generate(args.out, prompts(args.heldout, heldout=True), "heldout")
    generate(args.out, prompts(args.train), "train", args.shards)


if __name__ == "__main__":
    main()
