"""``GET /v1/me/usage``'s people, paged in SQL on the shared store: the same report (tenants/usage.py)
read through PgUsageReader from a real PostgreSQL (started as tests/integration/test_store_postgres.py
does) pages a front-end's people by name with LIMIT and a cursor, whole and in order."""

from __future__ import annotations

import uuid

from passerelle.tenants.pgstore import connect, migrate
from passerelle.tenants.pgusage import PgUsageReader
from tests.integration.test_store_postgres import postgres  # noqa: F401  (the fixture: one server for the module)

PEOPLE = 2500


async def test_people_are_paged_in_sql_on_postgresql(postgres):  # noqa: F811
    url = postgres.new_database()
    with connect(url, 5.0) as conn:
        migrate(conn)
        rows = [(uuid.uuid4(), 100.0 + i, f"webui/p{i:04d}", "k1", f"p{i:04d}") for i in range(PEOPLE)]
        rows += [(uuid.uuid4(), 100.0, "webui", "k1", "") for _ in range(3)]  # the front-end's own calls: nobody
        rows += [(uuid.uuid4(), 100.0, "other", "k2", "zz")]  # another key's person
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO usage (id, ts, tenant, key_id, class, model, cause, prompt_tokens, "
                            "completion_tokens, \"user\", session) VALUES (%s, %s, %s, %s, 'standard', 'm', 'ok', "
                            "3, 2, %s, '')", rows)
    reader = PgUsageReader(url)
    try:
        (total,) = await reader.report(since=0.0, by=("key",), key_id="k1")
        assert total["requests"] == PEOPLE + 3 and total["total_tokens"] == 5 * (PEOPLE + 3)
        seen, after, pages = [], "", 0
        while True:
            page = await reader.report(since=0.0, by=("user",), key_id="k1", after=after, limit=1001)
            assert len(page) <= 1001
            more = len(page) > 1000
            seen += [r["user"] for r in page[:1000]]
            pages += 1
            if not more:
                break
            after = page[999]["user"]
        assert seen == [f"p{i:04d}" for i in range(PEOPLE)] and pages == 3
        models = await reader.report(since=0.0, by=("model",), key_id="k1", limit=1)
        assert [m["model"] for m in models] == ["m"]
    finally:
        reader.close()
