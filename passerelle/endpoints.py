"""The inference endpoints the gateway forwards: one :class:`Endpoint` each, the one vocabulary the
configuration (``endpoints`` of a backend), the route table, the protocols, the model catalogue
and the embedded runtime's set-up derive from.

* ``paths``: the public paths that reach it; the first is the runtime's path too, and the one
  ``/v1/models`` lists (the others are other runtimes' spellings, all sent to the first);
* ``grammar``: how its stream speaks (proxy/grammars.py);
* ``errors``: the shape of the errors the gateway sends on it (OpenAI's or Anthropic's);
* ``scheduled``: it occupies a runtime slot, so it queues for one (token counting does not);
* ``generates``: it produces output tokens (a token budget applies to it);
* ``capability``: what serving it says a model can do (``[[models]] capabilities``), if anything;
* ``mode``: the llama-server mode it needs (``--embeddings``, ``--reranking``), in which a
  llama-server serves it alone; "" for what one chat instance serves.

How each one's body is read is proxy/protocols.py's business.

Example::

    >>> BY_NAME["rerank"].paths[:2], BY_NAME["rerank"].upstream
    (('/v1/rerank', '/rerank'), '/v1/rerank')
    >>> [e.name for e in ENDPOINTS if e.errors == ANTHROPIC]
    ['messages', 'count_tokens']
"""

from __future__ import annotations

from dataclasses import dataclass

OPENAI, ANTHROPIC = "openai", "anthropic"


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    paths: tuple[str, ...]
    grammar: str = "chat"
    errors: str = OPENAI
    scheduled: bool = True
    generates: bool = True
    capability: str = ""
    mode: str = ""

    @property
    def upstream(self) -> str:
        """The runtime's path (every public path of this endpoint goes there)."""
        return self.paths[0]


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("chat", ("/v1/chat/completions",), capability="chat"),
    Endpoint("completions", ("/v1/completions",), capability="completions"),
    Endpoint("embeddings", ("/v1/embeddings",), generates=False, capability="embeddings", mode="embeddings"),
    Endpoint("responses", ("/v1/responses",), "responses"),
    Endpoint("responses_input_tokens", ("/v1/responses/input_tokens",), scheduled=False, generates=False),
    Endpoint("messages", ("/v1/messages",), "messages", errors=ANTHROPIC),
    Endpoint("count_tokens", ("/v1/messages/count_tokens",), errors=ANTHROPIC, scheduled=False, generates=False),
    # llama-server's and vLLM's other spellings too
    Endpoint("rerank", ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"), generates=False,
             capability="rerank", mode="reranking"),
    Endpoint("tokenize", ("/tokenize",), scheduled=False, generates=False),
    Endpoint("detokenize", ("/detokenize",), scheduled=False, generates=False),
    Endpoint("apply_template", ("/apply-template",), scheduled=False, generates=False),
    Endpoint("infill", ("/infill",), "llama"),
    Endpoint("transcriptions", ("/v1/audio/transcriptions",), "transcription", capability="audio"),
)
BY_NAME: dict[str, Endpoint] = {e.name: e for e in ENDPOINTS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
