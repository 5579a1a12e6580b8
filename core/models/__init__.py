"""Several models under one memory budget: profiles, the arbiter, the pool."""
