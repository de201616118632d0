"""The anthropic Python SDK's requests, for the corpus (run by tests/corpus/record.py with
RECORDER_URL set): messages with tools and tool results, images, documents, thinking, a system
prompt with cache control, count_tokens, and the streaming helper."""

from __future__ import annotations

import os

import anthropic

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
PDF = ("JVBERi0xLjEKMSAwIG9iajw8L1R5cGUvQ2F0YWxvZy9QYWdlcyAyIDAgUj4+ZW5kb2JqCjIgMCBvYmo8PC9UeXBlL1BhZ2VzL0tp"
       "ZHNbMyAwIFJdL0NvdW50IDE+PmVuZG9iagozIDAgb2JqPDwvVHlwZS9QYWdlL1BhcmVudCAyIDAgUi9NZWRpYUJveFswIDAg"
       "MyAzXT4+ZW5kb2JqCnRyYWlsZXI8PC9Sb290IDEgMCBSPj4K")
SYSTEM = [{"type": "text", "text": "You are the team's assistant. Keep answers short and use tools for facts. " * 4,
           "cache_control": {"type": "ephemeral"}}]
TOOLS = [
    {"name": "get_weather", "description": "Get the current weather in a given location.",
     "input_schema": {"type": "object", "properties": {
         "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
         "unit": {"type": ["string", "null"], "enum": ["celsius", "fahrenheit", None]},
         "type": {"type": "string"}},
         "required": ["location"]}},
    {"name": "record_summary", "description": "Record a summary of an image using well-structured JSON.",
     "input_schema": {"type": "object", "properties": {
         "key_colors": {"type": "array", "items": {"$ref": "#/$defs/Color"}},
         "description": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
         "required": ["key_colors", "description"],
         "$defs": {"Color": {"type": "object", "properties": {
             "r": {"type": "number"}, "g": {"type": "number"}, "b": {"type": "number"},
             "name": {"type": "string", "description": "snake_case name, e.g. pastel_blue"}},
             "required": ["r", "g", "b", "name"]}}},
     "cache_control": {"type": "ephemeral"}},
]


def main() -> None:
    client = anthropic.Anthropic(base_url=os.environ["RECORDER_URL"], api_key="dummy", max_retries=0)
    model = "claude-sonnet-4-5"
    messages: list[dict] = [{"role": "user", "content": "What's the weather in Lyon?"}]
    first = client.messages.create(model=model, max_tokens=1024, system=SYSTEM, tools=TOOLS, messages=messages,
                                   tool_choice={"type": "auto"}, metadata={"user_id": "ana"})
    use = next(b for b in first.content if b.type == "tool_use")
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "18 C, clear"}]},
        {"type": "text", "text": "And tomorrow?"}]})
    client.messages.create(model=model, max_tokens=1024, system=SYSTEM, tools=TOOLS, messages=messages)
    messages[-1]["content"][0] = {"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                                  "content": "the weather service timed out"}
    client.messages.count_tokens(model=model, system=SYSTEM, tools=TOOLS, messages=messages)
    client.messages.create(model=model, max_tokens=512, tools=TOOLS, tool_choice={"type": "tool", "name":
                           "record_summary"}, messages=[{"role": "user", "content": [
                               {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                               {"type": "text", "text": "Summarise this image."}]}])
    client.messages.create(model=model, max_tokens=512, messages=[{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
         "title": "a.pdf", "citations": {"enabled": True}},
        {"type": "text", "text": "What does the document say?"}]}])
    thought = client.messages.create(model="claude-opus-4-1", max_tokens=4096,
                                     thinking={"type": "enabled", "budget_tokens": 2048}, tools=TOOLS,
                                     messages=[{"role": "user", "content": "Weather in Nice, think first."}])
    use = next(b for b in thought.content if b.type == "tool_use")
    with client.messages.stream(model="claude-opus-4-1", max_tokens=4096, tools=TOOLS,
                                thinking={"type": "enabled", "budget_tokens": 2048}, messages=[
                                    {"role": "user", "content": "Weather in Nice, think first."},
                                    {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                                      for b in thought.content]},
                                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                  "content": "22 C"}]}]) as stream:
        stream.get_final_message()
    with client.messages.stream(model="claude-haiku-4-5", max_tokens=64, stop_sequences=["\n\n"],
                                messages=[{"role": "user", "content": "Say hello."},
                                          {"role": "assistant", "content": "Hello"}]) as stream:
        for _ in stream.text_stream:
            pass
    client.beta.messages.create(model=model, max_tokens=256, betas=["context-management-2025-06-27"],
                                messages=[{"role": "user", "content": "hi"}])


if __name__ == "__main__":
    main()
