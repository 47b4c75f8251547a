"""Document-agent traces for ``bench fidelity`` and the demo's document agent: records in a sliding window, one question a step.

A record is one line of text (about 70 to 200 tokens) about one person: where they live, their
car's colour, an access code, and filler facts (work, pets, hobbies) that set its length. Within
an episode every name, city and code is unique, so an answer names one record's value.

The window holds ``window`` records. After the start step each step applies one operation:

- ``slide``: a new record joins at the end, the oldest leaves;
- ``reorder``: the first three records rotate by one (``[a b c d] -> [b c a d]``): the records
  behind the rotated ones keep the same set of antecedents in another order;
- ``revisit``: the window goes back to the ordering it had before the last reorder (an agent
  undoing a reorder): every record is behind an antecedent seen before;
- ``recall``: the most recently dropped record returns at the end, the oldest leaves.

Each step asks one question about a record in the window (half the time the record the
operation moved in or around): single-hop (``What is X's access code?``) or two-hop (``What colour
is the car of the person who lives in Y?``), with the expected value.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

OPERATIONS = ("slide", "reorder", "revisit", "slide", "recall")
START = "start"

FIRST = ("Maria", "Tomas", "Aiko", "Lena", "Omar", "Priya", "Jonas", "Chloe", "Mateo", "Ingrid",
         "Kofi", "Sofia", "Ravi", "Elena", "Hugo", "Nadia", "Pavel", "Yara", "Felix", "Grace",
         "Ivan", "Zara", "Leo", "Mina", "Oscar", "Rosa", "Sami", "Tara", "Umar", "Vera")
LAST = ("Lopez", "Berg", "Tanaka", "Novak", "Haddad", "Sharma", "Keller", "Dubois", "Silva",
        "Larsen", "Mensah", "Rossi", "Patel", "Ivanova", "Moreau", "Kowalski", "Costa", "Fischer",
        "Okafor", "Nguyen", "Ahmed", "Jensen", "Romero", "Weber", "Kim", "Santos", "Meyer")
CITIES = ("Lisbon", "Oslo", "Kyoto", "Prague", "Cairo", "Mumbai", "Zurich", "Lyon", "Porto",
          "Bergen", "Accra", "Turin", "Pune", "Kazan", "Nantes", "Gdansk", "Recife", "Bremen",
          "Lagos", "Hanoi", "Dhaka", "Aarhus", "Seville", "Graz", "Busan", "Quito", "Leipzig",
          "Tunis", "Malmo", "Split", "Cork", "Riga", "Perth", "Lima", "Basel", "Tartu")
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "silver", "orange", "purple",
           "brown", "grey", "pink")
FILLER = (
    "{p} works as a {job} and starts most days before seven.",
    "{p} keeps a {pet} that sleeps near the window.",
    "On weekends {p} enjoys {hobby} with old friends.",
    "{p} once spent a whole summer learning to {skill}.",
    "The house has a small garden with {plant} along the fence.",
    "{p} prefers tea to coffee and reads the news every evening.",
    "Last year {p} travelled by train to visit a cousin in the mountains.",
    "{p} is saving money for a new bicycle and a trip abroad.",
    "Neighbours describe {p} as quiet, careful and always on time.",
    "{p} volunteers at the local library on the first Monday of each month.",
    "In the kitchen {p} likes to cook soup with {plant} from the garden.",
    "{p} has two brothers and a sister who live in other towns.",
)
JOBS = ("baker", "nurse", "teacher", "carpenter", "pilot", "chemist", "gardener", "tailor")
PETS = ("cat", "dog", "parrot", "rabbit", "turtle", "hamster")
HOBBIES = ("chess", "hiking", "painting", "fishing", "cycling", "singing")
SKILLS = ("sail", "play the violin", "bake bread", "speak Italian", "carve wood")
PLANTS = ("roses", "tomatoes", "lavender", "mint", "sunflowers", "beans")


@dataclass(frozen=True)
class Record:
    index: int
    name: str
    city: str
    colour: str
    code: str
    text: str  # one line, ending with a newline


@dataclass(frozen=True)
class Question:
    text: str
    answer: str  # the value a correct answer contains
    hops: int  # 1: a field of a named person; 2: a field of the person found by another field
    record: int  # the record the answer comes from


@dataclass(frozen=True)
class FidelityStep:
    episode: int
    index: int
    op: str
    window: tuple[int, ...]  # record indices in prompt order
    new_records: tuple[int, ...]  # shown for the first time at this step
    question: Question

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Episode:
    index: int
    records: list[Record]
    steps: list[FidelityStep] = field(default_factory=list)


def make_record(rng: random.Random, index: int, used: dict[str, set[str]]) -> Record:
    def pick(pool: tuple[str, ...], kind: str) -> str:
        free = [v for v in pool if v not in used[kind]]
        value = rng.choice(free)
        used[kind].add(value)
        return value

    name = f"{pick(FIRST, 'first')} {rng.choice(LAST)}"
    city = pick(CITIES, "city")
    colour = rng.choice(COLOURS)
    code = pick(tuple(str(n) for n in range(100, 1000)), "code")
    first = name.split()[0]
    facts = [f"{name} lives in {city}.", f"{first} drives a {colour} car.",
             f"The access code of {first} is {code}."]
    num_filler = rng.randint(3, len(FILLER) - 1)  # about 70 to 200 tokens in all
    for template in rng.sample(FILLER, num_filler):
        facts.insert(rng.randint(1, len(facts)), template.format(
            p=first, job=rng.choice(JOBS), pet=rng.choice(PETS), hobby=rng.choice(HOBBIES),
            skill=rng.choice(SKILLS), plant=rng.choice(PLANTS)))
    text = f"Record {index + 1}: " + " ".join(facts) + "\n"
    return Record(index, name, city, colour, code, text)


def ask(rng: random.Random, record: Record) -> Question:
    if rng.random() < 0.5:
        return Question(f"What is the access code of {record.name}?", record.code, 1, record.index)
    return Question(f"What colour is the car of the person who lives in {record.city}?",
                    record.colour, 2, record.index)


def make_episode(seed: int, episode: int, *, window: int = 4, num_steps: int = 21) -> Episode:
    """An episode of ``num_steps`` steps: the start, then ``OPERATIONS`` in turn."""
    if window < 3:
        raise ValueError(f"window must be at least 3 records (a reorder rotates 3), got {window}")
    rng = random.Random(seed * 1_000_003 + episode)
    used: dict[str, set[str]] = {"first": set(), "city": set(), "code": set()}
    records: list[Record] = []

    def new_record() -> int:
        records.append(make_record(rng, len(records), used))
        return len(records) - 1

    ep = Episode(episode, records)
    current = [new_record() for _ in range(window)]
    dropped: list[int] = []
    before_reorder: list[int] | None = None
    shown: set[int] = set()
    for index in range(num_steps):
        op = START if index == 0 else OPERATIONS[(index - 1) % len(OPERATIONS)]
        focus: int | None = None
        if op == "slide":
            focus = new_record()
            dropped.append(current.pop(0))
            current.append(focus)
        elif op == "reorder":
            before_reorder = list(current)
            current = current[1:3] + current[:1] + current[3:]
            focus = current[2]
        elif op == "revisit" and before_reorder is not None:
            current, before_reorder = before_reorder, None
            focus = current[0]
        elif op == "recall" and dropped:
            focus = dropped.pop()
            dropped.append(current.pop(0))
            current.append(focus)
        if focus is None or rng.random() < 0.5:
            focus = rng.choice(current)
        new = tuple(r for r in current if r not in shown)
        shown.update(current)
        question = ask(rng, records[focus])
        ep.steps.append(FidelityStep(episode, index, op, tuple(current), new, question))
    return ep


def make_trace(
    seed: int, num_episodes: int, *, window: int = 4, num_steps: int = 21, first_episode: int = 0
) -> list[Episode]:
    """Episodes ``first_episode`` .. ``first_episode + num_episodes - 1`` of ``seed``: each depends
    on its seed and index only, so a later run can add episodes to an earlier one's."""
    return [
        make_episode(seed, e, window=window, num_steps=num_steps)
        for e in range(first_episode, first_episode + num_episodes)
    ]


def user_text(records: list[Record], step: FidelityStep) -> tuple[str, list[tuple[int, int]]]:
    """The user turn's text and each record's (start, end) character span in it."""
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for r in step.window:
        text = records[r].text
        spans.append((pos, pos + len(text)))
        parts.append(text)
        pos += len(text)
    parts.append(f"Question: {step.question.text} Answer in a few words.")
    return "".join(parts), spans
