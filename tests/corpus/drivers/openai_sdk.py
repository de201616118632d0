"""The openai Python SDK's requests, for the corpus (run by tests/corpus/record.py with
RECORDER_URL set): chat with tools and their results, strict structured outputs from pydantic
models, images, audio input, Responses with tools, parse and stream, embeddings, completions."""

from __future__ import annotations

import enum
import json
import os
from typing import Literal

import openai
from pydantic import BaseModel, Field

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
WAV = "UklGRigAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YQQAAACAgICA"
PDF = ("JVBERi0xLjEKMSAwIG9iajw8L1R5cGUvQ2F0YWxvZy9QYWdlcyAyIDAgUj4+ZW5kb2JqCjIgMCBvYmo8PC9UeXBlL1BhZ2VzL0tp"
       "ZHNbMyAwIFJdL0NvdW50IDE+PmVuZG9iagozIDAgb2JqPDwvVHlwZS9QYWdlL1BhcmVudCAyIDAgUi9NZWRpYUJveFswIDAg"
       "MyAzXT4+ZW5kb2JqCnRyYWlsZXI8PC9Sb290IDEgMCBSPj4K")
SYSTEM = ("You are a careful assistant for a small team. Answer briefly, use the tools when a question "
          "needs live data, and never invent a value a tool could give. " * 3)


class Unit(enum.StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(description="City name, e.g. Paris")
    unit: Unit | None = Field(default=None, description="Temperature unit")
    days: int | None = None


class Address(BaseModel):
    street: str
    city: str
    country: str | None


class Person(BaseModel):
    name: str
    type: Literal["employee", "contractor"]
    age: int | None
    tags: list[str]
    address: Address
    manager: Person | None


class Step(BaseModel):
    explanation: str
    output: str


class MathAnswer(BaseModel):
    steps: list[Step]
    final_answer: str


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country"},
                "unit": {"type": ["string", "null"], "enum": ["celsius", "fahrenheit", None]},
                "type": {"type": "string", "description": "a property named type"},
                "when": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
            },
            "required": ["location", "unit", "type", "when"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


def chat(client: openai.OpenAI) -> None:
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "What is the weather in Paris today?"}]
    first = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="auto", parallel_tool_calls=False, temperature=0.2)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})})
    client.chat.completions.create(model="gpt-4o", messages=messages, tools=[WEATHER_TOOL])
    # the same, streamed, with usage asked for
    stream = client.chat.completions.create(model="gpt-4o-mini", messages=messages[:2], tools=[WEATHER_TOOL],
                                            stream=True, stream_options={"include_usage": True}, max_tokens=256)
    for _ in stream:
        pass
    # strict structured outputs from pydantic models
    client.chat.completions.parse(model="gpt-4o-2024-08-06", response_format=MathAnswer,
                                  messages=[{"role": "user", "content": "solve 8x + 7 = -23"}])
    client.chat.completions.parse(model="gpt-4o-2024-08-06", response_format=Person,
                                  messages=[{"role": "user", "content": "Ana, an employee, lives in Lyon."}])
    parsed = client.chat.completions.parse(
        model="gpt-4o", tools=[openai.pydantic_function_tool(GetWeather)],
        messages=[{"role": "user", "content": "Weather in Oslo in fahrenheit?"}])
    assert parsed.choices[0].message.tool_calls[0].function.parsed_arguments is not None
    client.chat.completions.create(model="gpt-4o", response_format={"type": "json_object"},
                                   messages=[{"role": "user", "content": "Reply in JSON: a list of three colours."}])
    # content parts: an image and audio input
    client.chat.completions.create(model="gpt-4o", max_completion_tokens=300, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"}}]}])
    client.chat.completions.create(model="gpt-4o-audio-preview", modalities=["text"], messages=[{"role": "user",
                                                                                                 "content": [
        {"type": "text", "text": "Transcribe this."},
        {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}]}])
    client.chat.completions.create(model="gpt-4o", seed=7, n=1, logprobs=True, top_logprobs=2, user="ana",
                                   stop=["\n\n"], presence_penalty=0.1, frequency_penalty=0.1,
                                   metadata={"team": "docs"}, store=False, prompt_cache_key="sess-42",
                                   messages=[{"role": "developer", "content": "Be terse."},
                                             {"role": "user", "content": [{"type": "text", "text": "hi"}]}])


RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": ["string", "null"], "enum": ["c", "f", None]}},
                    "required": ["city", "unit"], "additionalProperties": False}, "strict": True},
    {"type": "function", "name": "search_docs", "description": "Search the team's documents.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                     "filters": {"$ref": "#/$defs/Filters"}},
                    "required": ["query"],
                    "$defs": {"Filters": {"type": "object", "properties": {
                        "type": {"type": "string", "enum": ["pdf", "page"]},
                        "after": {"type": ["string", "null"], "format": "date"}}}}},
     "strict": False},
]


def responses(client: openai.OpenAI) -> None:
    first = client.responses.create(model="gpt-5", instructions=SYSTEM, input="What is the weather in Rome?",
                                    tools=RESPONSES_TOOLS, reasoning={"effort": "low"}, store=False)
    call = next(o for o in first.output if o.type == "function_call")
    client.responses.create(model="gpt-5", instructions=SYSTEM, tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Rome?"}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp_c": 21})}])
    client.responses.parse(model="gpt-5", input="Solve 8x + 7 = -23", text_format=MathAnswer)
    client.responses.parse(model="gpt-5-mini", input="Ana, an employee in Lyon.", text_format=Person)
    with client.responses.stream(model="gpt-5", input="Say hello.", tools=RESPONSES_TOOLS) as stream:
        for _ in stream:
            pass
    client.responses.create(model="gpt-4.1", max_output_tokens=200, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe the image and the file."},
        {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}", "detail": "auto"},
        {"type": "input_file", "filename": "a.pdf", "file_data": f"data:application/pdf;base64,{PDF}"}]}])
    for _ in client.responses.create(model="gpt-5", input="Stream, please.", stream=True, prompt_cache_key="s1",
                                     text={"verbosity": "low"}, tool_choice="none", tools=RESPONSES_TOOLS):
        pass


def other(client: openai.OpenAI) -> None:
    client.embeddings.create(model="text-embedding-3-small", input="the river carried small boats")
    client.embeddings.create(model="text-embedding-3-small", input=["one", "two"], dimensions=8,
                             encoding_format="float")
    client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Once upon a time", max_tokens=16)
    for _ in client.completions.create(model="gpt-3.5-turbo-instruct", prompt=["a", "b"], max_tokens=4,
                                       stream=True):
        pass


def main() -> None:
    client = openai.OpenAI(base_url=os.environ["RECORDER_URL"] + "/v1", api_key="dummy", max_retries=0)
    chat(client)
    responses(client)
    other(client)


if __name__ == "__main__":
    main()
