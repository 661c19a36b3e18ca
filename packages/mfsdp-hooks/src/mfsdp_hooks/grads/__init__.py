"""The gradient side, bottom to top: collect a unit's gradients, reduce them (one plan per
topology), shard the result into ``.grad``; the reduction queue that bounds what is in flight."""
