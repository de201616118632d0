"""The OpenAI Agents SDK's requests, for the corpus (run by tests/corpus/record.py with
RECORDER_URL set, from a virtualenv with openai-agents): function tools made from typed Python
functions (optional fields, enums, nested models, Literal), a structured output type, handoffs,
on the Responses API (the SDK's default) and on chat completions."""

from __future__ import annotations

import enum
import os
from typing import Literal

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI
from pydantic import BaseModel, Field


class Priority(enum.StrEnum):
    low = "low"
    high = "high"


class Ticket(BaseModel):
    title: str
    type: Literal["bug", "feature"]
    priority: Priority
    assignee: str | None = None
    labels: list[str] = Field(default_factory=list)


class Window(BaseModel):
    start: str = Field(description="ISO date")
    end: str | None = None


@function_tool
def create_ticket(ticket: Ticket, notify: bool = False) -> str:
    """Create a ticket in the tracker.

    Args:
        ticket: the ticket to create.
        notify: whether to tell the assignee.
    """
    return f"created {ticket.title}"


@function_tool
def search_logs(query: str, window: Window | None = None, limit: int = 20,
                level: Literal["info", "warning", "error"] | None = None) -> list[str]:
    """Search the service logs."""
    return ["12:00 error disk full"]


class Triage(BaseModel):
    summary: str
    severity: Literal["low", "medium", "high"]
    tickets: list[Ticket]


def main() -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=os.environ["RECORDER_URL"] + "/v1", api_key="dummy", max_retries=0)
    writer = Agent(name="writer", instructions="You write short incident notes.", model="gpt-4.1-mini")
    triage = Agent(name="triage", instructions="Triage the incident: search the logs, file tickets.",
                   tools=[create_ticket, search_logs], handoffs=[writer], output_type=Triage,
                   model="gpt-4.1", model_settings=ModelSettings(temperature=0.1, tool_choice="auto"))
    from agents import set_default_openai_client
    set_default_openai_client(client, use_for_tracing=False)
    Runner.run_sync(triage, "The checkout service fails since noon.", max_turns=4)
    chat_agent = Agent(name="triage-chat", instructions="Triage the incident.", tools=[create_ticket, search_logs],
                       output_type=Triage, model=OpenAIChatCompletionsModel(model="gpt-4o", openai_client=client))
    Runner.run_sync(chat_agent, "The login page is slow.", max_turns=4)


if __name__ == "__main__":
    main()
