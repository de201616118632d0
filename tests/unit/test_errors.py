import orjson
import pytest

from passerelle import errors as e


@pytest.mark.parametrize(("err", "status", "cause"), [
    (e.InvalidRequest("bad"), 400, "invalid_request"),
    (e.UnknownModel("x", ["a", "b"]), 404, "invalid_request"),
    (e.BodyTooLarge(10), 413, "invalid_request"),
    (e.Unauthorized("no"), 401, "unauthorized"),
    (e.KeyExpired("expired at 2026-07-01 00:00 +02:00"), 401, "unauthorized"),
    (e.Forbidden("not for you"), 403, "forbidden"),
    (e.ModelNotAllowed("big-model", ["small-*"]), 403, "forbidden"),
    (e.KeyNotFound("3f9c0a1b2c4d"), 404, "invalid_request"),
    (e.RateLimited("slow", retry_after=1.2), 429, "rate_limited"),
    (e.QuotaExceeded("used up", retry_after=3600), 429, "quota_exceeded"),
    (e.QueueFull("full"), 429, "queue_full"),
    (e.QueueTimeout("late"), 429, "queue_timeout"),
    (e.NoBackend("none"), 503, "no_backend"),
    (e.UpstreamError("broke"), 502, "upstream_error"),
    (e.UpstreamTimeout("first token", 3), 504, "upstream_timeout"),
    (e.UpstreamTooLarge("answer", 10, "max_answer_bytes"), 502, "upstream_error"),
    (e.InternalError("bug"), 500, "internal_error"),
    (e.ClientTimeout("stalled"), 499, "client_timeout"),
])
def test_openai_error_shape(err, status, cause):
    body = orjson.loads(err.body())
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "code"}
    assert body["error"]["message"]
    assert err.status == status
    assert err.cause.value == cause


def test_unknown_model_lists_served_models():
    assert "a, b" in e.UnknownModel("x", ["a", "b"]).message


def test_retry_after_rounds_up_and_is_at_least_one():
    assert e.RateLimited("x", retry_after=1.2).headers() == [(b"retry-after", b"2")]
    assert e.RateLimited("x", retry_after=0.01).headers() == [(b"retry-after", b"1")]
    assert e.InvalidRequest("x").headers() == []


def test_sse_error_event_is_one_data_event():
    ev = e.UpstreamError("gone").sse_event()
    assert ev.startswith(b"data: {") and ev.endswith(b"\n\n") and ev.count(b"\n\n") == 1
    assert orjson.loads(ev[6:])["error"]["code"] == "upstream_error"


def test_upstream_status_passes_openai_bodies_and_wraps_others():
    raw = b'{"error":{"message":"context too long","type":"invalid_request_error","code":400}}'
    err = e.UpstreamStatus(400, raw)
    assert err.body() == raw and err.cause is e.Cause.INVALID_REQUEST
    wrapped = orjson.loads(e.UpstreamStatus(503, b"Service Unavailable").body())
    assert wrapped["error"]["message"] == "Service Unavailable"
    assert e.UpstreamStatus(503, b"").cause is e.Cause.UPSTREAM_ERROR


def test_one_enum_of_causes_matches_the_contract():
    assert {c.value for c in e.Cause} == {
        "ok", "client_disconnect", "upstream_error", "upstream_timeout", "queue_timeout", "queue_full",
        "rate_limited", "unauthorized", "invalid_request", "no_backend", "internal_error", "client_timeout",
        # added by the keys work (issue 16): one cause each, none overloaded
        "forbidden", "quota_exceeded",
        # added by the client-side limits (issue 11)
        "shutdown", "server_busy",
        # added by the answers' memory budget (issue 20)
        "answers_busy",
        # added by fair admission and sessions (issue 22)
        "tenant_queue_full", "session_limit",
        # added by the shared store and the active-passive pair (issue 25)
        "store_unavailable", "standby"}


def test_model_not_allowed_lists_the_keys_models():
    err = e.ModelNotAllowed("big-model", ["small-*", "embed-1"])
    assert err.type == "permission_error" and err.code == "model_not_allowed"
    assert "big-model" in err.message and "small-*, embed-1" in err.message


def test_a_fault_of_the_gateway_is_never_blamed_on_the_runtime():
    assert e.GatewayError("?").cause is e.Cause.INTERNAL_ERROR
    assert e.InternalError("bug").body() == b'{"error":{"message":"bug","type":"server_error","code":"internal_error"}}'


def test_a_timeout_is_an_upstream_error_that_names_its_phase_and_a_cap_names_its_setting():
    err = e.UpstreamTimeout("connect", 5, retryable=True)
    assert isinstance(err, e.UpstreamError) and err.retryable and err.phase == "connect"
    assert not e.UpstreamTimeout("total", 2).retryable
    assert "first token timeout of 3 s; no response head" in e.UpstreamTimeout("first token", 3,
                                                                              detail="no response head").message
    cap = e.UpstreamTooLarge("single event", 1024, "max_event_bytes")
    assert "1024 bytes ([limits] max_event_bytes)" in cap.message and not cap.retryable


def test_a_client_string_is_cut_to_a_short_length_with_an_ellipsis():
    from passerelle.errors import ECHO_CHARS, clip

    assert clip("gpt-4o") == "gpt-4o"
    assert clip("x" * ECHO_CHARS) == "x" * ECHO_CHARS
    cut = clip("x" * 10_000)
    assert len(cut) == ECHO_CHARS and cut.endswith("…")
    assert clip("ab\ncd\x00") == "ab\\ncd\\x00"  # no line breaks or control characters in a message
    assert len(e.UnknownModel("y" * 10_000, ["m"]).message) < 2 * ECHO_CHARS
