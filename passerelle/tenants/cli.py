"""``passerelle keys …`` and ``passerelle usage``: keys and the usage report, on the gateway's machine.

Both open the instance's store (``[auth] db``, else ``passerelle.db`` in the state directory of
``--config``: see ``Config.state_path``) and change keys through
:class:`~passerelle.tenants.manage.KeyManager`, the code behind the admin API, so a change is
checked, audited (actor ``cli:USER``) and seen by a running gateway within a second.

    passerelle keys create --tenant ci --label "CI runners" --model 'qwen2.5-7b*' --quota 2M/day
    passerelle keys update 3f9c0a1b2c4d --rpm 60 --expires 2026-07-01
    passerelle usage --by key --since 7d --csv > usage.csv
"""

from __future__ import annotations

import argparse
import csv
import getpass
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from passerelle.errors import ConfigError, InvalidRequest

if TYPE_CHECKING:
    from passerelle.config import Config
    from passerelle.tenants.keys import KeyStore


def _actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no name for this uid (e.g. a bare container)
        return f"cli:uid {os.getuid()}"


def _open(args: argparse.Namespace, *, usage: bool = False) -> tuple[Config, KeyStore]:
    """The instance's key store (``--db``, ``[store] url`` or its SQLite file), where its usage
    rows are too (``usage``: the same; its ``conn`` answers the reports' SQL either way)."""
    from passerelle.config import load_config
    from passerelle.tenants.store import open_key_store

    cfg = load_config(getattr(args, "config", None))
    return cfg, open_key_store(cfg, getattr(args, "db", None))


def _when(ts: float | None, never: str = "never") -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else never


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    """The key fields given on the command line (None: not given)."""
    spec: dict[str, Any] = {}
    for flag, name in (("tenant", "tenant"), ("label", "label"), ("owner", "owner"), ("priority", "priority"),
                       ("max_priority", "max_priority"), ("rpm", "rpm"), ("tpm", "tpm"),
                       ("max_concurrency", "max_concurrency"), ("weight", "weight"), ("expires", "expires_at"),
                       ("trust_forwarded_user", "trust_forwarded_user")):
        value = getattr(args, flag, None)
        if value is not None:
            spec[name] = value
    if getattr(args, "model", None) is not None:
        spec["models"] = [m for part in args.model for m in part.split(",")]
    if getattr(args, "quota", None) is not None:
        spec["quotas"] = [q for q in args.quota if q.strip().lower() not in ("", "none")]
    return spec


def cmd_keys(args: argparse.Namespace) -> int:
    from passerelle.tenants.manage import KeyManager

    try:
        cfg, store = _open(args)
    except ConfigError as exc:
        print(f"passerelle: configuration error: {exc}", file=sys.stderr)
        return 2
    manager = KeyManager(store, [c.name for c in cfg.classes])
    action = args.keys_command
    try:
        if action == "create":
            first = not store.list(include_revoked=True)
            key, secret = manager.create(_spec(args), actor=_actor())
            print(secret)
            print(f"key {key.id} for tenant '{key.tenant}' created; the key above is shown only once "
                  f"(store: {store.path})", file=sys.stderr)
            if first and not cfg.auth.required:
                print("note: this is the store's first key, so anonymous access is now off: a gateway using "
                      "this store refuses requests without a key from now on", file=sys.stderr)
        elif action == "update":
            key = manager.update(args.id, _spec(args), actor=_actor())
            print(f"key {key.id} updated: {_summary(key)}")
        elif action == "revoke":
            manager.revoke(args.id, actor=_actor())
            print(f"key {args.id} revoked")
        elif action == "show":
            import orjson

            print(orjson.dumps(manager.get(args.id).describe(), option=orjson.OPT_INDENT_2).decode())
        elif action == "audit":
            from passerelle.observe.accesslog import printable

            # client text (the admin API's actor header, labels, owners, models): escaped, so that
            # no control character or ANSI escape reaches the terminal or forges a line
            for row in reversed(store.audit_log(limit=args.limit, key_id=args.key)):
                detail = " ".join(f"{printable(str(k))}={printable(_plain(v))}" for k, v in row["detail"].items())
                print(f"{printable(row['ts'])}  {printable(row['actor']):28}  {printable(row['action']):7} "
                      f"{printable(row['key_id'])}  {detail}")
        else:
            print(f"store: {store.path}", file=sys.stderr)  # (stderr: the table stays a table)
            _list(store, show_all=args.all)
    except InvalidRequest as exc:
        print(f"passerelle: {exc.message}", file=sys.stderr)
        return 1 if exc.status == 404 else 2
    finally:
        store.close()
    return 0


def _plain(value: Any) -> str:
    """An audit detail's value as it was printed: a string as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    import orjson

    return orjson.dumps(value).decode()


def _summary(key: Any) -> str:
    parts = [f"tenant {key.tenant}"]
    if key.models:
        parts.append("models " + ",".join(key.models))
    limits = [f"{n} {getattr(key, n)}" for n in ("rpm", "tpm", "max_concurrency") if getattr(key, n)]
    parts += limits + [f"quota {q}" for q in key.quotas]
    if key.trust_forwarded_user:
        parts.append("trusts forwarded users")
    if key.expires_at:
        parts.append(f"expires {_when(key.expires_at)}")
    return ", ".join(parts)


def _list(store: Any, *, show_all: bool) -> None:
    from passerelle.observe.accesslog import printable

    now = time.time()
    rows = [["ID", "TENANT", "LABEL", "OWNER", "CLASS", "MODELS", "RPM", "TPM", "CONC", "QUOTAS", "EXPIRES", "STATUS"]]
    for k in store.list(include_revoked=show_all):
        status = "revoked" if k.revoked else "expired" if k.expired(now) else "active"
        rows.append([k.id, k.tenant, k.label or "-", k.owner or "-", k.priority or "-", ",".join(k.models) or "*",
                     str(k.rpm or "-"), str(k.tpm or "-"), str(k.max_concurrency or "-"),
                     ",".join(map(str, k.quotas)) or "-", _when(k.expires_at), status])
    rows = [[printable(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    numeric = {6, 7, 8}
    for r in rows:
        print("  ".join(v.rjust(w) if i in numeric else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths,
                                                                                                strict=True))).rstrip())


def cmd_usage(args: argparse.Namespace) -> int:
    from passerelle.observe.accesslog import printable
    from passerelle.tenants.usage import DIMENSIONS, parse_since, report

    try:
        since = parse_since(args.since)
        until = parse_since(args.until) if args.until else None
    except ValueError:
        print("passerelle: cannot read --since / --until; use 2026-11-30, 2026-11-30T12:00, or back from now: "
              "90m, 24h, 7d", file=sys.stderr)
        return 2
    by = [d.strip() for d in args.by.split(",") if d.strip()]
    if not by or any(d not in DIMENSIONS for d in by):
        print(f"passerelle: --by takes some of {', '.join(DIMENSIONS)} (comma-separated), not {args.by!r}",
              file=sys.stderr)
        return 2
    if args.export_trace is not None and args.access_log is not None:
        from passerelle.tenants.trace import access_log_rows, export_trace

        try:
            with args.access_log.open(errors="replace") as fh:
                lines = list(access_log_rows(fh, since))
        except OSError as exc:
            print(f"passerelle: cannot read {args.access_log}: {exc.strerror}", file=sys.stderr)
            return 2
        return export_trace(lines, args.export_trace, f"the access log {args.access_log}")
    try:
        _, store = _open(args, usage=True)
    except ConfigError as exc:
        print(f"passerelle: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.export_trace is not None:
        from passerelle.tenants.trace import export_trace, usage_rows

        return export_trace(usage_rows(store.conn, since), args.export_trace,
                            f"the usage store {store.path} (arrivals approximate: it keeps when requests ended)")
    rows = report(store.conn, since=since, until=until, by=by)
    print(f"store: {store.path}", file=sys.stderr)  # (stderr: --csv output stays CSV)
    keys = {k.id: k for k in store.list()} if "key" in by else {}
    people: dict[str, tuple[str, str]] = {}
    if "user" in by:  # names and emails a front-end forwarded beside its ids (tenants/people.py)
        from passerelle.tenants.people import names

        people = names(store.conn, None, [r["user"] for r in rows])
    figures = ["requests", "prompt_tokens", "completion_tokens", "total_tokens", "not_ok", "limited", "last_seen"]
    head: list[str] = []
    for d in by:
        head += ["key", "label", "key_tenant"] if d == "key" else ["user", "name", "email"] if d == "user" else [d]
    out = []
    for r in rows:
        line: list[Any] = []
        for d in by:
            if d == "key":
                k = keys.get(r["key"])
                line += [r["key"] or "-", (k.label if k else "") or ("(no key)" if not r["key"] else "-"),
                         k.tenant if k else "-"]
            elif d == "user":
                line += [r["user"], *people.get(r["user"], ("", ""))]
            else:
                line.append(r[d])
        out.append([*line, *(r[f] for f in figures)])
    if args.csv:
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(head + figures)
        for line in out:
            w.writerow([*line[:-1], time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(line[-1]))])
        return 0
    # tenants and models come from clients (a `user`, a `model`): never raw to a terminal
    out = [[printable(v) if isinstance(v, str) else v for v in line] for line in out]
    titles = [h.upper().replace("KEY_TENANT", "TENANT") for h in head]
    widths = [max([len(t), *(len(str(line[i])) for line in out)]) + 2 for i, t in enumerate(titles)]
    print("".join(f"{t:{w}}" for t, w in zip(titles, widths, strict=True))
          + f"{'REQUESTS':>10}{'PROMPT TOK':>12}{'COMPL TOK':>12}{'TOTAL TOK':>12}{'NOT OK':>8}{'LIMITED':>9}"
          f"  LAST SEEN")
    for line in out:
        n = len(titles)
        print("".join(f"{v!s:{w}}" for v, w in zip(line[:n], widths, strict=True))
              + "".join(f"{v:>{w}}" for v, w in zip(line[n:-1], (10, 12, 12, 12, 8, 9), strict=True))
              + f"  {_when(line[-1], '-')}")
    return 0


def _common() -> argparse.ArgumentParser:
    """--config and --db, accepted before or after the action (``keys --config F list`` or
    ``keys list --config F``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                   help="the gateway's configuration file: its store ([auth] db or its state directory) and "
                        "classes")
    p.add_argument("--db", default=argparse.SUPPRESS, help="the SQLite store itself (overrides --config)")
    return p


def _key_fields(p: argparse.ArgumentParser, *, creating: bool) -> None:
    if creating:
        p.add_argument("--tenant", required=True, help="who the key belongs to (fair share and usage)")
    else:
        p.add_argument("--tenant", help="move the key to another tenant")
    p.add_argument("--label", help="what the key is for (e.g. 'CI runners')")
    p.add_argument("--owner", help="who to ask about it (a person or a team address)")
    p.add_argument("--priority", help="class of its requests (default: the anonymous class)")
    p.add_argument("--max-priority", help="most urgent class X-Priority may raise it to (default: --priority)")
    p.add_argument("--rpm", type=int, help="requests per minute (0: unlimited)")
    p.add_argument("--tpm", type=int, help="tokens per minute, prompt + max_tokens (0: unlimited)")
    p.add_argument("--max-concurrency", type=int,
                   help="requests at once; more wait in the key's queue (0: unlimited)")
    p.add_argument("--weight", type=float, help="fair-share weight of the tenant (default 1)")
    p.add_argument("--model", action="append", metavar="GLOB",
                   help="a model it may use, globs allowed ('llama-3-8b*'); repeat or comma-separate "
                        "(default: all; '*' sets all again)")
    p.add_argument("--quota", action="append", metavar="TOKENS/PERIOD",
                   help="tokens per day, week or month: 2M/day, 500k/week, 30M/month, or requests: "
                        "'1000 requests/day' (repeat for several; 'none' removes them)")
    p.add_argument("--trust-forwarded-user", action=argparse.BooleanOptionalAction, default=None,
                   help="a trusted front-end's key (Open WebUI): the user it names in [auth] forwarded_user_header "
                        "becomes the tenant '<tenant>/<user>' for fair share, limits and usage")
    p.add_argument("--expires", metavar="WHEN",
                   help="2026-07-01 (local midnight), 2026-07-01T18:00, or from now: 90d, 12h"
                        + ("" if creating else "; 'never' removes the expiry"))


def add_parsers(subparsers: Any) -> None:
    """Register ``keys`` and ``usage`` on the ``passerelle`` command line."""
    common = _common()
    keys = subparsers.add_parser("keys", parents=[common],
                                 help="create, list, update and revoke API keys (stored hashed in SQLite)")
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = ksub.add_parser("create", parents=[common], help="create a key and print it once")
    _key_fields(create, creating=True)
    listing = ksub.add_parser("list", parents=[common], help="list keys (never their secrets)")
    listing.add_argument("--all", action="store_true", help="revoked keys too")
    update = ksub.add_parser("update", parents=[common], help="change a key's limits, models, quotas, expiry")
    update.add_argument("id")
    _key_fields(update, creating=False)
    show = ksub.add_parser("show", parents=[common], help="one key's fields as JSON")
    show.add_argument("id")
    revoke = ksub.add_parser("revoke", parents=[common], help="revoke a key by its id")
    revoke.add_argument("id")
    audit = ksub.add_parser("audit", parents=[common], help="who changed which key, and when (oldest first)")
    audit.add_argument("--key", help="only this key's changes")
    audit.add_argument("--limit", type=int, default=100, help="the last N changes (default 100)")
    keys.set_defaults(func=cmd_keys)

    usage = subparsers.add_parser("usage", parents=[common],
                                  help="requests and tokens by key, tenant, model or class")
    usage.add_argument("--by", default="tenant,class",
                       help="group by some of key, tenant, model, class, comma-separated (default tenant,class)")
    usage.add_argument("--since", help="2026-11-30, 2026-11-30T12:00, or back from now: 90m, 24h, 7d "
                                       "(default: everything)")
    usage.add_argument("--until", help="the end, same forms (default: now)")
    usage.add_argument("--csv", action="store_true", help="CSV on standard output, for a spreadsheet")
    usage.add_argument("--export-trace", type=Path, metavar="FILE",
                       help="write the requests' arrival times and lengths as a JSONL trace for "
                            "`passerelle bench --trace FILE` ('-': stdout)")
    usage.add_argument("--access-log", type=Path, metavar="FILE",
                       help="with --export-trace: read the access log's JSON lines (exact arrival times) "
                            "instead of the usage store (which keeps when requests ended)")
    usage.set_defaults(func=cmd_usage)
