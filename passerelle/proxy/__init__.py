"""One request's life: read, check, queue, relay to a runtime, account (gateway), the SSE relay and
the assembly of non-streaming answers. Imports scheduling, tenants, runtimes, upstream, observe."""
