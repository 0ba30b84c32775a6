"""The prompts of the speculative decoding benchmarks (bench_spec, bench_quant, bench_prediction,
bench_gpu): code edits that return the code, a summary that quotes its passage, and an open chat
question, as the bundled model's chat template makes them."""

from __future__ import annotations

from workers.model.tokenizer import Tokenizer

CODE = """def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age = line.strip().split(",")
            users.append({"name": name, "age": int(age)})
    return users


def adults(users):
    result = []
    for user in users:
        if user["age"] >= 18:
            result.append(user)
    return result
"""
PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres. The reef is located "
    "in the Coral Sea, off the coast of Queensland, Australia. It can be seen from outer space "
    "and is the world's biggest single structure made by living organisms. The reef structure "
    "is composed of and built by billions of tiny organisms, known as coral polyps. It supports "
    "a wide diversity of life and was selected as a World Heritage Site in 1981."
)
SCRIPT = """import sys


def read_scores(path):
    scores = {}
    with open(path) as f:
        for line in f:
            name, score = line.split(":")
            scores[name.strip()] = float(score)
    return scores


def main():
    tmp = read_scores(sys.argv[1])
    for name in sorted(tmp):
        print(name, tmp[name])


if __name__ == "__main__":
    main()
"""
JS = """function totalPrice(items, taxRate) {
  let total = 0;
  for (const item of items) {
    if (item.quantity = 0) {
      continue;
    }
    total += item.price * item.quantity;
  }
  return total * (1 + taxRate);
}

function cheapest(items) {
  return items.reduce((best, item) => (item.price < best.price ? item : best));
}
"""
# Each kind is a list: a kind's tokens/s pools its prompts, run one after another. Code edits
# are three, because one prompt's copy can hold in one process and drift in the next (see the
# section's text), which swings a single prompt's speed-up by a third.
PROMPTS = {
    "code edit": [
        "Fix the typo in this code and show the full corrected code:\n\n"
        f"```python\n{CODE.replace('result.append', 'result.apend')}```",
        "Rename the variable `tmp` to `scores` in this script and show the whole script:\n\n"
        f"```python\n{SCRIPT}```",
        "Fix the bug in this JavaScript code (the `if` uses `=` instead of `===`) and show the "
        f"full corrected code:\n\n```javascript\n{JS}```",
    ],
    "summary": [f"Summarize this passage, quoting its most important sentences:\n\n{PASSAGE}"],
    "open chat": ["What are some good habits for staying healthy while working from home?"],
}


def chat_prompts(tok: Tokenizer) -> dict[str, list[list[int]]]:
    return {
        kind: [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
        for kind, texts in PROMPTS.items()
    }
