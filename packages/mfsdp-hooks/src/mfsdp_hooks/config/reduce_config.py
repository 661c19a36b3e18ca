"""How gradients are scaled and reduced across data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GradReduceConfig:
    """The seed's gradient options, resolved once at wrap time.

    Default: average over the shard group, inside the collective (``average_in_collective``)
    or by pre-scaling with ``1/N`` and summing. ``gradient_scaling_factor`` replaces the
    average by a fixed pre-scale; ``calculate_per_token_loss`` sums (the loss is already
    normalised by the global token count).
    """

    average_in_collective: bool = True
    gradient_scaling_factor: float | None = None
    calculate_per_token_loss: bool = False
    mean_over: int | None = None
    """The mean divides by this many ranks instead of the reduction group's (expert
    parameters, reduced over fewer ranks than the dense ones: ``experts.ExpertSharding``)."""

    def __post_init__(self) -> None:
        if self.gradient_scaling_factor is not None and self.calculate_per_token_loss:
            raise ValueError(
                "gradient_scaling_factor and calculate_per_token_loss=True exclude each other: "
                "per-token loss sums gradients unscaled; pass only one of them"
            )

    def collective_args(
        self, world_size: int, native_average: bool = True
    ) -> tuple[bool, float | None]:
        """``(average, pre_scale)`` for the reduction collective.

        ``native_average``: whether the backend averages inside the collective. Gloo's AVG is
        a sum followed by a divide pass over the output; there a 1/N pre-scale folded into
        the gradient copy-in gives the same mean for free.
        """
        if self.calculate_per_token_loss:
            return False, None
        if self.gradient_scaling_factor is not None:
            return False, self.gradient_scaling_factor
        divisor = world_size if self.mean_over is None else self.mean_over
        if self.average_in_collective and native_average and divisor == world_size:
            return True, None
        return False, 1.0 / divisor
