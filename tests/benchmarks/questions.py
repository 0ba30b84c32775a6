"""Chat questions on subjects of their own, for benchmarks of servers that learn from what they
answered: `make serve`'s n-gram drafter drafts from every earlier request's text (the shared
n-gram pool, cluster/ngram_pool.py), so the same question asked again, under another number,
is drafted from its last answer, which no user's new question is. `distinct(n, first)` are `n`
questions, each on a subject none of the other `len(SUBJECTS) - 1` around it shares."""

from __future__ import annotations

SUBJECTS = (
    "what a hash table is", "how a bicycle gear works", "why the sky is blue",
    "the difference between weather and climate", "how vaccines train the immune system",
    "the plot of Romeo and Juliet", "how a refrigerator keeps food cold",
    "why leaves change colour in autumn", "how a bill becomes a law",
    "what inflation does to savings", "how bees make honey", "why the moon has phases",
    "how a compass finds north", "what causes earthquakes", "how bread rises",
    "why we need sleep", "how a rainbow forms", "what a black hole is",
    "how coffee is roasted", "why cats purr", "how an electric motor turns",
    "what photosynthesis does", "how tides follow the moon", "why ice floats on water",
    "how a credit score is made", "what DNA carries", "how a piano makes sound",
    "why volcanoes erupt", "how email reaches an inbox", "what a recession is",
    "how glass is made", "why the ocean is salty", "how a lock and key work",
    "what the Roman Empire built", "how solar panels make power", "why birds migrate",
    "how a camera lens focuses", "what a vaccine trial tests", "how cheese is aged",
    "why the Titanic sank", "how a search engine ranks pages", "what makes soil fertile",
    "how the heart pumps blood", "why airplanes stay in the air", "how paper is recycled",
    "what a stock exchange does", "how a thermostat works", "why metals conduct heat",
    "how chess openings differ", "what causes the seasons", "how a violin is tuned",
    "why onions make people cry", "how elections count votes", "what a glacier carves",
    "how a submarine dives", "why the Great Wall was built", "how yoghurt is made",
    "what a firewall blocks", "how lightning forms", "why dogs wag their tails",
    "how a battery stores energy", "what a haiku is", "how coral reefs grow",
    "why we yawn", "how a bridge carries its load", "what a comet is made of",
    "how a sewing machine stitches", "why rivers bend", "how noise-cancelling headphones work",
    "what a sourdough starter is", "how a lighthouse warns ships", "why bananas turn brown",
)  # fmt: skip
ASKS = ("Explain {} in a few sentences.", "Tell me {}, simply.", "Describe {} for a child.")


def distinct(n: int, first: int) -> list[str]:
    """Questions `first` .. `first + n - 1`: question `i` on subject `i % len(SUBJECTS)`."""
    out = []
    for i in range(first, first + n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        ask = ASKS[(i // len(SUBJECTS)) % len(ASKS)]
        out.append(ask.format(subject))
    return out
