"""Development tools, not on the request path: the fake runtime (exact timing, fault scripts), tiny
model makers for tests, the vLLM test set-up."""
