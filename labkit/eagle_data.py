"""Self-distillation data for the EAGLE draft: SmolLM2's own greedy answers to chat prompts written here.

EAGLE learns to continue the target's feature sequence, so its training text should be text the
target itself writes: the prompts below are filled from templates and subjects with fixed seeds,
and the target answers each greedily through the course's own serving engine (stage 04's LLMEngine on
labkit.cpu_kernels, ENGINE_CONCURRENCY chats at once: its aggregate throughput, not one chat's). A
prefill pass over each prompt + answer then keeps, at every position, the target's final normed hidden
state (the LM head's input, EAGLE-1's feature) and the residual stream after a low, a middle and a high
layer (EAGLE-3's fused input). Held-out prompts use subjects no training prompt names.

    python -m labkit.eagle_data OUT_DIR [--train 1536] [--heldout 40] [--shards N]   # one shard per 64 prompts

Training prompts are answered in blocks of BLOCK, sorted by length within a block, so asking for more
prompts adds shards and never changes the ones already written. Each shard records the seconds its
answers and its features took (labkit.train's report sums them)."""

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
# Past the first NARROW prompts, the corpus widens: one template in ten takes two subjects, so once the lists above
# run out of single-subject prompts, more prompts from them would be mostly comparisons. The first NARROW stay
# as they were, so the answers already generated for them stay valid.
NARROW = 1536
WIDE_TEMPLATES = [
    "What would happen if there were no {s}?",
    "Write a short dialogue between two friends about {s}.",
    "What careers involve {s}?",
    "Explain how {s} works, step by step.",
    "What are the biggest challenges related to {s}?",
    "Write a limerick about {s}.",
    "Give me a fun fact about {s} and explain why it is true.",
    "How has {s} changed over the last hundred years?",
    "Write an encouraging note to someone who is learning about {s}.",
    "What should a beginner read first to understand {s}?",
]
WIDE_SUBJECTS = (
    "rivers, mountains, forests, lakes, islands, caves, thunderstorms, hurricanes, the wind, fire, soil, "
    "butterflies, ants, spiders, frogs, sharks, octopuses, horses, wolves, bears, parrots, trees, flowers, "
    "mushrooms, seeds, apples, cheese, soup, spices, pizza, the kitchen, the Vikings, ancient Greece, the Middle "
    "Ages, the Renaissance, castles, pyramids, the wheel, the compass, clocks, maps, newspapers, radio, "
    "television, cameras, video games, email, passwords, the cloud, databases, spreadsheets, 3D printing, "
    "electric cars, rockets, satellites, the International Space Station, Jupiter, comets, the speed of light, "
    "atoms, magnetism, sound, light, heat, friction, chemistry, geometry, statistics, probability, algebra, "
    "economics, taxes, budgeting, the stock market, voting, laws, courts, history books, museums, theater, "
    "dance, the guitar, drums, opera, swimming, tennis, basketball, hiking, camping, board games, puzzles, "
    "handwriting, public speaking, teamwork, leadership, patience, habits, memory, emotions, exercise, nutrition"
).split(", ")
WIDE_CODE = (
    "counts the words in a sentence, checks if a string is a palindrome, returns the average of a list, "
    "merges two sorted lists, finds the second largest number in a list, flattens a nested list, "
    "counts how often each letter appears in a string, returns the n-th Fibonacci number"
).split(", ")
WIDE_HOWTO = (
    "organize my desk, write a cover letter, give a short presentation, learn to swim, keep a journal, "
    "start a small garden on a balcony, read more books, wake up earlier, learn to draw, fix a flat bicycle tire"
).split(", ")


def chat(text: str) -> str:
    """A one-turn prompt in SmolLM2's chat template, ending where the assistant starts."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompts(n: int, heldout: bool = False, seed: int = 0) -> list[str]:
    """n distinct chat prompts; heldout ones name subjects, code tasks and how-tos no training prompt names.
    Training prompts past the first NARROW also draw on the WIDE_ lists."""
    rng = random.Random(seed + (1000 if heldout else 0))
    subjects, code, howto = (HELDOUT_SUBJECTS, HELDOUT_CODE, HELDOUT_HOWTO) if heldout else (SUBJECTS, CODE, HOWTO)
    templates = TEMPLATES
    out: dict[str, None] = {}
    while len(out) < n:
        if not heldout and len(out) == NARROW and templates is TEMPLATES:
            templates, subjects = TEMPLATES + WIDE_TEMPLATES, SUBJECTS + WIDE_SUBJECTS
            code, howto = CODE + WIDE_CODE, HOWTO + WIDE_HOWTO
        if rng.random() < 0.8:
            s, t = rng.sample(subjects, 2)
            text = rng.choice(templates).format(s=s, t=t)
        else:
            text = rng.choice(TASKS).format(c=rng.choice(code), h=rng.choice(howto))
        out[chat(text)] = None
    return list(out)


HELDOUT = 40  # held-out prompts: the head's evaluation, and every one of them the EAGLE benchmark's
FUSED_LAYERS = (2, 15, 27)  # EAGLE-3's low, middle and high features: the residual stream after these layers
ENGINE_CONCURRENCY = 16  # sequences the engine decodes at once: its aggregate throughput, not one chat's


def answer(model: Llama, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], float]:
    """Greedy answers through stage 04's engine (labkit.cpu_kernels' float32 loops, ENGINE_CONCURRENCY chats
    at once), each ending at EOS or after max_new tokens: (prompt + answer tokens per prompt, seconds)."""
    from .impl import load  # the engine is stage 04's (given code); loaded, not imported, as notebooks do

    engine_mod, seq = load("stage04_batching.engine"), load("stage04_batching.sequence")
    engine = engine_mod.LLMEngine(model, None, kernels="cpp", max_num_seqs=ENGINE_CONCURRENCY, num_blocks=512)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, seq.SamplingParams(max_tokens=max_new, temperature=0.0))
    return [p + o.token_ids for p, o in zip(prompts, outs, strict=True)], time.perf_counter() - t0


@torch.no_grad()
def features(model: Llama, rows: list[list[int]], batch: int = 8) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One prefill pass of the target over each whole row (right-padded, so padding never precedes a real
    token): per row, the final normed hidden state at every position but the last, (len - 1, H) bfloat16
    (EAGLE-1's feature), and the residual stream after FUSED_LAYERS there, (len - 1, 3H) bfloat16 (EAGLE-3's)."""
    feats, fused = [], []
    for i in range(0, len(rows), batch):
        group = rows[i : i + batch]
        T = max(len(r) for r in group)
        x, cos, sin, mask = model.layer_inputs(torch.tensor([r + [0] * (T - len(r)) for r in group]))
        taps = []
        for j, layer in enumerate(model.model.layers):
            x = layer(x, cos, sin, mask)
            if j in FUSED_LAYERS:
                taps.append(x)
        h, taps = model.model.norm(x).to(torch.bfloat16), torch.cat(taps, -1).to(torch.bfloat16)
        for b, r in enumerate(group):
            feats.append(h[b, : len(r) - 1].clone())
            fused.append(taps[b, : len(r) - 1].clone())
    return feats, fused


BLOCK = 768  # training prompts per block (12 shards)


def generate(
    out: Path, texts: list[str], name: str, shards: int | None = None, per_shard: int = 64, max_new: int = 128
):
    """Answer `texts` shortest prompts first within each BLOCK, per_shard a shard; write the first `shards` (None:
    all) as out/NAME-NNN.pt ({ids, feats, fused, seconds: {answer, features}}), skipping those already there."""
    folder = require_real_model()
    tok, model = load_tokenizer(folder), from_pretrained(folder).eval()
    encoded = [p for b in range(0, len(texts), BLOCK) for p in sorted((tok.encode(t).ids for t in texts[b : b + BLOCK]), key=len)]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    t0, n_tokens = time.time(), 0
    for shard, i in enumerate(range(0, len(encoded), per_shard)):
        if shards is not None and shard >= shards:
            break
        path = out / f"{name}-{shard:03d}.pt"
        if path.exists():
            continue
        ids, answer_s = answer(model, encoded[i : i + per_shard], max_new)
        t1 = time.perf_counter()
        feats, fused = features(model, ids)
        seconds = {"answer": round(answer_s, 1), "features": round(time.perf_counter() - t1, 1)}
        torch.save({"ids": ids, "feats": feats, "fused": fused, "seconds": seconds}, path)
        n_tokens += sum(len(r) for r in ids)
        print(f"{name} shard {shard}: {n_tokens} tokens, {seconds}, {time.time() - t0:.0f}s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=2 * BLOCK)
    ap.add_argument("--heldout", type=int, default=HELDOUT)
    ap.add_argument("--shards", type=int, help="answer only the first SHARDS batches of training prompts")
    args = ap.parse_args(argv)
    generate(args.out, prompts(args.heldout, heldout=True), "heldout")
    generate(args.out, prompts(args.train), "train", args.shards)


if __name__ == "__main__":
    main()
