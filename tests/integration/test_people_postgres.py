"""The names and emails beside a front-end's ids (tenants/people.py) in the shared PostgreSQL store:
the same book and lookup as on SQLite, against a real server (started as
tests/integration/test_store_postgres.py does)."""

from __future__ import annotations

from passerelle.observe.record import RequestRecord
from passerelle.tenants.people import PeopleBook, _LazyPg, names
from passerelle.tenants.pgstore import _Conn, connect
from tests.integration.test_store_postgres import postgres  # noqa: F401  (the fixture: one server for the module)


async def test_people_are_written_and_read_back_on_postgresql(postgres):  # noqa: F811
    url = postgres.new_database()
    book = PeopleBook(_LazyPg(lambda: _Conn(connect(url, 5.0))))
    rec = RequestRecord("r1", "chat", key_id="k1", user="5b9c-ada", user_name="Ada", user_email="ada@example.org")
    book.observe(rec)
    await book.flush()
    rec.user_name = "Ada Lovelace"  # a new name replaces the old one
    book.observe(rec)
    await book.flush()
    book.close()
    conn = _Conn(connect(url, 5.0))
    try:
        assert names(conn, None, ["5b9c-ada", "nobody"]) == {"5b9c-ada": ("Ada Lovelace", "ada@example.org")}
        assert names(conn, "another-key", ["5b9c-ada"]) == {}
    finally:
        conn.close()
