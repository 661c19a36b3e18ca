"""How much quantizing costs, bucket by bucket: with a ``QuantizationErrorLog`` handed to the
quantized comms, each call measures on the sender ``||x - dequantize(quantize(x))|| / ||x||``
(one extra pass), keeps the latest per bucket (a unit's name and the op) and logs one line per
call. Nothing is measured without a log.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

__all__ = ["ErrorSums", "QuantizationErrorLog"]

LOGGER = logging.getLogger("mfsdp_collectives.quantized")


@dataclass
class ErrorSums:
    """Squared norms summed over the chunks one call quantized."""

    error_sq: float = 0.0
    value_sq: float = 0.0

    def add(self, error_sq: float, value_sq: float) -> None:
        self.error_sq += error_sq
        self.value_sq += value_sq

    @property
    def relative(self) -> float:
        """``||error|| / ||values||`` (0 for all-zero values)."""
        return math.sqrt(self.error_sq / self.value_sq) if self.value_sq > 0 else 0.0


class QuantizationErrorLog:
    """The latest relative quantization error of each bucket, and a log line per call.
    Thread-safe: a ``CollectiveWorker`` records from its own thread."""

    def __init__(self, logger: logging.Logger = LOGGER, level: int = logging.INFO) -> None:
        self.logger, self.level = logger, level
        self._lock = threading.Lock()
        self._latest: dict[str, float] = {}
        self._calls: dict[str, int] = {}

    def record(self, bucket: str, sums: ErrorSums, numel: int) -> None:
        """One call's error for ``bucket`` (e.g. ``"blocks.0 reduce_scatter"``)."""
        relative = sums.relative
        with self._lock:
            self._latest[bucket] = relative
            self._calls[bucket] = self._calls.get(bucket, 0) + 1
            call = self._calls[bucket]
        self.logger.log(
            self.level,
            "quantized %s: relative error %.3e over %d values (call %d)",
            bucket,
            relative,
            numel,
            call,
        )

    def latest(self) -> dict[str, float]:
        """Each bucket's relative error at its latest call."""
        with self._lock:
            return dict(self._latest)

    def calls(self) -> dict[str, int]:
        """How many calls each bucket has recorded."""
        with self._lock:
            return dict(self._calls)
