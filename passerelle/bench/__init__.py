"""``passerelle bench``: the multi-user benchmark of OpenAI-compatible endpoints.

One concept per module: ``workload`` (what is sent), ``client`` (one request, timed), ``target``
(the servers under test), ``runner`` (closed/open loops, processes), ``stats`` (percentiles,
SLOs, verdict), ``report`` and ``plots`` (the output directory), ``progress``, ``cli``.
"""
