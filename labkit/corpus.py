"""A deterministic synthetic corpus of short stories, generated from a seed (no download).

The stories are simple but not trivial: characters introduced early come back later, objects
and colours are repeated, dialogue quotes what was said before. So a model must use its context
(attention and the KV cache matter), text is predictable enough that a 1-layer draft agrees with
the target often (speculative decoding), and repeated phrases reward prompt-lookup drafting.
"""

import random

NAMES = """Ada Ben Cleo Dan Eva Finn Gus Hana Ivo Jade Kai Lena Milo Nora Otto Pia Quin Rosa Sam Tara
Uma Vic Wren Xena Yuri Zoe Ali Bea Cal Dora Eli Faye Hugo Iris Jon Kim Leo Mae Ned Oli""".split()
ANIMALS = "cat dog fox owl bear rabbit mouse duck frog horse goat deer wolf hen bee turtle".split()
ADJECTIVES = "little brave shy happy clever sleepy kind curious tiny busy quiet funny gentle proud".split()
PLACES = "village forest garden farm town meadow valley island castle harbor".split()
LANDMARKS = ["river", "hill", "old bridge", "tall tree", "big rock", "blue lake", "mill", "well", "market", "school"]
COLORS = "red blue green yellow purple orange white black pink silver golden brown".split()
OBJECTS = "ball kite box hat key book cup map shell stone drum bell boat lamp basket feather".split()
ACTIVITIES = [
    "play by the water",
    "read under a tree",
    "sing songs",
    "run in the grass",
    "climb the hill",
    "count the clouds",
    "bake bread",
    "paint pictures",
    "watch the birds",
    "build small houses",
]
PLANS = [
    "look for its owner",
    "show it to everyone",
    "keep it safe",
    "take it home",
    "ask the wise old owl",
    "put it back where it was",
    "share it with their friends",
]
ENDINGS = [
    "became best friends",
    "laughed all the way home",
    "had a big party",
    "went to sleep happy",
    "promised to help each other",
    "learned something new",
    "shared a warm dinner",
]
FEELINGS = "happy sad surprised excited scared proud tired".split()


def story(rng: random.Random) -> str:
    hero, friend = rng.sample(NAMES, 2)
    a1, a2 = rng.sample(ANIMALS, 2)
    adj1, adj2 = rng.sample(ADJECTIVES, 2)
    place, landmark = rng.choice(PLACES), rng.choice(LANDMARKS)
    color, obj = rng.choice(COLORS), rng.choice(OBJECTS)
    activity, plan, ending = rng.choice(ACTIVITIES), rng.choice(PLANS), rng.choice(ENDINGS)
    feeling = rng.choice(FEELINGS)
    n = rng.randint(2, 9)
    parts = [
        f"Once upon a time, there was a {adj1} {a1} named {hero}.",
        f"{hero} lived in a {place} near the {landmark}.",
        f"Every day, {hero} liked to {activity}.",
        f"One day, {hero} found a {color} {obj} by the {landmark}.",
        f'"{friend}, look at this {color} {obj}!" said {hero}.',
        f"{friend} was a {adj2} {a2}. {friend} felt {feeling}.",
        f'"Where did you find the {color} {obj}?" asked {friend}.',
        f'"I found it by the {landmark}," said {hero}.',
    ]
    if rng.random() < 0.5:
        parts.append(f"They counted {n} {obj}s in the {place}: " + ", ".join(str(i) for i in range(1, n + 1)) + ".")
    if rng.random() < 0.5:
        parts.append(f'{hero} said again, "This {color} {obj} is the best {obj} in the {place}."')
    parts += [
        f"So {hero} and {friend} decided to {plan}.",
        f"In the end, {hero} and {friend} {ending}.",
        "The end.",
    ]
    return " ".join(parts)


def stories(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [story(rng) for _ in range(n)]


def train_texts(n: int = 10_000) -> list[str]:
    return stories(seed=1234, n=n)


def valid_texts(n: int = 300) -> list[str]:
    """Held-out stories: a different seed, so they are new combinations, not copies of training text."""
    return stories(seed=98765, n=n)
