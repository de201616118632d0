"""``passerelle bench``: the multi-user benchmark of OpenAI-compatible endpoints.

One concept per module: ``workload`` (what is sent: prompts with a per-run nonce, lengths,
scenarios), ``trace`` (recorded load shapes), ``client`` (one request, timed), ``target`` (the
servers under test), ``runner`` (closed/open loops, replays, processes: ``processes``), ``memory``
and ``monitor`` (the runtime's processes, memory and own metrics while it is measured),
``measure`` (one target, or several taking turns), ``search`` (``--find-max``), ``stats``
(percentiles, steady-state throughput, SLOs), ``cache`` (the prompt-cache check), ``verdict``,
``tables``, ``report`` and ``plots`` (the output directory), ``progress``, ``options`` and ``cli``.
"""
