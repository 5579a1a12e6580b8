"""Which llama-server a request goes to: the router (one Decision per request), the
backend choice (session affinity) and the set of backends.
"""
