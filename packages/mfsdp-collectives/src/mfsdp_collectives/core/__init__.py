"""Local helpers every wing uses, no communication: torch-version shims (``_compat``),
argument checks (``_checks``) and readable process-group names (``naming``)."""
