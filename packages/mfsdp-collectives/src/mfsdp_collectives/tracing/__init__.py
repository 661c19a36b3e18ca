"""Communication accounting: ``CommTracer``, ``C10dTracer`` for torch's own collectives,
and the c10d ops a shared-memory collective shows dispatch modes (``mode_echo``)."""
