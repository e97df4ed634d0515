"""The prompts: composed here from templates (no data set download), a training set and a held-out set of
another distribution.

Each template is one phrasing of one kind of task (explanations, lists, code, math word problems, rewriting,
creative writing, multi-sentence instructions...) with slots filled from word pools. The seed splits every
pool and every kind's phrasings in two: the held-out prompts use only held-out phrasings, topics and other
pool entries, so they share the kinds of task with the training prompts but none of their phrasings or
subjects (what a drafter meets in deployment), and no prompt is in both sets.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any, Callable, Sequence

HELD_OUT_SHARE = 4
"""One entry in this many of every pool (and one phrasing in three of every kind, at least one) is held out."""

POOLS: dict[str, tuple[str, ...]] = {
    "topic": (
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
        "tides", "the Industrial Revolution", "migratory birds", "the human brain", "supply and demand",
        "nuclear fusion", "the Amazon rainforest", "ancient Egypt", "sourdough starters", "electric guitars",
        "urban gardening", "the Cold War", "tea ceremonies", "lightning", "the metric system",
        "sharks", "3D printing", "the Mars rovers", "social media", "sign language", "the Byzantine Empire",
        "fermentation", "deserts", "the Pythagorean theorem", "hot air balloons", "first aid", "the violin",
        "cryptography", "the Apollo program", "mushrooms", "minimalism", "typography", "the ozone layer",
        "public transport", "the Maya civilization", "password security", "bicycles", "the Northern Lights",
        "opera", "wolves", "the Eiffel Tower", "solar eclipses", "rice farming",
        "overfishing", "open-source software", "the Vikings", "photography", "elephants",
        "the theory of evolution", "smart homes", "knitting", "the Panama Canal", "allergies", "skyscrapers",
        "podcasts", "the Great Barrier Reef", "caffeine", "the Mongol Empire",
        "space telescopes", "home insurance", "ballet", "sea turtles", "the Sahara",
        "video game design", "the human skeleton", "carbon capture", "the samurai", "tornadoes", "pottery",
        "the Milky Way", "food preservation", "the history of writing", "ants", "semiconductors",
        "mountain climbing", "the French language", "owls",
    ),
    "audience": ("a five-year-old", "a high school student", "a busy manager", "a software engineer",
                 "a retired teacher", "someone learning English", "a new employee", "a curious grandparent",
                 "a university freshman", "a nurse", "a farmer", "a museum visitor"),
    "form": ("poem", "haiku", "short story", "limerick", "product description", "news headline", "dialogue",
             "riddle", "song chorus", "fable", "diary entry", "tweet", "speech opening", "postcard message"),
    "tone": ("cheerful", "serious", "humorous", "formal", "friendly", "dramatic", "calm", "enthusiastic"),
    "language": ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Swedish", "Polish"),
    "sentence": (
        "The meeting has been moved to Thursday afternoon.", "I would like a table for two, please.",
        "The train was late because of the snow.", "She finished the report before lunch.",
        "Our team won the match last night.", "Please remember to water the plants.",
        "The museum opens at nine in the morning.", "He forgot his umbrella at the office.",
        "We are out of milk and eggs.", "The new library has a rooftop garden.",
        "My brother is learning to play the piano.", "The store closes early on Sundays.",
        "They painted the kitchen a bright yellow.", "The flight to Lisbon was cancelled.",
        "Could you send me the slides from today?", "The cat sleeps on the warm windowsill.",
        "I have been waiting for the bus for twenty minutes.", "Tomorrow will be sunny with a light breeze.",
        "The printer on the second floor is broken again.", "She bought three tickets for the concert.",
    ),
    "draft": (  # short texts to rewrite, with the flaws a user asks to fix
        "hey so the thing is we cant make it friday, the van broke and nobody can fix it till monday. sorry!!",
        "The results of the experiment were good. The results showed that the method works. The method is good.",
        "In my opinion I think that basically we should probably maybe consider changing the schedule.",
        "Their going to announce the winner tomorow, and everyone are very exited about it.",
        "The committee, after a long and at times heated discussion that lasted well into the evening, decided "
        "that the proposal, which had been submitted by the finance team, should be postponed.",
        "i bought this blender last week it is loud and the lid doesnt fit but it makes nice smoothies i guess",
        "Customers can return items. Items must be unused. Returns take 30 days. Refunds go to the card.",
        "To whom it may concern, I am writing to say the heating in flat 4 has not worked since October.",
        "The app crashes when I open the settings page on my phone, but it works on my tablet.",
        "Our quarterly sales went up by 12 percent, mostly because of the new product line in Europe.",
        "yo, the party is at mine saturday 8pm, bring snacks and maybe a friend or two",
        "Water the tomatoes every morning. Do not water the cactus. Turn the compost on Sundays.",
    ),
    "code_task": (
        "reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
        "returns the n-th Fibonacci number", "merges two sorted lists", "removes duplicates from a list",
        "converts Celsius to Fahrenheit", "finds the longest word in a sentence", "computes a factorial",
        "checks whether a string is a palindrome", "flattens a nested list", "sums the digits of an integer",
        "counts how often each word appears in a text", "finds the second largest number in a list",
        "checks whether two words are anagrams", "rotates a list by k positions", "validates an email address",
        "converts a Roman numeral to an integer", "computes the greatest common divisor of two numbers",
        "groups a list of people by their age", "returns the median of a list of numbers",
        "capitalizes the first letter of every word", "finds all pairs in a list that sum to a target",
        "converts a binary string to an integer", "checks whether brackets in a string are balanced",
        "reads a CSV file and prints the average of a column", "generates all subsets of a set",
        "computes the running total of a list",
    ),
    "code_language": ("Python", "JavaScript", "Java", "C", "Go", "Rust", "TypeScript", "Ruby"),
    "item": ("apples", "notebooks", "pencils", "tickets", "loaves of bread", "bicycle bells", "lamps", "mugs",
             "plant pots", "t-shirts", "batteries", "chairs", "candles", "towels", "bottles of juice", "books"),
    "unit": ("kilometers to miles", "pounds to kilograms", "liters to gallons", "hours to minutes",
             "inches to centimeters", "square meters to square feet", "days to seconds", "cups to milliliters"),
    "person": ("Maria", "Ahmed", "Lena", "Kenji", "Olivia", "Tom", "Priya", "Lucas", "Fatima", "Noah", "Sofia",
               "Daniel"),
    "event": ("a birthday party", "a team offsite", "a weekend camping trip", "a charity bake sale",
              "a wedding reception", "a school science fair", "a neighborhood cleanup", "a book club meeting",
              "a family reunion", "a product launch", "a hackathon", "a picnic in the park"),
    "goal": ("learn to cook", "run a 10k race", "save money for a trip", "read more books", "learn Spanish",
             "sleep better", "get better at public speaking", "start a vegetable garden", "learn to draw",
             "spend less time on the phone", "learn the guitar", "get organized at work"),
    "place": ("Lisbon", "Kyoto", "Cape Town", "Vancouver", "Marrakesh", "Edinburgh", "Buenos Aires", "Hanoi",
              "Reykjavik", "Istanbul", "Melbourne", "Prague"),
}


class Draw:
    """A seeded RNG over one side's pools that remembers what each prompt drew (for the split's checks)."""

    def __init__(self, rng: random.Random, pools: dict[str, tuple[str, ...]]) -> None:
        self.rng = rng
        self.pools = pools
        self.drawn: list[tuple[str, str]] = []

    def __call__(self, pool: str) -> str:
        value = self.rng.choice(self.pools[pool])
        self.drawn.append((pool, value))
        return value

    def two(self, pool: str) -> tuple[str, str]:
        first, second = self.rng.sample(self.pools[pool], 2)
        self.drawn += [(pool, first), (pool, second)]
        return first, second

    def int(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)


@dataclasses.dataclass(frozen=True)
class Template:
    kind: str
    fill: Callable[[Draw], str]


def _older(d: Draw) -> tuple[Any, ...]:
    older, younger = d.two("person")
    return older, d.int(3, 12), younger, d.int(2, 10), d.int(40, 120)


def _templates() -> tuple[Template, ...]:
    t = Template
    return (
        # explanations
        t("explain", lambda d: f"Explain {d('topic')} to {d('audience')}."),
        t("explain", lambda d: f"How does {d('topic')} work? Keep it short."),
        t("explain", lambda d: f"Describe {d('topic')} using an analogy for {d('audience')}."),
        t("explain", lambda d: f"What is a common misconception about {d('topic')}?"),
        t("explain", lambda d: f"Why should {d('audience')} care about {d('topic')}?"),
        t("explain", lambda d: f"Summarize what is known about {d('topic')} in {d.int(2, 6)} sentences."),
        # lists
        t("list", lambda d: f"List {d.int(3, 7)} interesting facts about {d('topic')}."),
        t("list", lambda d: f"Give {d.int(3, 6)} tips for {d('audience')} who wants to learn about {d('topic')}."),
        t("list", lambda d: f"Name {d.int(3, 8)} words or ideas connected to {d('topic')}, one per line."),
        t("list", lambda d: f"What are the main advantages and disadvantages of {d('topic')}? Use two lists."),
        t("list", lambda d: f"Make a checklist of {d.int(4, 9)} things to prepare for {d('event')}."),
        t("list", lambda d: f"Write {d.int(3, 6)} bullet points someone should know before visiting {d('place')}."),
        # comparisons and questions
        t("compare", lambda d: "Compare {} and {}.".format(*d.two("topic"))),
        t("compare", lambda d: "What do {} and {} have in common?".format(*d.two("topic"))),
        t("compare", lambda d: "Which is easier to explain to {}: {} or {}? Why?".format(d("audience"),
                                                                                       *d.two("topic"))),
        t("compare", lambda d: f"Is it better to {d('goal')} alone or with friends? Give arguments for both."),
        # quizzes
        t("quiz", lambda d: f"Give me a short quiz with {d.int(2, 5)} questions about {d('topic')}."),
        t("quiz", lambda d: f"Write {d.int(2, 4)} multiple-choice questions about {d('topic')}, with the answers."),
        t("quiz", lambda d: f"Ask me one tricky question about {d('topic')} and then explain the answer."),
        # creative writing
        t("creative", lambda d: f"Write a {d('form')} about {d('topic')}."),
        t("creative", lambda d: "Write a {} that mentions both {} and {}.".format(d("form"), *d.two("topic"))),
        t("creative", lambda d: f"Write a {d('tone')} {d('form')} for {d('audience')}."),
        t("creative", lambda d: f"Write a {d('form')} for {d('audience')} that starts with '{d('sentence')}'"),
        t("creative", lambda d: f"Tell a short story in which {d('person')} discovers something about {d('topic')}."),
        t("creative", lambda d: f"Write a {d('tone')} toast for {d('event')}."),
        # code
        t("code", lambda d: f"Write a {d('code_language')} function that {d('code_task')}."),
        t("code", lambda d: f"Show me how to write a function that {d('code_task')} in {d('code_language')}, "
                            "and explain each step."),
        t("code", lambda d: f"What is the time complexity of a function that {d('code_task')}? Give an example "
                            f"in {d('code_language')}."),
        t("code", lambda d: f"Write unit tests for a {d('code_language')} function that {d('code_task')}."),
        t("code", lambda d: f"I need a {d('code_language')} snippet that {d('code_task')}. Keep it under 15 lines."),
        t("code", lambda d: "Translate a function that {} from {} to {}.".format(d("code_task"),
                                                                                 *d.two("code_language"))),
        # math word problems
        t("math", lambda d: f"What is {d.int(12, 999)} {d.rng.choice('+-*')} {d.int(2, 99)}? Show your work."),
        t("math", lambda d: f"A shop sells {d('item')} for ${d.int(2, 60)} each. How much do {d.int(3, 40)} cost?"),
        t("math", lambda d: f"Convert {d.int(2, 500)} {d('unit')}."),
        t("math", lambda d: f"{d('person')} has {d.int(20, 200)} {d('item')} and gives away {d.int(2, 19)} each "
                            f"day. How many days until fewer than {d.int(1, 10)} are left?"),
        t("math", lambda d: f"A train travels {d.int(40, 400)} km in {d.int(2, 6)} hours. What is its average "
                            "speed, and how long would 1,000 km take at that speed?"),
        t("math", lambda d: f"A jacket costs ${d.int(30, 300)} and is {d.int(5, 60)}% off. What is the sale "
                            "price? Explain the steps."),
        t("math", lambda d: "{} is {} years older than {}. In {} years their ages will add up to {}. How old is each "
                            "now?".format(*_older(d))),
        t("math", lambda d: f"A rectangle is {d.int(3, 40)} m long and {d.int(2, 30)} m wide. What are its area "
                            "and perimeter?"),
        t("math", lambda d: f"If I save ${d.int(5, 200)} a week, how many weeks do I need to {d('goal')} "
                            f"on a budget of ${d.int(300, 5000)}?"),
        # rewriting
        t("rewrite", lambda d: f"Rewrite this sentence to sound more formal: '{d('sentence')}'"),
        t("rewrite", lambda d: f"Rewrite this text so that it is clear and correct: \"{d('draft')}\""),
        t("rewrite", lambda d: f"Make this shorter without losing anything important: \"{d('draft')}\""),
        t("rewrite", lambda d: f"Turn this into a {d('tone')} message to a colleague: \"{d('draft')}\""),
        t("rewrite", lambda d: f"Rewrite for {d('audience')}: \"{d('draft')}\""),
        t("rewrite", lambda d: f"Turn the following into a bulleted list: \"{d('draft')}\""),
        t("rewrite", lambda d: f"Fix the grammar and spelling, then explain what you changed: \"{d('draft')}\""),
        # translation
        t("translate", lambda d: f"Translate into {d('language')}: '{d('sentence')}'"),
        t("translate", lambda d: f"How would you say '{d('sentence')}' in {d('language')}? Explain the grammar."),
        t("translate", lambda d: "Translate '{}' into {} and {}.".format(d("sentence"), *d.two("language"))),
        # multi-sentence instructions
        t("instructions", lambda d: f"I am organizing {d('event')} for {d.int(6, 80)} people with a budget of "
                                    f"${d.int(100, 3000)}. Suggest a schedule and a shopping list. Keep it "
                                    f"under {d.int(8, 20)} bullet points."),
        t("instructions", lambda d: f"I want to {d('goal')} in the next {d.int(2, 12)} weeks. I have about "
                                    f"{d.int(2, 10)} hours a week. Make me a week-by-week plan."),
        t("instructions", lambda d: f"I am visiting {d('place')} for {d.int(2, 7)} days with {d('audience')}. "
                                    "Plan each day, and say what to skip if it rains."),
        t("instructions", lambda d: f"Read this note: \"{d('draft')}\" Now write a polite reply that asks one "
                                    "follow-up question."),
        t("instructions", lambda d: f"You are a tutor for {d('audience')}. First explain {d('topic')} in two "
                                    "sentences. Then ask a question to check understanding."),
        t("instructions", lambda d: f"Act as a career coach. {d('person')} wants to {d('goal')} but has little "
                                    "time. Give three concrete first steps and one common mistake to avoid."),
        t("instructions", lambda d: f"Write an email to {d('audience')} inviting them to a talk about "
                                    f"{d('topic')}. Mention the date, keep it under 120 words, and end with a "
                                    "question."),
    )


TEMPLATES = _templates()
KINDS = tuple(dict.fromkeys(template.kind for template in TEMPLATES))


@dataclasses.dataclass(frozen=True)
class Composed:
    text: str
    template: int
    """Its index in ``TEMPLATES``."""
    drawn: tuple[tuple[str, str], ...]
    """(pool, entry) of every slot filled."""

    @property
    def kind(self) -> str:
        return TEMPLATES[self.template].kind


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of the split: the phrasings and the pool entries its prompts use."""

    templates: tuple[int, ...]
    pools: dict[str, tuple[str, ...]]


def split_sides(seed: int) -> tuple[Side, Side]:
    """(training, held-out): every pool and every kind's phrasings split in two by ``seed``, disjoint."""
    rng = random.Random(f"split-{seed}")
    train_pools, held_pools = {}, {}
    for name, pool in POOLS.items():
        shuffled = rng.sample(pool, len(pool))
        cut = max(2, len(pool) // HELD_OUT_SHARE)  # two at least: some templates draw two distinct entries
        held_pools[name], train_pools[name] = tuple(shuffled[:cut]), tuple(shuffled[cut:])
    train_templates, held_templates = [], []
    for kind in KINDS:
        indices = [i for i, template in enumerate(TEMPLATES) if template.kind == kind]
        shuffled = rng.sample(indices, len(indices))
        cut = max(1, len(indices) // 3)
        held_templates += shuffled[:cut]
        train_templates += shuffled[cut:]
    return Side(tuple(sorted(train_templates)), train_pools), Side(tuple(sorted(held_templates)), held_pools)


def compose(count: int, side: Side, seed: int) -> list[Composed]:
    """``count`` distinct prompts of one side, each a template filled by a seeded RNG; the same list for the same
    seed. The templates take turns, so every kind is there in proportion to its phrasings."""
    rng = random.Random(seed)
    prompts: dict[str, Composed] = {}
    attempts = 0
    while len(prompts) < count:
        if attempts > 50 * count:
            raise ValueError(f"only {len(prompts)} distinct prompts after {attempts} draws; ask for fewer than {count}")
        index = side.templates[attempts % len(side.templates)]
        attempts += 1
        draw = Draw(rng, side.pools)
        text = TEMPLATES[index].fill(draw)
        prompts.setdefault(text, Composed(text, index, tuple(draw.drawn)))
    return list(prompts.values())


def split_prompts_composed(train: int, held_out: int, seed: int) -> tuple[list[Composed], list[Composed]]:
    """A training set and a held-out set of another distribution (no phrasing or pool entry in common), each
    shuffled with ``seed``."""
    if held_out < 200:
        raise ValueError(f"held_out={held_out}: evaluate on at least 200 prompts for a usable interval")
    train_side, held_side = split_sides(seed)
    training = compose(train, train_side, seed)
    evaluation = compose(held_out, held_side, seed + 1)
    shuffle = random.Random(seed + 2)
    shuffle.shuffle(training)
    shuffle.shuffle(evaluation)
    return training, evaluation


def fresh_training_distribution(training: Sequence[str], count: int, seed: int) -> list[Composed]:
    """``count`` prompts of the training side's phrasings and pools (``seed`` splits the sides as for the training
    prompts), none of them a training prompt: acceptance on these against the held-out prompts' separates what a
    drafter has not learnt from what another distribution costs it."""
    train_side, _ = split_sides(seed)
    seen = set(training)
    fresh = [p for p in compose(count + len(seen), train_side, seed + 3) if p.text not in seen]
    if len(fresh) < count:
        raise ValueError(f"only {len(fresh)} prompts of the training distribution are not training prompts; "
                         f"ask for fewer than {count}")
    return fresh[:count]


def split_prompts(train: int, held_out: int, seed: int) -> tuple[list[str], list[str]]:
    """The texts of ``split_prompts_composed``."""
    training, evaluation = split_prompts_composed(train, held_out, seed)
    return [p.text for p in training], [p.text for p in evaluation]


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
