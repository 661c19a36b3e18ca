"""DTensor views of the flat shards: sharded views, row-sharded DTensors for uneven cuts,
and the tensor-parallel specs read off user parameters."""
