"""The prompt sets the EAGLE head is trained and judged on, shipped with the repo.

Training prompts are built from templates over subjects, tasks and passages with a seeded
shuffle, so `python -m workers.eagle.data` makes the same set everywhere. The held-out prompts
share none of those subjects, tasks or passages: acceptance measured on them says how the head
does on text it never saw.
"""

from __future__ import annotations

import random

SUBJECTS = [
    "photosynthesis",
    "the water cycle",
    "black holes",
    "plate tectonics",
    "vaccines",
    "the French Revolution",
    "inflation",
    "compound interest",
    "machine learning",
    "the immune system",
    "climate change",
    "the Roman Empire",
    "electric cars",
    "volcanoes",
    "the stock market",
    "DNA",
    "the internet",
    "renewable energy",
    "sleep",
    "meditation",
    "the moon landing",
    "earthquakes",
    "honey bees",
    "coffee",
    "the printing press",
    "recycling",
    "blockchain",
    "the solar system",
    "antibiotics",
    "rainforests",
    "the human heart",
    "supply and demand",
    "jazz music",
    "the Olympic Games",
    "glaciers",
    "cloud computing",
    "nutrition",
    "the Renaissance",
    "tides",
    "batteries",
    "democracy",
    "the Silk Road",
    "quantum computers",
    "bread baking",
    "chess",
    "public speaking",
    "time management",
    "gardening",
    "bird migration",
    "the Industrial Revolution",
    "encryption",
    "nuclear power",
    "the ocean floor",
    "wind turbines",
    "memory",
    "dinosaurs",
    "the speed of light",
    "minimalism",
    "team sports",
    "3D printing",
]
QUESTION_TEMPLATES = [
    "Explain {s} in simple terms.",
    "What is {s}? Give a short answer.",
    "Write three interesting facts about {s}.",
    "Why is {s} important?",
    "Describe {s} to a ten-year-old.",
    "What are the main advantages and disadvantages of {s}?",
    "Write a short paragraph about the history of {s}.",
    "List five questions a student might ask about {s}, with brief answers.",
    "Write a haiku about {s}.",
    "What is a common misconception about {s}?",
    "Give me a step-by-step overview of how {s} works.",
    "Compare {s} with something from everyday life.",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "computes the factorial of n",
    "returns the n-th Fibonacci number",
    "counts the vowels in a string",
    "merges two sorted lists",
    "removes duplicates from a list while keeping order",
    "finds the largest element in a list",
    "checks whether a string is a palindrome",
    "converts Celsius to Fahrenheit",
    "flattens a nested list",
    "sums the digits of a number",
    "reads a text file and counts its lines",
    "sorts a list of dictionaries by a key",
    "computes the average of a list of numbers",
    "capitalizes every word in a sentence",
    "returns the intersection of two lists",
    "checks whether two strings are anagrams",
    "generates all permutations of a list",
    "performs binary search on a sorted list",
    "computes the greatest common divisor of two numbers",
    "transposes a matrix",
    "counts word frequencies in a text",
    "validates an email address with a regex",
    "converts a decimal number to binary",
    "finds the second smallest number in a list",
    "chunks a list into pieces of size n",
    "checks whether a year is a leap year",
    "computes the running total of a list",
    "rotates a list by k positions",
]
CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Write a Python function that {t}, with a docstring and an example.",
    "Write a JavaScript function that {t}.",
    "How would you write a function that {t}? Show the code in Python.",
    "Write a Python function that {t} and explain how it works.",
]
PASSAGES = [
    "The Amazon River flows through South America and carries more water than any other river "
    "in the world. Its basin covers about seven million square kilometres, much of it "
    "rainforest. The river supports thousands of species of fish and provides food and "
    "transport for millions of people living along its banks.",
    "Marie Curie was a physicist and chemist who conducted pioneering research on "
    "radioactivity. She was the first woman to win a Nobel Prize and remains the only person "
    "to win Nobel Prizes in two different sciences. Her work led to the discovery of polonium "
    "and radium.",
    "The city council voted on Tuesday to expand the bicycle lane network by forty kilometres "
    "over the next three years. Supporters said the plan would reduce traffic and pollution, "
    "while some shop owners worried about losing parking spaces in front of their stores.",
    "Regular exercise improves heart health, strengthens muscles and bones, and can lift mood "
    "by releasing endorphins. Health organisations recommend at least 150 minutes of moderate "
    "activity each week, such as brisk walking, cycling or swimming.",
    "The first computers filled entire rooms and used thousands of vacuum tubes. The invention "
    "of the transistor in 1947 made machines smaller, cheaper and more reliable, and the "
    "integrated circuit later packed millions of transistors onto a single chip.",
    "Honey never spoils when it is stored properly. Archaeologists have found pots of honey in "
    "ancient Egyptian tombs that are thousands of years old and still edible, thanks to its "
    "low moisture content and natural acidity.",
    "The company reported a twelve percent rise in quarterly revenue, driven by strong demand "
    "for its cloud services. However, profits fell slightly because of higher spending on "
    "research and new data centres.",
    "Mount Everest, on the border between Nepal and China, is the highest mountain above sea "
    "level at 8,849 metres. Climbing it requires weeks of acclimatisation, and the thin air "
    "above 8,000 metres is known as the death zone.",
]
PASSAGE_TEMPLATES = [
    "Summarize this passage in one sentence:\n\n{p}",
    "Summarize the following text, quoting its key sentence:\n\n{p}",
    "Give three bullet points with the main ideas of this text:\n\n{p}",
    "Rewrite this passage in simpler words:\n\n{p}",
    "What is the main idea of this passage?\n\n{p}",
]
CHAT_PROMPTS = [
    "Hi! How are you today?",
    "Can you recommend a good book for a long flight?",
    "I feel stressed about my exams. Any advice?",
    "What should I cook for dinner tonight?",
    "Tell me a joke about programmers.",
    "How do I start learning to play the guitar?",
    "What are some fun things to do on a rainy weekend?",
    "How can I be more productive?",
    "Write a short birthday message for my friend Anna.",
    "What is the capital of Canada?",
    "Plan a one-day trip to a city by the sea.",
    "How do I make a good cup of tea?",
    "Suggest a name for a small bakery.",
    "How can I save money on groceries?",
    "Write a polite email asking my manager for a day off.",
    "What is a healthy breakfast?",
]

# Held out: none of these subjects, tasks or passages appear above.
HELD_OUT = {
    "chat": [
        "What are some good habits for staying healthy while working from home?",
        "Can you explain how airplanes stay in the air?",
        "Give me some tips for a job interview.",
        "What is the difference between weather and climate?",
        "How do I take care of a houseplant?",
        "Write a short story about a lost cat finding its way home.",
    ],
    "code": [
        "Write a Python function that checks whether a list is sorted.",
        "Write a Python function that counts how many times each character appears in a string.",
        "Write a Python class for a simple stack with push, pop and peek.",
        "Write a Python function that returns the longest word in a sentence.",
    ],
    "summary": [
        "Summarize this passage:\n\nThe Great Barrier Reef is the world's largest coral reef "
        "system, composed of over 2,900 individual reefs and 900 islands stretching for over "
        "2,300 kilometres. It supports a wide diversity of life and was selected as a World "
        "Heritage Site in 1981.",
        "Summarize this passage:\n\nThe library will close for renovation from March to June. "
        "During that time, books can be borrowed from the temporary branch in the town hall, "
        "and all due dates will be extended by four weeks.",
        "Summarize this passage:\n\nTea was first drunk in China thousands of years ago and "
        "spread along trade routes to Japan, India and Europe. Today it is the most consumed "
        "drink in the world after water.",
    ],
}


def training_prompts(seed: int = 0) -> list[str]:
    """Every training prompt (about 900), in a seeded order."""
    prompts = [t.format(s=s) for s in SUBJECTS for t in QUESTION_TEMPLATES]
    prompts += [t.format(t=task) for task in CODE_TASKS for t in CODE_TEMPLATES]
    prompts += [t.format(p=p) for p in PASSAGES for t in PASSAGE_TEMPLATES]
    prompts += CHAT_PROMPTS
    random.Random(seed).shuffle(prompts)
    return prompts


def held_out_prompts() -> dict[str, list[str]]:
    return {kind: list(prompts) for kind, prompts in HELD_OUT.items()}
