"""Build a chat corpus offline for fitting a hidden-state head to a chat model (SmolLM2-135M-Instruct).

Users ask a chat model to explain things, write code, summarise and make things up. Text shipped in
installed packages gives the first three, as instruction + answer pairs:

* explain:   "Explain what `json.dumps` does."        -> its docstring (Python's own help text)
* code:      "Write a Python function ... that <doc>." -> the standard library's source of it
* package:   "What is the Python package X for?"       -> the package's README (its metadata)
* summarise: "Summarise this passage: <help text>"     -> the passage's first sentences

and the model itself answers a smaller set of prompts of every kind (greedy, batched), so the head
also sees the model's own style. Every pair is formatted with the model's chat template. The output
is JSON Lines: {"kind", "source", "prompt", "answer", "text"}; ``text`` is what training reads.

Nothing is downloaded; the same installed packages and seed give the same file. Prompts of the held-out
benchmark set (benchmarks/smollm2_prompts.jsonl) are never used.

    python benchmarks/chat_corpus.py --target ~/.cache/specdec/models/smollm2-135m-instruct \
        --out out/smollm2_chat.jsonl --self-prompts 96 --self-tokens 96
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
import json
import random
import re
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELDOUT = HERE / "smollm2_prompts.jsonl"
# The held-out prompts' topics: a training prompt on any of them would measure the head on what it was
# fitted to. ``build`` drops any pair whose prompt names one: the self prompts' "an old bicycle", "climate
# change" and "a list of dictionaries" (in every corpus until stop 53), and "a stack in programming" and two
# tasks on dictionaries in stop 53's lists. Those stay in the lists, because removing them would reshuffle
# which prompts are asked, and the shipped head's recipe would no longer rebuild its corpus.
HELDOUT_TOPICS = ["bicycle", "weather", "climate", "refrigerator", "dictionar", "triangular", "stack",
                  "multiplication table", "kite", "key in", "coffee", "teapot", "honeybee", "bee ", "cholera",
                  "remote work", "reef", "each character"]

# Standard-library modules with plenty of documented, pure-Python functions.
MODULES = [
    "abc", "argparse", "base64", "bisect", "calendar", "collections", "colorsys", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions",
    "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.cookies",
    "imaplib", "inspect", "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging",
    "mimetypes", "netrc", "ntpath", "numbers", "operator", "optparse", "os", "os.path", "pathlib", "pickle",
    "pkgutil", "platform", "plistlib", "pprint", "queue", "quopri", "random", "re", "reprlib", "sched",
    "secrets", "shlex", "shutil", "smtplib", "socket", "statistics", "string", "struct", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "types", "typing",
    "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref", "webbrowser", "zipfile",
    "zoneinfo",
]

EXPLAIN = ["Explain what `{name}` does.", "What does `{name}` do in Python?", "How do I use `{name}`?",
           "Can you explain the Python function `{name}`?", "Describe `{name}` briefly."]
CODE = ["Write a Python function `{short}` that {doc}", "Implement `{short}` in Python: {doc}",
        "Show me Python code for `{short}`, which should {doc}"]
PACKAGE = ["What is the Python package `{name}` for?", "Tell me about the `{name}` library.",
           "Give me an overview of {name}."]
SUMMARISE = ["Summarise this passage:\n\n{text}", "Summarize the following text in a few sentences:\n\n{text}",
             "TL;DR:\n\n{text}"]

# Prompts the model answers itself (kinds as in the benchmark; topics disjoint from its prompts).
CREATIVE_TOPICS = [
    "a lighthouse keeper", "the first snow of winter", "a robot learning to cook", "an old bicycle",
    "a city at night", "a cat who hates Mondays", "the ocean", "a forgotten library", "a dragon who is afraid of fire",
    "a train journey", "autumn leaves", "a time traveller's diary", "a small village bakery", "the moon",
    "a lost umbrella", "friendship", "a garden in spring", "a detective in Paris", "mountains at dawn",
    "a talking tree", "the last day of school", "a spaceship crew", "a rainy afternoon", "a pirate's map",
]
CREATIVE = ["Write a short poem about {topic}.", "Write a short story about {topic}.",
            "Write a haiku about {topic}.", "Describe {topic} in a vivid paragraph."]
CONCEPTS = [
    "recursion", "a hash table", "photosynthesis", "inflation", "the water cycle", "gravity", "a linked list",
    "machine learning", "the difference between a list and a tuple in Python", "how vaccines work",
    "what an API is", "big-O notation", "how a compiler works", "the greenhouse effect", "supply and demand",
    "what DNA is", "binary numbers", "how the internet works", "object-oriented programming", "climate change",
    "a neural network", "version control with git", "the French Revolution", "how batteries work",
]
EXPLAIN_SELF = ["Explain {concept} in simple terms.", "What is {concept}?", "Can you explain {concept}?"]
CODE_SELF = ["Write a Python function that {task}.", "Write Python code to {task}."]
TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "counts the vowels in a string", "returns the largest element of a list", "merges two sorted lists",
    "removes duplicates from a list", "computes the Fibonacci numbers up to n", "checks if a string is a palindrome",
    "sorts a list of dictionaries by a key", "reads a CSV file and prints each row", "flattens a nested list",
    "converts Celsius to Fahrenheit", "finds the most common word in a text", "computes the mean of a list",
    "checks whether two strings are anagrams", "implements binary search", "generates a random password",
]


# General-knowledge prompts the model answers itself: what users of a chat model ask about that installed
# text does not cover. Topics are disjoint from the held-out benchmark prompts' (no bicycles, weather or
# climate, refrigerators, dictionaries, kites, keys, coffee, teapots, bees, cholera, remote work, reefs).
THINGS = [
    "a rainbow", "an earthquake", "a volcano", "a black hole", "the immune system", "an eclipse", "a tsunami",
    "the stock market", "a credit score", "compound interest", "a democracy", "the Renaissance", "the Roman Empire",
    "the Industrial Revolution", "the printing press", "evolution", "an atom", "electricity", "magnetism",
    "a solar panel", "nuclear energy", "a comet", "the solar system", "a galaxy", "the speed of light",
    "sound waves", "the human heart", "the brain", "sleep", "a virus", "bacteria", "antibiotics", "a calorie",
    "protein", "metabolism", "a food chain", "an ecosystem", "erosion", "the tides", "the seasons", "a desert",
    "a rainforest", "glaciers", "plate tectonics", "the ozone layer", "recycling", "composting", "a budget",
    "taxes", "a mortgage", "cryptocurrency", "a blockchain", "cloud computing", "encryption", "a password manager",
    "a firewall", "an operating system", "a database", "a spreadsheet", "a search engine", "social media",
    "artificial intelligence", "a robot", "a 3D printer", "GPS", "Wi-Fi", "Bluetooth", "a transistor",
    "a microchip", "the periodic table", "acids and bases", "friction", "inertia", "momentum", "energy",
    "a lever", "a pulley", "democracy in ancient Athens", "the Olympic Games", "a symphony orchestra",
    "jazz music", "impressionist painting", "a sonnet", "a novel", "mythology", "a museum", "a library",
    "meditation", "mindfulness", "exercise", "a balanced diet", "stress", "procrastination", "time management",
    "a job interview", "a resume", "public speaking", "negotiation", "teamwork", "leadership", "critical thinking",
    "the scientific method", "a hypothesis", "statistics", "probability", "a prime number", "fractions",
    "percentages", "algebra", "geometry", "calculus", "a spreadsheet formula", "a sorting algorithm", "a loop in programming",
    "a variable in programming", "a function in programming", "an exception in Python", "a Python list comprehension",
    "a REST API", "HTML", "CSS", "JavaScript", "SQL", "unit testing", "debugging", "open-source software",
    "the northern lights", "the Amazon river",
    "the Great Wall of China", "the pyramids of Egypt", "the Moon landing", "the Cold War", "the Silk Road",
    "the Middle Ages", "ancient Rome's aqueducts", "the Greek alphabet", "the metric system", "a calendar",
    "a leap year", "time zones", "the equator", "latitude and longitude", "a map projection", "a telescope",
    "a microscope", "a laser", "an X-ray", "an MRI scan", "blood types", "the digestive system", "the lungs",
    "the skeleton", "vitamins", "dehydration", "allergies", "a fever", "genes", "cells", "photosynthesis in algae",
    "pollination", "a fungus", "a seed bank", "a national park", "endangered species", "migration of whales",
    "a dinosaur", "fossils", "a museum curator", "inflation in an economy", "a recession", "a central bank",
    "a savings account", "an index fund", "insurance", "a small business", "marketing", "a supply chain",
    "a contract", "copyright", "a patent", "a jury trial", "the United Nations", "an election", "a constitution",
    "a startup", "a keyboard shortcut", "a computer virus", "phishing", "two-factor authentication",
    "a router", "an IP address", "a domain name", "a web browser", "a smartphone app", "a video game engine",
    "virtual reality", "a self-driving car", "a drone", "a quantum computer", "a programming language",
    "recursion in programming", "a stack in programming", "a queue in programming", "a binary tree",
    "a graph in computer science", "a regular expression", "a Python decorator", "a Python generator",
    "a virtual environment in Python", "type hints in Python", "a JSON file", "a CSV file", "Linux", "a terminal",
    "a shell script", "Docker", "an algorithm", "dynamic programming", "a cache", "a thread", "a deadlock",
]
HOW = [
    "a microwave oven heats food", "airplanes stay in the air", "a rocket reaches space", "the heart pumps blood",
    "plants grow from seeds", "the moon affects the tides", "a camera takes a picture", "a touchscreen works",
    "a light bulb makes light", "a compass finds north", "soap cleans your hands", "bread rises", "a thermostat works",
    "an electric car works", "a wind turbine makes electricity", "email gets delivered", "a web page loads",
    "a credit card payment works", "a vaccine trains the immune system", "the eye sees colours", "we hear sounds",
    "a submarine dives and surfaces", "a hot air balloon flies", "an elevator works", "a lock and key work",
    "a washing machine cleans clothes", "a river forms a canyon", "a bridge holds its weight",
    "a search engine ranks pages", "a hash function works", "a compiler turns code into a program", "garbage collection works in Python",
    "a neural network learns", "noise-cancelling headphones work", "a solar eclipse happens", "birds migrate",
    "muscles grow stronger", "the body fights a cold", "a battery stores energy",
    "a mobile phone makes a call", "a satellite stays in orbit", "a QR code stores information", "a barcode scanner works",
    "a car engine works", "a helicopter flies", "a ship floats", "a clock keeps time", "a piano makes sound",
    "a printer prints", "a smoke detector works", "an air conditioner cools a room", "a dishwasher cleans dishes",
    "a volcano erupts", "mountains form", "a caterpillar becomes a butterfly",
    "a spider spins a web", "fish breathe underwater", "the kidneys clean the blood",
    "the liver works", "a wound heals", "memory works in the brain", "a language is learned", "a loan works",
    "a stock exchange works", "a password is stored safely", "a computer boots up", "a CPU runs a program",
    "a file is saved on a disk", "a video is streamed", "a spell checker works", "a recommendation system works",
]
DIFFERENCES = [
    ("a virus", "bacteria"), ("speed", "velocity"), ("a list", "a set in Python"), ("RAM", "storage"),
    ("an alligator", "a crocodile"), ("a meteor", "a meteorite"), ("a republic", "a monarchy"),
    ("an acid", "a base"), ("mass", "weight"), ("a simile", "a metaphor"),
    ("stocks", "bonds"), ("a compiler", "an interpreter"), ("HTTP", "HTTPS"), ("a frog", "a toad"),
    ("a fruit", "a vegetable"), ("a lake", "a pond"), ("a novel", "a short story"), ("an ocean", "a sea"),
    ("a class", "an object in programming"), ("a planet", "a star"), ("machine learning", "deep learning"),
    ("a loan", "a grant"), ("empathy", "sympathy"), ("a theory", "a law in science"), ("Git", "GitHub"),
    ("a rabbit", "a hare"), ("a tuple", "a list in Python"), ("Python", "JavaScript"),
    ("a function", "a method in Python"), ("a debit card", "a credit card"), ("a cold", "the flu"),
    ("an emu", "an ostrich"), ("a dolphin", "a shark"), ("a city", "a town"), ("a poem", "a song"),
    ("affect", "effect"), ("a mountain", "a hill"), ("a process", "a thread"), ("TCP", "UDP"),
]
EXPLAIN_GENERAL = ["Explain {x} in simple terms.", "What is {x}?", "Can you explain {x}?", "Tell me about {x}.",
                   "Explain {x} to a ten-year-old.", "Give me a short explanation of {x}."]
HOW_GENERAL = ["Explain how {x}.", "Can you explain how {x}?", "Describe how {x}."]
DIFFERENCE_GENERAL = ["What is the difference between {a} and {b}?", "How is {a} different from {b}?"]
STORY_TOPICS = [
    "a fox who wants to fly", "a snowman in summer", "an astronaut who misses home", "a lonely robot",
    "a magic paintbrush", "a boy and his dog", "a haunted house", "a king who loses his crown", "a mermaid",
    "a lighthouse in a storm", "an old clock", "a secret door", "a penguin on holiday", "a shy dragon",
    "a grandmother's recipe", "a message in a bottle", "the last tree on Earth", "a school for wizards",
    "a sunflower", "a mouse in a museum", "a clever crow", "the northern lights", "a desert island",
    "a train that never stops", "a forgotten toy", "a baker who bakes dreams", "a whale song", "a candle",
    "a street musician", "a paper boat", "a river", "an owl at midnight", "a violin", "a busy market",
    "the first day of spring", "a fisherman", "a kingdom under the sea", "a broken robot", "a firefly",
    "a winter night", "a lost glove", "a superhero who is afraid of heights", "an empty playground",
    "a letter from the future", "a mountain climber", "a sleepy bear", "a garden gnome", "a hot summer day",
    "a city of cats", "the wind", "a birthday party", "a tiny planet", "an apple tree",
    "a brave little turtle", "a pair of old shoes", "a giraffe who loves to sing",
    "a wizard who forgets his spells", "a lost puppy", "a castle in the clouds", 
    "a ghost who is afraid of people", "a friendly monster", "a carnival", "a sailing ship", "a lonely star",
    "an old photograph", "a bookshop at midnight", "a chess game", "a robot and a cat", "a hidden waterfall",
    "a talking parrot", "a snowy mountain village", "a tiny elephant", "a clockmaker", "a jar of fireflies",
    "an unexpected guest", "the first day at a new school", "a broken compass", "a field of poppies",
    "a knight and a dragon", "a space station", "a sandcastle", "a circus clown",
    "an old sailor", "a snail in a race", "a cloud that wants to rain", "a haunted lighthouse",
]
DIALOGUE_PAIRS = [
    ("a cat", "a dog"), ("the sun", "the moon"), ("a pencil", "an eraser"), ("a chef", "a tomato"),
    ("a robot", "a toaster"), ("a student", "a teacher"), ("a fish", "a bird"), ("a detective", "a suspect"),
    ("a tree", "the wind"), ("a smartphone", "an old telephone"), ("a pirate", "a parrot"),
    ("a sock", "a washing machine"), ("a mouse", "an elephant"), ("a knight", "a dragon"),
    ("a customer", "a shopkeeper"), ("two snowmen", "a rising sun"),
]
DIALOGUE_GENERAL = ["Write a dialogue between {a} and {b}.", "Write a funny conversation between {a} and {b}."]
CREATIVE_GENERAL = ["Write a short poem about {topic}.", "Write a short story about {topic}.",
                    "Write a haiku about {topic}.", "Write a limerick about {topic}.",
                    "Write a funny short story about {topic}.", "Describe {topic} in a vivid paragraph.",
                    "Write the opening of a fairy tale about {topic}."]
TASKS_GENERAL = [
    "returns the sum of the digits of a number", "checks whether a year is a leap year", "converts a number to binary",
    "returns the second largest number in a list", "capitalises the first letter of every word",
    "finds the greatest common divisor of two numbers", "checks whether a list is sorted", "rotates a list by k positions",
    "returns all even numbers in a list", "counts the words in a sentence", "reverses the words in a sentence",
    "computes the average word length of a text", "finds the longest word in a sentence", "converts minutes to hours and minutes",
    "returns the n-th prime number", "checks whether a number is a perfect square", "computes the power set of a list",
    "transposes a matrix", "adds two matrices", "finds the intersection of two lists", "groups words by their first letter",
    "computes compound interest", "validates an email address with a regular expression", "removes punctuation from a string",
    "chunks a list into pieces of size n", "computes the median of a list", "checks whether brackets are balanced",
    "converts a Roman numeral to an integer", "computes the distance between two points", "finds missing numbers in a range",
    "simulates rolling two dice", "returns the Collatz sequence of a number", "shuffles a list without using random.shuffle",
    "counts the lines in a text file", "writes a list of numbers to a text file, one per line", "sums the numbers in a nested list",
    "returns the factorial of a number using recursion", "checks whether a string contains only digits",
    "returns the number of days between two dates", "converts a string to title case", "finds the mode of a list",
    "merges two dictionaries", "returns the first non-repeating character of a string", "squares every number in a list",
    "filters out the negative numbers of a list", "returns the cumulative sum of a list", "checks whether a number is even",
    "swaps the keys and values of a dictionary", "counts the uppercase letters in a string", "computes the area of a circle",
    "returns the largest of three numbers", "generates the first n square numbers", "checks whether a word is in a sentence",
    "splits a sentence into words and sorts them", "returns the digits of a number as a list", "pads a string to a given length",
]
SCRIPT_TASKS = [
    "asks for the user's name and greets them", "prints the numbers from 1 to 100, replacing multiples of 3 with Fizz",
    "prints the first 20 Fibonacci numbers", "reads a text file and prints its longest line", "prints a countdown from 10",
    "prints a pyramid of stars", "prints today's date", "lists the files in the current directory",
    "prints the squares of the numbers from 1 to 10", "simulates a coin toss 100 times and prints the counts",
    "converts a list of temperatures from Celsius to Fahrenheit", "prints every prime number below 50",
]
CLASSES_GENERAL = [
    "a bank account with deposit and withdraw methods", "a queue with enqueue and dequeue methods",
    "a rectangle with area and perimeter methods", "a to-do list", "a simple counter", "a temperature converter",
    "a student with a list of grades and an average method", "a library that lends books", "a deck of playing cards",
    "a shopping cart that totals its items", "a timer that measures elapsed time", "a point in two dimensions",
    "a circle with an area method", "a car with a start method", "a phone book", "a simple inventory",
    "a fraction with addition", "a vector in two dimensions", "a linked list", "a book with a title and an author",
]
CODE_GENERAL = ["Write a Python function that {task}.", "Can you write a Python function that {task}?"]
CLASS_TEMPLATES = ["Write a Python class for {x}.", "Implement {x} as a Python class."]
SCRIPT_GENERAL = ["Write a Python script that {task}.", "Write a short Python program that {task}."]
# The benchmark's own phrasings ("in two sentences", "Give me a short summary") are left out on purpose.
SUMMARY_TEMPLATES = SUMMARISE + ["Please summarise the text below.\n\n{text}", "Summarize this in one sentence:\n\n{text}",
                                 "What are the main points of this text?\n\n{text}"]

def _heldout_prompts() -> set[str]:
    if not HELDOUT.is_file():
        return set()
    return {json.loads(line)["prompt"] for line in HELDOUT.read_text().splitlines() if line.strip()}


def on_heldout_topic(prompt: str) -> bool:
    """Whether ``prompt`` names a topic of the held-out benchmark prompts (``HELDOUT_TOPICS``)."""
    text = prompt.lower()
    return any(topic in text for topic in HELDOUT_TOPICS)


def _clean(doc: str) -> str:
    return textwrap.dedent(doc).strip()


def _first_sentence(doc: str) -> str:
    line = doc.strip().split("\n\n")[0].replace("\n", " ")
    line = re.split(r"(?<=[.!?])\s", line)[0].strip()
    return line


def _lower_first(text: str) -> str:
    text = text.rstrip(".")
    if not text:
        return text
    verb = text[0].lower() + text[1:]
    # "Return the x" -> "returns the x" reads better after "that"
    word, _, rest = verb.partition(" ")
    if word.isalpha() and not word.endswith("s") and word not in ("is", "was"):
        word += "es" if word.endswith(("sh", "ch", "x")) else "s"
    return f"{word} {rest}".strip() + "."


def stdlib_pairs(rng: random.Random) -> list[dict]:
    """explain and code pairs from the standard library's docstrings and sources."""
    pairs = []
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - a module missing on this platform
            continue
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            if getattr(obj, "__module__", None) not in (module_name, module.__name__):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 60:
                continue
            name = f"{module_name}.{attr}"
            answer = _clean(doc)[:2400]
            pairs.append({"kind": "explain", "source": name, "prompt": rng.choice(EXPLAIN).format(name=name),
                          "answer": f"`{name}`: {answer}"})
            if inspect.isfunction(obj):
                try:
                    source = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                lines = source.count("\n")
                if 4 <= lines <= 60:
                    prompt = rng.choice(CODE).format(short=attr, doc=_lower_first(_first_sentence(doc)))
                    answer = f"Here is an implementation of `{attr}`:\n\n```python\n{textwrap.dedent(source).rstrip()}\n```"
                    pairs.append({"kind": "code", "source": name, "prompt": prompt, "answer": answer})
    return pairs


def package_pairs(rng: random.Random) -> list[dict]:
    """package and summarise pairs from the READMEs (long descriptions) of installed distributions."""
    pairs, seen = [], set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"]
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        body = re.sub(r"<[^>]+>", "", body)  # html badges
        body = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", body)  # image links
        body = re.sub(r"\n{3,}", "\n\n", body).strip()
        if len(body) < 300:
            continue
        pairs.append({"kind": "package", "source": name, "prompt": rng.choice(PACKAGE).format(name=name),
                      "answer": body[:3000]})
        paragraphs = [p.strip() for p in body.split("\n\n") if len(p.strip()) > 250 and not p.lstrip().startswith(("```", "|", "#", "-", "*", ">", "    "))]
        if paragraphs:
            passage = rng.choice(paragraphs)[:1500]
            sentences = re.split(r"(?<=[.!?])\s+", passage.replace("\n", " "))
            summary = " ".join(sentences[:2]).strip()
            if len(summary) > 40:
                pairs.append({"kind": "summarise", "source": name,
                              "prompt": rng.choice(SUMMARISE).format(text=passage), "answer": summary})
    return pairs


def self_prompts(rng: random.Random, count: int, heldout: set[str]) -> list[dict]:
    """Prompts of every kind for the model to answer itself."""
    pool = ([{"kind": "creative", "prompt": t.format(topic=x)} for t in CREATIVE for x in CREATIVE_TOPICS]
            + [{"kind": "explain", "prompt": t.format(concept=x)} for t in EXPLAIN_SELF for x in CONCEPTS]
            + [{"kind": "code", "prompt": t.format(task=x)} for t in CODE_SELF for x in TASKS])
    pool = [p for p in pool if p["prompt"] not in heldout]
    rng.shuffle(pool)
    return pool[:count]


def _in_turn(queues: list[list[dict]], count: int) -> list[dict]:
    """Up to ``count`` items, one from each queue in turn (the queues are emptied as they go)."""
    picked = []
    while len(picked) < count and any(queues):
        for queue in queues:
            if queue and len(picked) < count:
                picked.append(queue.pop(0))
    return picked


def general_prompts(rng: random.Random, count: int, heldout: set[str]) -> list[dict]:
    """``count`` general-knowledge prompts (explain, creative, code), the kinds taken in turn."""
    explain = ([t.format(x=x) for t in EXPLAIN_GENERAL for x in THINGS] + [t.format(x=x) for t in HOW_GENERAL for x in HOW]
               + [t.format(a=a, b=b) for t in DIFFERENCE_GENERAL for a, b in DIFFERENCES])
    creative = ([t.format(topic=x) for t in CREATIVE_GENERAL for x in STORY_TOPICS]
                + [t.format(a=a, b=b) for t in DIALOGUE_GENERAL for a, b in DIALOGUE_PAIRS])
    code = ([t.format(task=x) for t in CODE_GENERAL for x in TASKS_GENERAL] + [t.format(x=x) for t in CLASS_TEMPLATES for x in CLASSES_GENERAL]
            + [t.format(task=x) for t in SCRIPT_GENERAL for x in SCRIPT_TASKS])
    queues = []
    for kind, prompts in (("explain", explain), ("creative", creative), ("code", code)):
        prompts = [p for p in prompts if p not in heldout]
        rng.shuffle(prompts)
        queues.append([{"kind": kind, "prompt": p} for p in prompts])
    return _in_turn(queues, count)


def _passage(answer: str, words: int = 160) -> str | None:
    """The whole sentences of ``answer`` within about ``words`` words, as prose (no lists or code)."""
    if "```" in answer or len(answer.split()) < 50:
        return None
    text = re.sub(r"\s+", " ", re.sub(r"^\s*([-*#]|\d+\.)\s*", "", answer, flags=re.M)).strip()
    kept, total = [], 0
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        total += len(sentence.split())
        if total > words:
            break
        kept.append(sentence)
    passage = " ".join(kept)
    return passage if len(passage.split()) >= 40 else None


def summary_prompts(rng: random.Random, answers: list[dict], count: int) -> list[dict]:
    """Summaries of the model's own explanations: ``count`` prompts that ask to summarise one of ``answers``
    (a chat model is asked to summarise prose it did not write; these passages are the prose at hand
    that is not technical documentation)."""
    passages = [p for p in (_passage(a["answer"]) for a in answers if a["kind"] == "explain") if p]
    rng.shuffle(passages)
    return [{"kind": "summarise", "prompt": rng.choice(SUMMARY_TEMPLATES).format(text=p)} for p in passages[:count]]


def corpus_prompts(pairs: list[dict], count: int) -> list[dict]:
    """``count`` prompts of the installed-text pairs, the kinds taken in turn, for the model to answer.

    EAGLE's recipe: the head learns the target's own answers to a dataset's prompts, not the dataset's
    answers (the model's answers to "Summarise this passage" are what the drafter meets in use)."""
    by_kind: dict[str, list[dict]] = {}
    for p in pairs:
        by_kind.setdefault(p["kind"], []).append({"kind": p["kind"], "prompt": p["prompt"]})
    return _in_turn([list(q) for _, q in sorted(by_kind.items())], count)


def generate_answers(target_path: str, prompts: list[dict], max_new_tokens: int, batch_size: int,
                     threads: int, store: Path | None = None, dtype: str = "float32") -> list[dict]:
    """The model's greedy answers to ``prompts``. With ``store``, answers already in that JSON Lines file
    are reused and new ones appended as each batch finishes, so a long run can be stopped and resumed.

    ``dtype="bfloat16"`` generates about 1.8x faster on a CPU with bfloat16 units (Zen 4 at batch 16). Its
    greedy answers leave float32's only where two tokens nearly tie (13% of 24-token rows' tokens differed,
    the rest of such a row continuing from the other token), and the head is trained on float32's own
    hidden states and next tokens over that text either way."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done: dict[str, dict] = {}
    if store is not None and store.is_file():
        for line in store.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["prompt"]] = row
    todo = [p for p in prompts if p["prompt"] not in done]
    if todo:
        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(target_path, dtype=getattr(torch, dtype)).eval()
        tokenizer = AutoTokenizer.from_pretrained(target_path, padding_side="left")
        texts = {p["prompt"]: tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                                            tokenize=False, add_generation_prompt=True)
                 for p in todo}
        todo.sort(key=lambda p: len(texts[p["prompt"]]))  # rows of a batch alike in length: little padding
        started, made = time.perf_counter(), 0
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            batch = tokenizer([texts[p["prompt"]] for p in chunk], return_tensors="pt", padding=True,
                              add_special_tokens=False)
            with torch.no_grad():
                generated = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens)
            rows = []
            for p, row in zip(chunk, generated[:, batch["input_ids"].shape[1]:]):
                made += int((row != tokenizer.pad_token_id).sum())
                rows.append({**p, "source": "self", "answer": tokenizer.decode(row, skip_special_tokens=True).strip()})
            done.update((r["prompt"], r) for r in rows)
            if store is not None:
                store.parent.mkdir(parents=True, exist_ok=True)
                with store.open("a", encoding="utf-8") as handle:
                    handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            elapsed = time.perf_counter() - started
            answered = sum(p["prompt"] in done for p in prompts)
            print(f"self answers: {answered}/{len(prompts)} ({elapsed:.0f}s, {made / elapsed:.0f} tok/s)",
                  file=sys.stderr)
    return [done[p["prompt"]] for p in prompts]


def build(target_path: str, out: Path, seed: int = 0, self_count: int = 96, self_tokens: int = 96,
          max_pairs: int = 6000, batch_size: int = 16, threads: int = 1, self_corpus: int = 0,
          self_store: Path | None = None, self_general: int = 0, self_summaries: int = 0,
          dtype: str = "float32") -> dict:
    from transformers import AutoTokenizer

    rng = random.Random(seed)
    heldout = _heldout_prompts()
    pairs = stdlib_pairs(rng) + package_pairs(rng)
    pairs = [p for p in pairs if p["prompt"] not in heldout]
    rng.shuffle(pairs)
    pairs = pairs[:max_pairs]
    wanted = self_prompts(rng, self_count, heldout) + corpus_prompts(pairs, self_corpus)
    general = general_prompts(random.Random(seed + 1), self_general, heldout)  # its own stream: the rest stays as before
    if wanted or general:  # first, so that a token budget (``specdec drafter train --max-tokens``) keeps them
        answers = generate_answers(target_path, general + wanted, self_tokens, batch_size, threads, self_store, dtype)
        summaries = summary_prompts(random.Random(seed + 2), answers[: len(general)], self_summaries)
        if summaries:
            answers[len(general) : len(general)] = generate_answers(target_path, summaries, self_tokens, batch_size,
                                                                    threads, self_store, dtype)
        pairs = answers + pairs
    # Last, so that which prompts are asked (and the answers a --self-store keeps) does not move with it.
    pairs = [p for p in pairs if not on_heldout_topic(p["prompt"])]
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    temporary = out.with_suffix(out.suffix + ".tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        for p in pairs:
            p["text"] = tokenizer.apply_chat_template(
                [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["answer"]}],
                tokenize=False)
            counts[p["kind"] if p["source"] != "self" else "self-" + p["kind"]] = counts.get(
                p["kind"] if p["source"] != "self" else "self-" + p["kind"], 0) + 1
            handle.write(json.dumps(p, ensure_ascii=False) + "\n")
    temporary.replace(out)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the chat model's folder (tokenizer with a chat template)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-pairs", type=int, default=6000, help="pairs from installed text, at most")
    parser.add_argument("--self-prompts", type=int, default=96, help="prompts the model answers itself (0: none)")
    parser.add_argument("--self-tokens", type=int, default=96, help="tokens per self answer")
    parser.add_argument("--self-corpus", type=int, default=0,
                        help="prompts of the installed-text pairs the model also answers itself (kinds in turn)")
    parser.add_argument("--self-general", type=int, default=0,
                        help="general-knowledge prompts (explain, creative, code) the model answers itself")
    parser.add_argument("--self-summaries", type=int, default=0,
                        help="prompts to summarise the model's own general explanations, which it then answers")
    parser.add_argument("--self-store", type=Path, default=None,
                        help="JSON Lines file of self answers: reused, and appended to as batches finish")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's dtype for its own answers (bfloat16: faster where the CPU has bfloat16 units)")
    args = parser.parse_args()
    counts = build(args.target, args.out, args.seed, args.self_prompts, args.self_tokens, args.max_pairs,
                   args.batch_size, args.threads, args.self_corpus, args.self_store, args.self_general,
                   args.self_summaries, args.dtype)
    print(json.dumps({"out": str(args.out), "pairs": counts}))


if __name__ == "__main__":
    main()
