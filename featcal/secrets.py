"""Secrets in a run's config never reach a file, a log or the Prefect API in clear.

A value is secret when its key looks like a credential (`key`, `secret`, `token`, `password`, `auth`, … as
the key's last word, or `secret…`/`password…`/`auth…`/`token…` as its first; `pooled_token_weight` is not
one, nor is a count such as `max_new_tokens`) — in `runtime.storage_options` and anywhere else in the config,
except where keys are task names (`experts`, `calibration.data`, `evaluation.data`, `evaluation.label_words`,
`zero_shot.class_names`, `zero_shot.task_templates`). Under such a key every scalar is secret (a nested
credentials mapping too); `null` and booleans are left alone.

What is written instead is a placeholder, `<redacted:HHHHHHHHHHHHHHHH>`: 64 bits of a salted, slow hash
(PBKDF2-SHA256) of the value. So `run.yaml`, the manifest's config fingerprint and the cache keys change when
a secret changes, but the value itself is not in them and a weak password is costly to guess from them.

The values live in memory only, in this module's registry (placeholder → value): filled by whoever redacts
(the process that loaded the user's config: the CLI, the flow), shipped to Dask workers by a worker plugin
(flows/dask_runner.py), and handed by `featcal serve` to the runs it starts through the environment variable
FEATCAL_SECRETS. `restore` puts them back when a stage rebuilds its config from `run.yaml`; a placeholder
nobody here knows is reported by `require_known` in one line that names the key.

Once a value is registered, log records made in this process have it replaced by its placeholder (a log
record factory), so neither the terminal nor the Prefect API log handler sees it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Iterable
from typing import Any

import yaml

ENV_VAR = "FEATCAL_SECRETS"
PLACEHOLDER = re.compile(r"<redacted:[0-9a-f]{16}>")
_SALT = b"featcal-redaction-v1"
_ITERATIONS = 100_000

# The key's last word (or its first, for the second set) says it holds a credential.
_LAST_WORDS = {"key", "keys", "secret", "secrets", "token", "tokens", "password", "passwords", "passwd", "pwd",
               "passphrase", "auth", "authorization", "credential", "credentials", "creds", "apikey", "cookie",
               "signature"}
_FIRST_WORDS = {"secret", "password", "passwd", "auth", "authorization", "token", "credential", "credentials",
                "apikey", "private"}
_NAMES = {"connection_string", "connectionstring", "conn_str", "sas", "sas_url", "dsn"}
# A key starting with one of these counts something (`max_new_tokens`), whatever its last word.
_COUNTS = {"max", "min", "num", "n"}
# Mappings whose keys are task names, not settings.
NAME_MAPS = {("experts",), ("calibration", "data"), ("evaluation", "data"), ("evaluation", "label_words"),
              ("zero_shot", "class_names"), ("zero_shot", "task_templates")}

_known: dict[str, Any] = {}  # placeholder → value
_hashes: dict[str, str] = {}  # canonical JSON of a value → its placeholder
_lock = threading.Lock()
_env_loaded = False
_factory_installed = False


class SecretUnknown(ValueError):
    """A redacted value this process cannot restore; the message names the key and what to do."""


def looks_secret(name: object) -> bool:
    """Whether a config key names a credential (`key`, `aws_secret_access_key`, `session_token`, `password`…)."""
    if not isinstance(name, str) or not name:
        return False
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    words = [w for w in re.split(r"[^a-z0-9]+", snake) if w]
    if not words or (len(words) > 1 and words[0] in _COUNTS):
        return False
    return words[-1] in _LAST_WORDS or words[0] in _FIRST_WORDS or "_".join(words) in _NAMES


def is_placeholder(value: object) -> bool:
    return isinstance(value, str) and PLACEHOLDER.fullmatch(value) is not None


def placeholder(value: Any) -> str:
    """The placeholder of a secret value (registers the value in this process)."""
    if is_placeholder(value):
        return value
    canonical = json.dumps(value, sort_keys=True)
    with _lock:
        ph = _hashes.get(canonical)
    if ph is None:
        digest = hashlib.pbkdf2_hmac("sha256", canonical.encode(), _SALT, _ITERATIONS)
        ph = f"<redacted:{digest[:8].hex()}>"
        with _lock:
            _hashes[canonical] = ph
    remember({ph: value})
    return ph


def _redact_all(value: Any) -> Any:
    """Every scalar under a secret-looking key."""
    if isinstance(value, dict):
        return {k: _redact_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_all(v) for v in value]
    if value is None or isinstance(value, bool) or value == "":
        return value
    return placeholder(value)


def redact(tree: Any, path: tuple[str, ...] = ()) -> Any:
    """A copy of `tree` (a config as JSON-able data, or a part of it at key path `path`) with every secret
    value replaced by its placeholder. Idempotent; registers the values it replaces."""
    if isinstance(tree, dict):
        names = path in NAME_MAPS
        return {k: (_redact_all(v) if not names and looks_secret(k) else redact(v, (*path, str(k))))
                for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redact(v, path) for v in tree]
    return tree


def redact_value(value: Any, path: tuple[str, ...]) -> Any:
    """`value` set at key path `path` (as `--set` does), redacted."""
    if path and looks_secret(path[-1]) and path[:-1] not in NAME_MAPS:
        return _redact_all(value)
    return redact(value, path)


def redact_override(assignment: str) -> str:
    """`--set KEY.PATH=VALUE` with its secrets replaced by placeholders; unchanged when it holds none."""
    if not isinstance(assignment, str) or "=" not in assignment:
        return assignment
    dotted, text = assignment.split("=", 1)
    path = tuple(dotted.strip().split("."))
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:  # not valid YAML (load_config will say so): hide the whole value if its key is secret
        secretive = any(looks_secret(k) for k in path) or any(
            looks_secret(k) for k in re.findall(r"([A-Za-z_][\w-]*)[\"']?\s*[:=]", text))
        return f"{dotted}=<redacted>" if secretive else assignment
    redacted = redact_value(value, path)
    return assignment if redacted == value else f"{dotted}={json.dumps(redacted)}"


def redact_overrides(overrides: Iterable[str] | None) -> list[str]:
    return [redact_override(o) for o in overrides or []]


def found(tree: Any) -> dict[str, Any]:
    """{placeholder: value} for the secrets in `tree` (JSON-able config data)."""
    out: dict[str, Any] = {}

    def walk(red: Any, orig: Any) -> None:
        if is_placeholder(red) and not is_placeholder(orig):
            out[red] = orig
        elif isinstance(red, dict) and isinstance(orig, dict):
            for k in red:
                walk(red[k], orig.get(k))
        elif isinstance(red, list) and isinstance(orig, (list, tuple)):
            for r, o in zip(red, orig, strict=False):
                walk(r, o)

    walk(redact(tree), tree)
    return out


# ---- the registry ---------------------------------------------------------------------------------------------
def remember(values: dict[str, Any]) -> None:
    """Make placeholders restorable in this process (and their values scrubbed from its logs)."""
    if not values:
        return
    with _lock:
        _known.update(values)
    _install_log_scrubber()


def forget(placeholders: Iterable[str]) -> None:
    with _lock:
        for ph in placeholders:
            _known.pop(ph, None)


def known() -> dict[str, Any]:
    _load_env()
    with _lock:
        return dict(_known)


def export_env(values: dict[str, Any]) -> str:
    """The value of FEATCAL_SECRETS that lets a child process restore `values`."""
    return json.dumps(values)


def _load_env() -> None:
    global _env_loaded
    if _env_loaded:
        return
    _env_loaded = True
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return
    try:
        values = json.loads(raw)
    except ValueError:
        return
    if isinstance(values, dict):
        remember({k: v for k, v in values.items() if is_placeholder(k)})


def restore(tree: Any) -> Any:
    """A copy of `tree` with every placeholder this process knows replaced by its value."""
    table = known()
    if not table:
        return tree

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if is_placeholder(node):
            return table.get(node, node)
        return node

    return walk(tree)


def unresolved(tree: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Dotted key paths in `tree` that still hold a placeholder."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in unresolved(v, (*path, str(k)))]
    if isinstance(tree, list):
        return [p for i, v in enumerate(tree) for p in unresolved(v, (*path, str(i)))]
    return [".".join(path)] if is_placeholder(tree) else []


def require_known(tree: Any, where: str) -> None:
    """Fail in one line when `tree` holds a placeholder this process cannot restore."""
    missing = unresolved(tree)
    if missing:
        keys = ", ".join(missing)
        raise SecretUnknown(
            f"{where}: {keys} {'is' if len(missing) == 1 else 'are'} redacted and this process (pid {os.getpid()} "
            f"on {socket.gethostname()}) does not know the value: rerun `featcal run` with the config or --set that "
            "sets it (a deployment of `featcal serve` reads secrets from its config file, or from --set given to the "
            "`featcal serve` that runs it), or give the storage backend its credentials through its own environment "
            "variables (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) instead of storage_options")


# ---- logs -----------------------------------------------------------------------------------------------------
def scrub(text: str) -> str:
    """`text` with every known secret value (of 6 characters or more: shorter ones would garble ordinary words)
    replaced by its placeholder."""
    if not isinstance(text, str):
        return text
    with _lock:
        pairs = [(str(v), ph) for ph, v in _known.items() if not isinstance(v, bool) and len(str(v)) >= 6]
    for value, ph in sorted(pairs, key=lambda p: -len(p[0])):
        if value in text:
            text = text.replace(value, ph)
    return text


def _install_log_scrubber() -> None:
    global _factory_installed
    with _lock:
        if _factory_installed:
            return
        _factory_installed = True
    previous = logging.getLogRecordFactory()
    formatter = logging.Formatter()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
            clean = scrub(message)
            if clean != message:
                record.msg, record.args = clean, ()
            if record.exc_info and record.exc_info[1] is not None:
                text = formatter.formatException(record.exc_info)
                clean = scrub(text)
                if clean != text:  # formatters print exc_text when it is set
                    record.exc_text = clean
        except Exception:  # noqa: BLE001 - a log line must never fail because of us
            pass
        return record

    logging.setLogRecordFactory(factory)
