"""TP inference workers: rank 0 takes requests over loopback HTTP, every rank fetches its own shards into a
host-memory tier, the ranks agree on certificates, then reuse or fall back, explicitly and counted."""
