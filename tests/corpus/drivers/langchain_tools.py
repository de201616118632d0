"""LangChain's requests, for the corpus (run by tests/corpus/record.py with RECORDER_URL set,
from a virtualenv with langchain-openai and langchain-anthropic): tools bound from pydantic
models and typed functions, a tool round trip, structured output, on chat completions, the
Responses API and Anthropic Messages."""

from __future__ import annotations

import os
from typing import Literal

from langchain_anthropic import ChatAnthropic
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Filter(BaseModel):
    field: str
    op: Literal["eq", "lt", "gt"]
    value: str | int | None


class QueryTable(BaseModel):
    """Query a table of the warehouse."""

    table: str = Field(description="the table's name")
    filters: list[Filter] = Field(default_factory=list)
    limit: int | None = None


@tool
def convert(amount: float, to: Literal["EUR", "USD", "GBP"], at: str | None = None) -> str:
    """Convert an amount of money."""
    return "42"


class Answer(BaseModel):
    answer: str
    sources: list[str]
    confidence: float | None


def round_trip(llm: object) -> None:
    bound = llm.bind_tools([QueryTable, convert])  # type: ignore[attr-defined]
    messages: list = [HumanMessage("How many orders over 100 EUR last week?")]
    first = bound.invoke(messages)
    messages.append(first)
    for call in first.tool_calls:
        messages.append(ToolMessage(content="[{\"count\": 12}]", tool_call_id=call["id"]))
    bound.invoke(messages)
    llm.with_structured_output(Answer).invoke("Answer with sources: what is 2+2?")  # type: ignore[attr-defined]


def main() -> None:
    url = os.environ["RECORDER_URL"]
    round_trip(ChatOpenAI(model="gpt-4o", base_url=url + "/v1", api_key="dummy", max_retries=0))
    round_trip(ChatOpenAI(model="gpt-5", base_url=url + "/v1", api_key="dummy", max_retries=0, use_responses_api=True,
                          streaming=True))
    round_trip(ChatAnthropic(model="claude-sonnet-4-5", base_url=url, api_key="dummy", max_retries=0))


if __name__ == "__main__":
    main()
