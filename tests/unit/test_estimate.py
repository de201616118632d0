"""The prompt estimate reads text only and charges images and audio a constant, so that a request
with a large base64 image is not refused a tokens/minute budget it fits in."""

from __future__ import annotations

import dataclasses

import orjson

from passerelle.config import load_config
from passerelle.tenants.estimate import MediaCosts, estimate_prompt_tokens
from passerelle.tenants.keys import ApiKey
from passerelle.tenants.limits import KeyLimiter
from passerelle.tenants.policy import KeyPolicy

COSTS = MediaCosts(image_tokens=768, audio_tokens=1500)
IMAGE = "data:image/jpeg;base64," + "/9j/" + "A" * 900_000  # about 0.9 MB, as in the issue


def chat_with(*parts: dict) -> dict:
    return {"model": "vision", "max_tokens": 300,
            "messages": [{"role": "system", "content": "You describe pictures."},
                         {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, *parts]}]}


def test_a_large_image_costs_its_constant_not_its_bytes():
    body = chat_with({"type": "image_url", "image_url": {"url": IMAGE, "detail": "high"}})
    est = estimate_prompt_tokens(body, COSTS)
    text_only = estimate_prompt_tokens(chat_with(), COSTS)
    assert est == text_only + 768  # a media part is its constant, nothing more
    assert est < 1000 and len(orjson.dumps(body)) // 4 > 225_000  # what bytes / 4 said


def test_two_images_and_an_audio_clip():
    body = chat_with({"type": "image_url", "image_url": {"url": IMAGE}},
                     {"type": "image_url", "image_url": {"url": "https://example.org/cat.png"}},
                     {"type": "input_audio", "input_audio": {"data": "UklGR" + "A" * 400_000, "format": "wav"}})
    assert estimate_prompt_tokens(body, COSTS) - estimate_prompt_tokens(chat_with(), COSTS) == 2 * 768 + 1500


def test_other_shapes_anthropic_responses_completions_embeddings():
    anthropic = {"system": "Be brief.", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR" + "A" * 500_000}},
        {"type": "text", "text": "Describe."}]}]}
    assert 768 < estimate_prompt_tokens(anthropic, COSTS) < 800
    responses = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                        {"type": "input_image", "image_url": IMAGE}]}]}
    assert 768 < estimate_prompt_tokens(responses, COSTS) < 790
    assert estimate_prompt_tokens({"prompt": "a" * 400}, COSTS) == 100
    assert estimate_prompt_tokens({"prompt": [1, 2, 3, 4, 5]}, COSTS) == 5  # token ids
    assert estimate_prompt_tokens({"input": ["abcd" * 10, "efgh" * 5]}, COSTS) == 15
    # sampling fields are not prompt
    assert estimate_prompt_tokens({"prompt": "abcd", "logit_bias": {"50256": -100}, "stop": ["\n\n"]}, COSTS) == 1


def test_the_key_with_200k_tpm_admits_the_image_request():
    """The issue's case: 0.9 MB image, tpm = 200000, refused with 'needs about 233,440 tokens' before."""
    cfg = load_config(env={})
    policy = KeyPolicy(cfg, None)
    body = chat_with({"type": "image_url", "image_url": {"url": IMAGE}})
    est = policy.estimate_prompt(body, "vision") + body["max_tokens"]
    grant = KeyLimiter().admit(ApiKey("k", "t", tpm=200_000), est)
    assert grant.entry[1] == est < 1500


def test_limits_section_sets_the_constants(tmp_path):
    path = tmp_path / "gw.toml"
    path.write_text("[limits]\nimage_tokens = 1200\naudio_tokens = 0\n")
    cfg = load_config(path, env={})
    assert cfg.limits == dataclasses.replace(cfg.limits, image_tokens=1200, audio_tokens=0)
    policy = KeyPolicy(cfg, None)
    assert policy.estimate_prompt({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": IMAGE}}]}]}, "vision") == 1200 + 1 + 4  # "user", template


def test_tool_schemas_with_a_type_property_or_a_nullable_type_are_text():
    """Codex's tools have a property named "type" (a dict); every schema generator writes a nullable
    field as "type": ["string", "null"] (a list). Neither is a content part's kind."""
    schema = {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["a", "b"]},
        "note": {"type": ["string", "null"]},
        "anyOf": [{"type": ["integer", "null"]}]}}
    for body in ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": schema}]},
                 {"messages": [{"role": "user", "content": "hi"}],
                  "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]},
                 {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "input_schema": schema}]}):
        assert estimate_prompt_tokens(body, COSTS) > 0


def test_json_nested_past_the_recursion_limit_is_counted():
    deep: object = "x" * 40
    for _ in range(5000):
        deep = {"type": {"k": [deep]}}
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": [deep]}]}, COSTS) >= 10
