"""A PostgreSQL DSN fit for a message: its password never shown."""
from __future__ import annotations

import re
import urllib.parse

# Where a DSN holds a password: a URL's user:PASSWORD@ or ?password=, a key=value
# string's password = value (quoted with '' when it holds spaces, \ escaping).
# (A URL's password up to the authority's last '@': one written with an '@' unencoded,
# which libpq cuts at the first, is still never shown in part.)
_PASSWORDS = (re.compile(r"://[^:/@?#]*:([^/?#]*)@"),
              re.compile(r"[?&]password=([^&#]*)", re.I),
              re.compile(r"(?<!\S)password\s*=\s*('(?:[^'\\]|\\.)*'?|\S+)", re.I))


def redact(dsn: str) -> str:
    """A DSN fit for a log line: never its password."""
    for pattern in _PASSWORDS:
        dsn = pattern.sub(lambda m: m.group(0)[:m.start(1) - m.start(0)] + "***"
                          + m.group(0)[m.end(1) - m.start(0):], dsn)
    return dsn


def scrub(text: str, dsn: str) -> str:
    """``text`` (libpq's words on ``dsn``: it quotes a token it cannot parse)
    without the DSN's password, as written or decoded."""
    for pattern in _PASSWORDS:
        for m in pattern.finditer(dsn):
            raw = m.group(1)
            for secret in {raw, raw.strip("'"), urllib.parse.unquote(raw)}:
                if secret:
                    text = text.replace(secret, "***")
    return text
