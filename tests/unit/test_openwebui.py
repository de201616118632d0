"""Open WebUI's contract (issue 29): its background tasks at their own class with a default output
limit, its signed X-OpenWebUI-User-Jwt verified with the configured secret, and its users' names
and emails beside their ids in `passerelle usage --by user`. Read only from a key marked to trust
the front-end.

In process, against the fake runtime (tests/inprocess.py), which generates max_tokens tokens (16
when a request gives none).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from passerelle.cli import main
from passerelle.config import AuthConfig, load_config
from passerelle.errors import Cause, ConfigError
from passerelle.observe.accesslog import record_fields
from passerelle.observe.record import RequestRecord
from passerelle.tenants import people
from passerelle.tenants.keys import KeyStore
from passerelle.tenants.signed_user import MAX_TOKEN_CHARS, BadToken, SignedUser, sign, verify
from tests.inprocess import fake_runtime, gateway

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
ADA = {"x-openwebui-user-id": "5b9c0e4e-ada", "x-openwebui-user-name": "Ada%20Lovelace",
       "x-openwebui-user-email": "ada@example.org", "x-openwebui-user-role": "user"}
SECRET = "a-long-shared-secret-for-open-webui-tokens"


def bearer(secret: str, **more: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}", **more}


def token(secret: str = SECRET, *, exp_in: float = 300.0, alg: str = "HS256", **claims: object) -> str:
    now = int(time.time())
    return sign({"sub": "8f1c-ada", "email": "ada@example.org", "name": "Ada", "role": "user",
                 "iss": "open-webui", "iat": now, "exp": now + exp_in, **claims}, secret.encode(), alg=alg)


# -- background tasks ---------------------------------------------------------------------------
async def test_a_trusted_front_ends_task_runs_at_the_task_class_with_the_default_output_limit(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("webui", trust_forwarded_user=True)
    auth = AuthConfig(task_max_tokens=7)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db", auth=auth) as gw:
        follow_up = bearer(secret, **ADA, **{"x-openwebui-task": "follow_up_generation"})
        assert (await gw.post("/v1/chat/completions", CHAT, headers=follow_up)).status == 200
        task = gw.records[-1]
        assert (task.priority, task.task, task.max_tokens, task.completion_tokens) == (
            "batch", "follow_up_generation", 7, 7)
        assert record_fields(task)["task"] == "follow_up_generation" and record_fields(task)["priority"] == "batch"
        # a task that sets its own limit keeps it (Open WebUI's title sends one)
        assert (await gw.post("/v1/chat/completions", {**CHAT, "max_tokens": 3}, headers=follow_up)).status == 200
        assert (gw.records[-1].priority, gw.records[-1].completion_tokens) == ("batch", 3)
        # a user's own turn: the header is sent empty ("{{TASK}}" with no task)
        own = bearer(secret, **ADA, **{"x-openwebui-task": ""})
        assert (await gw.post("/v1/chat/completions", CHAT, headers=own)).status == 200
        turn = gw.records[-1]
        assert (turn.priority, turn.task, turn.completion_tokens) == ("standard", "", 16)
        assert "task" not in record_fields(turn)


async def test_a_key_without_the_mark_cannot_call_its_requests_tasks(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("plain")
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        headers = bearer(secret, **{"x-openwebui-task": "title_generation"})
        assert (await gw.post("/v1/chat/completions", CHAT, headers=headers)).status == 200
        rec = gw.records[-1]
        assert (rec.priority, rec.task, rec.completion_tokens) == ("standard", "", 16)


async def test_a_task_never_runs_above_its_keys_class(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("webui", priority="batch", trust_forwarded_user=True)
    auth = AuthConfig(task_priority="interactive")
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db", auth=auth) as gw:
        headers = bearer(secret, **{"x-openwebui-task": "tags_generation"})
        assert (await gw.post("/v1/chat/completions", CHAT, headers=headers)).status == 200
        assert gw.records[-1].priority == "batch"


def test_the_task_settings_are_checked_naming_their_key(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('[auth]\ntask_priority = "later"\n')
    with pytest.raises(ConfigError, match=r"auth\.task_priority"):
        load_config(f)
    f.write_text("[auth]\ntask_max_tokens = -1\n")
    with pytest.raises(ConfigError, match=r"auth\.task_max_tokens"):
        load_config(f)
    f.write_text('[[classes]]\nname = "background"\nrank = 2\n[auth]\ntask_priority = "background"\n'
                 'task_max_tokens = 256\nforwarded_user_jwt_secret = "s3cret-value"\n')
    cfg = load_config(f)
    assert (cfg.auth.task_priority, cfg.auth.task_max_tokens) == ("background", 256)
    assert "s3cret-value" not in repr(cfg)  # the secret never reaches a log through the configuration


# -- the signed user token ----------------------------------------------------------------------
async def test_a_valid_signed_token_names_the_person_and_the_plain_headers_are_then_ignored(tmp_path, caplog):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("webui", trust_forwarded_user=True)
    auth = AuthConfig(forwarded_user_jwt_secret=SECRET)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db", auth=auth) as gw:
        jwt = {"x-openwebui-user-jwt": token(), "x-openwebui-chat-id": "chat-1"}
        assert (await gw.post("/v1/chat/completions", CHAT, headers=bearer(secret, **jwt))).status == 200
        rec = gw.records[-1]
        assert (rec.tenant, rec.user, rec.user_name, rec.user_email) == (
            "webui/8f1c-ada", "8f1c-ada", "Ada", "ada@example.org")
        # with a secret set, whoever holds the key cannot name a person in plain headers
        forged = {**ADA, "x-openwebui-user-id": "admin"}
        assert (await gw.post("/v1/chat/completions", CHAT, headers=bearer(secret, **forged))).status == 200
        assert (gw.records[-1].tenant, gw.records[-1].user) == ("webui", "")
    assert SECRET not in caplog.text and SECRET not in str(record_fields(rec))


@pytest.mark.parametrize("bad", [
    pytest.param(token(exp_in=-120), id="expired"),
    pytest.param(token("another-secret"), id="wrong-secret"),
    pytest.param(token().rsplit(".", 1)[0] + ".", id="unsigned"),
    pytest.param(token(alg="none"), id="alg-none"),
    pytest.param(token(alg="HS512"), id="alg-hs512"),
    pytest.param(token(nbf=time.time() + 600), id="not-yet-valid"),
    pytest.param("x" * (MAX_TOKEN_CHARS + 1), id="too-long"),
    pytest.param("eyJ.garbage", id="garbage"),
])
async def test_a_bad_signed_token_is_a_401_in_the_apis_shape_and_logged_as_unauthorized(bad, tmp_path, caplog):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("webui", trust_forwarded_user=True)
    auth = AuthConfig(forwarded_user_jwt_secret=SECRET)
    caplog.set_level(logging.INFO)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db", auth=auth) as gw:
        resp = await gw.post("/v1/chat/completions", CHAT, headers=bearer(secret, **{"x-openwebui-user-jwt": bad}))
        assert resp.status == 401
        err = resp.json()["error"]
        assert err["code"] == "invalid_user_token" and "x-openwebui-user-jwt" in err["message"]
        assert gw.records[-1].cause is Cause.UNAUTHORIZED
        assert record_fields(gw.records[-1])["cause"] == "unauthorized"
        # Anthropic's shape on its route
        resp = await gw.post("/v1/messages", {"model": "fake-model", "max_tokens": 3, "messages": CHAT["messages"]},
                             headers=bearer(secret, **{"x-openwebui-user-jwt": bad}))
        assert resp.status == 401 and resp.json()["type"] == "error"
    assert SECRET not in caplog.text


def test_the_verifier_checks_what_open_webui_signs():
    now = time.time()
    assert verify(token(), SECRET.encode(), now=now) == SignedUser("8f1c-ada", "ada@example.org", "Ada", "user")
    assert verify(token(exp_in=-10), SECRET.encode(), now=now).sub == "8f1c-ada"  # within the clock leeway
    for why, bad in (("no expiry", token(exp=None)), ("names nobody", token(sub="")),
                     ("not a number", token(exp="soon")), ("not a number", token(exp=True))):
        with pytest.raises(BadToken, match=why):
            verify(bad, SECRET.encode(), now=now)
    with pytest.raises(BadToken, match="no secret"):
        verify(token(), b"", now=now)


_b64 = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=", max_size=60)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=200), st.builds(lambda a, b, c: f"{a}.{b}.{c}", _b64, _b64, _b64),
                 st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_any_text_is_a_person_or_a_refusal_never_an_exception(text):
    with contextlib.suppress(BadToken):
        verify(text, SECRET.encode(), now=time.time())


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["sub", "exp", "nbf", "name", "email", "role", "iat", "x"]), _json),
       st.sampled_from(["HS256", "none", "HS384", "RS256", ""]))
def test_signed_claims_of_any_shape_are_a_person_or_a_refusal(claims, alg):
    try:
        person = verify(sign(claims, SECRET.encode(), alg=alg), SECRET.encode(), now=time.time())
    except BadToken:
        return
    assert alg == "HS256" and isinstance(person.sub, str) and person.sub.strip()
    assert isinstance(claims.get("exp"), int | float) and not isinstance(claims.get("exp"), bool)


# -- what Open WebUI 0.12.4 really sent (tests/corpus/open-webui*, recorded by tests/corpus/record.py) --
CORPUS = Path(__file__).resolve().parents[1] / "corpus"


def test_the_token_open_webui_signed_verifies_with_its_secret():
    """Interoperability: a token minted by Open WebUI 0.12.4 itself (PyJWT), checked by our verifier
    at the time it was signed, and refused once expired."""
    from tests.corpus.record import OPEN_WEBUI_JWT_SECRET

    recorded = json.loads((CORPUS / "open-webui-jwt" / "001-chat.json").read_text())
    jwt = recorded["headers"]["x-openwebui-user-jwt"]
    claims = json.loads(base64.urlsafe_b64decode(jwt.split(".")[1] + "=="))
    person = verify(jwt, OPEN_WEBUI_JWT_SECRET.encode(), now=claims["iat"])
    assert (person.name, person.email, person.role) == ("Ada Admin", "ada@example.org", "admin") and person.sub
    with pytest.raises(BadToken, match="expired"):
        verify(jwt, OPEN_WEBUI_JWT_SECRET.encode(), now=claims["exp"] + 60)


async def test_open_webuis_recorded_requests_through_a_trusted_key(tmp_path):
    """Each chat and embeddings request Open WebUI sent, replayed with its headers through a key that
    trusts it: 200; its tasks at the task class with the default limit where they set none (its
    title sets 1000), its users' turns at the key's class; the person named with name and email."""
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("webui", trust_forwarded_user=True)
    files = sorted((CORPUS / "open-webui").glob("*.json"))
    assert len(files) >= 15
    seen_tasks = set()
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db",
                                               auth=AuthConfig(task_max_tokens=9)) as gw:
        for path in files:
            recorded = json.loads(path.read_text())
            body = {**recorded["body"], "model": "fake-model"}
            resp = await gw.post(recorded["path"], body, headers=bearer(secret, **recorded["headers"]))
            assert resp.status == 200, (path.name, resp.body[:300])
            rec, task = gw.records[-1], recorded["headers"].get("x-openwebui-task", "")
            assert (rec.user_name, rec.user_email) == ("Ada Admin", "ada@example.org"), path.name
            assert rec.task == task and rec.priority == ("batch" if task else "standard"), path.name
            if task:
                seen_tasks.add(task)
                assert rec.max_tokens == body.get("max_tokens", 9), path.name
    assert {"title_generation", "tags_generation", "follow_up_generation", "query_generation",
            "autocomplete_generation"} <= seen_tasks


# -- names and emails beside the ids ------------------------------------------------------------
async def test_usage_by_user_shows_the_names_and_emails_a_front_end_forwarded(tmp_path, capsys):
    db = tmp_path / "k.db"
    store = KeyStore(db)
    _, secret = store.create("webui", trust_forwarded_user=True)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=db) as gw:
        for headers in (ADA, {**ADA, "x-openwebui-user-id": "c0ffee-bob", "x-openwebui-user-name": "Bob",
                              "x-openwebui-user-email": "bob@example.org"}):
            assert (await gw.post("/v1/chat/completions", CHAT, headers=bearer(secret, **headers))).status == 200
        assert (gw.records[0].user_name, gw.records[0].user_email) == ("Ada Lovelace", "ada@example.org")
        users = (await gw.get("/v1/me/usage", headers=bearer(secret))).json()["users"]
        assert {(u["user"], u["name"], u["email"]) for u in users} == {
            ("5b9c0e4e-ada", "Ada Lovelace", "ada@example.org"), ("c0ffee-bob", "Bob", "bob@example.org")}
    capsys.readouterr()
    assert main(["usage", "--db", str(db), "--by", "user", "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("user,name,email,requests")
    rows = {line.split(",")[0]: line.split(",")[1:3] for line in lines[1:]}
    assert rows == {"5b9c0e4e-ada": ["Ada Lovelace", "ada@example.org"], "c0ffee-bob": ["Bob", "bob@example.org"]}


async def test_many_people_keep_the_book_bounded(tmp_path):
    book = people.PeopleBook(people.connect(tmp_path / "p.db"))
    rec = RequestRecord("r1", "chat", key_id="k1")
    for i in range(people.MAX_PENDING + 5000):
        rec.user, rec.user_name, rec.user_email = f"u{i}", "N" * 10, "e@x"
        book.observe(rec)
    assert len(book._pending) == people.MAX_PENDING  # the rest wait for a later request of theirs
    await book.flush()
    assert len(book._known) == people.MAX_KNOWN and not book._pending
    assert book.conn.execute("SELECT COUNT(*) FROM people").fetchone()[0] == people.MAX_PENDING
    rec.user = f"u{people.MAX_PENDING - 1}"
    book.observe(rec)  # an unchanged name written recently is not written again
    assert not book._pending
    rec.user = "u0"  # (written, then forgotten past MAX_KNOWN: written again, at most once a flush)
    book.observe(rec)
    assert list(book._pending) == [("k1", "u0")]
    book.close()


def test_hostile_names_are_clipped_and_never_raw_control_characters():
    from passerelle.proxy.frontend import person_of

    auth = AuthConfig()
    scope = {"headers": [(b"x-openwebui-user-id", b"u1"), (b"x-openwebui-user-name", b"%1b[31mEve%0a" + b"x" * 5000),
                         (b"x-openwebui-user-email", "é\x00ve@example.org".encode())]}
    person = person_of(auth, scope, time.time())
    assert person is not None and person.user == "u1"
    assert "\x1b" not in person.name and "\n" not in person.name and len(person.name) <= auth.max_user_chars * 4
    assert person.email == "é ve@example.org"


_header_value = st.binary(max_size=300)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"x-openwebui-user-id", b"x-openwebui-user-name", b"x-openwebui-user-email",
                                           b"x-openwebui-user-jwt", b"x-openwebui-task"]), _header_value), max_size=6),
       st.booleans())
def test_any_forwarded_headers_name_a_bounded_person_or_are_refused_with_a_401(headers, signed):
    from passerelle.errors import BadForwardedUser
    from passerelle.proxy.frontend import MAX_TASK_CHARS, person_of, task_of

    auth = AuthConfig(forwarded_user_jwt_secret=SECRET if signed else "")
    scope = {"headers": headers}
    try:
        person = person_of(auth, scope, time.time())
    except BadForwardedUser:
        assert signed
        person = None
    if person is not None:
        assert 0 < len(person.user) <= auth.max_user_chars + 13 and "/" not in person.user
        assert len(person.name) <= auth.max_user_chars * 4 and len(person.email) <= auth.max_user_chars * 4
    assert len(task_of(auth, scope)) <= MAX_TASK_CHARS
