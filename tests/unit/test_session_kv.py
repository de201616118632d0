"""Sessions keep their KV (scheduling/session_kv.py, session_hold.py, kv_store.py, slots.py): the
hold learned from a session's gaps, released to a request that waited past its class's budget, the
save/restore plans scoped to tenant and session, the bounded store, and deadlines that never fail
a request. With an injected clock; the real llama-server's side is tests/integration/test_sessions_llama.py."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from pathlib import Path
from typing import Any

import pytest

from passerelle.config import DEFAULT_CLASSES, BackendConfig, SessionsConfig, TimeoutConfig
from passerelle.runtimes.llama_server import LlamaServerBackend, clean_saved_kv
from passerelle.scheduling.job import Job
from passerelle.scheduling.kv_store import KvStore
from passerelle.scheduling.session_hold import SessionGaps
from passerelle.scheduling.session_kv import SessionKv, session_key
from tests.unit.test_scheduler import Clock, FakeBackend, scheduler
from tests.waiting import until

CLS = {c.name: c for c in DEFAULT_CLASSES}


@dataclasses.dataclass(eq=False)
class SlotBackend(FakeBackend):
    """A runtime with named slots and a save directory; records the slot actions asked of it."""

    slot_ids: bool = True
    slot_save_dir: Path | None = Path("/nonexistent")
    actions: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    fail: str = ""  # an action that gets no answer

    async def slot_action(self, slot: int, action: str, filename: str = "", timeout: float = 10.0
                          ) -> dict[str, Any] | None:
        self.actions.append((slot, action, filename))
        if action == self.fail:
            return None
        return {"save": {"n_written": 1000, "n_saved": 10}, "restore": {"n_restored": 10}}.get(action, {})


@pytest.fixture
def clock():
    return Clock()


def job(pool, tenant="t", session="", cls="interactive") -> Job:
    j = Job(pool=pool, cls=CLS[cls], tenant=tenant, slotted=True, session=session_key(tenant, session))
    j.future = asyncio.get_running_loop().create_future()
    return j


def make(clock, **sessions: Any):
    s = scheduler(clock=clock, hold_s=0)
    s.sessions.configure(SessionsConfig(**sessions))
    return s


def test_the_hold_is_a_high_percentile_of_the_sessions_own_gaps_capped():
    g = SessionGaps(SessionsConfig(hold_percentile=90, hold_max_s=30, hold_default_s=5))
    assert g.left("a", 0.0) == 5  # no gap known yet: the default
    t = 0.0
    for gap in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10):  # turn ends at t, the next comes gap seconds later
        g.arrived("a", t + gap)
        t += gap + 1
        ttl = g.left("a", t)
    assert g.gaps("a") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert ttl == pytest.approx(9 * 1.25)  # the 90th percentile, with a quarter more
    assert g.ttl("b") == 5  # another session's hold is its own
    g.arrived("b", 1.0)  # (no turn of b ended: nothing learned)
    assert g.gaps("b") == []
    g.left("slow", 0.0)
    g.arrived("slow", 100.0)
    g.left("slow", 101.0)
    g.arrived("slow", 201.0)
    assert g.left("slow", 202.0) == 30  # capped by hold_max_s


def test_sessions_remembered_are_bounded():
    g = SessionGaps(SessionsConfig(max_sessions=3))
    for i in range(10):
        g.left(f"s{i}", 0.0)
        g.arrived(f"s{i}", 1.0)
    assert len(g._gaps) == 3 and len(g._ended) <= 3
    assert g.gaps("s9") == [1.0] and g.gaps("s0") == []


async def test_a_sessions_slot_is_held_across_its_gap_and_saved_ahead_for_a_request_that_waits(clock):
    b = SlotBackend(capacity=1)
    s = make(clock)
    a1 = job([b], session="agent-a")
    s.submit(a1)
    assert a1.backend is b and a1.slot == 0 and a1.kv is None  # nothing to save or restore yet
    s.release(a1)
    # agent-a comes back within its hold (5 s by default): its slot, its KV there (no save, no restore)
    clock.now += 0.3
    a2 = job([b], session="agent-a")
    s.submit(a2)
    assert a2.backend is b and a2.slot == 0 and a2.kv is None
    assert s.sessions.counts.holds["kept"] == 1
    s.release(a2)
    # another session's request waits for the held slot: agent-a's KV is saved at once, while it
    # waits, and the saved slot goes to it without waiting out its class's budget (no erase: the
    # same tenant; nothing left to save)
    other = job([b], session="agent-b")
    s.submit(other)
    assert other.backend is None and (b.name, 0) in s.sessions.ahead
    await until(lambda: other.backend is b, what="the request takes the slot once its KV is saved")
    assert [a[:2] for a in b.actions] == [(0, "save")]
    assert s.sessions.store.has(a2.session, b.name) and s.sessions.counts.saves["ok"] == 1
    assert other.slot == 0 and other.kv is None
    assert s.sessions.counts.holds["taken"] == 1
    # agent-a's next turn gets its KV back by a restore of what was saved
    s.release(other)
    a3 = job([b], session="agent-a")
    s.submit(a3)
    await until(lambda: a3.backend is b)
    assert a3.kv is not None and a3.kv.restore == a3.session


async def test_where_held_slots_mostly_go_to_other_sessions_a_turns_kv_is_saved_as_it_ends(clock):
    """Once most holds on a runtime ended with their slot taken by another session, a turn's KV is
    saved as the turn ends, while its slot idles: the request that later wants the slot takes it at
    once, with no save to wait for. Holds kept by their own sessions turn that off again."""
    b = SlotBackend(capacity=1)
    s = make(clock, hold_max_s=60, hold_default_s=60)
    names = ["agent-a", "agent-b"]

    def saves() -> int:
        return [a[1] for a in b.actions].count("save")

    for i in range(4):  # a and b in turn on one slot: each turn waits for the other's held slot
        clock.now += 1.0  # (a session's gaps are learned: each comes back after a second or two)
        j = job([b], session=names[i % 2])
        s.submit(j)
        assert (j.backend is None) == (i > 0)  # (the first found the slot free)
        await until(lambda j=j: j.backend is b, what="the turn takes the slot once the other's KV is saved")
        await s.sessions.before(j)
        s.release(j)
        # the release's own save: only once three holds in a row were taken (a share past one half)
        assert ((b.name, 0) in s.sessions.ahead) == (i == 3)
    slots = s._slots[b.name]
    assert s.sessions.counts.holds["taken"] == 3 and slots.save_on_release
    await until(lambda: slots.saved[0], what="agent-b's KV saved as its turn ended")
    assert saves() == 4
    clock.now += 1.0
    a = job([b], session="agent-a")
    s.submit(a)
    assert a.backend is b and a.kv is not None  # at once: nothing left to save, agent-a's KV to restore
    assert (a.kv.save, a.kv.wait, a.kv.restore) == ("", None, a.session)
    await s.sessions.before(a)
    assert saves() == 4 and b.actions[-1][1] == "restore"
    s.release(a)
    await until(lambda: not s.sessions.ahead)
    # agent-a now comes back within its holds: its slot is kept, and the share falls under a half
    for _ in range(2):
        clock.now += 1.0
        a = job([b], session="agent-a")
        s.submit(a)
        assert a.backend is b and a.kv is None
        s.release(a)
        await until(lambda: not s.sessions.ahead)
    assert s.sessions.counts.holds["kept"] == 2 and not slots.save_on_release
    assert saves() == 6  # (the first kept turn's release still saved; the second's did not)


async def test_a_session_that_comes_back_sooner_than_a_save_takes_is_not_saved_as_its_turn_ends(clock):
    """Its tools return at once: its next turn would wait for that save, and it keeps its slot."""
    b = SlotBackend(capacity=1)
    s = make(clock, hold_max_s=60, hold_default_s=60)
    s.sessions.swap_s[b.name] = 2.0  # a save and a restore take 2 s on b

    def turn() -> None:
        clock.now += 0.5  # back 0.5 s after each answer
        j = job([b], session="agent-quick")
        s.submit(j)
        assert j.backend is b and j.kv is None
        s.release(j)
        s._slots[b.name].taken_share = 1.0  # (as if holds here mostly went to other sessions)

    for _ in range(3):
        turn()
    assert b.actions == [] and not s.sessions.ahead
    s.sessions.swap_s[b.name] = 0.2  # where saving and restoring take less than its gaps, it is saved
    turn()
    assert s.sessions.ahead
    await until(lambda: not s.sessions.ahead)
    assert [a[1] for a in b.actions] == ["save"]


@dataclasses.dataclass(eq=False)
class SlowSaveBackend(SlotBackend):
    """Its saves end only when ``gate`` is set; every action is recorded with what ran before it."""

    gate: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    late: bool = False  # its answer comes past the deadline it was given (the request's wait ends first)
    saving: int = 0  # saves under way
    overlaps: list[str] = dataclasses.field(default_factory=list)  # actions sent while a save ran

    async def slot_action(self, slot: int, action: str, filename: str = "", timeout: float = 10.0
                          ) -> dict[str, Any] | None:
        if self.saving:
            self.overlaps.append(action)
        if action != "save":
            return await super().slot_action(slot, action, filename, timeout)
        self.saving += 1
        try:
            await asyncio.wait_for(self.gate.wait(), None if self.late else timeout)
        except TimeoutError:
            return None
        finally:
            self.saving -= 1
        return await super().slot_action(slot, action, filename, timeout)


async def test_a_save_slower_than_the_class_budget_is_waited_for_before_the_slot_is_used(clock):
    b = SlowSaveBackend(capacity=1)
    s = make(clock, hold_max_s=60, hold_default_s=60)
    a = job([b], session="agent-a")
    s.submit(a)
    s.release(a)
    plain = job([b], cls="interactive")  # no session: 0.5 s for a held slot
    s.submit(plain)
    await until(lambda: b.saving == 1, what="the save ahead under way")
    clock.now += 0.49
    s.dispatch()
    assert plain.backend is None
    clock.now += 0.02
    s.dispatch()
    # its budget spent, it takes the slot; the save under way is not asked again, but waited for
    assert plain.backend is b and plain.kv is not None
    assert plain.kv.save == "" and plain.kv.wait is not None
    prepared = asyncio.create_task(s.sessions.before(plain))
    await asyncio.sleep(0.05)
    assert not prepared.done()  # (nothing is sent to the slot while its save runs)
    b.gate.set()
    await prepared
    assert b.overlaps == [] and s.sessions.store.has(a.session, b.name)


async def test_a_session_that_comes_back_during_its_save_waits_for_it_and_keeps_its_slot(clock):
    b = SlowSaveBackend(capacity=1)
    s = make(clock)
    a = job([b], session="agent-a")
    s.submit(a)
    s.release(a)
    other = job([b], session="agent-b")
    s.submit(other)
    await until(lambda: b.saving == 1)
    a2 = job([b], session="agent-a")  # its hold: it gets its slot, and its KV is still there
    s.submit(a2)
    assert a2.backend is b and a2.kv is not None and a2.kv.wait is not None
    assert (a2.kv.save, a2.kv.restore, a2.kv.erase) == ("", "", False)
    b.gate.set()
    await s.sessions.before(a2)
    assert b.overlaps == [] and [x[1] for x in b.actions] == ["save"]
    assert other.backend is None  # (the slot is a2's now)


async def test_a_save_ahead_that_outlives_the_wait_for_it_is_never_restored(clock):
    """A save that did not end when the request waiting for it gave up on it may write that
    request's KV under the other session's name: it is dropped, whatever it answers."""
    b = SlowSaveBackend(capacity=1, late=True)
    s = make(clock, hold_max_s=60, hold_default_s=60, save_timeout_s=0.1)
    a = job([b], tenant="acme", session="agent-a")
    s.submit(a)
    s.release(a)
    e = job([b], tenant="evil")
    s.submit(e)
    await until(lambda: b.saving == 1)
    clock.now += 0.6
    s.dispatch()
    assert e.backend is b and e.kv is not None and e.kv.wait is not None and e.kv.erase
    waited = e.kv.wait
    await s.sessions.before(e)
    assert not waited.done()
    b.gate.set()  # the runtime answers the save late: it is not kept
    await waited
    assert not s.sessions.store.has(a.session, b.name) and s.sessions.counts.saves["ok"] == 1


def held_and_wanted(clock, b: SlotBackend):
    """agent-a's turn on ``b``'s one slot, held for it a minute; then a request with no session waits."""
    s = make(clock, hold_max_s=60, hold_default_s=60)
    a = job([b], session="agent-a")
    s.submit(a)
    s.release(a)
    plain = job([b], cls="interactive")
    s.submit(plain)
    return s, a, plain


async def test_a_request_without_a_session_takes_a_held_slot_once_it_is_saved(clock):
    b = SlotBackend(capacity=1)
    s, a, plain = held_and_wanted(clock, b)
    assert plain.backend is None
    await until(lambda: plain.backend is b)
    assert plain.kv is None and s.sessions.store.has(a.session, b.name)
    # without a save directory the slot waits out the class's budget (0.5 s), then goes unsaved
    c = SlotBackend(name="c", capacity=1, slot_save_dir=None)
    s2, _, plain2 = held_and_wanted(clock, c)
    await asyncio.sleep(0.01)
    clock.now += 0.49
    s2.dispatch()
    assert plain2.backend is None and not s2.sessions.ahead
    assert s2._wake_timer_at <= clock.now + 0.02  # a timer looks again when its budget is spent
    clock.now += 0.02
    s2.dispatch()
    assert plain2.backend is c and c.actions == []


async def test_a_lapsed_hold_leaves_the_slot_to_anyone(clock):
    b = SlotBackend(capacity=1, slot_save_dir=None)  # (nothing saved: the hold alone decides)
    s = make(clock, hold_default_s=2)
    a = job([b], session="agent-a")
    s.submit(a)
    s.release(a)
    batch = job([b], cls="batch")  # batch would wait 10 s for a held slot
    s.submit(batch)
    assert batch.backend is None
    clock.now += 2.01
    s.dispatch()
    assert batch.backend is b  # the hold ended
    assert s.sessions.counts.holds["lapsed"] == 1


async def test_keep_kv_off_holds_nothing_and_plans_nothing(clock):
    b = SlotBackend(capacity=1)
    s = make(clock, keep_kv=False)
    a = job([b], session="agent-a")
    s.submit(a)
    s.release(a)
    other = job([b], session="agent-b")
    s.submit(other)
    assert other.backend is b and other.kv is None


async def test_a_session_comes_back_to_its_saved_kv_and_never_to_another_tenants(clock):
    b = SlotBackend(capacity=1)
    s = make(clock, hold_default_s=0)
    a = job([b], tenant="acme", session="shared-id")
    s.submit(a)
    s.release(a)
    # another tenant with the same session id: a different session; the slot goes to it, acme's KV
    # is saved and the slot erased, and nothing is restored for it
    e = job([b], tenant="evil", session="shared-id")
    s.submit(e)
    assert e.backend is b and e.kv is not None
    assert (e.kv.save, e.kv.erase, e.kv.restore) == (a.session, True, "")
    await s.sessions.before(e)
    assert b.actions == [(0, "save", b.actions[0][2]), (0, "erase", "")]
    assert s.sessions.store.has(a.session, b.name) and not s.sessions.store.has(e.session, b.name)
    s.release(e)
    # acme comes back: evil's KV saved, the slot erased, acme's own restored
    a2 = job([b], tenant="acme", session="shared-id")
    s.submit(a2)
    assert a2.kv is not None and (a2.kv.save, a2.kv.erase, a2.kv.restore) == (e.session, True, a.session)
    await s.sessions.before(a2)
    names = {a.session: s.sessions.store.lookup(a.session, b.name).name,
             e.session: s.sessions.store.lookup(e.session, b.name).name}
    assert names[a.session] != names[e.session]
    assert b.actions[-1] == (0, "restore", names[a.session])
    assert s.sessions.counts.restores == {"ok": 1, "failed": 0, "missing": 0}
    # file names say nothing of tenant or session
    assert all("acme" not in n and "shared" not in n for n in names.values())


async def test_a_failed_save_or_restore_costs_a_recompute_never_the_request(clock):
    b = SlotBackend(capacity=1, fail="save")
    s = make(clock, hold_default_s=0)
    a = job([b], session="a")
    s.submit(a)
    s.release(a)
    o = job([b], session="o")
    s.submit(o)
    await s.sessions.before(o)  # no answer to the save: nothing raised, nothing kept
    assert s.sessions.counts.saves == {"ok": 0, "failed": 1}
    assert not s.sessions.store.has(a.session, b.name)
    s.release(o)
    b.fail = "restore"
    o2 = job([b], session="a")  # (a has nothing saved: no restore planned)
    s.submit(o2)
    assert o2.kv is not None and o2.kv.restore == ""
    await s.sessions.before(o2)
    s.release(o2)
    o3 = job([b], session="o")  # o's KV was saved by o2's dispatch: restored, and that fails
    s.submit(o3)
    assert o3.kv is not None and o3.kv.restore == o3.session
    await s.sessions.before(o3)
    assert s.sessions.counts.restores["failed"] == 1 and b.actions[-1][1] == "erase"
    assert not s.sessions.store.has(o3.session, b.name)

    class Broken(SlotBackend):
        async def slot_action(self, *args: Any, **kw: Any) -> dict[str, Any] | None:
            raise RuntimeError("boom")

    kv = SessionKv(SessionsConfig())
    j = job([b], session="x")
    from passerelle.scheduling.kv_store import KvPlan
    j.kv = KvPlan(Broken(), 0, save="k", erase=True)
    await kv.before(j)  # logged, not raised
    assert j.kv is None


def test_the_store_evicts_the_least_recently_used_and_removes_its_file(tmp_path):
    store = KvStore(SessionsConfig(max_saved_files=2, max_saved_bytes=10_000))
    names = {}
    for k in ("a", "b"):
        names[k] = store.name_for(k, "r")
        (tmp_path / names[k]).write_bytes(b"x" * 100)
        store.saved(k, "r", tmp_path, 100)
    assert store.lookup("a", "r") is not None  # a is now the most recently used
    names["c"] = store.name_for("c", "r")
    (tmp_path / names["c"]).write_bytes(b"x" * 100)
    store.saved("c", "r", tmp_path, 100)
    assert not (tmp_path / names["b"]).exists() and store.lookup("b", "r") is None
    assert (tmp_path / names["a"]).exists() and (tmp_path / names["c"]).exists()
    assert (store.evictions, store.files, store.bytes) == (1, 2, 200)
    # the byte bound too
    names["d"] = store.name_for("d", "r")
    (tmp_path / names["d"]).write_bytes(b"x" * 100)
    store.configure(SessionsConfig(max_saved_files=2, max_saved_bytes=150))
    assert store.files == 1 and store.bytes == 100
    # a file of the same session on another replica is another entry, another name
    assert store.name_for("c", "r2") != names["c"]


def test_start_up_removes_saved_kv_files_and_nothing_else(tmp_path):
    (tmp_path / ("ab" * 16 + ".kv")).write_bytes(b"kv")
    (tmp_path / "operator-notes.txt").write_text("keep")
    assert clean_saved_kv(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["operator-notes.txt"]


async def test_a_slot_save_that_gets_no_answer_ends_at_its_deadline():
    """A runtime that takes the save and never answers (hung, or dying mid-save)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []

    async def accept() -> None:
        conn, _ = await asyncio.get_running_loop().sock_accept(listener)
        accepted.append(conn)

    acceptor = asyncio.create_task(accept())
    b = LlamaServerBackend(BackendConfig(name="l", kind="llama-server", url=f"http://127.0.0.1:{port}",
                                         models=("m",)), TimeoutConfig())
    await b.start()
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await b.slot_action(0, "save", "x.kv", timeout=0.3) is None
        assert 0.25 < loop.time() - t0 < 2.0
    finally:
        acceptor.cancel()
        for c in accepted:
            c.close()
        listener.close()
        await b.close()


async def test_a_held_slot_is_yielded_sooner_where_saving_and_restoring_costs_less(clock):
    """A hold is worth its wait only while moving the session's KV out and back would cost more:
    with a measured swap of 0.1 s, a waiting request takes the held slot after 0.1 s, not 0.5 s."""
    b = SlotBackend(capacity=1)
    s = make(clock, hold_default_s=30)
    s.sessions.swap_s[b.name] = 0.1
    a = job([b], session="agent-a")
    s.submit(a)
    s.release(a)
    other = job([b], session="agent-b")
    s.submit(other)
    clock.now += 0.09
    s.dispatch()
    assert other.backend is None
    clock.now += 0.02
    s.dispatch()
    assert other.backend is b
    # without a save directory the swap is a recompute: the class's budget stands
    c = SlotBackend(name="c", capacity=1, slot_save_dir=None)
    s.sessions.swap_s[c.name] = 0.1
    assert s.sessions.yield_after(c, 0.5) == 0.5


def test_a_launched_llama_server_gets_a_save_path_emptied_of_old_kv(tmp_path):
    from passerelle.runtimes.factory import build_runtime

    bc = BackendConfig(name="own", kind="llama-server", models=("m",),
                       launch=("llama-server", "-m", "m.gguf", "--port", "{port}"))
    stale = tmp_path / "slot-kv" / "own" / ("cd" * 16 + ".kv")
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    backend, proc = build_runtime(bc, TimeoutConfig(), tmp_path)
    assert proc is not None and proc.template[-2:] == ("--slot-save-path", str(tmp_path / "slot-kv" / "own"))
    assert backend.slot_save_dir == tmp_path / "slot-kv" / "own" and not stale.exists()
    # the operator's own path is kept, and known
    own = tmp_path / "mine"
    own.mkdir()
    bc2 = dataclasses.replace(bc, launch=(*bc.launch, "--slot-save-path", str(own)))
    backend2, proc2 = build_runtime(bc2, TimeoutConfig(), tmp_path)
    assert proc2 is not None and list(proc2.template).count("--slot-save-path") == 1
    assert backend2.slot_save_dir == own
    # a runtime passerelle does not launch has none: its sessions fall back to its RAM prompt cache
    remote, _ = build_runtime(dataclasses.replace(bc, launch=(), url="http://127.0.0.1:9"), TimeoutConfig(), tmp_path)
    assert remote.slot_save_dir is None
    # a stand-in that speaks llama-server's API (a fake runtime, a script) is launched as written
    fake = dataclasses.replace(bc, launch=("python", "-m", "passerelle", "fake-backend", "--port", "{port}"))
    backend3, proc3 = build_runtime(fake, TimeoutConfig(), tmp_path)
    assert proc3 is not None and "--slot-save-path" not in proc3.template and backend3.slot_save_dir is None


def test_a_session_key_is_of_fixed_length_and_scoped_to_its_tenant():
    from passerelle.scheduling.session_kv import tenant_of, tenant_tag

    a, b = session_key("alice", "s1"), session_key("bob", "s1")
    long = session_key("t" * 64, "x" * 24)
    assert len(a) == len(b) == len(long) == 26 and a != b
    assert tenant_of(a) == tenant_tag("alice") != tenant_of(b) and session_key("alice", "") == ""
