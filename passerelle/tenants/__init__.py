"""Who is asking: API keys (hashed, in SQLite), per-key limits and throttles, the usage store."""
