"""What upper layers call (public ops that check, then issue through a ``Route``, which an
engine holds per group); the package README's "Wings" lists the modules."""
