"""passerelle: an OpenAI-compatible gateway and control plane in front of local LLM runtimes."""

__version__ = "0.1.0"
