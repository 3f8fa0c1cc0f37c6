"""Secrets in a config (an `--api-key` among rollout.sglang.launch's args, a password in tracking.uri):
recognised by name, masked wherever a config is written — the frozen config.yaml, MLflow params, the
flow-run parameters Prefect stores — and never read back from there.

A masked value is ``***``. A resumed run whose frozen config holds one must be given the secret again
(``--set``); it never runs with the mask in place of the secret.
"""
from __future__ import annotations

import re
import urllib.parse
from typing import Any

import yaml

REDACTED = "***"

# A config key names a secret when its last component is, or ends in, one of these words
# ("hf_token", "api_key", "password"); "max_new_tokens", "input_key" and "top_k" do not.
_SECRET_KEY = re.compile(
    r"(^|[_-])(token|secret|password|passwd|credentials?|api[_-]?key|access[_-]?key|secret[_-]?key|"
    r"private[_-]?key|auth|signature)$|^key$|secret|password|credential", re.I)
# In a list of command-line args (rollout.sglang.launch): the value after a secret-looking flag.
_SECRET_FLAG = re.compile(r"^--?[\w-]*(token|secret|password|passwd|credential|api[_-]?key|access[_-]?key)[\w-]*$", re.I)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(str(key).rsplit(".", 1)[-1]))


def _token_userinfo(parts: urllib.parse.SplitResult) -> bool:
    # hf://name@revision is a model and its revision, not a user
    return "@" in parts.netloc and parts.scheme.lower() not in ("hf", "builtin") and bool(parts.username)


def uri_secrets(uri: str) -> list[str]:
    """The secret parts of a URI: its password (or a user part alone: a token), the values of secret-named
    query parameters."""
    try:
        parts = urllib.parse.urlsplit(str(uri))
        found = [parts.password or parts.username if parts.password or _token_userinfo(parts) else None]
        found = [f for f in found if f]
    except ValueError:
        return []
    found += [v for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True) if is_secret_key(k) and v]
    return found


def redact_uri(uri: str) -> str:
    """``scheme://user:password@host/...`` -> ``scheme://user:***@host/...``, a secret-named query parameter's
    value -> ``***``; anything else unchanged."""
    text = str(uri)
    try:
        parts = urllib.parse.urlsplit(text)
        password = parts.password
    except ValueError:
        return text
    host = parts.netloc.rsplit("@", 1)[-1]
    if password:
        parts = parts._replace(netloc=f"{parts.username or ''}:{REDACTED}@{host}")
    elif _token_userinfo(parts):
        password = parts.username  # a user part alone is a token (s3://KEY@bucket, https://TOKEN@host)
        parts = parts._replace(netloc=f"{REDACTED}@{host}")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(is_secret_key(k) for k, _ in query):
        q = urllib.parse.urlencode([(k, REDACTED if is_secret_key(k) else v) for k, v in query], safe="*")
        parts = parts._replace(query=q)
    return urllib.parse.urlunsplit(parts) if password or parts.query != urllib.parse.urlsplit(text).query else text


# ---- free text: every line printed, every message stored (errors, Prefect states, MLflow) -------------
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{},;]+")
_known: set[str] = set()  # secrets of the configs this process loaded, masked wherever they appear
_MIN_KNOWN = 6  # shorter "secrets" (a password "model") would mask ordinary words


def remember(tree: dict) -> None:
    """Note the secrets of a config tree (``model_dump``), so :func:`redact_text` masks them even where a
    library quotes them without their URI (botocore's "Invalid bucket name 'user:pw@bucket'")."""
    for key, value in _leaves(tree):
        if isinstance(value, str):
            if is_secret_key(key):
                _known.add(value)
            _known.update(uri_secrets(value) if "://" in value else ())
        elif isinstance(value, (list, tuple)):
            for plain, masked in zip(value, redact_value(list(value))):
                if plain != masked and isinstance(plain, str):
                    _known.add(plain.split("=", 1)[-1])
                _known.update(uri_secrets(plain) if isinstance(plain, str) and "://" in plain else ())
    _known.difference_update({s for s in _known if len(s) < _MIN_KNOWN})


def _leaves(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def redact_text(text: str) -> str:
    """Any text with its secrets masked: the URIs in it (:func:`redact_uri`) and every secret a loaded config
    held (:func:`remember`). The one mask for what grpoflow prints or hands to Prefect and MLflow."""
    out = _URI_IN_TEXT.sub(lambda m: redact_uri(m.group(0)), str(text))
    for secret in sorted(_known, key=len, reverse=True):
        for form in (secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret)):
            out = out.replace(form, REDACTED)
    return out


def redact_exception(exc: BaseException) -> BaseException:
    """``exc`` with its secrets masked in place (its type kept: retries are decided by type), before Prefect
    stores its message as a task's or flow's state, or the CLI prints it."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        try:
            link.args = tuple(redact_text(a) if isinstance(a, str) else a for a in link.args)
            if isinstance(link, OSError):
                for attr in ("filename", "filename2"):
                    if isinstance(getattr(link, attr, None), str):
                        setattr(link, attr, redact_text(getattr(link, attr)))
        except (AttributeError, TypeError):  # an exception type whose args cannot be set: its message stays
            pass
        link = link.__cause__ or link.__context__
    return exc


def redact_value(value: Any) -> Any:
    """A value with its secret parts masked: a URI's password, the argument after a secret flag."""
    if isinstance(value, str):
        return redact_uri(value) if "://" in value else value
    if isinstance(value, (list, tuple)):
        out, hide_next = [], False
        for item in value:
            if hide_next:
                out.append(REDACTED)
                hide_next = False
                continue
            s = str(item)
            if _SECRET_FLAG.match(s.split("=", 1)[0]):
                if "=" in s:
                    out.append(s.split("=", 1)[0] + "=" + REDACTED)
                else:
                    out.append(s)
                    hide_next = True
                continue
            out.append(redact_value(item))
        return out
    return value


def mask_tree(tree: dict) -> dict:
    """A config tree (``model_dump``) with every secret masked: secret keys whole, secret parts of values."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out[k] = mask_tree(v)
        elif is_secret_key(str(k)) and v is not None:
            out[k] = REDACTED
        else:
            out[k] = redact_value(v)
    return out


def masked_fields(tree: dict, prefix: str = "") -> list[str]:
    """Fields of a config tree that hold a mask where a secret was (a frozen config read back)."""
    found = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            found += masked_fields(v, key + ".")
        elif v == REDACTED or (isinstance(v, (list, tuple)) and any(str(i) == REDACTED or str(i).endswith("=" + REDACTED)
                                                                    for i in v)) \
                or (isinstance(v, str) and (f"{REDACTED}@" in v or f"={REDACTED}" in v)):
            found.append(key)
    return found


# ---- --set overrides on their way through Prefect -------------------------------------------------
# Prefect stores a flow run's parameters in its database; the overrides given to the flow are masked,
# and the flow, in the same process, gets the real ones back from here. (A deployment's overrides live
# in Prefect's database: put secrets in the environment of its worker, not in its parameters.)
_held: dict[str, str] = {}


def mask_override(item: str) -> str:
    key, sep, raw = item.partition("=")
    if not sep:
        return item
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError:
        value = raw
    masked = REDACTED if is_secret_key(key.strip()) and value is not None else redact_value(value)
    if masked == value:
        return item
    return f"{key}={yaml.safe_dump(masked, default_flow_style=True).strip().removesuffix('...').strip()}"


def hold(overrides: list[str] | None) -> list[str] | None:
    """The overrides with secrets masked, for the flow's parameters; the real ones are kept here."""
    if overrides is None:
        return None
    out = []
    for item in overrides:
        masked = mask_override(item)
        if masked != item:
            _held[masked] = item
        out.append(masked)
    return out


def reveal(overrides: list[str] | None) -> list[str] | None:
    """The real overrides behind ``hold``'s masked ones (inside the flow, in the CLI's process)."""
    return None if overrides is None else [_held.get(o, o) for o in overrides]
