"""The shared-memory transport for the ranks of one host: the futex wait, one lane, the
transport, its per-group setup (``host_transport``) and the background collective worker."""
