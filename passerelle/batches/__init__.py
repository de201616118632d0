"""The Batch API (``/v1/files``, ``/v1/batches``): bulk work run at the batch class in the
capacity interactive traffic leaves idle, kept on disk so that a restart resumes it, each line
answered exactly once.

    api.py       the routes' handlers (files, batches), who sees what
    status.py    a batch's lifecycle: OpenAI's statuses and the moves allowed between them
    validate.py  what an input file and a batch must be, checked a line at a time; its lines read back
    store.py     SQLite state and content files, durable before acknowledged
    runner.py    lines through the gateway, bounded in flight, window, cancel, resume, retention
    idle.py      lines only in the slots other classes leave idle (a reserve, back off when they wait)
    internal.py  one line as a request of the gateway's own path, without HTTP, and its record
    outcome.py   a line's outcome, from its record, as its row of the output or error file
"""
