"""Communication accounting: the tracer every op reports to (``tracer``), the same
records for torch's own c10d collectives (``c10d_tracer``), and the c10d ops a collective
that issues none shows to dispatch modes (``mode_echo``)."""
