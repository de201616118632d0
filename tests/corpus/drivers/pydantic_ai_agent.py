"""pydantic-ai's requests, for the corpus (run by tests/corpus/record.py with RECORDER_URL set,
from a virtualenv with pydantic-ai-slim[openai,anthropic]): tools from typed functions and a
structured output, on chat completions, the Responses API and Anthropic Messages."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider


@dataclass
class Deps:
    team: str


class Booking(BaseModel):
    room: str
    day: Literal["mon", "tue", "wed", "thu", "fri"]
    attendees: list[str]
    note: str | None = None


class Slot(BaseModel):
    start: str
    minutes: int = 30


def build(model: object) -> Agent[Deps, Booking]:
    agent: Agent[Deps, Booking] = Agent(model, deps_type=Deps, output_type=Booking,  # type: ignore[arg-type]
                                        instructions="Book a meeting room for the team.")

    @agent.tool
    def free_rooms(ctx: RunContext[Deps], day: Literal["mon", "tue", "wed", "thu", "fri"], slot: Slot | None = None,
                   capacity: int | None = None) -> list[str]:
        """List the rooms free on a day."""
        return ["blue", "green"]

    @agent.tool_plain
    def team_members(team: str, include_guests: bool = False) -> list[str]:
        """The members of a team."""
        return ["ana", "bo"]

    return agent


def main() -> None:
    url = os.environ["RECORDER_URL"]
    provider = OpenAIProvider(base_url=url + "/v1", api_key="dummy")
    for model in (OpenAIChatModel("gpt-4o", provider=provider), OpenAIResponsesModel("gpt-5", provider=provider),
                  AnthropicModel("claude-sonnet-4-5", provider=AnthropicProvider(base_url=url, api_key="dummy"))):
        build(model).run_sync("Book a room on tuesday for the docs team.", deps=Deps("docs"))


if __name__ == "__main__":
    main()
