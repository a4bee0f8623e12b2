"""Write the eight demo prompt files, demo/<name>.jsonl.gz, each in its real source dataset's row shape.

The text is invented for this project (no dataset is downloaded); only the columns, value types and quirks follow
the real datasets described in shared/SOURCES.md, so the adapters in draftdata/sources/shapes.py meet realistic rows:
glaive's single-quoted call arguments with apostrophes and raw newlines, ShareGPT rows that open with the bot or
end on the human, OpenThoughts' system column, SWE-agent's `ai` role and `text` field, and so on. Every file also
holds 2-3 exact duplicate rows (for dedup). Every row adapts: the demo datasets run with `on_bad_record: fail`,
so rows the adapters must reject are left to tests/test_sources.py.

Deterministic: one seeded random.Random per file and gzip mtime=0, so reruns are byte-identical.
Run from the repository root: python scripts/make_demo_data.py
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "sources" / "demo"
SEED = 20250601
UNIQUE_ROWS = 230  # per file, before the duplicates are added

# ---------------------------------------------------------------------------------------------------------------
# Invented prose material: a few facts per topic, combined into prompts and answers of very different lengths.

TOPICS: dict[str, list[str]] = {
    "sourdough baking": [
        "A sourdough starter is a culture of wild yeast and lactic acid bacteria kept alive with flour and water.",
        "Longer, cooler fermentation gives the bread a more sour flavour and a more open crumb.",
        "Hydration is the ratio of water to flour by weight, and wetter doughs are harder to shape.",
        "Stretch-and-fold sessions build gluten strength without traditional kneading.",
        "Baking in a covered pot traps steam, which lets the loaf expand before the crust sets.",
        "A starter that doubles within six hours of feeding is usually strong enough to leaven bread.",
    ],
    "photosynthesis": [
        "Photosynthesis converts light energy into chemical energy stored in sugars.",
        "Chlorophyll absorbs mostly red and blue light and reflects green light.",
        "The light-dependent reactions split water and release oxygen as a by-product.",
        "The Calvin cycle fixes carbon dioxide into three-carbon sugars using ATP and NADPH.",
        "C4 and CAM plants have extra steps that reduce water loss in hot, dry climates.",
        "Roughly half of the world's oxygen production comes from marine phytoplankton.",
    ],
    "the French Revolution": [
        "The French Revolution began in 1789 amid a fiscal crisis and widespread food shortages.",
        "The storming of the Bastille on 14 July became a symbol of popular resistance.",
        "The Declaration of the Rights of Man and of the Citizen set out principles of equality before the law.",
        "The Reign of Terror saw thousands executed by the Committee of Public Safety.",
        "The revolution abolished feudal privileges and reorganised France into departments.",
        "Napoleon Bonaparte's coup in 1799 is usually taken as the end of the revolutionary decade.",
    ],
    "black holes": [
        "A black hole is a region where gravity is so strong that not even light can escape.",
        "The boundary beyond which nothing returns is called the event horizon.",
        "Stellar-mass black holes form when massive stars collapse at the end of their lives.",
        "Supermassive black holes with millions of solar masses sit at the centres of most galaxies.",
        "Hawking radiation predicts that black holes slowly lose mass over immense timescales.",
        "In 2019 the Event Horizon Telescope published the first image of a black hole's shadow.",
    ],
    "compound interest": [
        "Compound interest is interest earned on both the principal and previously earned interest.",
        "The more often interest compounds, the faster the balance grows, though the gains shrink at high frequencies.",
        "The rule of 72 estimates doubling time by dividing 72 by the annual percentage rate.",
        "Small differences in fees compound over decades into large differences in final savings.",
        "Debt compounds too, which is why high-interest credit card balances grow so quickly.",
        "Starting early matters more than contributing large amounts later because time drives compounding.",
    ],
    "container gardening": [
        "Containers need drainage holes, otherwise roots sit in water and rot.",
        "Potting mix is lighter than garden soil and does not compact as easily in pots.",
        "Terracotta pots breathe and dry out faster than plastic or glazed ceramic ones.",
        "Tomatoes, peppers and herbs grow well in containers that get six or more hours of sun.",
        "Plants in pots need regular feeding because watering washes nutrients out.",
        "Grouping pots together raises humidity and makes watering quicker.",
    ],
    "marathon training": [
        "Most marathon plans build weekly mileage gradually over sixteen to twenty weeks.",
        "The long run teaches the body to burn fat efficiently and the mind to cope with fatigue.",
        "Easy runs should feel conversational; many runners go too fast on their easy days.",
        "Tapering for two to three weeks before race day lets the body recover and absorb training.",
        "Practising race-day nutrition on long runs prevents stomach trouble during the event.",
        "Strength training twice a week lowers the risk of common running injuries.",
    ],
    "the water cycle": [
        "The water cycle describes how water moves between the oceans, the atmosphere and the land.",
        "Evaporation from the oceans supplies most of the water vapour in the atmosphere.",
        "Water vapour cools as it rises and condenses into clouds around tiny particles.",
        "Precipitation returns water to the surface as rain, snow, sleet or hail.",
        "Groundwater can stay underground for thousands of years before reaching the sea.",
        "Plants release water vapour through their leaves in a process called transpiration.",
    ],
    "public speaking": [
        "Most speakers feel nervous, and a little adrenaline can actually sharpen delivery.",
        "Rehearsing out loud reveals awkward phrasing that silent reading hides.",
        "A clear structure with three main points is easier for listeners to remember.",
        "Pausing deliberately gives the audience time to absorb an important idea.",
        "Eye contact with a few friendly faces makes a large room feel smaller.",
        "Slides should support the talk rather than repeat every word the speaker says.",
    ],
    "vaccines": [
        "Vaccines train the immune system to recognise a pathogen without causing the disease.",
        "Memory B and T cells allow a faster response when the real pathogen appears.",
        "Herd immunity protects people who cannot be vaccinated by limiting transmission.",
        "mRNA vaccines deliver instructions for cells to make a harmless viral protein.",
        "Booster doses refresh immunity that fades over time for some vaccines.",
        "Vaccine trials run in phases that test safety, dosage and effectiveness in growing groups.",
    ],
    "plate tectonics": [
        "The Earth's lithosphere is broken into plates that move a few centimetres per year.",
        "Mid-ocean ridges form where plates pull apart and new crust rises from the mantle.",
        "Subduction zones, where one plate sinks beneath another, produce deep trenches and volcanoes.",
        "The Himalayas are still rising because the Indian plate keeps pushing into Eurasia.",
        "Earthquakes cluster along plate boundaries where stress builds and is suddenly released.",
        "Matching fossils on distant continents were early evidence that the continents had moved.",
    ],
    "remote team management": [
        "Remote teams work best when decisions are written down where everyone can find them.",
        "Overlapping core hours make real-time collaboration possible across time zones.",
        "Regular one-on-one meetings catch problems that never come up in group calls.",
        "Asynchronous updates reduce meeting load but need clear owners and deadlines.",
        "New hires on remote teams benefit from an assigned buddy during their first month.",
        "Trust grows when managers judge outcomes rather than hours spent online.",
    ],
    "electric cars": [
        "Electric cars convert a much larger share of their stored energy into motion than petrol cars.",
        "Regenerative braking recovers energy when the car slows down.",
        "Battery range drops in cold weather because chemical reactions slow and cabin heating draws power.",
        "Fast chargers usually slow down after about eighty percent to protect the battery.",
        "Lifetime emissions depend heavily on how the electricity used for charging is generated.",
        "Electric motors deliver full torque from a standstill, which makes acceleration feel quick.",
    ],
    "coral reefs": [
        "Coral reefs are built by colonies of tiny animals called polyps that secrete calcium carbonate.",
        "Corals get most of their energy from symbiotic algae living in their tissues.",
        "Bleaching happens when stressed corals expel their algae, often after a marine heatwave.",
        "Reefs cover a tiny fraction of the ocean floor but host about a quarter of marine species.",
        "Healthy reefs protect coastlines by breaking up waves during storms.",
        "Ocean acidification makes it harder for corals to build their skeletons.",
    ],
    "jazz improvisation": [
        "Jazz improvisers often build solos from the chord changes of the tune rather than its melody.",
        "Learning solos by ear from recordings is a traditional way to absorb the language of jazz.",
        "The ii-V-I progression appears so often that players practise it in every key.",
        "Leaving space between phrases can be as expressive as playing many notes.",
        "Call and response between soloist and band keeps an improvisation conversational.",
        "Guide tones, the thirds and sevenths of chords, outline the harmony with very few notes.",
    ],
    "the Roman Empire": [
        "The Roman Empire is usually dated from Augustus becoming emperor in 27 BC.",
        "Roman roads connected the provinces and carried armies, traders and messengers.",
        "Latin spread across the western provinces and later evolved into the Romance languages.",
        "The empire was formally divided into eastern and western halves in the late fourth century.",
        "The western empire ended in 476, while the eastern empire lasted until 1453.",
        "Roman concrete used volcanic ash, which helps explain why some harbour structures still stand.",
    ],
    "sleep hygiene": [
        "Going to bed and waking at consistent times stabilises the body clock.",
        "Bright screens late in the evening can delay the release of melatonin.",
        "Caffeine has a half-life of several hours, so an afternoon coffee can still affect sleep.",
        "A cool, dark and quiet bedroom makes it easier to fall and stay asleep.",
        "Short naps early in the afternoon refresh without disturbing night-time sleep.",
        "Lying awake for a long time in bed can teach the brain to associate bed with wakefulness.",
    ],
    "energy storage": [
        "Grid batteries smooth out the variable output of solar and wind farms.",
        "Pumped hydro storage moves water uphill when power is cheap and releases it when demand peaks.",
        "Lithium-ion cells dominate short-duration storage because their costs fell sharply.",
        "Long-duration storage options include flow batteries, compressed air and hydrogen.",
        "Round-trip efficiency measures how much stored energy comes back out.",
        "Thermal storage keeps heat in molten salt or rock for use hours later.",
    ],
    "chess openings": [
        "Opening principles favour controlling the centre, developing pieces and castling early.",
        "The Sicilian Defence is the most popular reply to 1.e4 at the top level.",
        "Gambits offer material early in exchange for faster development or attacking chances.",
        "Memorising long opening lines helps less than understanding the plans behind them.",
        "The Queen's Gambit is not a true gambit because Black cannot easily keep the pawn.",
        "Transpositions mean different move orders can reach the same position.",
    ],
    "urban beekeeping": [
        "City bees often thrive because gardens and parks offer a long, varied flowering season.",
        "A strong colony in summer can contain fifty thousand or more worker bees.",
        "Beekeepers inspect hives regularly for signs of disease, pests and swarming.",
        "Varroa mites are one of the biggest threats to honey bee colonies worldwide.",
        "Local rules may limit the number of hives and require a distance from neighbours.",
        "Providing a shallow water source stops bees from visiting neighbours' ponds.",
    ],
    "home composting": [
        "Composting turns food scraps and garden waste into a soil conditioner.",
        "A good compost heap mixes nitrogen-rich greens with carbon-rich browns.",
        "Turning the pile adds oxygen and speeds up decomposition.",
        "Meat and dairy attract pests and are best kept out of a simple home bin.",
        "A heap that smells bad is usually too wet or has too many greens.",
        "Finished compost is dark, crumbly and smells like a forest floor.",
    ],
    "the printing press": [
        "Johannes Gutenberg developed a movable-type printing press in Mainz around 1440.",
        "Printing made books far cheaper and helped literacy spread across Europe.",
        "The Gutenberg Bible, printed in the 1450s, is one of the earliest major printed books.",
        "Pamphlets printed in large numbers helped the Reformation spread quickly.",
        "Standardised printed texts encouraged more consistent spelling and grammar.",
        "Printing also made it easier for scientists to share and check each other's results.",
    ],
    "personal budgeting": [
        "A budget starts with knowing exactly what comes in and what goes out each month.",
        "The 50/30/20 rule splits income between needs, wants and savings.",
        "An emergency fund covering three to six months of expenses cushions unexpected shocks.",
        "Automating savings on payday removes the temptation to spend first.",
        "Small subscriptions add up and are easy to forget.",
        "Reviewing the budget monthly keeps it realistic as circumstances change.",
    ],
    "machine translation": [
        "Modern machine translation systems are neural networks trained on pairs of translated sentences.",
        "Languages with little parallel text are harder to translate well.",
        "Idioms and cultural references are classic sources of translation errors.",
        "Attention mechanisms let a model focus on the relevant source words for each output word.",
        "Automatic metrics like BLEU compare output with reference translations but miss nuance.",
        "Human post-editing of machine output is now common in professional translation.",
    ],
}

CONTEXT = [
    "I'm a high school teacher preparing a lesson for next week.",
    "My partner and I disagree about this and I'd like a neutral take.",
    "I only have about twenty minutes a day to spend on this.",
    "English is not my first language, so please keep the wording simple.",
    "I already read the encyclopedia article but it was too dense for me.",
    "This is for a club newsletter, so the tone can be light.",
    "I'm writing a short story and want the details to be believable.",
    "My daughter asked me about this at dinner and I didn't know what to say.",
    "I tried looking it up, but the sources I found contradicted each other.",
    "I'm preparing for an exam at the end of the month.",
    "We're planning a family trip and this came up in conversation.",
    "I work in a completely different field, so assume I know nothing.",
]

SHORT_ASKS = [
    "What is {t}?",
    "Give me one interesting fact about {t}.",
    "Explain {t} in a single sentence.",
    "Why does {t} matter?",
    "Quick question: what's the most common misconception about {t}?",
    "Summarise {t} for a ten-year-old.",
]

REQUESTS = [
    "Can you summarise the main points in a few bullet points?",
    "What are the most common misconceptions?",
    "How would you explain this to a complete beginner?",
    "What should I read next to learn more?",
    "Please write a short overview of about three paragraphs.",
    "Could you give me a step-by-step plan to get started?",
    "What are the main pros and cons?",
    "Can you suggest three questions I could use to test my understanding?",
    "Please point out anything in my notes that is wrong.",
]

OPENERS = [
    "Great question!",
    "Sure, here is an overview.",
    "Happy to help with that.",
    "Here's a concise explanation.",
    "Let's break it down.",
    "",
]

CLOSERS = [
    "Let me know if you'd like more detail on any of these points.",
    "I hope this helps!",
    "If you tell me more about your situation, I can tailor the advice.",
    "Feel free to ask a follow-up question.",
    "",
]


@dataclass
class Writer:
    """Composes invented prompts and answers from the topic facts."""

    rng: random.Random

    def topic(self) -> str:
        return self.rng.choice(list(TOPICS))

    def facts(self, topic: str, k: int) -> str:
        return " ".join(self.rng.sample(TOPICS[topic], k))

    def question(self, topic: str) -> str:
        """One short sentence up to several paragraphs."""
        size = self.rng.choice(["short", "short", "medium", "medium", "medium", "long"])
        if size == "short":
            return self.rng.choice(SHORT_ASKS).format(t=topic)
        if size == "medium":
            return f"{self.rng.choice(CONTEXT)} Can you tell me about {topic}? {self.rng.choice(REQUESTS)}"
        facts = self.rng.sample(TOPICS[topic], 5)
        notes = "\n".join(f"- {fact}" for fact in facts[:3])
        return (
            f"{' '.join(self.rng.sample(CONTEXT, 2))}\n\n"
            f"I've been reading about {topic} and took these notes:\n{notes}\n\n"
            f"{' '.join(facts[3:])} At least, that's what I understood.\n\n{self.rng.choice(REQUESTS)}"
        )

    def answer(self, topic: str) -> str:
        body = self.facts(topic, self.rng.randint(2, 5))
        if self.rng.random() < 0.4:
            extra = "\n".join(f"{i}. {fact}" for i, fact in enumerate(self.rng.sample(TOPICS[topic], 3), 1))
            body = f"{body}\n\nKey points:\n{extra}"
        return "\n\n".join(part for part in (self.rng.choice(OPENERS), body, self.rng.choice(CLOSERS)) if part)

    def follow_up(self, topic: str) -> str:
        return self.rng.choice(
            [
                f"Thanks! Can you go deeper on the second point about {topic}?",
                "That makes sense. How would this apply in practice?",
                "Could you make that shorter?",
                f"Interesting. Is there any debate among experts about {topic}?",
                "Can you give me a concrete example?",
                "Now turn that into three quiz questions with answers.",
            ]
        )


# ---------------------------------------------------------------------------------------------------------------
# Invented coding tasks with reference implementations, so sample outputs and unit tests are correct.


@dataclass(frozen=True)
class Task:
    name: str
    statement: str  # completes "a function `name` that ..."
    input_spec: str
    output_spec: str
    sample: Callable[[random.Random], tuple]  # random arguments
    impl: Callable[..., object]
    solution: str  # Python source


def _ints(rng: random.Random, lo: int = -50, hi: int = 99, n: tuple[int, int] = (4, 9)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _word(rng: random.Random) -> str:
    return rng.choice(["level", "apple", "racecar", "stats", "banana", "noon", "kayak", "python", "refer", "data"])


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _two_sum_case(rng: random.Random) -> tuple[list[int], int]:
    nums = rng.sample(range(-20, 60), rng.randint(4, 8))
    i, j = rng.sample(range(len(nums)), 2)
    return nums, nums[i] + nums[j]


def _two_sum(nums: list[int], target: int) -> list[int]:
    seen: dict[int, int] = {}
    for j, x in enumerate(nums):
        if target - x in seen:
            return [seen[target - x], j]
        seen[x] = j
    return []


def _rle(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        out.append(f"{s[i]}{j - i}")
        i = j
    return "".join(out)


def _balanced(s: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for c in s:
        if c in pairs:
            if not stack or stack.pop() != pairs[c]:
                return False
        else:
            stack.append(c)
    return not stack


_ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def _roman(s: str) -> int:
    return sum(-_ROMAN[c] if k + 1 < len(s) and _ROMAN[s[k + 1]] > _ROMAN[c] else _ROMAN[c] for k, c in enumerate(s))


TASKS = [
    Task(
        "find_max",
        "returns the largest integer in the list, or `None` if the list is empty",
        "A list of integers `numbers` (0 ≤ len(numbers) ≤ 10^5).",
        "The maximum integer, or `None` for an empty list.",
        lambda rng: (_ints(rng),),
        lambda xs: max(xs) if xs else None,
        "def find_max(numbers):\n    if not numbers:\n        return None\n    best = numbers[0]\n"
        "    for x in numbers[1:]:\n        if x > best:\n            best = x\n    return best",
    ),
    Task(
        "is_palindrome",
        "checks whether a string reads the same forwards and backwards, ignoring case",
        "A string `s` of lowercase letters (1 ≤ len(s) ≤ 1000).",
        "`True` if `s` is a palindrome, `False` otherwise.",
        lambda rng: (_word(rng),),
        lambda s: s.lower() == s.lower()[::-1],
        "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]",
    ),
    Task(
        "count_vowels",
        "counts the vowels (a, e, i, o, u) in a string",
        "A string `text` (0 ≤ len(text) ≤ 10^4).",
        "The number of vowels in `text`.",
        lambda rng: (" ".join(_word(rng) for _ in range(rng.randint(1, 4))),),
        lambda s: sum(c in "aeiou" for c in s.lower()),
        "def count_vowels(text):\n    return sum(1 for c in text.lower() if c in 'aeiou')",
    ),
    Task(
        "fibonacci",
        "returns the n-th Fibonacci number, with `fibonacci(0) == 0` and `fibonacci(1) == 1`",
        "A non-negative integer `n` (0 ≤ n ≤ 90).",
        "The n-th Fibonacci number.",
        lambda rng: (rng.randint(3, 60),),
        _fib,
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    ),
    Task(
        "two_sum",
        "returns the indices of the two numbers that add up to `target`",
        "A list of distinct integers `nums` and an integer `target`; at least one pair adds up to `target`.",
        "A list `[i, j]` with `i < j`, the first such pair found scanning `j` from left to right.",
        _two_sum_case,
        _two_sum,
        "def two_sum(nums, target):\n    seen = {}\n    for j, x in enumerate(nums):\n        if target - x in seen:\n"
        "            return [seen[target - x], j]\n        seen[x] = j\n    return []",
    ),
    Task(
        "run_length_encode",
        "compresses a string with run-length encoding, writing each character followed by its count",
        "A string `s` of uppercase letters (1 ≤ len(s) ≤ 10^4).",
        "The encoded string.",
        lambda rng: ("".join(rng.choice("ABC") * rng.randint(1, 4) for _ in range(rng.randint(2, 6))),),
        _rle,
        "def run_length_encode(s):\n    out = []\n    i = 0\n    while i < len(s):\n        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n            j += 1\n        out.append(f'{s[i]}{j - i}')\n"
        "        i = j\n    return ''.join(out)",
    ),
    Task(
        "second_largest",
        "returns the second largest distinct value in the list, or `None` if there is none",
        "A list of integers `values` (0 ≤ len(values) ≤ 10^5).",
        "The second largest distinct integer, or `None`.",
        lambda rng: (_ints(rng, 0, 20),),
        lambda xs: sorted(set(xs))[-2] if len(set(xs)) > 1 else None,
        "def second_largest(values):\n    distinct = sorted(set(values))\n"
        "    return distinct[-2] if len(distinct) > 1 else None",
    ),
    Task(
        "balanced_brackets",
        "checks whether every bracket in a string of `()[]{}` is properly closed and nested",
        "A string `s` containing only the characters `()[]{}` (0 ≤ len(s) ≤ 10^4).",
        "`True` if the brackets are balanced, `False` otherwise.",
        lambda rng: ("".join(rng.choice("()[]{}") for _ in range(rng.randint(2, 8))),),
        _balanced,
        "def balanced_brackets(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n    for c in s:\n"
        "        if c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n                return False\n"
        "        else:\n            stack.append(c)\n    return not stack",
    ),
    Task(
        "moving_average",
        "returns the average of every window of `k` consecutive values, rounded to two decimals",
        "A list of integers `values` and a window size `k` (1 ≤ k ≤ len(values)).",
        "A list of floats, one per window.",
        lambda rng: (_ints(rng, 0, 30, (5, 8)), rng.randint(2, 3)),
        lambda xs, k: [round(sum(xs[i : i + k]) / k, 2) for i in range(len(xs) - k + 1)],
        "def moving_average(values, k):\n    window = sum(values[:k])\n    out = [round(window / k, 2)]\n"
        "    for i in range(k, len(values)):\n        window += values[i] - values[i - k]\n"
        "        out.append(round(window / k, 2))\n    return out",
    ),
    Task(
        "roman_to_int",
        "converts a Roman numeral to an integer",
        "A valid Roman numeral `s` representing a number from 1 to 3999.",
        "The integer value of `s`.",
        lambda rng: (rng.choice(["XIV", "MCMXCIV", "LVIII", "IX", "CDXLIV", "MMXXV", "DCCC", "XC", "CMXCIX"]),),
        _roman,
        "def roman_to_int(s):\n    values = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n"
        "    total = 0\n    for k, c in enumerate(s):\n        v = values[c]\n"
        "        total += -v if k + 1 < len(s) and values[s[k + 1]] > v else v\n    return total",
    ),
    Task(
        "digit_sum",
        "returns the sum of the decimal digits of a non-negative integer",
        "A non-negative integer `n` (0 ≤ n ≤ 10^18).",
        "The sum of the digits of `n`.",
        lambda rng: (rng.randint(10, 10**12),),
        lambda n: sum(map(int, str(n))),
        "def digit_sum(n):\n    total = 0\n    while n:\n        n, d = divmod(n, 10)\n"
        "        total += d\n    return total",
    ),
    Task(
        "merge_sorted",
        "merges two sorted lists into one sorted list without calling `sorted`",
        "Two lists of integers `a` and `b`, each sorted in non-decreasing order.",
        "A single sorted list containing every element of `a` and `b`.",
        lambda rng: (sorted(_ints(rng, 0, 40, (2, 5))), sorted(_ints(rng, 0, 40, (2, 5)))),
        lambda a, b: sorted(a + b),
        "def merge_sorted(a, b):\n    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
        "            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]",
    ),
]


def _call_repr(args: tuple) -> str:
    return ", ".join(repr(a) for a in args)


# ---------------------------------------------------------------------------------------------------------------
# Invented maths problems with computed answers (B4, B5)


@dataclass(frozen=True)
class MathProblem:
    question: str
    steps: str  # a short worked reasoning
    answer: str


def math_problem(rng: random.Random) -> MathProblem:
    kind = rng.randrange(6)
    if kind == 0:
        a, b, m = rng.randint(2, 19), rng.randint(5, 60), rng.randint(3, 13)
        return MathProblem(
            f"What is the remainder when ${a}^{{{b}}}$ is divided by ${m}$?",
            f"Powers of {a} modulo {m} repeat, so I can reduce step by step instead of computing {a}^{b} directly.",
            str(pow(a, b, m)),
        )
    if kind == 1:
        a, d, n = rng.randint(1, 30), rng.randint(2, 9), rng.randint(10, 60)
        return MathProblem(
            f"The first term of an arithmetic sequence is {a} and the common difference is {d}. "
            f"What is the sum of the first {n} terms?",
            f"The last term is {a} + {n - 1}*{d} = {a + (n - 1) * d}, and the sum is n times the average of the "
            f"first and last terms: {n} * ({a} + {a + (n - 1) * d}) / 2.",
            str(n * (2 * a + (n - 1) * d) // 2),
        )
    if kind == 2:
        a, b = rng.randint(6, 90), rng.randint(6, 90)
        g = _gcd(a, b)
        return MathProblem(
            f"Find the least common multiple of {a} and {b}.",
            f"gcd({a}, {b}) = {g}, and lcm = a*b/gcd = {a * b}/{g}.",
            str(a * b // g),
        )
    if kind == 3:
        n = rng.randint(24, 720)
        count = sum(1 for k in range(1, n + 1) if n % k == 0)
        return MathProblem(
            f"How many positive divisors does {n} have?",
            f"Factor {n} into primes and multiply one more than each exponent.",
            str(count),
        )
    if kind == 4:
        s = rng.randint(2, 12)
        ways = sum(1 for x in range(1, 7) for y in range(1, 7) if x + y == s)
        g = _gcd(ways, 36)
        return MathProblem(
            f"Two fair six-sided dice are rolled. What is the probability that the sum is {s}? "
            "Express your answer as a common fraction.",
            f"There are 36 equally likely outcomes and {ways} of them sum to {s}.",
            f"\\frac{{{ways // g}}}{{{36 // g}}}",
        )
    length, width = rng.randint(3, 40), rng.randint(2, 30)
    return MathProblem(
        f"A rectangle has a perimeter of {2 * (length + width)} cm and one side of length {length} cm. "
        "What is its area in square centimetres?",
        f"Half the perimeter is {length + width}, so the other side is {length + width} - {length} = {width}.",
        str(length * width),
    )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


# ---------------------------------------------------------------------------------------------------------------
# Row assembly shared by all files


def unique_rows(make: Callable[[random.Random, int], tuple[dict, str]], rng: random.Random) -> list[dict]:
    """UNIQUE_ROWS rows whose prompt-bearing parts (the key) all differ, so the only duplicates are planted ones."""
    rows: list[dict] = []
    seen: set[str] = set()
    while len(rows) < UNIQUE_ROWS:
        row, key = make(rng, len(rows))
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


def with_duplicates(rows: list[dict], rng: random.Random) -> list[dict]:
    """Insert 2-3 exact copies of existing rows at random positions."""
    copies = [json.loads(json.dumps(row)) for row in rng.sample(rows, rng.choice([2, 3]))]
    out = list(rows)
    for row in copies:
        out.insert(rng.randrange(len(out) + 1), row)
    return out


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


# ---------------------------------------------------------------------------------------------------------------
# B1 glaiveai/glaive-function-calling-v2: {"system": str, "chat": str}

GLAIVE_WITH_FUNCTIONS = (
    "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -"
)
GLAIVE_NO_FUNCTIONS = "SYSTEM: You are a helpful assistant, with no access to external functions."
GLAIVE_EOS = " <|endoftext|>"


@dataclass(frozen=True)
class Function:
    spec: dict
    draw: Callable[[random.Random], dict]  # call arguments
    ask: Callable[[dict, random.Random], str]  # the user's request for those arguments
    result: Callable[[dict, random.Random], dict]
    reply: Callable[[dict, dict], str]


def _params(required: list[str], **props: tuple[str, str]) -> dict:
    return {
        "type": "object",
        "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
        "required": required,
    }


MOVIES = [
    "Schindler's List",
    "Ocean's Eleven",
    "Singin' in the Rain",
    "Ferris Bueller's Day Off",
    "The King's Speech",
    "Howl's Moving Castle",
    "Inception",
    "The Matrix",
    "Amélie",
    "Arrival",
]
NOTES = [
    ("Groceries", "Buy milk\nCall the plumber about the kitchen sink"),
    ("Reminder", "Don't forget Mom's birthday on Friday"),
    ("Meeting", "Agenda:\n1. Budget review\n2. Q3 hiring plan\n3. Anything else"),
    ("Books", "Read 'The Name of the Wind' next"),
    ("Trip", "Pack passport\nCheck in online 24h before"),
    ("Ideas", "Podcast about the city's hidden gardens"),
]
EMAILS = [
    ("boss@example.com", "Running late", "Hi,\nI'm stuck in traffic and will be 15 minutes late.\nSorry!"),
    ("team@example.com", "Friday's demo", "Hi team,\nThe demo's moved to 3pm. Please bring your laptops."),
    ("anna@example.com", "Thanks", "Thank you for yesterday's help, it's much appreciated."),
    ("landlord@example.com", "Heating", "Hello,\nThe heating in flat 4 isn't working again.\nBest regards"),
]
PHRASES = [
    "I'd like a coffee, please",
    "Where's the train station?",
    "It's a beautiful day",
    "We're going to the museum tomorrow",
    "How much does this cost?",
    "Don't worry about it",
]
CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Toronto", "Mumbai", "Sydney", "Cairo", "Denver"]
INGREDIENTS = ["chicken", "rice", "broccoli", "tomatoes", "eggs", "spinach", "lentils", "garlic"]
DISHES = ["stir-fry", "bake", "soup", "curry", "salad"]
CURRENCIES = {
    "USD": "US dollars",
    "EUR": "Euros",
    "GBP": "British pounds",
    "JPY": "Japanese yen",
    "INR": "Indian rupees",
    "CAD": "Canadian dollars",
}

FUNCTIONS = [
    Function(
        {
            "name": "convert_currency",
            "description": "Convert an amount from one currency to another",
            "parameters": _params(
                ["amount", "from_currency", "to_currency"],
                amount=("number", "The amount to convert"),
                from_currency=("string", "The currency to convert from"),
                to_currency=("string", "The currency to convert to"),
            ),
        },
        lambda rng: dict(
            zip(
                ["amount", "from_currency", "to_currency"],
                [rng.choice([50, 100, 250, 500, 1200, 3000]), *rng.sample(list(CURRENCIES), 2)],
                strict=True,
            )
        ),
        lambda a, rng: (
            f"Hi, I need to convert {a['amount']} {CURRENCIES[a['from_currency']]} to "
            f"{CURRENCIES[a['to_currency']]}. Can you help me with that?"
        ),
        lambda a, rng: {
            "converted_amount": round(a["amount"] * rng.uniform(0.5, 1.6), 2),
            "from_currency": a["from_currency"],
            "to_currency": a["to_currency"],
        },
        lambda a, r: (
            f"Sure, {a['amount']} {a['from_currency']} is approximately {r['converted_amount']} {a['to_currency']}."
        ),
    ),
    Function(
        {
            "name": "calculate_bmi",
            "description": "Calculate the Body Mass Index (BMI)",
            "parameters": _params(
                ["weight", "height"],
                weight=("number", "The weight in kilograms"),
                height=("number", "The height in meters"),
            ),
        },
        lambda rng: {"weight": rng.randint(48, 110), "height": rng.choice([1.55, 1.62, 1.7, 1.75, 1.83, 1.9])},
        lambda a, rng: f"I weigh {a['weight']} kilograms and I'm {a['height']} meters tall. What's my BMI?",
        lambda a, rng: {"bmi": round(a["weight"] / a["height"] ** 2, 2)},
        lambda a, r: (
            f"Your Body Mass Index (BMI) is {r['bmi']}. "
            + (
                "This is within the normal range."
                if 18.5 <= r["bmi"] < 25
                else "You may want to discuss it with a doctor."
            )
        ),
    ),
    Function(
        {
            "name": "get_movie_details",
            "description": "Get details about a movie",
            "parameters": _params(["title"], title=("string", "The title of the movie")),
        },
        lambda rng: {"title": rng.choice(MOVIES)},
        lambda a, rng: rng.choice(
            [f'Can you tell me about the movie "{a["title"]}"?', f"What's {a['title']} about and who directed it?"]
        ),
        lambda a, rng: {
            "title": a["title"],
            "year": rng.randint(1952, 2016),
            "director": rng.choice(["S. Rivera", "M. Okafor", "J. Lindqvist", "H. Tanaka"]),
            "rating": round(rng.uniform(6.5, 9.2), 1),
        },
        lambda a, r: (
            f'"{r["title"]}" was released in {r["year"]} and directed by {r["director"]}. '
            f"It has a rating of {r['rating']}."
        ),
    ),
    Function(
        {
            "name": "create_note",
            "description": "Create a new note",
            "parameters": _params(
                ["title", "content"],
                title=("string", "The title of the note"),
                content=("string", "The content of the note"),
            ),
        },
        lambda rng: dict(zip(["title", "content"], rng.choice(NOTES), strict=True)),
        lambda a, rng: f'I need to create a note titled "{a["title"]}". It should say:\n{a["content"]}',
        lambda a, rng: {"status": "success", "message": f"Note '{a['title']}' created successfully"},
        lambda a, r: f'Your note titled "{a["title"]}" has been created successfully.',
    ),
    Function(
        {
            "name": "get_weather",
            "description": "Get the current weather for a location",
            "parameters": _params(["location"], location=("string", "The city, e.g. Paris")),
        },
        lambda rng: {"location": rng.choice(CITIES)},
        lambda a, rng: rng.choice(
            [f"What's the weather like in {a['location']} right now?", f"Should I take an umbrella in {a['location']}?"]
        ),
        lambda a, rng: {"temperature": rng.randint(-5, 35), "condition": rng.choice(["sunny", "cloudy", "rainy"])},
        lambda a, r: f"It is currently {r['temperature']}°C and {r['condition']} in {a['location']}.",
    ),
    Function(
        {
            "name": "calculate_tip",
            "description": "Calculate the tip amount for a bill",
            "parameters": _params(
                ["bill_amount", "tip_percentage"],
                bill_amount=("number", "The total bill amount"),
                tip_percentage=("number", "The tip percentage"),
            ),
        },
        lambda rng: {"bill_amount": rng.choice([24, 37.5, 58, 85, 120]), "tip_percentage": rng.choice([10, 15, 20])},
        lambda a, rng: (
            f"My bill is ${a['bill_amount']} and I want to leave a {a['tip_percentage']}% tip. How much is that?"
        ),
        lambda a, rng: {"tip_amount": round(a["bill_amount"] * a["tip_percentage"] / 100, 2)},
        lambda a, r: f"The tip amount for your bill is ${r['tip_amount']}.",
    ),
    Function(
        {
            "name": "send_email",
            "description": "Send an email to a recipient",
            "parameters": _params(
                ["recipient", "subject", "message"],
                recipient=("string", "The email address"),
                subject=("string", "The subject line"),
                message=("string", "The body of the email"),
            ),
        },
        lambda rng: dict(zip(["recipient", "subject", "message"], rng.choice(EMAILS), strict=True)),
        lambda a, rng: (
            f'Please email {a["recipient"]} with the subject "{a["subject"]}" and this message:\n{a["message"]}'
        ),
        lambda a, rng: {"status": "sent", "message_id": _hex(rng, 12)},
        lambda a, r: f"The email to {a['recipient']} has been sent.",
    ),
    Function(
        {
            "name": "translate_text",
            "description": "Translate text from one language to another",
            "parameters": _params(
                ["text", "source_language", "target_language"],
                text=("string", "The text to translate"),
                source_language=("string", "The source language"),
                target_language=("string", "The target language"),
            ),
        },
        lambda rng: {
            "text": rng.choice(PHRASES),
            "source_language": "English",
            "target_language": rng.choice(["French", "Spanish", "German", "Italian"]),
        },
        lambda a, rng: f'How do I say "{a["text"]}" in {a["target_language"]}?',
        lambda a, rng: {"translated_text": f"[{a['target_language']}] {a['text']}"},
        lambda a, r: f"In {a['target_language']}, that is: {r['translated_text']}",
    ),
    Function(
        {
            "name": "search_recipes",
            "description": "Search for recipes by ingredients",
            "parameters": {
                "type": "object",
                "properties": {
                    "ingredients": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "The ingredients to use",
                    }
                },
                "required": ["ingredients"],
            },
        },
        lambda rng: {"ingredients": rng.sample(INGREDIENTS, rng.randint(2, 4))},
        lambda a, rng: f"I have {', '.join(a['ingredients'][:-1])} and {a['ingredients'][-1]}. What can I cook?",
        lambda a, rng: {
            "recipes": [{"name": f"{a['ingredients'][0].title()} {dish}"} for dish in rng.sample(DISHES, 2)]
        },
        lambda a, r: f"Here are some recipes you can try: {' and '.join(x['name'] for x in r['recipes'])}. Enjoy!",
    ),
    Function(
        {
            "name": "get_stock_price",
            "description": "Get the current stock price of a company",
            "parameters": _params(["symbol"], symbol=("string", "The stock ticker symbol")),
        },
        lambda rng: {"symbol": rng.choice(["AAPL", "MSFT", "GOOGL", "AMZN", "NVDA", "TSLA"])},
        lambda a, rng: f"What's the current price of {a['symbol']} stock?",
        lambda a, rng: {"symbol": a["symbol"], "price": round(rng.uniform(80, 900), 2)},
        lambda a, r: f"The current price of {a['symbol']} is ${r['price']}.",
    ),
]

REFUSALS = [
    (
        "Can you also book a flight to {city} for me?",
        "I'm sorry, but I can't book flights. I can only help with the functions I have access to.",
    ),
    (
        "Could you order a pizza to my address?",
        "I'm sorry, but I'm unable to place orders. My capabilities are limited to the functions provided to me.",
    ),
]


def _glaive_call(function: Function, args: dict, rng: random.Random) -> str:
    arguments = json.dumps(args, ensure_ascii=False)
    # glaive's quirk: argument strings sometimes hold raw newlines instead of \n escapes.
    if rng.random() < 0.5:
        arguments = arguments.replace("\\n", "\n")
    name = json.dumps(function.spec["name"])
    return f'<functioncall> {{"name": {name}, "arguments": \'{arguments}\'}}{GLAIVE_EOS}'


def _glaive_system(functions: list[Function], rng: random.Random) -> str:
    # The separator between back-to-back definitions is unverified upstream; vary it.
    defs = rng.choice(["\n\n", "\n", ""]).join(json.dumps(f.spec, indent=4, ensure_ascii=False) for f in functions)
    system = f"{GLAIVE_WITH_FUNCTIONS}\n{defs}"
    # About a third of the real rows have definitions that do not parse; keep a few broken ones.
    if rng.random() < 0.04:
        system = system[: -rng.randint(2, 12)]
    return system


def b1_row(rng: random.Random, index: int) -> tuple[dict, str]:
    writer = Writer(rng)
    turns: list[tuple[str, str]] = []
    if rng.random() < 0.25:
        system = GLAIVE_NO_FUNCTIONS
        topic = writer.topic()
        turns += [("USER", writer.question(topic)), ("ASSISTANT", writer.answer(topic) + GLAIVE_EOS)]
        for _ in range(rng.randint(0, 2)):
            turns += [("USER", writer.follow_up(topic)), ("ASSISTANT", writer.answer(topic) + GLAIVE_EOS)]
    else:
        functions = rng.sample(FUNCTIONS, rng.choice([1, 1, 2]))
        system = _glaive_system(functions, rng)
        if rng.random() < 0.2:
            turns += [("USER", "Hi there!"), ("ASSISTANT", "Hello! How can I assist you today?" + GLAIVE_EOS)]
        asked: set[str] = set()
        for _ in range(rng.choice([1, 1, 2])):
            function = rng.choice(functions)
            args = function.draw(rng)
            ask = function.ask(args, rng)
            if ask in asked:  # a repeated request would repeat the final answer inside the history
                continue
            asked.add(ask)
            result = function.result(args, rng)
            # Prose and call in one turn, as in part of the real data.
            prose = rng.choice(["Let me check that for you. ", "Sure, one moment. "]) if rng.random() < 0.25 else ""
            turns += [
                ("USER", ask),
                ("ASSISTANT", prose + _glaive_call(function, args, rng)),
                ("FUNCTION RESPONSE", json.dumps(result, ensure_ascii=False)),
            ]
            reply = function.reply(args, result)
            if rng.random() < 0.06:  # two consecutive ASSISTANT turns
                turns.append(("ASSISTANT", "Here is what I found." + GLAIVE_EOS))
            turns.append(("ASSISTANT", reply + GLAIVE_EOS))
        if rng.random() < 0.15:
            ask, refusal = rng.choice(REFUSALS)
            turns += [("USER", ask.format(city=rng.choice(CITIES))), ("ASSISTANT", refusal + GLAIVE_EOS)]
    if rng.random() < 0.05:  # an empty USER turn after the last answer
        turns.append(("USER", ""))
    chat = "\n\n\n".join(f"{tag}: {body}" for tag, body in turns) + "\n\n\n"
    last = max(i for i, (tag, body) in enumerate(turns) if tag == "FUNCTION RESPONSE" or (tag == "USER" and body))
    return {"system": system, "chat": chat}, json.dumps([system, turns[: last + 1]])


def b1_glaive(rng: random.Random) -> list[dict]:
    return with_duplicates(unique_rows(b1_row, rng), rng)


# ---------------------------------------------------------------------------------------------------------------
# B2 nvidia/OpenCodeInstruct: all columns are strings

OCI_INTROS = [
    "You are given {input_lower} Your task is to implement a function `{name}` that {statement}.",
    "Implement a function `{name}` that {statement}.",
    "Write a Python function named `{name}` that {statement}. Your function should be efficient and handle edge cases.",
    "In this problem, you need to write a function `{name}` that {statement}. Think about the corner cases first.",
]
OCI_CONSTRAINTS = [
    "",
    "Your solution should run in linear time.",
    "Do not use any external libraries.",
    "Include a docstring that explains the parameters.",
    "The function must not modify its input.",
    "Aim for a readable solution rather than a clever one.",
]
OCI_CLASSES = [
    (
        "BankAccount",
        "a bank account",
        ["deposit(amount)", "withdraw(amount)", "get_balance()"],
        "Withdrawals that exceed the balance must raise a `ValueError`.",
    ),
    (
        "Inventory",
        "a shop inventory",
        ["add_item(name, quantity)", "remove_item(name, quantity)", "total_items()"],
        "Removing more items than are in stock must raise a `ValueError`.",
    ),
    (
        "TemperatureLog",
        "a log of temperature readings",
        ["record(celsius)", "average()", "maximum()"],
        "`average()` and `maximum()` must return `None` when no readings exist.",
    ),
    (
        "Library",
        "a small library",
        ["add_book(title, author)", "checkout(title)", "available_books()"],
        "Checking out a book that is already checked out must return `False`.",
    ),
]


def _method_signature(method: str) -> str:
    """'deposit(amount)' -> 'deposit(self, amount)'."""
    name, params = method.rstrip(")").split("(")
    return f"{name}({', '.join(['self'] + [p for p in params.split(', ') if p])})"


def _judgement(rng: random.Random) -> str:
    dims = ["Requirement Conformance", "Logical Correctness", "Edge Case Consideration"]
    notes = [
        "The solution fully meets the requirements.",
        "The logic is correct and consistent.",
        "Handles the empty input case.",
        "Does not validate the input type.",
        "Minor issue with negative numbers.",
    ]
    return json.dumps({d: {"score": rng.choice([3, 4, 5, 5, 5]), "justification": rng.choice(notes)} for d in dims})


def b2_row(rng: random.Random, index: int) -> tuple[dict, str]:
    if rng.random() < 0.2:
        name, what, methods, rule = rng.choice(OCI_CLASSES)
        listed = "\n".join(f"- `{m}`" for m in methods)
        text = (
            f"Implement a class `{name}` that models {what}. The class should support the following methods:\n"
            f"{listed}\n\n{rule} {rng.choice(OCI_CONSTRAINTS)}".rstrip()
        )
        body = "\n\n".join(f"    def {_method_signature(m)}:\n        raise NotImplementedError" for m in methods)
        output = f"```python\nclass {name}:\n    def __init__(self):\n        self._items = {{}}\n\n{body}\n```"
        tests = [f"assert hasattr({name}(), '{m.split('(')[0]}')" for m in methods]
        domain, key = "generic", text
    else:
        task = rng.choice(TASKS)
        args = task.sample(rng)
        intro = rng.choice(OCI_INTROS).format(
            name=task.name, statement=task.statement, input_lower=task.input_spec[0].lower() + task.input_spec[1:]
        )
        text = (
            f"{intro} {rng.choice(OCI_CONSTRAINTS)}".rstrip()
            + f"\n\n**Input:**\n- {task.input_spec}\n\n**Output:**\n- {task.output_spec}\n\n"
            f"**Sample Input:**\n```\n{_call_repr(args)}\n```\n\n**Sample Output:**\n```\n{task.impl(*args)!r}\n```"
        )
        output = f"```python\n{task.solution}\n```"
        cases = [args] + [task.sample(rng) for _ in range(rng.randint(2, 5))]
        tests = [f"assert {task.name}({_call_repr(c)}) == {task.impl(*c)!r}" for c in cases]
        domain, key = "algorithmic", text
    status = ["pass" if rng.random() < 0.93 else "fail" for _ in tests]
    row = {
        "id": _hex(rng, 32),
        "input": text,
        "output": output,
        "domain": domain,
        "generation_algorithm": rng.choice(["self-instruct", "evol-instruct"]),
        "llm_judgement": _judgement(rng),
        "unit_tests": json.dumps(tests),
        "tests_execution_status": json.dumps(status),
        "average_test_score": str(status.count("pass") / len(status)),
    }
    return row, key


def b2_opencodeinstruct(rng: random.Random) -> list[dict]:
    return with_duplicates(unique_rows(b2_row, rng), rng)


# ---------------------------------------------------------------------------------------------------------------
# B3 ise-uiuc/Magicoder-OSS-Instruct-75K

LANGS = {
    "python": "Python",
    "rust": "Rust",
    "typescript": "TypeScript",
    "java": "Java",
    "cpp": "C++",
    "swift": "Swift",
    "php": "PHP",
    "shell": "Shell",
    "csharp": "C#",
    "go": "Go",
}
STUBS = {
    "rust": "pub fn {name}(input: &[i64]) -> i64 {{\n    // TODO\n    unimplemented!()\n}}",
    "typescript": "export function {name}(input: number[]): number {{\n  // TODO\n"
    "  throw new Error('not implemented');\n}}",
    "java": "public class Solution {{\n    public static int {name}(int[] input) {{\n        // TODO\n"
    "        return 0;\n    }}\n}}",
    "cpp": "#include <vector>\n\nint {name}(const std::vector<int>& input) {{\n    // TODO\n    return 0;\n}}",
    "swift": "func {name}(_ input: [Int]) -> Int {{\n    // TODO\n    return 0\n}}",
    "php": "<?php\nfunction {name}(array $input): int {{\n    // TODO\n    return 0;\n}}",
    "shell": "#!/bin/bash\n# usage: ./{name}.sh <values...>\n{name}() {{\n    # TODO\n    :\n}}",
    "csharp": "public static class Solution\n{{\n    public static int {name}(int[] input)\n    {{\n"
    "        // TODO\n        return 0;\n    }}\n}}",
    "go": "package solution\n\nfunc {name}(input []int) int {{\n\t// TODO\n\treturn 0\n}}",
}
OSS_CONTEXT = [
    "This function is part of a data-processing library used by a logistics company.",
    "The function will be called from a command-line tool that reads values from standard input.",
    "You are working on a small analytics service and need this helper for one of its endpoints.",
    "The code snippet below comes from an open-source project that is being refactored.",
    "Performance matters because the function runs inside a tight loop.",
    "",
]


def b3_row(rng: random.Random, index: int) -> tuple[dict, str]:
    lang = rng.choice(list(LANGS))
    task = rng.choice(TASKS)
    args = task.sample(rng)
    stub = f"def {task.name}(*args):\n    # TODO\n    pass" if lang == "python" else STUBS[lang].format(name=task.name)
    seed = "" if rng.random() < 0.15 else stub
    snippet = (
        f"\n\nYou are given the following code snippet as a starting point:\n```{lang}\n{seed}\n```"
        if seed and rng.random() < 0.6
        else ""
    )
    problem = (
        f"You are tasked with implementing a {LANGS[lang]} function `{task.name}` that {task.statement}. "
        f"{rng.choice(OSS_CONTEXT)}".rstrip()
        + f"{snippet}\n\n"
        f"Your task is to complete the implementation of `{task.name}`.\n\n"
        f"Input: {task.input_spec}\nOutput: {task.output_spec}\n\n"
        f"For example, given `{_call_repr(args)}`, the function should return `{task.impl(*args)!r}`."
    )
    code = (
        task.solution
        if lang == "python"
        else stub.replace("// TODO", "// iterate over the input once").replace(
            "# TODO", "# iterate over the input once"
        )
    )
    solution = f"```{lang}\n{code}\n```\n\nThe `{task.name}` function {task.statement}, visiting each element once."
    row = {
        "lang": lang,
        "raw_index": rng.randint(0, 999_999),
        "index": index,
        "seed": seed,
        "openai_fingerprint": "fp_" + _hex(rng, 10),
        "problem": problem,
        "solution": solution,
    }
    return row, problem


def b3_magicoder(rng: random.Random) -> list[dict]:
    return with_duplicates(unique_rows(b3_row, rng), rng)


# ---------------------------------------------------------------------------------------------------------------
# B4 open-r1/Mixture-of-Thoughts: {"messages": [user, assistant], "num_tokens": int, "source": str}


def _codeforces(rng: random.Random) -> tuple[str, str, str]:
    task = rng.choice(TASKS)
    args = task.sample(rng)
    question = (
        f"You are given some data and must write a program whose core is a function that {task.statement}.\n\n"
        f"Input\n\n{task.input_spec} The input is given on a single line.\n\n"
        f"Output\n\n{task.output_spec}\n\nExamples\n\nInput\n\n{_call_repr(args)}\n\nOutput\n\n{task.impl(*args)!r}\n\n"
        "Note\n\nRead the input from standard input and write the answer to standard output."
    )
    thinking = (
        f"Okay, I need to figure out how to solve this. The function {task.statement}. "
        f"For the sample {_call_repr(args)} the answer should be {task.impl(*args)!r}. "
        "Let me think about edge cases first, then write a simple linear pass."
    )
    return question, thinking, f"```python\n{task.solution}\n```"


def b4_row(rng: random.Random, index: int) -> tuple[dict, str]:
    domain = rng.choice(["math", "code", "science"])
    if domain == "math":
        p = math_problem(rng)
        question = p.question
        thinking = (
            f"Okay, let's see. {p.steps} Let me double-check that. Yes, that seems right, so the answer is {p.answer}."
        )
        answer = f"{p.steps}\n\nThe answer is $\\boxed{{{p.answer}}}$."
        source = "open-r1/OpenR1-Math-220k"
    elif domain == "code":
        question, thinking, answer = _codeforces(rng)
        source = "open-r1/codeforces-cots"
    else:
        writer = Writer(rng)
        topic = writer.topic()
        question = writer.question(topic)
        thinking = f"Hmm, the user is asking about {topic}. {writer.facts(topic, 2)} I should keep the answer focused."
        answer = writer.answer(topic)
        source = "nvidia/Llama-Nemotron-Post-Training-Dataset"
    reply = f"<think>\n{thinking}\n</think>\n\n{answer}"
    messages = [{"content": question, "role": "user"}, {"content": reply, "role": "assistant"}]
    return {"messages": messages, "num_tokens": (len(question) + len(reply)) // 4, "source": source}, question


def b4_mixture_of_thoughts(rng: random.Random) -> list[dict]:
    return with_duplicates(unique_rows(b4_row, rng), rng)


# ---------------------------------------------------------------------------------------------------------------
# B5 open-thoughts/OpenThoughts-114k: {"system": str, "conversations": [{"from": "user"|"assistant", "value"}]}

OPENTHOUGHTS_SYSTEM = (
    "Your role as an assistant involves thoroughly exploring questions through a systematic long thinking process "
    "before providing the final precise and accurate solutions. Structure your response in two main sections: "
    "Thought and Solution. In the Thought section, write your reasoning using the specified format: "
    "<|begin_of_thought|> {thought with steps separated with '\\n\\n'} <|end_of_thought|>. Each step should analyse "
    "the question, summarise relevant findings, brainstorm new ideas, verify the accuracy of the current steps, "
    "refine any errors, and revisit previous steps. In the Solution section, based on the attempts in the Thought "
    "section, present the final solution that you deem correct, using the format: <|begin_of_solution|> "
    "{final formatted, precise, and clear solution} <|end_of_solution|>. Now, try to solve the following question "
    "through the above guidelines:"
)


def b5_row(rng: random.Random, index: int) -> tuple[dict, str]:
    if rng.random() < 0.7:
        p = math_problem(rng)
        question = f"Return your final response within \\boxed{{}}. {p.question}"
        thought = (
            f"Okay, so I need to solve this.\n\n{p.steps}\n\nLet me verify once more.\n\nThe result is {p.answer}."
        )
        solution = f"{p.steps}\n\nTherefore, the answer is \\(\\boxed{{{p.answer}}}\\)."
    else:
        question, thinking, code = _codeforces(rng)
        question = (
            "Generate an executable Python function generated from the given prompt. The function should take "
            "stdin as input and print the output. Simply call the function after the definition." + question
        )
        thought, solution = thinking, f"To solve this problem we make a single pass over the input.\n\n{code}"
    value = (
        f"<|begin_of_thought|>\n\n{thought}\n\n<|end_of_thought|>\n\n"
        f"<|begin_of_solution|>\n\n{solution}\n\n<|end_of_solution|>"
    )
    row = {
        "system": OPENTHOUGHTS_SYSTEM,
        "conversations": [{"from": "user", "value": question}, {"from": "assistant", "value": value}],
    }
    return row, question


def b5_openthoughts(rng: random.Random) -> list[dict]:
    return with_duplicates(unique_rows(b5_row, rng), rng)


# ---------------------------------------------------------------------------------------------------------------
# B6 HuggingFaceH4/ultrachat_200k: {"prompt", "prompt_id", "messages"}, messages[0].content == prompt


def b6_row(rng: random.Random, index: int) -> tuple[dict, str]:
    writer = Writer(rng)
    topic = writer.topic()
    prompt = writer.question(topic)
    messages = [{"content": prompt, "role": "user"}, {"content": writer.answer(topic), "role": "assistant"}]
    for _ in range(rng.choice([0, 1, 1, 2])):
        messages += [
            {"content": writer.follow_up(topic), "role": "user"},
            {"content": writer.answer(topic), "role": "assistant"},
        ]
    row = {"prompt": prompt, "prompt_id": hashlib.sha256(prompt.encode()).hexdigest(), "messages": messages}
    return row, prompt


def b6_ultrachat(rng: random.Random) -> list[dict]:
    return with_duplicates(unique_rows(b6_row, rng), rng)


# ---------------------------------------------------------------------------------------------------------------
# B7 ShareGPT: {"id", "conversations": [{"from", "value"}]} with all the scraped-data quirks

FOREIGN = [
    (
        "¿Puedes explicarme cómo funciona la fotosíntesis?",
        "Claro. La fotosíntesis convierte la luz en energía química.",
    ),
    ("Écris un court poème sur la mer.", "La mer respire,\nles vagues murmurent,\nle sel reste sur mes lèvres."),
    (
        "Was ist der Unterschied zwischen Wetter und Klima?",
        "Wetter beschreibt kurzfristige Zustände, Klima den langjährigen Durchschnitt.",
    ),
    ("Qual è la capitale dell'Australia?", "La capitale dell'Australia è Canberra."),
]


def b7_row(rng: random.Random, index: int) -> tuple[dict, str]:
    writer = Writer(rng)
    topic = writer.topic()
    turns: list[dict] = []
    kind = rng.random()
    if kind < 0.05:
        question, reply = rng.choice(FOREIGN)
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": reply}]
    for k in range(rng.randint(1, 3)):
        ask = writer.question(topic) if k == 0 else writer.follow_up(topic)
        answer = writer.answer(topic)
        if rng.random() < 0.05:  # HTML residue from the scrape
            answer = "<div><p>" + answer.replace("\n\n", "</p><p>") + "</p></div>"
        turns += [{"from": "human", "value": ask}, {"from": "gpt", "value": answer}]
    quirk = rng.random()
    if quirk < 0.05:  # a split conversation that opens with the bot
        turns.insert(0, {"from": "gpt", "value": writer.answer(topic)})
    elif quirk < 0.10:  # ends on the human: nothing to drop
        turns.append({"from": "human", "value": writer.follow_up(topic)})
    elif quirk < 0.14:
        turns.insert(0, {"from": "system", "value": "You are ChatGPT, a large language model. Answer concisely."})
    elif quirk < 0.17:  # an empty bot turn in the middle
        turns.insert(2, {"from": "gpt", "value": ""})
    elif quirk < 0.20:  # consecutive human turns
        turns.insert(1, {"from": "human", "value": "Also, please keep it short."})
    elif quirk < 0.25:  # other assistant names found in the dumps
        name = rng.choice(["chatgpt", "bing", "bard"])
        turns = [{**t, "from": name} if t["from"] == "gpt" else t for t in turns]
    elif quirk < 0.28:
        turns = [{**t, "from": "user"} if t["from"] == "human" else t for t in turns]
    suffix = rng.choice(["", "", "_0", "_1", "_2"])
    row = {"id": "".join(rng.choices(string.ascii_letters + string.digits, k=7)) + suffix, "conversations": turns}
    # Key on what the prompt will be: role names folded, empty turns gone, cut at the last human turn.
    spoken = [
        ("user" if t["from"] in ("human", "user") else t["from"] == "system", t["value"]) for t in turns if t["value"]
    ]
    last_user = max(i for i, (role, _) in enumerate(spoken) if role == "user")
    return row, json.dumps(spoken[: last_user + 1])


def b7_sharegpt(rng: random.Random) -> list[dict]:
    return with_duplicates(unique_rows(b7_row, rng), rng)


# ---------------------------------------------------------------------------------------------------------------
# B8 nebius/SWE-agent-trajectories: trajectory of {cutoff_date, mask, role: system|user|ai, system_prompt, text}

SWE_SYSTEM = (
    "SETTING: You are an autonomous programmer, and you're working directly in the command line with a special "
    "interface.\n\nThe special interface consists of a file editor that shows you 100 lines of a file at a time.\n"
    "In addition to typical bash commands, you can also use the following commands:\n\n"
    "open <path> [<line_number>] - opens the file at the given path in the editor\n"
    "goto <line_number> - moves the window to show <line_number>\n"
    "search_file <search_term> [<file>] - searches for search_term in file\n"
    "find_file <file_name> [<dir>] - finds all files with the given name in dir\n"
    "edit <start_line>:<end_line> - replaces lines start_line through end_line with the given text, "
    "terminated by a line with only end_of_edit\n"
    "submit - submits your current code and terminates the session\n\n"
    "RESPONSE FORMAT:\nYour output should always include _one_ discussion and _one_ command field EXACTLY as in the "
    "following example:\nDISCUSSION\nFirst I'll start by using ls to see what files are in the current directory.\n"
    "```\nls -a\n```\nYou should only include a *SINGLE* command in the command section."
)
REPOS = [
    ("pallets", "flask", "src/flask/app.py"),
    ("psf", "requests", "requests/sessions.py"),
    ("sympy", "sympy", "sympy/core/numbers.py"),
    ("django", "django", "django/db/models/query.py"),
    ("pydata", "xarray", "xarray/core/dataset.py"),
    ("pytest-dev", "pytest", "src/_pytest/python.py"),
    ("astropy", "astropy", "astropy/units/core.py"),
    ("sphinx-doc", "sphinx", "sphinx/ext/autodoc/__init__.py"),
]
SYMBOLS = [
    "_get_default",
    "merge_settings",
    "as_real_imag",
    "resolve_lookup",
    "to_dict",
    "collect_fixtures",
    "parse_unit",
    "format_signature",
    "__repr__",
    "_validate_keys",
]
BUGS = [
    "raises a TypeError when the argument is None",
    "returns the wrong value for negative inputs",
    "ignores the `strict` keyword",
    "loses the timezone information",
    "crashes on an empty mapping",
    "produces a misleading error message",
]


CODE_LINES = ["return value", "if key is None:", "result = {}", "pass", "self._cache.clear()", "raise ValueError(msg)"]


def _observation(rng: random.Random, path: str, repo: str) -> str:
    start = rng.randint(1, 400)
    lines = "\n".join(f"{start + k}:    {rng.choice(CODE_LINES)}" for k in range(rng.randint(3, 8)))
    return (
        f"[File: /{repo}/{path} ({rng.randint(400, 2500)} lines total)]\n{lines}\n"
        f"(Open file: /{repo}/{path})\n(Current directory: /{repo})\nbash-$"
    )


def b8_row(rng: random.Random, index: int) -> tuple[dict, str]:
    owner, repo, path = rng.choice(REPOS)
    symbol, bug = rng.choice(SYMBOLS), rng.choice(BUGS)
    issue = (
        f"We're currently solving the following issue within our repository. Here's the issue text:\nISSUE:\n"
        f"`{symbol}` {bug}\n\nSteps to reproduce: call `{symbol}` from a fresh virtualenv with version "
        f"{rng.randint(1, 5)}.{rng.randint(0, 12)}.\n\nINSTRUCTIONS:\nNow, you're going to solve this issue on "
        "your own. When you're satisfied with all of the changes you've made, you can submit them with the "
        "`submit` command.\n\n(Open file: n/a)\n(Current directory: /" + repo + ")\nbash-$"
    )
    model = rng.choice(["swe-agent-llama-8b", "swe-agent-llama-70b", "swe-agent-llama-405b"])

    def turn(role: str, text: str) -> dict:
        # Meaning and nulls of mask/system_prompt are unverified upstream: vary them.
        return {
            "cutoff_date": "01.01.2023",
            "mask": role == "ai",
            "role": role,
            "system_prompt": SWE_SYSTEM if role == "system" else rng.choice(["", None]),
            "text": text,
        }

    line = rng.randint(20, 400)
    steps = [
        (f"First, let's find the file that defines `{symbol}`.", f'search_file "{symbol}"'),
        ("Let's open the file at the definition.", f"open {path} {line}"),
        ("The bug is in the handling of the default case; let me look a little further down.", f"goto {line + 40}"),
        ("I'll write a small script to reproduce the issue.", "create reproduce.py"),
        ("Now let's run the reproduction script.", "python reproduce.py"),
        (
            "I'll fix the missing check.",
            f"edit {line}:{line + 1}\n        if value is None:\n            return default\nend_of_edit",
        ),
        ("Let's run the reproduction again to confirm the fix.", "python reproduce.py"),
    ]
    trajectory = [turn("system", SWE_SYSTEM), turn("user", issue)]
    for thought, command in steps[: rng.randint(2, len(steps))]:
        trajectory.append(turn("ai", f"DISCUSSION\n{thought}\n```\n{command}\n```"))
        trajectory.append(turn("user", _observation(rng, path, repo)))
    trajectory.append(
        turn("ai", "DISCUSSION\nThe fix works and the script runs cleanly. Let's submit.\n```\nsubmit\n```")
    )
    target = rng.random() < 0.17
    patch = (
        ""
        if rng.random() < 0.1
        else (
            f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
            f"@@ -{line},1 +{line},2 @@\n+        if value is None:\n+            return default\n"
        )
    )
    row = {
        "instance_id": f"{owner}__{repo}-{rng.randint(1000, 9999)}",
        "model_name": model,
        "target": target,
        "trajectory": trajectory,
        "exit_status": rng.choice(["submitted", "submitted", "submitted (exit_cost)", "submitted (exit_context)"]),
        "generated_patch": patch,
        "eval_logs": "" if not patch else f"Test results: {'PASSED' if target else 'FAILED'}\n",
    }
    return row, json.dumps(trajectory[:-1])


def b8_sweagent(rng: random.Random) -> list[dict]:
    return with_duplicates(unique_rows(b8_row, rng), rng)


# ---------------------------------------------------------------------------------------------------------------

BUILDERS: dict[str, Callable[[random.Random], list[dict]]] = {
    "B1_glaive": b1_glaive,
    "B2_opencodeinstruct": b2_opencodeinstruct,
    "B3_magicoder": b3_magicoder,
    "B4_mixture_of_thoughts": b4_mixture_of_thoughts,
    "B5_openthoughts": b5_openthoughts,
    "B6_ultrachat": b6_ultrachat,
    "B7_sharegpt": b7_sharegpt,
    "B8_sweagent": b8_sweagent,
}


def write_jsonl_gz(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False) + "\n").encode())


def rows_for(name: str) -> list[dict]:
    # One generator per file, seeded by name, so changing one builder leaves the other files byte-identical.
    return BUILDERS[name](random.Random(f"{SEED}:{name}"))


def main() -> None:
    for name in BUILDERS:
        rows = rows_for(name)
        path = DEMO / f"{name}.jsonl.gz"
        write_jsonl_gz(path, rows)
        print(f"{path.relative_to(DEMO.parent)}: {len(rows)} rows, {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
