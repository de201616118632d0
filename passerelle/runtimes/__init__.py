"""The runtimes behind the gateway: one Backend per kind (the seam to a running runtime), the
registry that polls their health, the supervisor of launched runtime processes, and the embedded
llama-server build. Imports upstream, observe and the base modules.

Words: a *runtime* is the program that generates (llama-server, vLLM, Ollama); a *backend* is one
configured instance of it that passerelle sends requests to (:class:`~passerelle.runtimes.base.Backend`);
a *runtime process* is a backend that passerelle launched and supervises
(:class:`~passerelle.runtimes.supervisor.RuntimeProcess`).
"""
