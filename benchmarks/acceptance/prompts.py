"""The prompts: composed here from templates (no data set download), split into training and held-out sets."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Sequence

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
    "compound interest", "volcanoes", "the immune system", "climate change", "the Roman Empire",
    "plate tectonics", "vaccines", "the internet", "democracy", "jazz music", "chess openings", "honeybees",
    "the moon landing", "renewable energy", "sleep", "coffee", "the stock market", "recycling",
    "earthquakes", "DNA", "electric cars", "the Great Wall of China", "rainbows", "gravity", "inflation",
    "meditation", "the printing press", "coral reefs", "time zones", "blockchains", "the human heart",
    "glaciers", "bread baking", "solar panels", "the Olympic Games", "octopuses", "the Renaissance",
    "antibiotics", "cloud computing", "penguins", "marathon training", "origami", "the periodic table",
    "hurricanes", "public libraries", "quantum computing", "the Silk Road", "composting", "dinosaurs",
    "wind turbines", "the speed of light", "volunteering", "board games", "budget travel", "rivers",
)
AUDIENCES = ("a five-year-old", "a high school student", "a busy manager", "a software engineer",
             "a retired teacher", "someone learning English")
FORMS = ("poem", "haiku", "short story", "limerick", "product description", "news headline", "dialogue",
         "riddle")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")
SENTENCES = (
    "The meeting has been moved to Thursday afternoon.", "I would like a table for two, please.",
    "The train was late because of the snow.", "She finished the report before lunch.",
    "Our team won the match last night.", "Please remember to water the plants.",
    "The museum opens at nine in the morning.", "He forgot his umbrella at the office.",
)
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
    "returns the n-th Fibonacci number", "merges two sorted lists", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "finds the largest word in a sentence", "computes a factorial",
    "checks whether a string is a palindrome", "flattens a nested list", "sums the digits of an integer",
)
ITEMS = ("apples", "notebooks", "pencils", "tickets", "loaves of bread", "bicycles", "lamps", "mugs")
UNITS = (("kilometers", "miles"), ("pounds", "kilograms"), ("liters", "gallons"), ("hours", "minutes"),
         ("inches", "centimeters"))
TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    lambda r: f"Explain {r.choice(TOPICS)} to {r.choice(AUDIENCES)}.",
    lambda r: f"Write a {r.choice(FORMS)} about {r.choice(TOPICS)}.",
    lambda r: f"List {r.randint(3, 7)} interesting facts about {r.choice(TOPICS)}.",
    lambda r: f"What are the main advantages and disadvantages of {r.choice(TOPICS)}?",
    lambda r: f"Give me a short quiz with {r.randint(2, 5)} questions about {r.choice(TOPICS)}.",
    lambda r: f"Summarize what is known about {r.choice(TOPICS)} in {r.randint(2, 6)} sentences.",
    lambda r: f"How would you teach {r.choice(TOPICS)} to {r.choice(AUDIENCES)}?",
    lambda r: f"Write an email to {r.choice(AUDIENCES)} inviting them to a talk about {r.choice(TOPICS)}.",
    lambda r: "Compare {} and {}.".format(*r.sample(TOPICS, 2)),
    lambda r: f"What is a common misconception about {r.choice(TOPICS)}?",
    lambda r: f"Describe {r.choice(TOPICS)} using an analogy for {r.choice(AUDIENCES)}.",
    lambda r: "Write a {} that mentions both {} and {}.".format(r.choice(FORMS), *r.sample(TOPICS, 2)),
    lambda r: f"What is {r.randint(12, 999)} {r.choice('+-*')} {r.randint(2, 99)}? Show your work.",
    lambda r: f"A shop sells {r.choice(ITEMS)} for ${r.randint(2, 60)} each. How much do {r.randint(3, 40)} cost?",
    lambda r: "Convert {} {} to {}.".format(r.randint(2, 500), *r.choice(UNITS)),
    lambda r: f"Write a Python function that {r.choice(CODE_TASKS)}.",
    lambda r: f"Translate into {r.choice(LANGUAGES)}: '{r.choice(SENTENCES)}'",
    lambda r: f"Rewrite this sentence to sound more formal: '{r.choice(SENTENCES)}'",
    lambda r: f"Write a {r.choice(FORMS)} for {r.choice(AUDIENCES)} that starts with '{r.choice(SENTENCES)}'",
    lambda r: f"Give {r.randint(3, 6)} tips for {r.choice(AUDIENCES)} who wants to learn about {r.choice(TOPICS)}.",
)


def compose_prompts(count: int, seed: int) -> list[str]:
    """``count`` distinct prompts, each a template filled by a seeded RNG; the same list for the same seed."""
    rng = random.Random(seed)
    prompts: dict[str, None] = {}
    attempts = 0
    while len(prompts) < count:
        attempts += 1
        if attempts > 50 * count:
            raise ValueError(f"only {len(prompts)} distinct prompts after {attempts} draws; ask for fewer than {count}")
        prompts.setdefault(TEMPLATES[attempts % len(TEMPLATES)](rng))  # every template in turn: varied tasks
    return list(prompts)


def split_prompts(train: int, held_out: int, seed: int) -> tuple[list[str], list[str]]:
    """A training set and a held-out set of distinct prompts (no prompt in both), shuffled with ``seed``."""
    if held_out < 200:
        raise ValueError(f"held_out={held_out}: evaluate on at least 200 prompts for a usable interval")
    prompts = compose_prompts(train + held_out, seed)
    random.Random(seed + 1).shuffle(prompts)
    return prompts[held_out:], prompts[:held_out]


def write_conversations(prompts: Sequence[str], path: Path) -> None:
    """OpenAI-style conversations, one user turn each (the answers come from the target: regeneration)."""
    with open(path, "w") as handle:
        for prompt in prompts:
            handle.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")



def render_prompts(tokenizer: Any, prompts: Path) -> list[list[int]]:
    """The held-out prompts as the target's chat template renders a user turn with its generation prompt
    (what jobs.prepare renders before each answer it regenerates)."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": line["prompt"]}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
            for line in map(json.loads, prompts.read_text().splitlines())]
