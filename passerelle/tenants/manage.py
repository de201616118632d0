"""Creating, changing and revoking keys from what a person typed: the one code path behind both
``passerelle keys …`` and the admin API ``/admin/keys``.

Input comes as a mapping of field names to values, from JSON or from command-line flags; every
value is checked here, and a wrong one raises :class:`~passerelle.errors.InvalidRequest` naming
the field. Accepted forms:

    tenant, label, owner        strings (a tenant without "/": those name a front-end's people)
    priority, max_priority      a class name ("" or null: the default)
    rpm, tpm, max_concurrency   a non-negative integer (0: unlimited)
    weight                      a positive number
    trust_forwarded_user        true or false: the user a front-end forwards becomes the tenant
    models                      a list of globs, or one comma-separated string ("" or []: all models)
    quotas                      a list of "2M/day", "500k/week", "30000000/month" (one per period)
    expires_at                  an ISO date or time in the gateway's time zone ("2026-07-01",
                                "2026-07-01T18:00"), a duration from now ("90d", "12h"), a Unix
                                time, or null / "never"

Every change is written to the audit log with ``actor`` (who) in the same transaction.

Example::

    manager = KeyManager(store, classes=("interactive", "standard", "batch"))
    key, secret = manager.create({"tenant": "ci", "models": "llama-3-8b*", "quotas": ["2M/day"]},
                                 actor="cli:ops")
    manager.update(key.id, {"rpm": 60}, actor="admin API from 127.0.0.1")
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from passerelle.errors import InvalidRequest, KeyNotFound, clip
from passerelle.tenants.keys import EDITABLE, ApiKey, KeyStore
from passerelle.tenants.names import key_tenant_problem
from passerelle.tenants.quota import PERIODS, Quota, parse_quota

_DURATION = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_expiry(value: Any, now: float | None = None) -> float | None:
    """A Unix time (or None for never) from the accepted forms above; raises ValueError."""
    now = time.time() if now is None else now
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "never", "none")):
        return None
    if isinstance(value, bool):
        raise ValueError("expected a date, a duration or null")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ValueError("expected a date, a duration or null")
    text = value.strip()
    if text[-1:] in _DURATION and text[:-1].replace(".", "", 1).isdigit():
        return now + float(text[:-1]) * _DURATION[text[-1]]
    try:
        return datetime.fromisoformat(text).timestamp()  # naive: the gateway's local time
    except ValueError:
        raise ValueError(f"cannot read {value!r}; expected a date like 2026-07-01, a time like "
                         "2026-07-01T18:00, a duration like 90d or 12h, or 'never'") from None


def _text(name: str, value: Any, *, empty: bool = True, limit: int = 200) -> str:
    if not isinstance(value, str) or (not empty and not value.strip()) or len(value) > limit:
        raise InvalidRequest(f"'{name}' must be a {'non-empty ' if not empty else ''}string of at most "
                             f"{limit} characters.", param=name)
    if any(ord(ch) < 32 or 0x7f <= ord(ch) <= 0x9f for ch in value):  # C0, DEL, C1 (CSI)
        raise InvalidRequest(f"'{name}' must not contain control characters.", param=name)
    return value.strip()


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"'{name}' must be a non-negative integer (0: unlimited).", param=name)
    return value


class KeyManager:
    def __init__(self, store: KeyStore, classes: Sequence[str]) -> None:
        self.store = store
        self.configure(classes)

    def configure(self, classes: Sequence[str]) -> None:
        """The class names a key may be given (the configuration's classes, at a reload too)."""
        self.classes = tuple(classes)

    def fields(self, spec: Mapping[str, Any], *, creating: bool) -> dict[str, Any]:
        """``spec`` checked and converted to :class:`~passerelle.tenants.keys.ApiKey` field values."""
        unknown = [k for k in spec if k not in EDITABLE]
        if unknown:
            raise InvalidRequest(f"Unknown field(s) {', '.join(repr(clip(k)) for k in unknown[:10])}; a key has: "
                                 f"{', '.join(EDITABLE)}.", param=clip(unknown[0]))
        if creating and "tenant" not in spec:
            raise InvalidRequest("Missing required field 'tenant' (who the key belongs to).", param="tenant")
        out: dict[str, Any] = {}
        for name, value in spec.items():
            if name == "tenant":
                out[name] = _text(name, value, empty=False, limit=100)
                if (problem := key_tenant_problem(out[name])) is not None:
                    raise InvalidRequest(f"'tenant' {problem}.", param=name)
            elif name in ("label", "owner"):
                out[name] = _text(name, "" if value is None else value)
            elif name in ("priority", "max_priority"):
                if value in (None, ""):
                    out[name] = None
                elif value not in self.classes:
                    raise InvalidRequest(f"'{name}' must be one of the classes: {', '.join(self.classes)}.",
                                         param=name)
                else:
                    out[name] = value
            elif name in ("rpm", "tpm", "max_concurrency"):
                out[name] = _count(name, value)
            elif name == "weight":
                if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                    raise InvalidRequest("'weight' must be a positive number.", param=name)
                out[name] = float(value)
            elif name == "trust_forwarded_user":
                if not isinstance(value, bool):
                    raise InvalidRequest("'trust_forwarded_user' must be true or false.", param=name)
                out[name] = value
            elif name == "models":
                out[name] = self._models(value)
            elif name == "quotas":
                out[name] = self._quotas(value)
            elif name == "expires_at":
                try:
                    out[name] = parse_expiry(value)
                except ValueError as exc:
                    raise InvalidRequest(f"'expires_at': {exc}.", param=name) from None
                if creating and out[name] is not None and out[name] <= time.time():
                    raise InvalidRequest("'expires_at' is in the past; a new key must expire later.", param=name)
        return out

    @staticmethod
    def _models(value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(m, str) for m in items):
            raise InvalidRequest("'models' must be a list of model ids or globs (e.g. [\"llama-3-8b*\"]).",
                                 param="models")
        globs = tuple(dict.fromkeys(m.strip() for m in items if m.strip()))
        if any(len(g) > 200 for g in globs) or len(globs) > 100:
            raise InvalidRequest("'models' takes at most 100 globs of at most 200 characters.", param="models")
        return () if "*" in globs else globs

    @staticmethod
    def _quotas(value: Any) -> tuple[Quota, ...]:
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(q, str) for q in items):
            raise InvalidRequest("'quotas' must be a list like [\"2M/day\", \"40M/month\"].", param="quotas")
        try:
            quotas = [parse_quota(q) for part in items for q in part.split(",") if q.strip()]
        except ValueError as exc:
            raise InvalidRequest(f"'quotas': {exc}.", param="quotas") from None
        periods = [(q.period, q.unit) for q in quotas]  # one of tokens and one of requests per period
        twice = sorted({f"{u} a {p}" for p, u in periods if periods.count((p, u)) > 1})
        if twice:
            raise InvalidRequest(f"'quotas': one quota per period and unit; {', '.join(twice)} is given more "
                                 "than once.", param="quotas")
        return tuple(sorted(quotas, key=lambda q: (PERIODS.index(q.period), q.unit)))

    # -- the operations ------------------------------------------------------------------------
    def create(self, spec: Mapping[str, Any], *, actor: str) -> tuple[ApiKey, str]:
        """A new key and its secret (shown once)."""
        values = self.fields(spec, creating=True)
        return self.store.create(values.pop("tenant"), actor=actor, **values)

    def get(self, key_id: str) -> ApiKey:
        key = self.store.get(key_id)
        if key is None:
            raise KeyNotFound(key_id)
        return key

    def update(self, key_id: str, spec: Mapping[str, Any], *, actor: str) -> ApiKey:
        values = self.fields(spec, creating=False)
        if not values:
            raise InvalidRequest(f"Nothing to change; a key has: {', '.join(EDITABLE)}.")
        key = self.store.update(key_id, actor=actor, **values)
        if key is None:
            raise KeyNotFound(key_id)
        return key

    def revoke(self, key_id: str, *, actor: str) -> ApiKey:
        if not self.store.revoke(key_id, actor=actor):
            raise KeyNotFound(key_id)
        return self.get(key_id)
