"""What runs each iteration: the unit lifecycle and its states, the root (discovery, streams,
final callback, step windows), execution order and prefetch, input-grad triggers."""
