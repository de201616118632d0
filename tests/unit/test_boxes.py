"""Other boxes: the box state machine, ``[[boxes]]`` validation, placement, and what a box's
reading does to its replicas (no network: the readings are given)."""

from __future__ import annotations

import logging

import pytest

from passerelle.config import BoxConfig, TimeoutConfig, load_config
from passerelle.errors import ConfigError
from passerelle.runtimes.box_state import BoxState, BoxStatus, IllegalTransition
from passerelle.runtimes.boxes import Boxes, RemoteBox
from passerelle.runtimes.breaker import BreakerState
from passerelle.runtimes.placement import BoxMemory, RemoteModel, decide, to_start

KEY = "bk_Zq3v9TfLw2NcR8pXy4HdJm6K"


# -- the state machine ---------------------------------------------------------------------------
def test_a_box_goes_up_suspect_down_and_up_again():
    s = BoxStatus("b1")
    assert s.state is BoxState.UNKNOWN and not s.serving
    assert s.seen_up(now=1.0) and s.state is BoxState.UP and s.serving
    assert s.missed("no answer within 1 s", hard=False, now=2.0)
    assert s.state is BoxState.SUSPECT and s.serving  # one late answer is not a dead box
    assert s.missed("no answer within 1 s", hard=False, now=3.0)
    assert (s.state, s.cause, s.since) == (BoxState.DOWN, "no answer within 1 s", 3.0) and not s.serving
    assert not s.missed("connection failed: refused", hard=True)  # still down, the cause follows
    assert s.cause == "connection failed: refused"
    assert s.seen_up(now=9.0) and s.state is BoxState.UP and s.cause == ""
    assert s.changes == 4


def test_a_refused_or_reset_connection_takes_a_box_down_at_once():
    s = BoxStatus("b1")
    s.seen_up()
    assert s.missed("connection reset", hard=True) and s.state is BoxState.DOWN
    fresh = BoxStatus("b2")
    assert fresh.missed("connection failed", hard=True) and fresh.state is BoxState.DOWN


def test_a_suspect_box_that_answers_is_up_again():
    s = BoxStatus("b1")
    s.seen_up()
    s.missed("HTTP 503", hard=False)
    assert s.seen_up() and s.state is BoxState.UP


def test_transitions_the_machine_does_not_have_are_refused():
    s = BoxStatus("b1")
    s.to(BoxState.DOWN, "gone")
    with pytest.raises(IllegalTransition, match="DOWN -> SUSPECT"):
        s.to(BoxState.SUSPECT)
    with pytest.raises(IllegalTransition, match="DOWN -> UNKNOWN"):
        s.to(BoxState.UNKNOWN)


# -- [[boxes]] -----------------------------------------------------------------------------------
def load(tmp_path, text: str):
    p = tmp_path / "gw.toml"
    p.write_text(text)
    return load_config(p, env={}), str(p)


def test_boxes_load_and_a_gateway_with_only_boxes_does_not_start_the_embedded_default(tmp_path):
    cfg, _ = load(tmp_path, f'[[boxes]]\nname = "strix-a"\nurl = "http://10.0.0.2:8080"\nkey = "{KEY}"\n'
                            f'[[boxes]]\nname = "strix-b"\nurl = "https://b.example.org"\nkey = "{KEY}"\n'
                            f'models = ["qwen*"]\npoll_s = 2\n')
    assert [b.name for b in cfg.boxes] == ["strix-a", "strix-b"]
    assert cfg.boxes[1].models == ("qwen*",) and cfg.boxes[1].poll_s == 2.0 and cfg.boxes[0].place
    assert not cfg.uses_embedded and cfg.backends == ()


@pytest.mark.parametrize(("body", "key", "line", "message"), [
    ('name = "a"\nurl = "http://10.0.0.2:8080"\n', "boxes[0].key", 2, "box key"),
    (f'name = "a"\nurl = "http://93.184.216.34:8080"\nkey = "{KEY}"\n', "boxes[0].url", 3, "in clear"),
    (f'name = "a"\nurl = "http://gpu.example.org:8080"\nkey = "{KEY}"\n', "boxes[0].url", 3, "allow_http"),
    (f'name = "a"\nurl = "ftp://10.0.0.2"\nkey = "{KEY}"\n', "boxes[0].url", 3, "http(s) URL"),
    (f'name = "a b"\nurl = "http://10.0.0.2"\nkey = "{KEY}"\n', "boxes[0].name", 2, "letters, digits"),
    (f'name = "a"\nurl = "http://10.0.0.2"\nkey = "{KEY}"\npoll_s = 0\n', "boxes[0].poll_s", 5, "between 0.1"),
    (f'name = "a"\nurl = "http://10.0.0.2"\nkey = "{KEY}"\nslots = 4\n', "boxes.slots", 5, "unknown key"),
])
def test_box_errors_name_the_file_the_key_and_the_line(tmp_path, body, key, line, message):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, "# boxes\n[[boxes]]\n" + body)
    e = err.value
    assert (e.key, e.line) == (key, line + 1) and e.file and e.file.endswith("gw.toml")
    assert message in str(e)


def test_plain_http_to_a_public_address_is_allowed_only_when_asked(tmp_path):
    cfg, _ = load(tmp_path, f'[[boxes]]\nname = "a"\nurl = "http://93.184.216.34:8080"\nkey = "{KEY}"\n'
                            'allow_http = true\n')
    assert cfg.boxes[0].allow_http
    cfg, _ = load(tmp_path, f'[[boxes]]\nname = "a"\nurl = "http://strix-b.lan:8080"\nkey = "{KEY}"\n')
    assert cfg.boxes[0].url == "http://strix-b.lan:8080"  # a name of the local network


def test_a_box_and_a_backend_cannot_share_a_name(tmp_path):
    with pytest.raises(ConfigError, match="duplicate name 'a'") as err:
        load(tmp_path, '[[backends]]\nname = "a"\nurl = "http://127.0.0.1:9"\nmodels = ["m"]\n'
                       f'[[boxes]]\nname = "a"\nurl = "http://10.0.0.2"\nkey = "{KEY}"\n')
    assert err.value.key == "boxes[0].name"


def test_a_reload_plans_the_boxes_by_name_and_applies_them_at_once():
    from passerelle.config import Config
    from passerelle.runtimes.reload_plan import effective, plan_reload

    a, b = BoxConfig("a", url="http://10.0.0.2:8080", key=KEY), BoxConfig("b", url="http://10.0.0.4:8080", key=KEY)
    old = Config(boxes=(a, b))
    new = Config(boxes=(BoxConfig("a", url="http://10.0.0.3:8080", key=KEY), BoxConfig("c", url="http://10.0.0.5",
                                                                                       key=KEY)))
    plan = plan_reload(old, new)
    assert (plan.boxes.added, plan.boxes.removed, plan.boxes.replaced) == (("c",), ("b",), ("a",))
    assert plan.restart == () and plan.live == ()
    assert "boxes added c; boxes removed b; boxes replaced a" in plan.summary()
    assert plan.as_dict()["boxes"]["added"] == ["c"]
    assert effective(old, new).boxes == new.boxes


async def test_reconfigured_boxes_keep_the_unchanged_read_the_new_and_drain_the_removed():
    a, b = BoxConfig("a", url="http://127.0.0.1:9", key=KEY), BoxConfig("b", url="http://127.0.0.1:9", key=KEY)
    boxes = Boxes((a, b), TimeoutConfig())
    seen: list[list[str]] = []
    boxes.on_change = lambda replicas: seen.append(sorted(r.name for r in replicas))
    box_a, box_b = boxes.boxes
    for box in boxes.boxes:
        box._learn(*reading())
    gone = box_b.replicas["qwen"]
    gone.in_flight = 1  # a stream still running there
    c = BoxConfig("c", url="http://127.0.0.1:9", key=KEY)
    leaving = boxes.reconfigure((a, c), TimeoutConfig())
    assert boxes.boxes[0] is box_a and [x.cfg.name for x in boxes.boxes] == ["a", "c"]  # a untouched
    assert leaving == [gone] and gone.draining and not gone.routable(0.0)
    assert seen[-1] == ["a/qwen", "b/qwen"]  # b's replica stays listed while its request runs; c not read yet
    assert set(boxes._tasks) == {boxes.boxes[1]}  # c is being read (a's loop was never started here)
    gone.in_flight = 0
    await boxes.forget(leaving)
    assert seen[-1] == ["a/qwen"]
    await boxes.stop()


def test_a_catalogue_entry_may_name_a_box_replica(tmp_path):
    cfg, _ = load(tmp_path, f'[[boxes]]\nname = "b"\nurl = "http://10.0.0.2"\nkey = "{KEY}"\n'
                            '[[models]]\nname = "chat"\nserved_name = "qwen"\nbackends = ["b/qwen"]\n')
    assert cfg.models[0].backends == ("b/qwen",)
    with pytest.raises(ConfigError, match="BOX/MODEL") as err:
        load(tmp_path, f'[[boxes]]\nname = "b"\nurl = "http://10.0.0.2"\nkey = "{KEY}"\n'
                       '[[models]]\nname = "chat"\nbackends = ["c/qwen"]\n')
    assert (err.value.key, err.value.line) == ("models[0].backends", 7)


# -- placement -----------------------------------------------------------------------------------
def test_a_model_that_fits_a_box_runs_as_replicas_and_one_that_fits_none_is_split():
    small = RemoteModel("m", state="loaded", need_gib=20.0, runtimes=("m",))
    placed = decide("m", {"a": (small, BoxMemory(96.0, 20.0)), "b": (small, BoxMemory(96.0, 0.0))})
    assert (placed.mode, placed.boxes) == ("replicas", ("a", "b"))
    big = RemoteModel("big", state="down", need_gib=130.0, runtimes=("big",))
    split = decide("big", {"a": (big, BoxMemory(110.0)), "b": (big, BoxMemory(110.0))})
    assert split.mode == "split" and split.as_dict()["fits"] is False
    assert "130.0 GiB" in split.why and "rpc-split.md" in split.why


def test_a_replica_is_started_only_where_the_budget_has_room_now():
    m = RemoteModel("m", state="unloaded", need_gib=30.0, runtimes=("m-rt",))
    assert to_start(m, BoxMemory(96.0, 60.0)) == "m-rt"
    assert to_start(m, BoxMemory(96.0, 70.0)) is None  # 100 GiB would be over its budget
    assert to_start(m, BoxMemory(None, 500.0)) == "m-rt"  # no budget there
    assert to_start(RemoteModel("m", state="loaded", need_gib=30.0, runtimes=("m-rt",)), BoxMemory()) is None


# -- a box's readings and its replicas -------------------------------------------------------------
def reading(state: str = "loaded", capacity: int = 4, in_flight: int = 0):
    listing = {"data": [{"id": "qwen", "state": state, "memory_gib": 12.5, "backends": ["qwen-rt"],
                         "routes": ["/v1/chat/completions", "/v1/completions"]},
                        {"id": "alias-only", "state": "loaded", "backends": []}]}
    runtimes = {"runtimes": [{"name": "qwen-rt", "capacity": capacity, "models": ["qwen"], "up": True,
                              "in_flight": in_flight}],
                "budget": {"max_loaded_gib": 96.0, "loaded_gib": 12.5}}
    return listing, runtimes


def make_box() -> tuple[RemoteBox, list[int]]:
    changes: list[int] = []
    box = RemoteBox(BoxConfig("a", url="http://10.0.0.2:8080", key=KEY), TimeoutConfig(),
                    on_change=lambda: changes.append(1))
    return box, changes


def test_a_reading_makes_one_replica_per_model_with_the_box_slots():
    box, _ = make_box()
    box._learn(*reading(capacity=4))
    box._answered()
    (replica,) = box.replicas.values()
    assert replica.name == "a/qwen" and replica.models == ("qwen",)
    assert replica.capacity == 4 and replica.capacity_info.source == "reported"
    assert replica.endpoints == ("chat", "completions") and replica.stats.up
    assert box.memory == BoxMemory(96.0, 12.5)
    box._learn(*reading(capacity=6))
    assert box.replicas["qwen"] is replica and replica.capacity == 6  # the same replica, its slots follow


def test_slots_taken_on_a_box_by_others_are_not_offered_here():
    box, _ = make_box()
    box._learn(*reading(capacity=4))
    (replica,) = box.replicas.values()
    replica.in_flight = 1  # one of this gateway's requests runs there
    box._learn(*reading(capacity=4, in_flight=3))  # the box runs three: two came from elsewhere
    assert replica.capacity == 2 and "2 taken by others" in replica.capacity_info.describe()
    box._learn(*reading(capacity=4, in_flight=9))  # a box swamped by others: one slot still offered
    assert replica.capacity == 1
    box._learn(*reading(capacity=4, in_flight=1))  # only ours: every slot again
    assert replica.capacity == 4


def test_a_box_going_down_takes_its_replicas_out_opens_their_breakers_and_names_the_cause():
    box, changes = make_box()
    box._learn(*reading())
    box._answered()
    replica = box.replicas["qwen"]
    box._missed("no answer within 1 s", hard=False)
    assert box.status.state is BoxState.SUSPECT and replica.stats.up  # not yet
    box._missed("no answer within 1 s", hard=False)
    assert box.status.state is BoxState.DOWN and not replica.stats.up
    assert replica.breaker.state is BreakerState.OPEN
    assert replica.stats.error == "box a down: no answer within 1 s"
    assert box.describe()["cause"] == "no answer within 1 s" and changes
    box._answered()
    assert replica.stats.up and replica.routable(0.0)  # back with its box, its breaker closed at once
    assert replica.breaker.state is BreakerState.CLOSED


def test_a_replica_resumes_suspended_streams_only_in_the_one_dialect_its_runtimes_speak():
    box, _ = make_box()
    listing, runtimes = reading()
    runtimes["runtimes"][0]["kind"] = "llama-server"
    box._learn(listing, runtimes)
    assert box.replicas["qwen"].continuation == "llama-server"
    listing["data"][0]["backends"] = ["qwen-rt", "qwen-openai"]
    runtimes["runtimes"].append({"name": "qwen-openai", "capacity": 2, "models": ["qwen"], "kind": "openai"})
    box._learn(listing, runtimes)
    assert box.replicas["qwen"].continuation == "" and box.replicas["qwen"].capacity == 6


def test_a_model_whose_runtime_is_down_on_its_box_is_not_routed_there():
    box, _ = make_box()
    box._learn(*reading(state="down"))
    box._answered()
    assert not box.replicas["qwen"].stats.up


def test_a_model_that_fits_no_box_is_marked_split_with_shares_by_budget_and_said_once_per_change(caplog):
    boxes = Boxes((BoxConfig("a", url="http://10.0.0.2:8080", key=KEY),
                   BoxConfig("b", url="http://10.0.0.3:8080", key=KEY)), TimeoutConfig())
    for box in boxes.boxes:
        listing, runtimes = reading(state="down")
        listing["data"][0]["memory_gib"] = 130.0  # over each box's 96 GiB budget
        box._learn(listing, runtimes)
    with caplog.at_level(logging.WARNING, logger="passerelle.runtimes.boxes"):
        for box in (*boxes.boxes, *boxes.boxes):
            box._answered()
    said = [r.getMessage() for r in caplog.records if "fits no box alone" in r.getMessage()]
    assert len(said) == 2 and said[-1].endswith("(boxes a, b)")  # as each box is seen, then no more
    (p,) = boxes.placements()
    assert (p["model"], p["mode"], p["fits"], p["need_gib"]) == ("qwen", "split", False, 130.0)
    assert p["shares"] == {"a": 0.5, "b": 0.5} and "a 0.50, b 0.50" in str(p["why"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="passerelle.runtimes.boxes"):
        boxes.boxes[1]._missed("connection reset", hard=True)  # a box that goes: the split is planned again
    assert boxes.placements()[0]["boxes"] == ["a"] and boxes.placements()[0]["shares"] == {"a": 1.0}
    assert any("fits no box alone" in r.getMessage() and r.getMessage().endswith("(boxes a)") for r in caplog.records)


def test_split_shares_follow_the_boxes_budgets():
    from passerelle.runtimes.placement import BoxMemory, shares

    assert shares({"big": BoxMemory(96.0), "small": BoxMemory(32.0)}) == {"big": 0.75, "small": 0.25}
    assert shares({"a": BoxMemory(None), "b": BoxMemory(64.0)}) == {"a": 0.5, "b": 0.5}
