"""A synthetic corpus of package descriptions: many templated near-copies, plus free text.

Real package indexes are full of boilerplate: a cookiecutter README with the
name swapped in, "A Python wrapper for the X API", the same two sentences
with a different verb. This generator writes that shape of corpus, seeded:

- `templates` templates, each 2-6 sentences drawn from a pool of boilerplate
  sentences with slots ({name}, {domain}, {verb}, {feature}, {service}, ...).
  Template popularity is Zipf-like, so a few templates hold thousands of
  documents: the large LSH buckets that made unit building and the audit blow up.
- Each document fills its template's slots at random and, half the time,
  appends a short free-text tail, so instances of one template land anywhere
  from exact copies to Jaccard ~0.3 of each other.
- `free_share` of the documents are free text: word sequences from a Zipf
  vocabulary, unrelated to each other.

Used by `benchmarks/split.py` (run as a script: this folder is on sys.path).
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def _options(text: str) -> list[str]:
    """Slot fillers written as one "|"-separated string."""
    return text.split("|")


_SYLLABLES = _options(
    "py|ka|ro|ne|te|mi|za|lo|qu|ex|fl|ow|gr|id|sn|ap|vi|ta|tor|ix|on|ly|ra|de|co|bu"
)
_DOMAINS = _options(
    "time series|geospatial data|image processing|natural language|web scraping|"
    "configuration files|command line tools|async networking|unit testing|data validation|"
    "cloud storage|machine learning|audio signals|PDF documents|email delivery|"
    "database migrations|graph analytics|cryptography|job scheduling|logging|"
    "REST APIs|spreadsheets|finance data|bioinformatics|robotics|chat bots|"
    "static sites|feature flags|caching|rate limiting|serialization|plotting"
)
_VERBS = _options(
    "parse|validate|render|stream|convert|index|schedule|monitor|compress|encrypt|"
    "visualize|cache|deploy|test|profile|annotate|query|sync|export|transform"
)
_FEATURES = _options(
    "a simple API|type hints|zero dependencies|async support|a plugin system|"
    "full test coverage|a command line interface|streaming input|lazy evaluation|"
    "pandas integration|numpy arrays|a REST client|retry logic|structured logging|"
    "caching|thread safety|pure Python code|C extensions|a Django integration|"
    "a Flask extension|Jupyter widgets|YAML configuration|JSON schema support"
)
_SERVICES = _options(
    "GitHub|Slack|Stripe|Twilio|AWS S3|Google Sheets|Dropbox|Jira|Trello|Discord|"
    "Telegram|OpenWeather|Spotify|Shopify|Zendesk|PagerDuty|Notion|Airtable"
)
_LICENSES = ("MIT", "BSD", "Apache 2.0", "GPL v3", "LGPL", "MPL 2.0")

_SENTENCES = (
    "{name} is a Python library to {verb} {domain}.",
    "{name} is a lightweight toolkit for {domain} with {feature}.",
    "A Python wrapper for the {service} API.",
    "This package provides {feature} and {feature2} for {domain}.",
    "It lets you {verb} and {verb2} {domain} in a few lines of code.",
    "Install it with pip install {name}.",
    "The project is released under the {license} license.",
    "Documentation is available at https://{name}.readthedocs.io.",
    "Contributions are welcome: open an issue or a pull request on GitHub.",
    "This is a placeholder description for {name}; the real one is coming soon.",
    "Features: {feature}, {feature2} and {feature3}.",
    "{name} supports Python 3.{minor} and newer.",
    "Use {name} to {verb} data from {service} and {verb2} it locally.",
    "Built on top of {name2}, it adds {feature} to {domain}.",
    "Quick start: import {name} and call {name}.{verb}() on your data.",
    "This project was generated with cookiecutter and the pypackage template.",
    "Version {major}.{minor}.{patch} adds {feature} and fixes several bugs.",
    "The {service} client handles authentication, pagination and {feature}.",
    "It is fast, well tested and ships with {feature}.",
    "{name} is no longer maintained; please use {name2} instead.",
    "See the examples folder for how to {verb} {domain}.",
    "Tested on Linux, macOS and Windows with Python 3.{minor}.",
)


def _package_names(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` pronounceable package names of 2-4 syllables, some with a -py/-kit suffix."""
    parts = rng.choice(_SYLLABLES, size=(count, 4))
    lengths = rng.integers(2, 5, size=count)
    suffix = rng.choice(["", "", "", "py", "-kit", "-client", "lib"], size=count)
    return np.array(["".join(p[:k]) + s for p, k, s in zip(parts, lengths, suffix, strict=True)])


def _free_text(rng: np.random.Generator, vocab: np.ndarray, weights: np.ndarray, n: int) -> str:
    return " ".join(rng.choice(vocab, size=n, p=weights))


_SLOTS = {
    "domain": _DOMAINS,
    "verb": _VERBS,
    "verb2": _VERBS,
    "feature": _FEATURES,
    "feature2": _FEATURES,
    "feature3": _FEATURES,
    "service": _SERVICES,
    "license": _LICENSES,
}


def _template(rng: np.random.Generator, vocab: np.ndarray, weights: np.ndarray) -> dict:
    """A template: its sentences, the slots it fixes once (the rest vary per document) and a
    tagline of its own, so that different templates share little beyond stock phrases."""
    sentences = rng.choice(len(_SENTENCES), size=int(rng.integers(2, 6)), replace=False)
    fixed = {k: rng.choice(v) for k, v in _SLOTS.items() if rng.random() < 0.5}
    tagline = _free_text(rng, vocab, weights, int(rng.integers(4, 16)))
    return {"sentences": sentences, "fixed": fixed, "tagline": tagline}


def _fill(rng: np.random.Generator, template: dict, names: np.ndarray) -> str:
    slots = {k: rng.choice(v) for k, v in _SLOTS.items()}
    slots.update(template["fixed"])
    slots.update(
        name=rng.choice(names),
        name2=rng.choice(names),
        major=int(rng.integers(0, 4)),
        minor=int(rng.integers(0, 13)),
        patch=int(rng.integers(0, 20)),
    )
    body = " ".join(_SENTENCES[s].format(**slots) for s in template["sentences"])
    return f"{slots['name']}: {template['tagline']}. {body}"


def templated_corpus(
    n_docs: int = 60_000, *, templates: int = 1000, free_share: float = 0.15, seed: int = 0
) -> pd.DataFrame:
    """`n_docs` package descriptions, seeded, shuffled: columns text and template (-1 for
    free text)."""
    rng = np.random.default_rng(seed)
    names = _package_names(rng, max(n_docs, 1000))
    syl = np.array(_SYLLABLES)
    vocab = np.unique(["".join(w) for w in rng.choice(syl, size=(20_000, 3))])
    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 0.8  # Zipf-like word frequencies
    weights /= weights.sum()
    shapes = [_template(rng, vocab, weights) for _ in range(templates)]
    popularity = 1.0 / np.sqrt(np.arange(1, templates + 1))  # Zipf-like: a few dominate
    popularity /= popularity.sum()
    n_free = int(n_docs * free_share)
    chosen = rng.choice(templates, size=n_docs - n_free, p=popularity)
    texts = []
    for t in chosen:
        text = _fill(rng, shapes[t], names)
        if rng.random() < 0.5:
            text += " " + _free_text(rng, vocab, weights, int(rng.integers(3, 25)))
        texts.append(text)
    texts += [_free_text(rng, vocab, weights, int(rng.integers(20, 120))) for _ in range(n_free)]
    order = rng.permutation(len(texts))
    template = np.r_[chosen, np.full(n_free, -1)]
    return pd.DataFrame({"text": [texts[i] for i in order], "template": template[order]})
