"""What keeps a failure from becoming a hang: which peers are alive (``liveness``) and
whether every rank is about to do the same thing (``agreement``)."""
